"""The package's layout holds: no import circle, no oversized file, one docstring per
module, environment variable names written once (tfdist/env.py)."""

import pytest
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "tfdist"
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path], direct=False) -> set[str]:
    """The tfdist modules ``name`` imports (importlib look-ups of literal names count).

    With ``direct``, ``from tfdist import env`` is tfdist.env alone, not tfdist too.
    """
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            named = [f"{base}.{alias.name}" for alias in node.names]
            targets = ([n if n in modules else base for n in named] if direct
                       else named + [base])
        elif (isinstance(node, ast.Call)
              and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("import_module", "__import__")
              and node.args and isinstance(node.args[0], ast.Constant)):
            targets = [node.args[0].value]
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and target.startswith("tfdist"):
                found.add(target)
    return found


@pytest.mark.unit
def test_no_import_circle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    # A package importing its own submodules is not a circle of jobs.
    graph = {name: {t for t in targets if not t.startswith(name + ".")}
             for name, targets in graph.items()}
    state, circles = {}, []

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                circles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


@pytest.mark.unit
def test_no_file_holds_two_jobs_by_size_and_each_says_its_job():
    too_long = {str(p.relative_to(ROOT.parent)): n for p in ROOT.rglob("*.py")
                if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not too_long, f"over {MAX_LINES} lines: {too_long}"
    silent = [str(p.relative_to(ROOT.parent)) for p in ROOT.rglob("*.py")
              if p.read_text().strip() and ast.get_docstring(ast.parse(p.read_text())) is None]
    assert not silent, f"modules without a docstring saying their job: {silent}"


@pytest.mark.unit
def test_environment_variable_names_are_written_once():
    literal = re.compile(r"""(?:environ(?:\.get)?\s*[\[(]\s*|^\w+\s*=\s*)["'](TFDIST_\w+|TF_CONFIG)["']""",
                         re.M)
    found = {str(p.relative_to(ROOT.parent)): literal.findall(p.read_text())
             for p in ROOT.rglob("*.py") if p.name != "env.py"}
    found = {path: names for path, names in found.items() if names}
    assert not {path: names for path, names in found.items()
                if any(n.startswith("TFDIST_") for n in names)}, \
        f"TFDIST_* names outside tfdist/env.py: {found}"


@pytest.mark.unit
def test_no_module_hides_tfdist_env_behind_a_local_name():
    """A parameter or variable called ``env`` in a module that imports `tfdist.env` makes
    ``env.TASK`` an AttributeError at run time (seen: every launched task failed)."""
    hidden = []
    for path in ROOT.rglob("*.py"):
        text = path.read_text()
        if "from tfdist import env" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.arg) and node.arg == "env") or (
                    isinstance(node, ast.Name) and node.id == "env"
                    and isinstance(node.ctx, ast.Store)):
                hidden.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")
    assert not hidden, f"'env' rebound where tfdist.env is imported: {hidden}"


# ---- the house rules of docs/architecture.md, executable ----------------------------------

# Modules allowed to touch TF/Keras internals outside tfdist/_hooks/, and why. Keep short.
PRIVATE_ACCESS_ALLOWED: dict[str, str] = {}

# Modules allowed to write the literal "TF_CONFIG" (tfdist.env.TF_CONFIG is the name).
TF_CONFIG_ALLOWED: dict[str, str] = {}

# The import layers, top first: a module imports only from its own row or rows below.
# tfdist/_hooks/ may be imported by anyone and itself imports only the bottom row.
LAYERS = [
    ("the main job", ["tfdist", "tfdist.cli", "tfdist.train", "tfdist.config",
                      "tfdist.models", "tfdist.data"]),
    ("runners and launch", ["tfdist.runners", "tfdist.spark", "tfdist.ray", "tfdist.launch"]),
    ("keras glue", ["tfdist.keras"]),
    ("strategies", ["tfdist.strategies"]),
    # The strategy <-> Keras contract the strategies implement (KerasHandoff) and the
    # optimizer unwrapping they share: below the strategies, though under keras/.
    ("the keras contract", ["tfdist.keras.handoff", "tfdist.keras.optimizer"]),
    # Pieces and placements (DESIGN.md: imported by strategies/, imports comm/).
    ("layouts", ["tfdist.layout"]),
    ("engines and comm", ["tfdist.engines", "tfdist.comm"]),
    ("who and where", ["tfdist.cluster", "tfdist.devices", "tfdist.env", "tfdist.checks",
                       "tfdist.files", "tfdist.wire"]),
]
HOOKS_PACKAGE = "tfdist._hooks"


def _layer(module: str) -> int | None:
    """The row of ``module`` (0 is the top), or None for tfdist/_hooks/."""
    if module == HOOKS_PACKAGE or module.startswith(HOOKS_PACKAGE + "."):
        return None
    rows = [(len(prefix), row) for row, (_, prefixes) in enumerate(LAYERS)
            for prefix in prefixes if module == prefix or module.startswith(prefix + ".")
            and prefix != "tfdist"]
    assert rows, f"{module} is in no row of LAYERS: add it where it belongs"
    return max(rows)[1]


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bottom = len(LAYERS) - 1
    found = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            source_row, target_row = _layer(module), _layer(target)
            if target_row is None:
                continue  # anyone may import the hooks
            if (source_row is None and target_row != bottom) or (
                    source_row is not None and target_row < source_row):
                found.append(f"{module} ({'hooks' if source_row is None else LAYERS[source_row][0]})"
                             f" imports {target} ({LAYERS[target_row][0]})")
    return found


