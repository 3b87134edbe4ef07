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


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The tfdist modules ``name`` imports (importlib look-ups of literal names count)."""
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
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module"
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
