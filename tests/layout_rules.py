"""The house rules of tfdist/ as data and scans, shared by tests/test_layout.py and
scripts/private_access.py (which prints the private-access count).

Private TF/Keras access is one of:

- an import of ``tensorflow.python`` or ``keras.src`` (``import``, ``from ... import``,
  ``importlib.import_module``/``__import__`` or any string constant naming one);
- ``X._y`` where ``_y`` has one leading underscore (not a dunder) and tfdist itself never
  defines ``_y``. tfdist defines a name by ``def``/``class``, a module-level or class-body
  assignment, an import alias, or an assignment to ``self._y``/``cls._y``. ``obj._y = v``
  on another object defines nothing (that writes into someone else's object);
- ``super()._y`` where the class has a base that tfdist does not define (a Keras or TF
  class): that calls its parent's private member;
- ``def _y`` in such a class when tfdist defines ``_y`` nowhere else: an override of a
  private method of TF/Keras.
"""

from __future__ import annotations

import ast
import functools
import sys
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "tfdist"
HOOKS = "tfdist/_hooks/"
PRIVATE_MODULES = re.compile(r"^(tensorflow\.python|keras\.src)(\.|$)")
FRAMEWORKS = re.compile(r"^(tensorflow|keras|horovod)(\.|$)")
# Underscored names the standard library documents as public.
DEF = re.compile(r"^\s*def (_[A-Za-z]\w*)\(", re.M)
STDLIB_PUBLIC = {"_exit", "_replace", "_asdict", "_fields", "_make", "_current_frames"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def python_files(root: Path = ROOT) -> dict[str, ast.Module]:
    """``{"tfdist/x/y.py": tree}`` for every module of the package under ``root``."""
    return {str(p.relative_to(root.parent)): ast.parse(p.read_text())
            for p in sorted(root.rglob("*.py"))}


def _framework_names(tree: ast.Module) -> set[str]:
    """The names a module binds by importing TensorFlow, Keras or Horovod."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names
                      if FRAMEWORKS.match(a.name)}
        elif isinstance(node, ast.ImportFrom) and (FRAMEWORKS.match(node.module or "")
                                                   or node.module == "tfdist._hooks"):
            names |= {a.asname or a.name for a in node.names}
    # ``x = hooks.something()`` hands out TF's internals (a module or a class).
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Attribute)
                and getattr(node.value.func.value, "id", None) in names):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _external_base(node: ast.ClassDef, framework: set[str]) -> bool:
    """Whether a class derives from a TF, Keras or Horovod class."""
    for base in node.bases:
        while isinstance(base, (ast.Attribute, ast.Call)):
            base = base.value if isinstance(base, ast.Attribute) else base.func
        if isinstance(base, ast.Name) and base.id in framework:
            return True
    return False


@functools.lru_cache(maxsize=None)
def framework_methods() -> frozenset[str]:
    """Every ``_name`` TF, Keras and Horovod define as a method (read from their source
    files; nothing is imported)."""
    names = set()
    for package, below in (("tensorflow", "python"), ("keras", "src"), ("horovod", "")):
        # Found on sys.path, not by importlib: the unit tier makes TF's import fail.
        roots = [Path(p, package) for p in sys.path if Path(p, package, "__init__.py").is_file()]
        if not roots and package != "horovod":  # Horovod is optional outside make test
            raise RuntimeError(f"{package} is not installed: the rule reads its source")
        for path in (roots[0] / below).rglob("*.py") if roots else ():
            names.update(DEF.findall(path.read_text(errors="replace")))
    return frozenset(names)


def tfdist_names(trees) -> set[str]:
    """Every ``_name`` tfdist defines itself (see the module docstring)."""
    names = set(STDLIB_PUBLIC)
    for path, tree in trees.items():
        if path.startswith(HOOKS):
            continue  # what the hooks name is TF's and Keras' own
        framework = _framework_names(tree)
        external = {id(d) for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
                    and _external_base(c, framework) for d in c.body
                    if isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and d.name in framework_methods()}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if id(node) not in external:
                    names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.alias):
                names.add(node.asname or node.name.split(".")[-1])
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                names.add(node.attr)
    return {n for n in names if _private(n)}


def private_sites(trees=None) -> list[str]:
    """``"path:line: what"`` for every private TF/Keras access in tfdist/."""
    trees = python_files() if trees is None else trees
    own, sites = tfdist_names(trees), []
    for path, tree in trees.items():
        external_defs, framework = {}, _framework_names(tree)
        for c in ast.walk(tree):
            if isinstance(c, ast.ClassDef) and _external_base(c, framework):
                for d in ast.walk(c):
                    external_defs[id(d)] = c.name
        for node in ast.walk(tree):
            what = None
            if isinstance(node, ast.Import):
                what = next((a.name for a in node.names if PRIVATE_MODULES.match(a.name)), None)
            elif isinstance(node, ast.ImportFrom) and not node.level:
                what = node.module if PRIVATE_MODULES.match(node.module or "") else None
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                what = node.value if PRIVATE_MODULES.match(node.value) else None
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                is_super = (isinstance(node.value, ast.Call)
                            and getattr(node.value.func, "id", None) == "super")
                if node.attr not in own or (is_super and id(node) in external_defs):
                    what = "." + node.attr
            elif (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                  and _private(node.name) and id(node) in external_defs
                  and node.name in framework_methods()):
                what = f"def {node.name} (overrides {external_defs[id(node)]}'s)"
            if what:
                sites.append(f"{path}:{node.lineno}: {what}")
    return sites
