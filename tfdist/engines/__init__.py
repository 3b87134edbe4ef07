"""Engines: what moves a multi-worker strategy's tensors, as plug-ins.

``tfdist.engines.Engine`` is the interface (built from an ``EngineSetup``: the cluster,
this task and the timeouts), ``register_engine(name, engine_class)`` adds
one, ``available()`` lists them (``"tf"``, ``"horovod"``, then any registered), and
``select_engine`` holds the ``engine="auto"`` rule. Importing this package does not
import TensorFlow nor Horovod.
"""

from tfdist.engines.base import Engine, EngineSetup
from tfdist.engines.registry import (AUTO, ENV_VAR, available, engine_class,
                                     register_engine, select_engine)

__all__ = ["AUTO", "ENV_VAR", "Engine", "EngineSetup", "available", "engine_class",
           "register_engine", "select_engine"]
