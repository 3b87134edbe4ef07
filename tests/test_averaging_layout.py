"""Model averaging is objects, not one class cut into files: no module of
tfdist/strategies/averaging reads a private attribute of another object (``x._name``
where ``x`` is not ``self``, ``cls`` or ``super()``)."""

import ast
from pathlib import Path

import pytest

AVERAGING = Path(__file__).resolve().parents[1] / "tfdist" / "strategies" / "averaging"


def private_reads(source: str) -> list[str]:
    """``line: expression`` of each private attribute read on another object."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        if (isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name)
                and owner.func.id == "super"):
            continue
        found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.unit
def test_the_check_finds_a_private_read_and_allows_self():
    source = "class A:\n    def f(self, s):\n        self._a = s._b\n        super()._c()\n"
    assert private_reads(source) == ["3: s._b"]


@pytest.mark.unit
def test_no_averaging_module_reads_another_objects_private_attributes():
    modules = sorted(AVERAGING.glob("*.py"))
    assert {p.stem for p in modules} >= {"model_average", "fragment", "runner", "outer",
                                         "keras", "elastic"}
    found = {p.name: private_reads(p.read_text()) for p in modules}
    assert {name: reads for name, reads in found.items() if reads} == {}


@pytest.mark.unit
def test_the_old_files_are_gone():
    strategies = AVERAGING.parent
    for old in ("model_average.py", "_average_state.py", "_average_steps.py",
                "_average_keras.py", "_average_elastic.py", "_delayed.py", "_outer.py"):
        assert not (strategies / old).exists(), old
