"""Training scripts of tests/test_pair_references.py, run by ``tfdist launch``.

    python pair_jobs.py compressed OUT EPOCHS [TASK:EPOCH:BATCH]

``compressed``: tests/elastic_job.py's elastic job, its strategy given
``compression="fp16"``; its JSON also holds the strategy's compression.
"""

import json
import os
import sys


def compressed(out, epochs, kill=""):
    import tfdist

    import elastic_job

    made = []
    cls = tfdist.MultiWorkerMirroredStrategy

    def strategy(*args, **kwargs):
        made.append(cls(*args, compression="fp16", **kwargs))
        return made[-1]

    tfdist.MultiWorkerMirroredStrategy = strategy
    elastic_job.main(out, epochs, kill)
    path = os.path.join(out, f"{os.environ['TFDIST_TASK']}.json")
    with open(path) as f:
        result = json.load(f)
    compression = made[0].communication.compression
    result["compression"] = getattr(compression, "name", compression)
    with open(path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    from helpers import exit_without_a_last_collection

    {"compressed": compressed}[sys.argv[1]](sys.argv[2], int(sys.argv[3]), *sys.argv[4:5])
    exit_without_a_last_collection()  # as a function's task: no wait on the last GC
