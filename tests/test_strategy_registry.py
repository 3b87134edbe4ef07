"""The strategy registry agrees with the strategy classes and is read without TensorFlow."""

import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from tfdist.strategies import registry

ROOT = Path(__file__).resolve().parents[1]


def _init_parameters(entry):
    """``(keyword names, takes **kwargs)`` of the entry's class's real ``__init__``."""
    cls = getattr(importlib.import_module(entry.module), entry.class_name)
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
    names = {p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    return names, any(p.kind is p.VAR_KEYWORD for p in parameters)


@pytest.mark.parametrize("name", [n for n, e in registry.STRATEGIES.items() if e.class_name])
def test_entry_options_are_the_classes_init_arguments(name):
    """Fails when a class gains, renames or drops a keyword its entry does not list."""
    entry = registry.STRATEGIES[name]
    names, var_kwargs = _init_parameters(entry)
    assert set(entry.options) == names - set(registry.NOT_FROM_CONFIG), name
    assert bool(entry.kwargs_go_to) == var_kwargs, (
        f"{entry.class_name}.__init__ {'takes' if var_kwargs else 'takes no'} **kwargs; "
        f"kwargs_go_to={entry.kwargs_go_to}")


@pytest.mark.parametrize("name", [n for n, e in registry.STRATEGIES.items() if e.class_name])
def test_public_names_are_defined_where_the_entry_says(name):
    import tfdist

    entry = registry.STRATEGIES[name]
    module = importlib.import_module(entry.module)
    for public in (entry.class_name, *entry.exports):
        assert public in tfdist.__all__
        assert getattr(tfdist, public) is getattr(module, public)


@pytest.mark.unit
def test_option_names_follow_kwargs_to_the_base_classes():
    assert registry.option_names("model_average") >= registry.option_names("multi_worker")
    assert "collective_timeout" in registry.option_names("model_average")
    assert registry.option_names("none") == frozenset()


@pytest.mark.unit
def test_unknown_name_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"one of \['none', 'mirrored'.*Received: 'ring'"):
        registry.get("ring")


@pytest.mark.unit
def test_registry_is_read_without_tensorflow():
    code = ("import sys\nfrom tfdist.strategies import registry\nregistry.option_names("
            "'model_average')\nprint('tensorflow' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, cwd=ROOT)
    assert result.stdout.strip() == "False", result.stderr