@pytest.mark.unit
def test_no_import_goes_up_the_layers():
    modules = _modules()
    graph = {name: _imports(name, path, modules, direct=True)
             for name, path in modules.items()}
    upward = _upward_imports(graph)
    assert not upward, "imports going up the layers (LAYERS in this file):\n" + "\n".join(upward)


@pytest.mark.unit
def test_the_layer_rule_finds_an_upward_import():
    assert _upward_imports({"tfdist.cluster": {"tfdist.strategies.mirrored"},
                            "tfdist._hooks.tf": {"tfdist.keras.callbacks"},
                            "tfdist.strategies.mirrored": {"tfdist._hooks.tf", "tfdist.env"},
                            "tfdist.keras.handoff": {"tfdist.strategies"}}) == [
        "tfdist._hooks.tf (hooks) imports tfdist.keras.callbacks (keras glue)",
        "tfdist.cluster (who and where) imports tfdist.strategies.mirrored (strategies)",
        "tfdist.keras.handoff (the keras contract) imports tfdist.strategies (strategies)"]


@pytest.mark.unit
def test_private_tf_keras_access_only_in_hooks():
    """The rule is in tests/layout_rules.py; `python scripts/private_access.py` counts."""
    import layout_rules

    sites = [s for s in layout_rules.private_sites() if not s.startswith(layout_rules.HOOKS)]
    outside = [s for s in sites if s.split(":")[0] not in PRIVATE_ACCESS_ALLOWED]
    assert not outside, ("private TF/Keras access outside tfdist/_hooks/ (move it into a "
                         "hook with its Why: and a test in tests/test_hooks*.py):\n"
                         + "\n".join(outside))
    stale = set(PRIVATE_ACCESS_ALLOWED) - {s.split(":")[0] for s in sites}
    assert not stale, f"PRIVATE_ACCESS_ALLOWED names modules with no private access: {stale}"


@pytest.mark.unit
def test_the_private_access_rule_finds_each_kind():
    import layout_rules

    source = '''
import importlib
import keras
from keras.src.optimizers import base_optimizer
import tensorflow.python.distribute as td

class Checkpoint(keras.callbacks.ModelCheckpoint):
    def _save_model(self, epoch, batch, logs):
        super()._save_model(epoch, batch, logs)
        return self._own_counter

    def _tfdist_helper(self):
        self._own_counter = 1

def f(model):
    importlib.import_module("keras.src.losses")
    model._own_counter = 2
    return model._distribute_strategy, os._exit
'''
    sites = layout_rules.private_sites({"tfdist/x.py": ast.parse(source)})
    assert sorted(s.split(": ", 1)[1] for s in sites) == sorted([
        "keras.src.optimizers", "tensorflow.python.distribute", "keras.src.losses",
        "def _save_model (overrides Checkpoint's)", "._save_model",
        "._distribute_strategy"]), sites


@pytest.mark.unit
def test_tf_config_is_written_only_in_env_py():
    found, allowed = [], set()
    for path in ROOT.rglob("*.py"):
        name = str(path.relative_to(ROOT.parent))
        if path.relative_to(ROOT) == Path("env.py"):
            continue
        lines = [node.lineno for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.Constant) and node.value == "TF_CONFIG"]
        if name in TF_CONFIG_ALLOWED:
            allowed.add(name) if lines else None
        else:
            found += [f"{name}:{line}" for line in lines]
    assert not found, f'"TF_CONFIG" outside tfdist/env.py (use env.TF_CONFIG): {found}'
    stale = set(TF_CONFIG_ALLOWED) - allowed
    assert not stale, f"TF_CONFIG_ALLOWED names modules without the literal: {stale}"


@pytest.mark.unit
def test_the_architecture_page_lists_every_member_of_the_keras_handoff():
    """docs/architecture.md's hand-off table names every KerasHandoff member."""
    source = (ROOT / "keras" / "handoff.py").read_text()
    members = set(re.findall(r"^    (?:def )?(keras_\w+)", source, re.M))
    table = (ROOT.parent / "docs" / "architecture.md").read_text()
    missing = sorted(m for m in members if f"`{m}" not in table)
    assert len(members) >= 14 and not missing, f"not in docs/architecture.md: {missing}"


# strategies/ keeps the modes flat; each concern of stored pieces, elastic state and option
# checking is a package of its own (issue 40's floor plan).
STRATEGY_PACKAGES = {"averaging", "zero", "fsdp", "tensor_parallel", "elastic", "options"}
CONCERN_PREFIXES = ("_zero", "_fsdp", "_tp_", "_tensor_parallel", "_elastic", "pair",
                    "arguments", "sharded_optimizer")


@pytest.mark.unit
def test_each_concern_of_the_strategies_is_a_package():
    strategies = ROOT / "strategies"
    assert {p.parent.name for p in strategies.glob("*/__init__.py")} == STRATEGY_PACKAGES
    flat = sorted(p.stem for p in strategies.glob("*.py") if p.stem != "__init__")
    assert [name for name in flat if name.startswith(CONCERN_PREFIXES)] == []
    assert {"mirrored", "multi_worker", "model_parallel", "parameter_server",
            "horovod", "registry"} <= set(flat)
