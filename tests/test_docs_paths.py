"""Every file, module and test the docs cite exists: `tests/x.py::name`, `tfdist/...py`,
`_hooks/keras.py`, `scripts/...`, `configs/...`, `benchmarks/...` in docs/*.md and README.md."""

import ast
import fnmatch
import functools
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
# Folders a cited path may start with, looked up from the checkout's root.
ROOTED = ("tests/", "tfdist/", "scripts/", "benchmarks/", "configs/", "notebooks/", "docs/")
# A path in backquotes (with an optional ::test and [parameters]).
CITED = re.compile(r"`([A-Za-z0-9_./*-]+\.(?:py|md|toml|yaml|ipynb|sh|json|sbatch|png))(?![\w.])"
                   r"(?:::\s*([A-Za-z0-9_*]+)(?:\[[^\]`]*\])?)?")
# Paths of the checkout in prose, without backquotes.
PROSE = re.compile(r"(?<![\w/.`])((?:tests|tfdist|scripts|benchmarks|configs|notebooks|docs)/"
                   r"[A-Za-z0-9_./*-]+\.(?:py|md|toml|yaml|ipynb|sh|json))(?![\w.])")
# Dotted names of the package: `tfdist.keras.callbacks.BackupAndRestore`.
DOTTED = re.compile(r"`(tfdist(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
# Bare test-file names in prose, like test_faults.py::test_x.
BARE_TEST = re.compile(r"(?<![/\w])(test_[a-z0-9_]+\.py)(?:::([A-Za-z0-9_*]+))?")
# Names that are examples or files a run writes, not files of the checkout.
OUTPUTS = {"report.json", "compare.json", "compare.md", "config.resolved.json",
           "bench_status.json", "RESULTS.md", "tfdist_training_done.json", "train.py", "report.png", "compare.png",
           "my.toml", "x.toml", "A.toml", "B.toml", "CONFIG.toml"}


# `::test_name` after a test file's citation: a test of the file cited last before it.
FOLLOWING = re.compile(r"(test_[a-z0-9_]+\.py)|`::([A-Za-z0-9_]+)")


def _citations() -> list[tuple[str, str, str | None]]:
    found = set()
    for page in PAGES:
        text = page.read_text()
        last = None
        for match in FOLLOWING.finditer(text):
            if match.group(1):
                last = match.group(1)
            elif last is not None:
                found.add((page.relative_to(REPO).as_posix(), last, match.group(2)))
        for pattern in (CITED, BARE_TEST, PROSE):
            for match in pattern.finditer(text):
                test = match.group(2) if pattern.groups > 1 else None
                found.add((page.relative_to(REPO).as_posix(), match.group(1), test))
    return sorted(found, key=lambda c: (c[0], c[1], c[2] or ""))


@functools.lru_cache(maxsize=1)
def _package_files() -> tuple[Path, ...]:
    return tuple((REPO / "tfdist").rglob("*"))


def _resolve(page: str, cited: str) -> Path | None:
    """The checkout file ``cited`` names, or None when it names an output or example."""
    name = cited.lstrip("./")
    if cited.startswith("../"):
        return (REPO / page).parent.joinpath(cited).resolve()
    if Path(name).name in OUTPUTS or Path(name).stem.isupper():  # FILE.py: a placeholder
        return None
    if name.startswith(ROOTED) or name in ("Makefile", "setup.cfg", "Dockerfile"):
        return REPO / name
    if name.startswith("test_"):
        return REPO / "tests" / name
    if "/" not in name and (REPO / name).exists():
        return REPO / name
    if name.startswith(("DIR/", "OUTPUT_DIR/", "/opt/")):
        return None
    # A path inside the package, like _hooks/keras.py, averaging/keras.py or _fit.py.
    matches = [p for p in _package_files() if p.as_posix().endswith("/" + name)]
    return matches[0] if matches else REPO / "tfdist" / name


@functools.lru_cache(maxsize=None)
def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


@pytest.mark.unit
def test_the_docs_cite_some_paths():
    cited = _citations()
    assert len(cited) > 50, cited
    assert any(test for _, _, test in cited), "no tests/x.py::name citation was found"


@pytest.mark.unit
def test_every_cited_path_and_test_exists():
    missing = []
    for page, cited, test in _citations():
        path = _resolve(page, cited)
        if path is None:
            continue
        if "*" in path.name and list(path.parent.glob(path.name)):
            continue
        if not path.exists():
            missing.append(f"{page}: {cited} (no {path.relative_to(REPO) if path.is_relative_to(REPO) else path})")
            continue
        if test and path.suffix == ".py" and not fnmatch.filter(_test_names(path), test):
            missing.append(f"{page}: {cited}::{test} (no such test)")
    assert not missing, "\n".join(missing)


def _dotted_names() -> list[tuple[str, str]]:
    return sorted({(page.relative_to(REPO).as_posix(), match.group(1))
                   for page in PAGES for match in DOTTED.finditer(page.read_text())})


def _module_path(dotted: str) -> Path | None:
    path = REPO.joinpath(*dotted.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def _defines(path: Path, name: str) -> bool:
    """True if the module at ``path`` defines or lazily exports ``name`` (read, not imported)."""
    text = path.read_text()
    tree = ast.parse(text)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                and node.name == name:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) \
                and any((a.asname or a.name.split(".")[-1]) == name for a in node.names):
            return True
    # Lazy exports: the name as a quoted key (tfdist.keras) or in the strategy registry.
    if f'"{name}"' in text:
        return True
    return path == REPO / "tfdist" / "__init__.py" and \
        f'"{name}"' in (REPO / "tfdist" / "strategies" / "registry.py").read_text()


@pytest.mark.unit
def test_every_cited_module_and_name_exists():
    missing = []
    for page, dotted in _dotted_names():
        parts = dotted.split(".")
        for split in range(len(parts), 0, -1):
            path = _module_path(".".join(parts[:split]))
            if path:
                break
        rest = parts[split:]
        if path is None or len(rest) > 2 or rest and not _defines(path, rest[0]):
            missing.append(f"{page}: {dotted}")
    assert not missing, "\n".join(missing)


# Flags of other tools the docs quote (spark-submit, docker).
OTHER_TOOLS_FLAGS = {"--args", "--build-arg", "--conf"}


@pytest.mark.unit
def test_every_cited_command_line_flag_exists():
    """A `--flag` in backquotes is one of tfdist's (cli, launcher, benchmarks, scripts)."""
    sources = "\n".join(p.read_text() for folder in ("tfdist", "benchmarks", "scripts")
                        for p in (REPO / folder).rglob("*.py"))
    flags = {(page.relative_to(REPO).as_posix(), flag) for page in PAGES
             for flag in re.findall(r"`(--[a-z][a-z-]+)", page.read_text())}
    assert len(flags) > 10, flags
    missing = sorted(f"{page}: {flag}" for page, flag in flags
                     if flag not in OTHER_TOOLS_FLAGS and f'"{flag}"' not in sources)
    assert not missing, "\n".join(missing)


@pytest.mark.unit
def test_every_cited_environment_variable_is_read_or_set_somewhere():
    """A ``TFDIST_*`` name the docs cite appears in the package, the tests, the
    benchmarks, the scripts or the Makefile."""
    sources = "\n".join(p.read_text() for folder in ("tfdist", "tests", "benchmarks", "scripts")
                        for p in (REPO / folder).rglob("*") if p.suffix in (".py", ".sh"))
    sources += (REPO / "Makefile").read_text()
    cited = {(page.relative_to(REPO).as_posix(), name) for page in PAGES
             for name in re.findall(r"\bTFDIST_[A-Z_]*[A-Z]\b", page.read_text())}
    assert len(cited) > 5, cited
    missing = sorted(f"{page}: {name}" for page, name in cited if name not in sources)
    assert not missing, "\n".join(missing)
