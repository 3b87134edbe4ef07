"""``python -m tfdist.train --task SNAPSHOT_JSON``: one task of a launched job.

The snapshot is ``{"name": ..., "config": {...}}`` (or a bare config); see
`tfdist.train.task.run_snapshot`.
"""

import json
import sys
from pathlib import Path

from tfdist.train.task import run_snapshot

if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--task":
        sys.exit(run_snapshot(json.loads(Path(sys.argv[2]).read_text())))
    sys.exit("usage: python -m tfdist.train --task CONFIG_JSON")
