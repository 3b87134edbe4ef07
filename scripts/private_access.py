"""Counts the private TF/Keras access sites in tfdist/ outside tfdist/_hooks/ (the rule
is in tests/layout_rules.py). Usage: python scripts/private_access.py [TFDIST_DIR] [-v]"""

import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import layout_rules  # noqa: E402

args = [a for a in sys.argv[1:] if a != "-v"]
root = Path(args[0]).resolve() if args else layout_rules.ROOT
sites = [s for s in layout_rules.private_sites(layout_rules.python_files(root))
         if not s.startswith(layout_rules.HOOKS)]
for path, count in sorted(collections.Counter(s.split(":")[0] for s in sites).items()):
    print(f"{count:4d}  {path}")
if "-v" in sys.argv:
    print("\n".join(sites))
print(f"{len(sites)} private TF/Keras access sites outside tfdist/_hooks/")
