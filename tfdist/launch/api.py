"""The Python API of the launcher: `launch` (a script, a function or a module) and `run`."""

from __future__ import annotations

import importlib.machinery
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

from tfdist.launch.local import run as run_local
from tfdist.launch.nodes import run_node
from tfdist.launch.options import DEFAULTS, LaunchOptions, resolve_options
from tfdist.launch.restarts import JobRestarts, PsWorkerRestarts
from tfdist.launch.results import LaunchResult


def run(argv: Sequence[str], options: LaunchOptions | None = None, *,
        restarts: type[JobRestarts] | None = None, **fields) -> LaunchResult:
    """Starts ``argv`` once per task and waits for the job.

    With ``master`` (and ``nnodes`` > 1), this is one node of a multi-node job: every
    node runs the same call with its own ``node_rank``; ``workers``, ``chief`` and
    ``ps`` count the tasks of this node (`tfdist.launch.nodes`). Otherwise the job runs
    on this host (`tfdist.launch.local`).

    Args:
        argv: The command every task runs, e.g. ``[sys.executable, "train.py"]``.
        options: The job's `LaunchOptions` (default: the defaults).
        restarts: The restart policy class of a job on this host, made with
            ``(max_restarts, log)``: `JobRestarts` (the default) restarts the whole job,
            `PsWorkerRestarts` also a parameter-server worker alone. In a multi-node
            job node 0 decides the restarts of the whole job.
        **fields: `LaunchOptions` fields that replace those of ``options``.

    Returns:
        A `LaunchResult` when every chief and worker exited 0 (in a multi-node job:
        this node's tasks, and the whole cluster).

    Raises:
        LaunchError: a task failed (after all restarts), or the timeout passed.
        RendezvousError: a multi-node job could not form.
        ValueError: bad options.
    """
    options = resolve_options(options, fields)
    if options.is_multi_node:
        return run_node(argv, options)
    return run_local(argv, options, restarts=restarts)


def launch(target: str | os.PathLike | Callable | None = None, *args: Any,
           module: str | None = None, workers: int = DEFAULTS.workers,
           chief: bool = DEFAULTS.chief, ps: int = DEFAULTS.ps,
           timeout: float | None = DEFAULTS.timeout,
           max_restarts: int = DEFAULTS.max_restarts, env: dict | None = DEFAULTS.env,
           backup_dir=DEFAULTS.backup_dir, grace_period: float = DEFAULTS.grace_period,
           stream=DEFAULTS.stream, isolate_network: bool = DEFAULTS.isolate_network,
           restart_ps_workers: bool = True,
           gpus_per_task: int | None = DEFAULTS.gpus_per_task, nnodes: int = DEFAULTS.nnodes,
           node_rank: int = DEFAULTS.node_rank, master: str | None = DEFAULTS.master,
           node_addr: str | None = DEFAULTS.node_addr, token: str | None = DEFAULTS.token,
           join_timeout: float = DEFAULTS.join_timeout, evaluator: bool = DEFAULTS.evaluator,
           evaluator_wait: float = DEFAULTS.evaluator_wait,
           min_workers: int | None = DEFAULTS.min_workers,
           max_workers: int | None = DEFAULTS.max_workers,
           elastic_timeout: float = DEFAULTS.elastic_timeout, **kwargs: Any):
    """Runs a script or a function as a local cluster, one fresh process per task.

    A function (from a notebook, say) is pickled by value with cloudpickle, run in every
    task with ``*args`` and ``**kwargs``, and its return values come back as a list in
    task order (chief, workers, ps, evaluator; ps tasks return None, and so does an
    evaluator stopped after ``evaluator_wait``). Multi-worker TensorFlow
    cannot start twice in one process, so this is how a notebook trains on many workers.

    With ``module="pkg.train"`` every task runs ``python -m pkg.train`` instead, and all
    positional arguments are the module's: ``launch("--epochs", 3, module="pkg.train")``.

    Args:
        target: A path to a Python script (``args`` become its argv) or a callable;
            with ``module``, the module's first argument (or nothing).
        *args: Script or module arguments, or positional arguments of the function.
        module: A module every task runs as ``python -m module``, found as ``python -m``
            finds it (the current directory first).
        workers: Number of worker tasks.
        chief: Whether to add a chief task.
        ps: Number of parameter-server tasks.
        timeout: Seconds before the whole job is killed.
        max_restarts: Restarts of the whole job after a failure (multi-node: on every
            node; give every node the same number), or in a parameter-server job of a
            dead worker alone (see ``restart_ps_workers``).
        env: Extra environment variables.
        backup_dir: Directory exported as ``TFDIST_BACKUP_DIR`` for resuming.
        grace_period: Seconds between SIGTERM and SIGKILL.
        stream: Where the prefixed output goes; None to silence it.
        isolate_network: Run the job in a private network namespace (needs root): TF's
            servers listen on 0.0.0.0, and this keeps them unreachable from outside.
        restart_ps_workers: With a chief and ps tasks, restart a dead (or frozen)
            worker alone while the chief runs, one of ``max_restarts`` each, and with
            none left carry on without it, as TF's coordinator does; the job fails once
            no worker is left (`PsWorkerRestarts`). False: any failure ends the job.
        gpus_per_task: GPUs pinned per task with CUDA_VISIBLE_DEVICES (`LaunchOptions`).
        nnodes: Nodes in a multi-node job; every node makes the same call.
        node_rank: This node's rank (node 0 hosts the rendezvous at ``master``).
        master: ``HOST:PORT`` of node 0's rendezvous.
        node_addr: This node's address as the others reach it (default: as node 0 sees it).
        token: Shared rendezvous secret (default: $TFDIST_TOKEN, else node 0 prints one).
        join_timeout: Seconds for every node to join.
        evaluator: Add one ``evaluator`` task (see `LaunchOptions`); single-node jobs only.
        evaluator_wait: Seconds the evaluator may run on after training ended.
        min_workers: Makes the job elastic (docs/elastic.md): a lost worker is removed
            and the others train on (engine="horovod") while this many remain; each of
            ``max_restarts`` starts a replacement that joins the running job.
        max_workers: The most workers of an elastic job (default: ``workers``).
        elastic_timeout: Seconds an elastic job may stay below ``min_workers``.
        **kwargs: Keyword arguments of the function.

    Returns:
        For a script or module, a `LaunchResult`; for a function, the list of return
        values (in a multi-node job: None for the tasks of other nodes).

    Raises:
        LaunchError: a task failed or the timeout passed; names the task.
        FileNotFoundError: the script does not exist.
        ModuleNotFoundError: the module's top-level package is nowhere to be found.
        TypeError: no target and no module, or keyword arguments without a function.
    """
    options = LaunchOptions(
        workers=workers, chief=chief, ps=ps, timeout=timeout, max_restarts=max_restarts,
        env=env, backup_dir=backup_dir, grace_period=grace_period, stream=stream,
        isolate_network=isolate_network, gpus_per_task=gpus_per_task, nnodes=nnodes,
        node_rank=node_rank, master=master, node_addr=node_addr, token=token,
        join_timeout=join_timeout, evaluator=evaluator, evaluator_wait=evaluator_wait,
        min_workers=min_workers, max_workers=max_workers, elastic_timeout=elastic_timeout)
    restarts = restarts_for(chief, ps) if restart_ps_workers else JobRestarts
    return launch_target(target, args, kwargs, options, restarts, module=module)


