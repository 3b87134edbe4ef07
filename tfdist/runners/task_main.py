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


if __name__ == "__main__":
    main()
