"""Runs a function as a tfdist job on Ray actors: ``tfdist.ray.run``.

One actor per task, in the Ray cluster this process is connected to. Each actor
reserves a free port on its node; the driver gathers every ``host:port`` and hands each
actor the list, from which it builds its TF_CONFIG. The function runs in a fresh child
process per actor (`tfdist.runners.remote_task`), so any tfdist strategy works
inside. The actors are removed when the job ends, however it ends.

For Ray Train, `ray.train.tensorflow.TensorflowTrainer` sets TF_CONFIG itself: use a
`tfdist.MultiWorkerMirroredStrategy` in its training loop (see docs/multi_host.md).
Ray is imported on first use only; ``import tfdist`` does not load it. ``tfdist.ray`` is
its public name.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import uuid
from typing import Any, Callable

from tfdist.cluster import ClusterSpec
from tfdist.launch import LaunchError
from tfdist.runners import interpreter
from tfdist.runners.remote_task import (TaskFailedError, check_run_options, load_results,
                                        make_payload, reserve_port, run_task)


def run(fn: Callable, *args: Any, workers: int = 1, num_cpus: float = 1,
        num_gpus: float = 0, timeout: float | None = None, env: dict[str, str] | None = None,
        startup_timeout: float = 300.0, **kwargs: Any) -> list[Any]:
    """Runs ``fn(*args, **kwargs)`` as worker 0..N-1 of a job, one Ray actor each.

    The same contract as `tfdist.launch` with a function: ``fn`` is pickled by value
    with cloudpickle, every task runs it with a TF_CONFIG naming all of them, and the
    return values come back in task order. Connects with ``ray.init()`` if this
    process is not connected yet (a local instance, or $RAY_ADDRESS). The cluster's
    nodes need tfdist and TensorFlow installed.

    Args:
        fn: The function each task runs.
        *args: Positional arguments of ``fn``.
        workers: Number of tasks (actors, TensorFlow workers), >= 1.
        num_cpus: CPUs Ray reserves for each actor.
        num_gpus: GPUs Ray reserves for each actor; Ray sets CUDA_VISIBLE_DEVICES.
        timeout: Seconds before each task's function is killed; None for no deadline.
        env: Extra environment variables for the function's processes.
        startup_timeout: Seconds for every actor to be placed and started.
        **kwargs: Keyword arguments of ``fn``.

    Returns:
        The return value of every task, in task order.

    Raises:
        LaunchError: a task failed, was killed or timed out, or its actor died or could
            not be placed; names the task. The other actors are stopped.
        RuntimeError: Ray's workers run a Python without tfdist, cloudpickle or
            TensorFlow (checked with a one-task probe before the actors start).
        ValueError: bad arguments.
    """
    import ray

    check_run_options(workers, timeout)
    for name, value in (("num_cpus", num_cpus), ("num_gpus", num_gpus)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{name} must be a number >= 0. Received: {name}={value!r}")
    payload = make_payload(fn, args, kwargs)
    if not ray.is_initialized():
        ray.init()
    _check_worker_python(ray, startup_timeout)
    actor_class = ray.remote(_TaskActor)
    tag = uuid.uuid4().hex[:8]
    names = [f"tfdist-{tag}-worker-{index}" for index in range(workers)]
    actors = [actor_class.options(name=name, num_cpus=num_cpus, num_gpus=num_gpus,
                                  max_restarts=0).remote(index)
              for index, name in enumerate(names)]
    try:
        addresses = _gather(ray, [a.reserve_address.remote() for a in actors], names,
                            startup_timeout, f"{num_cpus:g} CPU and {num_gpus:g} GPU each")
        blobs = _gather(ray, [a.run.remote(payload, addresses, env, timeout) for a in actors],
                        names)
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)
    return load_results(blobs)


CONNECT_TIMEOUT = 30.0


@contextlib.contextmanager
def connect(address: str | None = None, connect_timeout: float = CONNECT_TIMEOUT,
            **init_kwargs: Any):
    """This process's Ray connection, or a new one to ``address``, shut down on exit.

    Args:
        address: A Ray cluster (``auto``, ``HOST:6379``, ``ray://HOST:10001``); default:
            $RAY_ADDRESS, else a new local instance.
        connect_timeout: Seconds to reach a ``HOST:PORT`` address before giving up (Ray
            itself retries an unreachable address forever).
        **init_kwargs: More arguments of ``ray.init`` (``num_cpus=``, ...).

    Raises:
        ConnectionError: nothing answers at ``address`` within ``connect_timeout``.

    A new local instance is started again (up to 3 times) when its node does not
    register in time, as happens on a heavily loaded host.
    """
    import ray

    if ray.is_initialized():
        yield
        return
    if address:
        check_reachable(address, connect_timeout)
    for attempt in range(3):
        try:
            ray.init(address=address, **init_kwargs)
            break
        except Exception as error:
            ray.shutdown()
            # A new local node waits a fixed 30 s for its raylet; a loaded host can pass it.
            if address or "timed out during startup" not in str(error) or attempt == 2:
                raise
    try:
        yield
    finally:
        ray.shutdown()


def _check_worker_python(ray, timeout: float) -> None:
    """Fails before any actor starts when Ray's workers run a Python that cannot run a
    task; a probe that cannot be placed within ``timeout`` is left to the actors' check."""
    probe = ray.remote(num_cpus=0, max_retries=0)(interpreter.make_probe()).remote()
    if not ray.wait([probe], timeout=timeout)[0]:
        ray.cancel(probe, force=True)
        return
    how = ("Install tfdist and TensorFlow in the Python Ray runs on every node, or pass "
           "ray.init(runtime_env={'pip': ['tfdist[ray]']}).")
    try:
        facts = ray.get(probe)
    except ray.exceptions.RayError as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        raise RuntimeError(f"tfdist.ray.run: Ray's workers could not run a probe task "
                           f"({first}); this driver runs {interpreter.driver()}. {how}"
                           ) from None
    why = interpreter.problem(facts)
    if why is not None:
        raise RuntimeError(f"tfdist.ray.run: Ray's workers run Python {facts['python']} "
                           f"({facts['version']}), {why}; this driver runs "
                           f"{interpreter.driver()}. {how}")


def check_reachable(address: str, timeout: float) -> None:
    """Fails when a ``HOST:PORT`` or ``ray://HOST:PORT`` Ray address does not accept a
    TCP connection within ``timeout`` seconds; ``auto`` and ``local`` are not checked.

    Raises:
        ConnectionError: names the address, the reason and how long it waited.
    """
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as error:
        reason = "timed out" if isinstance(error, TimeoutError) else (
            error.strerror or str(error))
        raise ConnectionError(f"no Ray cluster reachable at {address} ({reason}; waited up "
                              f"to {timeout:g}s)") from None


class _TaskActor:
    """One task of `run`, as a Ray actor: reserves a port, then runs the function."""

    def __init__(self, index: int):
        self._index = index
        self._reserved = None

    def reserve_address(self) -> str:
        import ray

        self._reserved = reserve_port()
        host = ray.util.get_node_ip_address()
        host = f"[{host}]" if ":" in host else host
        return f"{host}:{self._reserved.getsockname()[1]}"

    def run(self, payload: bytes, addresses: list[str], env: dict | None,
            timeout: float | None) -> bytes:
        return run_task(payload, ClusterSpec(worker=addresses), self._index, env=env,
                        timeout=timeout, reserved=self._reserved, stream=sys.stderr)


def _gather(ray, refs, names, timeout: float | None = None, resources: str = "") -> list:
    """Every ref's value in order; the first failure raises a `LaunchError` naming it."""
    index = {ref: i for i, ref in enumerate(refs)}
    values, pending = [None] * len(refs), list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
        if not done:
            missing = [f"worker-{index[ref]}" for ref in pending]
            raise LaunchError(
                f"{', '.join(missing)} did not start within {timeout:g}s: Ray could not "
                f"place {len(refs)} actors ({resources}). Available: "
                f"{ray.available_resources()}", task=missing[0])
        for ref in done:
            values[index[ref]] = _get(ray, ref, f"worker-{index[ref]}", names[index[ref]])
    return values


def _get(ray, ref, task: str, actor_name: str):
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as error:
        cause = error.cause
        if isinstance(cause, TaskFailedError):
            raise LaunchError(
                f"{cause.cause}; the other actors were stopped. Last output of "
                f"{cause.task}:\n{cause.output_tail}", task=cause.task,
                returncode=cause.returncode, output_tail=cause.output_tail) from None
        raise LaunchError(f"{task} failed in its Ray actor: {error}", task=task) from None
    except ray.exceptions.RayActorError as error:
        lines = str(error).splitlines()
        why = next((line.strip() for line in lines if "dead because" in line), lines[0])
        raise LaunchError(f"{task} failed: its Ray actor {actor_name} "
                          f"died; the other actors were stopped. Ray says: {why}",
                          task=task) from None
