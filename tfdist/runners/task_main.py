"""Entry point of a task started by `tfdist.launch` with a function.

Usage: ``python -m tfdist.runners.task_main PAYLOAD RESULT_DIR``. The payload is written
by the parent launcher into its private temporary directory, never read from the network.
"""

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
    # The interpreter's last garbage collection is kept (3-5 s on a busy machine): a
    # parameter-server chief with little to do listens for about 2 s, and its workers
    # and ps must see its port open once before they wait for it to close
    # (`tfdist.strategies.parameter_server.wait_for_chief`). Without the collection, one
    # that first polled after the chief had gone waited for it to start and failed
    # (tests/test_ps_save.py's 1-ps job). Test job scripts skip it
    # (tests/helpers.exit_without_a_last_collection).


if __name__ == "__main__":
    main()
