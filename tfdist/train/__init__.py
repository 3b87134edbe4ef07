"""The main job, ``tfdist train`` and ``tfdist compare``, one job per module.

`tfdist.train.main` dispatches a job (in this process, launched, on nodes, on Spark or
Ray, or under horovodrun); `tfdist.train.task` runs one task; `tfdist.train.checks`
checks a job before anything starts; `tfdist.train.outdir` owns the output directory
(lock, backup, atomic writes); `tfdist.train.report` writes tables and the history plot;
`tfdist.train.compare` runs ``tfdist compare``. Strategies are looked up in
`tfdist.strategies.registry`, never by name.
"""
