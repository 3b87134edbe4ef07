"""One attempt of a job: start its tasks, poll them until it ends, stop them.

An attempt ends when the chief and workers have exited 0 (and the evaluator had its
time), when a task fails (unless the restart policy replaces it, or goes on without
it), when the deadline passes, or, on a node of a multi-node job, when node 0 says so.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Sequence

from tfdist import env
from tfdist.cluster import TRAINING_TASK_TYPES, ClusterSpec, TaskSpec
from tfdist.launch.options import LaunchOptions
from tfdist.launch.process import TaskProcess, command_env, stop_tasks
from tfdist.launch.restarts import JobRestarts
from tfdist.launch.results import exit_cause, is_peer_failure
from tfdist.launch.usr1 import IgnoredUsr1

# Seconds the launcher waits, when the first task to fail says another task failed
# first, for that task to end and be named instead (`wait_for_cause`).
CAUSE_WAIT_SECONDS = 5.0


def task_env(cluster: ClusterSpec, spec: TaskSpec, base: dict[str, str] | None,
             attempt: int, backup_dir: str | None) -> dict[str, str]:
    """The environment of task ``spec``: ``base`` plus its TF_CONFIG and tfdist's variables."""
    environ = command_env(base)
    environ[env.TF_CONFIG] = cluster.with_task(spec).to_tf_config()
    environ[env.TASK] = spec.name
    environ[env.RESTART] = str(attempt)
    if backup_dir:
        environ[env.BACKUP_DIR] = str(backup_dir)
    return environ


def run_attempt(argv: list[str], cluster: ClusterSpec, options: LaunchOptions, attempt: int,
                restarts: JobRestarts | None = None, *,
                specs: Sequence[TaskSpec] | None = None,
                extra_env: Callable[[TaskSpec], dict] | None = None,
                peers=None) -> tuple[list[TaskProcess], TaskProcess | None, bool]:
    """Runs every task of one attempt. Returns (tasks, failed task, timed out).

    Args:
        argv: The command every task runs.
        cluster: This attempt's cluster (no task set).
        options: The job's options (env, timeout, grace period, stream, wrap, ...).
        attempt: The job's starts so far, exported as ``TFDIST_RESTART``.
        restarts: The restart policy; its hooks may restart a failed task alone
            (default: none is).
        specs: The tasks to start here (default: all of ``cluster``).
        extra_env: Adds variables per task.
        peers: A `tfdist.launch.rendezvous.NodeLink` that joins this node to a
            multi-node job: a failure here is reported to node 0, and node 0's word
            (stop, or end) stops the tasks here; the caller reads ``peers`` for which.

    An ``evaluator`` task does not train: its exit code never fails the job (a non-zero
    one is reported on the log), and once the chief and workers have exited 0 it has
    ``evaluator_wait`` seconds to end on its own before it is stopped like a ps task.
    """
    log = options.log or sys.stderr
    policy = restarts if restarts is not None else JobRestarts(0, log)
    grace, timeout = options.grace_period, options.timeout
    reported: set[str] = set()
    trained_at = None
    tasks: list[TaskProcess] = []

    def start(spec, task_restart=0, grown=None):
        prefix = [str(a) for a in options.wrap(spec)] if options.wrap is not None else []
        environ = task_env(grown or cluster, spec, options.env, attempt, options.backup_dir)
        if extra_env is not None:
            environ.update(extra_env(spec))
        environ.update(policy.task_env(task_restart))
        return TaskProcess(spec, prefix + argv, environ, options.stream)

    with IgnoredUsr1(log) as usr1, policy.attempt():
        try:
            for spec in (cluster.tasks() if specs is None else specs):
                tasks.append(start(spec))
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                usr1.say()
                policy.check(tasks)
                policy.grow(tasks, cluster, start)
                _report_evaluator_exit(tasks, reported, log)
                counted = [t for t in tasks if not policy.is_lost(t)]
                failed = first_failed(counted)
                if failed is not None and policy.replace(tasks, failed, start):
                    continue
                if failed is not None:
                    failed = wait_for_cause(counted, failed)
                    if peers is not None:
                        peers.report_failure(failed.name, exit_cause(
                            failed.name, failed.poll()) + policy.failure_note(failed))
                    stop_tasks([t for t in tasks if t is not failed], grace)
                    failed.finish_output()
                    return tasks, failed, False
                done = all(t.poll() == 0 for t in counted
                           if t.spec.type in TRAINING_TASK_TYPES) and policy.others_done(tasks)
                if done and peers is not None:
                    peers.report_done()  # ps tasks serve on until every node is done
                if done and trained_at is None:
                    trained_at = time.monotonic()
                evaluating = done and peers is None and _is_evaluating(tasks) and \
                    time.monotonic() - trained_at < options.evaluator_wait
                if (done and peers is None and not evaluating) or (
                        peers is not None and peers.should_stop()):
                    stop_tasks([t for t in tasks if t.poll() is None], grace)
                    return tasks, None, False
                if deadline is not None and time.monotonic() > deadline:
                    if peers is not None:
                        peers.report_failure(None, f"the job timed out after {timeout:g}s")
                    stop_tasks(tasks, grace)
                    return tasks, None, True
                time.sleep(0.05)
        except BaseException:
            stop_tasks(tasks, grace)
            raise


def first_failed(tasks: Sequence[TaskProcess]) -> TaskProcess | None:
    """The task (not an evaluator) that exited non-zero first, or None.

    Its failure is the cause: a chief that fails because a ps ran out of memory exits
    after the ps, however late the launcher looks.
    """
    failed = [t for t in tasks if t.poll() not in (None, 0) and t.spec.type != "evaluator"]
    return min(failed, key=lambda t: t.exited_at, default=None)


def wait_for_cause(tasks: Sequence[TaskProcess], failed: TaskProcess,
                   seconds: float = CAUSE_WAIT_SECONDS) -> TaskProcess:
    """The task whose failure ends the attempt: ``failed``, or, when ``failed``'s last
    lines say it failed because another task did (Horovod's "has been shut down", a peer
    named as not running), the first task that fails of its own within ``seconds``.

    A chief that fills its disk stops Horovod as it exits, and the other worker, told
    "Horovod has been shut down", often exits before the chief has.
    """
    failed.finish_output()  # its last lines, all of them
    if not is_peer_failure(failed.tail_text()):
        return failed
    deadline = time.monotonic() + seconds
    while True:
        ended = [t for t in tasks if t is not failed and t.spec.type != "evaluator"
                 and t.poll() not in (None, 0)]
        for task in ended:
            task.finish_output()
        own = [t for t in ended if not is_peer_failure(t.tail_text())]
        if own:
            return min(own, key=lambda t: t.exited_at)
        running = [t for t in tasks if t is not failed and t.poll() is None]
        if not running or time.monotonic() > deadline:
            return failed
        time.sleep(0.05)


def _is_evaluating(tasks: Sequence[TaskProcess]) -> bool:
    """Whether an evaluator task is still running."""
    return any(t.spec.type == "evaluator" and t.poll() is None for t in tasks)


def _report_evaluator_exit(tasks: Sequence[TaskProcess], reported: set[str], log) -> None:
    """Reports (once) an evaluator that exited non-zero; the job goes on without it."""
    for task in tasks:
        code = task.poll()
        if task.spec.type == "evaluator" and code not in (None, 0) and \
                task.name not in reported:
            reported.add(task.name)
            task.finish_output()
            print(f"tfdist launch: {exit_cause(task.name, code)}; training goes on "
                  f"without it. Last output of {task.name}:\n{task.tail_text()}",
                  file=log, flush=True)
