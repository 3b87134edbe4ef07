"""The launcher: runs a job's tasks, one process each with its own TF_CONFIG.

Used from the CLI (``tfdist launch``) and from Python or notebooks (`launch`). The
modules, each one job, from the bottom up:

- `options`: `LaunchOptions`, every option and its default, once.
- `results`: `LaunchResult` and `LaunchError`.
- `oom`: whether the kernel's OOM killer ended a task (its memory cgroup's counters).
- `output`, `process` (and the `task_guard` script): a task process, its relayed
  output, and the mechanisms that make it die with the launcher.
- `banner`: TF's C++ start-up banner, dropped in the ``tfdist`` process as in its tasks.
- `command`: one command run like a task (for ``horovodrun``).
- `gpus`, `network`: GPU pinning; free ports and a private network namespace.
- `restarts`: restart policies, given by the caller (`JobRestarts`, `PsWorkerRestarts`).
- `attempt`: one attempt of a cluster: start, poll, stop.
- `local`: a run on this host; `rendezvous` and `nodes`: a multi-node run.
- `api`: `launch` (a script, a function or a module) and `run`.

``tfdist.launch`` (the attribute of `tfdist`) is the function `launch`; this package
is ``sys.modules["tfdist.launch"]``. So import its modules as
``from tfdist.launch import local`` (``import tfdist.launch.local as local`` would look
``local`` up on the function).
"""

from tfdist.launch.api import launch, run
from tfdist.launch.command import run_command, split_horovod_prefix
from tfdist.launch.network import find_free_ports, make_local_cluster
from tfdist.launch.options import LaunchOptions
from tfdist.launch.rendezvous import RendezvousError
from tfdist.launch.restarts import JobRestarts, PsWorkerRestarts
from tfdist.launch.results import LaunchError, LaunchResult, TaskResult

__all__ = ["JobRestarts", "LaunchError", "LaunchOptions", "LaunchResult", "PsWorkerRestarts",
           "RendezvousError", "TaskResult", "find_free_ports", "launch", "make_local_cluster",
           "run", "run_command", "split_horovod_prefix"]
