"""The Horovod engine: Horovod's ops (`ops`), Gloo's rendezvous without ``horovodrun``
(`rendezvous`), the strategy ``extended`` (`extended`) and the `Engine` (`engine`).

The only tfdist package that imports ``horovod``; its modules import it lazily.
"""
