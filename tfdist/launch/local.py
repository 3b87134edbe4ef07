"""A run on this host: attempts of the whole cluster, with port retries and restarts."""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Sequence

from tfdist.launch.attempt import run_attempt
from tfdist.launch.gpus import elastic_gpu_env, gpu_env
from tfdist.launch.network import make_local_cluster, private_network
from tfdist.launch.options import LaunchOptions, resolve_options
from tfdist.launch.process import TaskProcess, command_env
from tfdist.launch.restarts import JobRestarts
from tfdist.launch.results import (LaunchError, LaunchResult, announce_restart,
                                   failure_cause, is_port_clash, launch_result)

MAX_PORT_RETRIES = 3


def run(argv: Sequence[str], options: LaunchOptions | None = None, *,
        restarts: type[JobRestarts] | None = None, policy: JobRestarts | None = None,
        **fields) -> LaunchResult:
    """Starts ``argv`` once per task on this host and waits for the job.

    A task that fails stops every other task; then the job starts again while the
    restart policy allows, on fresh ports. A task that could not bind its port is
    retried on new ports (`MAX_PORT_RETRIES` times) without using a restart.

    Args:
        argv: The command every task runs, e.g. ``[sys.executable, "train.py"]``.
        options: The job's `LaunchOptions` (default: the defaults).
        restarts: The restart policy class, made with ``(max_restarts, log)``
            (default: `JobRestarts`, whole-job restarts only).
        policy: A restart policy already made (node 0 of a multi-node elastic job);
            replaces ``restarts``.
        **fields: `LaunchOptions` fields that replace those of ``options``.

    Returns:
        A `LaunchResult` when every chief and worker exited 0.

    Raises:
        LaunchError: a task failed (after all restarts), or the timeout passed.
        ValueError: bad options.
    """
    options = resolve_options(options, fields)
    if options.isolate_network:
        if options.wrap is not None:
            raise ValueError("isolate_network and wrap both place the tasks; give one.")
        with private_network() as prefix:
            placed = dataclasses.replace(options, isolate_network=False,
                                         wrap=lambda spec: prefix)
            return run(argv, placed, restarts=restarts, policy=policy)
    log = options.log or sys.stderr
    if policy is not None:
        pass
    elif options.is_elastic:
        from tfdist.launch.elastic import ElasticRestarts

        policy = ElasticRestarts(
            options.max_restarts, log, host=options.host, min_workers=options.min_workers,
            max_workers=options.max_workers or options.workers + options.chief,
            elastic_timeout=options.elastic_timeout)
    else:
        policy = (restarts or JobRestarts)(options.max_restarts, log)
    attempt = port_retries = 0
    while True:
        cluster = options.cluster or make_local_cluster(
            options.workers, options.chief, options.ps, options.host, options.evaluator)
        started = time.monotonic()
        if options.is_elastic:
            pin = elastic_gpu_env(policy.max_workers, command_env(options.env),
                                  options.gpus_per_task)
        else:
            pins = gpu_env(cluster.tasks(), command_env(options.env), options.gpus_per_task)
            pin = lambda spec: pins.get(spec.name, {})  # noqa: E731
        tasks, failed, timed_out = run_attempt(list(argv), cluster, options, attempt, policy,
                                               extra_env=pin)
        if failed is None and not timed_out:
            return launch_result(tasks, attempt + 1, cluster)
        if timed_out:
            cause = f"timed out after {options.timeout:g}s; every task was killed"
            error = LaunchError(f"job {cause}", attempts=attempt + 1,
                                output_tail="\n".join(f"[{t.name}] {t.tail_text()}"
                                                      for t in tasks))
        else:
            code = failed.poll()
            cause = failure_cause(failed.name, code, failed.tail_text()) + \
                policy.failure_note(failed)
            clash = is_port_clash(failed.tail_text())
            if clash:
                cause += (f": it could not bind its port "
                          f"{cluster.with_task(failed.spec).task_address} (in use?)")
            error = LaunchError(
                f"{cause} after {time.monotonic() - started:.1f}s; the other tasks were "
                f"stopped. Last output of {failed.name}:\n{failed.tail_text()}",
                task=failed.name, returncode=code, output_tail=failed.tail_text(),
                attempts=attempt + 1)
            if options.cluster is None and clash and port_retries < MAX_PORT_RETRIES:
                port_retries += 1
                attempt += 1
                print(f"tfdist launch: {failed.name} could not bind its port "
                      f"{cluster.with_task(failed.spec).task_address}; retrying on new ports",
                      file=log, flush=True)
                continue
        restart = policy.restart_job()
        if restart is None:
            raise error
        attempt += 1
        announce_restart(log, restart, options.max_restarts, cause)

