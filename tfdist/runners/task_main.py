"""Entry point of a task started by `tfdist.launch` with a function.

Usage: ``python -m tfdist.runners.task_main PAYLOAD RESULT_DIR``. The payload is written
by the parent launcher into its private temporary directory, never read from the network.
"""

import gc
import os
import sys
from pathlib import Path

from tfdist import env


def main() -> None:
    import cloudpickle

    payload, result_dir = sys.argv[1], sys.argv[2]
    fn, args, kwargs = cloudpickle.loads(Path(payload).read_bytes())
    value = fn(*args, **kwargs)
    task = os.environ.get(env.TASK, "task")
    tmp = Path(result_dir, f"{task}.result.pkl.tmp")
    tmp.write_bytes(cloudpickle.dumps(value))
    tmp.replace(Path(result_dir, f"{task}.result.pkl"))
    # Not exit_without_a_last_collection(): a task that skipped its last collection
    # left a parameter-server job's next launch without a chief
    # (tests/test_ps_save.py::test_sharded_model_saves_resumes_after_a_ps_kill_loads_plain_and_reshards).


def exit_without_a_last_collection() -> None:
    """Leaves the objects alive now to the process's end (test job scripts call it).

    The interpreter's last garbage collection walks every object TensorFlow made: seconds
    on a busy machine, while the launcher waits for the task to exit. Frozen objects are
    not walked; streams are still flushed and ``atexit`` handlers (Horovod's shutdown)
    still run.
    """
    gc.freeze()


if __name__ == "__main__":
    main()