def restarts_for(chief: bool, ps: int) -> type[JobRestarts]:
    """The restart policy `launch` and ``tfdist launch`` give a job of these tasks.

    Only a parameter-server job (a chief and ps tasks) goes on without a worker, so
    its workers restart alone, or are left out (`PsWorkerRestarts`); any other job
    restarts whole.
    """
    return PsWorkerRestarts if chief and ps else JobRestarts


def launch_target(target: str | os.PathLike | Callable | None, args: Sequence,
                  kwargs: dict, options: LaunchOptions,
                  restarts: type[JobRestarts] | None = None, *,
                  module: str | None = None):
    """`launch` with its options as one `LaunchOptions` and a restart policy (`run`)."""
    if module is not None:
        return _launch_module(module, target, args, kwargs, options, restarts)
    if target is None:
        raise TypeError("launch needs a script path, a function or module=. Received none.")
    if callable(target):
        return _launch_function(target, args, kwargs, options, restarts)
    if kwargs:
        raise TypeError(f"keyword arguments are only for functions. Received: {sorted(kwargs)}")
    script = Path(target)
    if not script.is_file():
        raise FileNotFoundError(f"script {str(target)!r} does not exist")
    return run([sys.executable, str(script), *map(str, args)], options, restarts=restarts)


def _launch_function(fn, args, kwargs, options, restarts):
    import cloudpickle

    with tempfile.TemporaryDirectory(prefix="tfdist-launch-") as tmp:
        payload = Path(tmp, "payload.pkl")
        payload.write_bytes(cloudpickle.dumps((fn, args, kwargs)))
        argv = [sys.executable, "-m", "tfdist.runners.task_main", str(payload), tmp]
        # Functions of importable modules are pickled by reference: let every task
        # import what this process can.
        env = dict(options.env or {})
        paths = [env.get("PYTHONPATH", ""), *sys.path, os.environ.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        result = run(argv, options, restarts=restarts, env=env)
        values = []
        for task in result.cluster.tasks():
            path = Path(tmp, f"{task.name}.result.pkl")
            # Written by our own child process into our private temp dir: safe to load.
            values.append(cloudpickle.loads(path.read_bytes()) if path.exists() else None)
        return values


def _launch_module(module, target, args, kwargs, options, restarts):
    """``python -m module ARGS`` in every task; ``target``, if given, is the first ARG."""
    if kwargs:
        raise TypeError(f"keyword arguments are only for functions. Received: {sorted(kwargs)}")
    if callable(target):
        raise TypeError(f"give a function or module=, not both. Received: {target!r} and "
                        f"module={module!r}")
    _check_module(module, (options.env or {}).get("PYTHONPATH", ""))
    module_args = args if target is None else (target, *args)
    return run([sys.executable, "-m", module, *map(str, module_args)], options,
               restarts=restarts)


def _check_module(module, pythonpath: str = "") -> None:
    """Fails unless ``module`` is a dotted name whose top-level package a task's
    ``python -m`` would find (the current directory first). Imports nothing."""
    if not isinstance(module, str) or not all(p.isidentifier() for p in module.split(".")):
        raise ValueError(f"module must be a dotted module name like 'pkg.train'. "
                         f"Received: module={module!r}")
    top = module.split(".")[0]
    search = [os.getcwd(), *pythonpath.split(os.pathsep),
              *os.environ.get("PYTHONPATH", "").split(os.pathsep), *sys.path]
    if top not in sys.builtin_module_names and importlib.machinery.PathFinder.find_spec(
            top, [p for p in search if p]) is None:
        raise ModuleNotFoundError(f"no module named {top!r} in the current directory "
                                  f"({os.getcwd()}) or on the path. Received: module={module!r}")
