"""Every pair of a strategy's options, and of an option and a launch mode, composes
(its reference tests exist) or is refused in one line before anything runs.

Generated from `tfdist.strategies.registry` and the decisions of
`tfdist.strategies.options.pairs`: an option added to the registry without decided pairs fails
`test_every_pair_of_every_strategy_is_decided`.
"""

import ast
import itertools
import os

import pytest

from tfdist.strategies import registry
from tfdist.strategies.options import pairs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRIES = [e for e in registry.STRATEGIES.values() if e.class_name is not None]


def _decided():
    """``[(entry name, pair, decision)]`` for every entry."""
    return [(e.name, key, decision) for e in ENTRIES
            for key, decision in pairs.decisions(e)[0].items()]


def _refused():
    return sorted(((name, key, d) for name, key, d in _decided() if isinstance(d, pairs.Refused)),
                  key=lambda t: (t[0], sorted(map(str, t[1]))))


def _id(value) -> str:
    """pytest's id of one parametrize value."""
    return str(value) if isinstance(value, (int, float, bool, str, type(None))) else None


def _node_ids(path: str) -> dict[str, set | None]:
    """The test functions of a file -> their case ids (None: not computable from the
    source, e.g. generated cases; any id is then taken)."""
    tree = ast.parse(open(path).read(), path)
    found = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test_"):
            continue
        cases = [[]]
        for decorator in reversed(node.decorator_list):  # the innermost first
            if not (isinstance(decorator, ast.Call)
                    and getattr(decorator.func, "attr", "") == "parametrize"):
                continue
            try:
                values = ast.literal_eval(decorator.args[1])
                ids = next((ast.literal_eval(k.value) for k in decorator.keywords
                            if k.arg == "ids"), None)
            except (ValueError, IndexError, TypeError, SyntaxError):
                cases = None
                break
            if ids is None:
                ids = [[_id(v) for v in (value if isinstance(value, tuple) else (value,))]
                       for value in values]
                if any(None in i for i in ids):
                    cases = None
                    break
                ids = ["-".join(i) for i in ids]
            cases = [c + [i] for c in cases for i in ids]
        found[node.name] = None if cases is None else {"-".join(c) for c in cases if c}
    return found


def _missing(node_id: str, files: dict) -> str | None:
    """Why ``node_id`` names no test, or None."""
    path, _, name = node_id.partition("::")
    case = name.partition("[")[2].rstrip("]") if "[" in name else None
    name = name.partition("[")[0]
    full = os.path.join(ROOT, path)
    if not os.path.exists(full):
        return f"{node_id}: no file {path}"
    if path not in files:
        files[path] = _node_ids(full)
    if name not in files[path]:
        return f"{node_id}: no test {name} in {path}"
    cases = files[path][name]
    if case is not None and cases is not None and case not in cases:
        return f"{node_id}: {name} has no case [{case}] (it has {sorted(cases)})"
    if case is None and cases:
        return None  # the whole parametrized test
    return None


@pytest.mark.unit
def test_every_pair_of_every_strategy_is_decided():
    undecided = {e.name: pairs.decisions(e)[1] for e in ENTRIES}
    undecided = {name: u for name, u in undecided.items() if u}
    assert not undecided, (
        "pairs without a decision in tfdist/strategies/options/pairs.py (add Composes with its "
        f"reference tests, or Refused with the reason): {undecided}")


@pytest.mark.unit
def test_every_reference_test_exists():
    files, missing = {}, {}
    for name, key, decision in _decided():
        if isinstance(decision, pairs.Composes):
            for node_id in decision.tests:
                why = _missing(node_id, files)
                if why:
                    missing.setdefault(why, []).append(f"{name}: {' x '.join(sorted(key))}")
    assert not missing, "reference tests that do not exist:\n" + "\n".join(
        f"  {why}  (for {', '.join(sorted(set(used)))})" for why, used in sorted(missing.items()))


@pytest.mark.unit
def test_the_node_id_check_finds_cases_and_misses():
    """The check above can fail: a case or a test that is not there is reported."""
    files = {}
    here = "tests/test_option_pairs.py"
    assert _missing(here + "::test_every_reference_test_exists", files) is None
    assert "no test" in _missing(here + "::test_nothing_of_the_kind", files)
    assert "no file" in _missing("tests/test_nowhere.py::test_x", files)
    delay = "tests/test_model_average_delay.py::test_delay_and_mix_match_numpy_streaming_diloco"
    assert _missing(delay + "[4-2-1-1.0-False]", files) is None
    assert "no case" in _missing(delay + "[4-2-1-1.0-True]", files)


def _refusal(name, key, decision) -> ValueError:
    """The error a refused pair gets, from the checks that run before anything."""
    from tfdist.strategies.options import arguments

    mode = next((m for m in key if m in pairs.MODES), None) if isinstance(key, tuple) else None
    with pytest.raises(ValueError) as raised:
        arguments.check_options(name, dict(decision.example))
        if mode is not None:
            arguments.check_pairs(name, getattr(arguments, f"check_{name}"),
                                  dict(decision.example), modes=(mode,))
    return raised.value


@pytest.mark.unit
@pytest.mark.parametrize("name,key,decision", _refused(),
                         ids=lambda v: "-".join(sorted(map(str, v))) if isinstance(
                             v, (tuple, frozenset)) else None)
def test_a_refused_pair_is_one_line_received_before_anything_runs(name, key, decision):
    text = str(_refusal(name, key, decision))
    assert "\n" not in text and "Received: " in text, text
    assert decision.reason.split("{")[0] in text, text
    named = [o for o, v in decision.example.items()
             if f"{o}={v!r}" in text or f"{o}={v}" in text]
    assert set(named) & set(key), text


@pytest.mark.unit
def test_check_modes_lets_defaults_and_allowed_values_through():
    from tfdist.strategies.options import arguments

    check = arguments.check_model_average
    arguments.check_pairs("model_average", check, dict(fragments=1, mix=1, sync_delay=0,
                                                       commit_every_steps=1), (pairs.ELASTIC,))
    arguments.check_pairs("multi_worker", arguments.check_multi_worker,
                          dict(engine="horovod", shard_optimizer_state=True,
                               accumulate_steps=2), (pairs.ELASTIC,))
    arguments.check_pairs("model_average", check, dict(fragments=2), (pairs.SPARK,))
    assert pairs.environment_modes({"TFDIST_ELASTIC_ADDR": "h:1", "TFDIST_NNODES": "2"}) == (
        pairs.ELASTIC, pairs.MULTI_NODE)
    assert pairs.environment_modes({"TFDIST_NNODES": "1"}) == ()


@pytest.mark.unit
@pytest.mark.parametrize("cluster,options,words", [
    ({"min_workers": 2}, {"engine": "horovod", "fragments": 2, "period": 4},
     "In an elastic job (tfdist launch --min-workers), ModelAverageStrategy averages"),
    ({"mode": "spark"}, {"devices": ["/cpu:0"], "period": 2},
     "In a Spark job (tfdist.spark.run), devices is for one host"),
])
def test_tfdist_train_refuses_a_pair_with_its_launch_mode_before_any_process(
        cluster, options, words):
    from tfdist.config import ConfigError, DEFAULTS
    from tfdist.train.checks import check_strategy_options

    config = {"strategy": {"name": "model_average", "options": options},
              "cluster": dict(DEFAULTS["cluster"], **cluster)}
    with pytest.raises(ConfigError) as raised:
        check_strategy_options(config, "x.toml")
    assert str(raised.value).startswith(f"x.toml: strategy.options: {words}")
    assert "\n" not in str(raised.value)


def _construction_cases():
    """Refused (option, mode) pairs whose mode a task's environment shows: the
    strategy itself refuses them at construction."""
    shown = {pairs.ELASTIC: {"TFDIST_ELASTIC_ADDR": "127.0.0.1:1"},
             pairs.MULTI_NODE: {"TFDIST_NNODES": "2"}}
    return [pytest.param(name, dict(d.example), mode, shown[mode], id=f"{name}-{o}-{mode}")
            for name, (o, mode), d in
            ((n, k, d) for n, k, d in _refused() if isinstance(k, tuple))
            if mode in shown]


@pytest.mark.parametrize("name,example,mode,environ", _construction_cases())
def test_the_strategy_refuses_a_pair_its_environment_shows_at_construction(
        monkeypatch, name, example, mode, environ):
    import tfdist

    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    cls = getattr(tfdist, registry.get(name).class_name)
    kwargs = dict(example, engine="horovod") if "engine" not in example else dict(example)
    if name == "model_average":
        kwargs.setdefault("period", 4)
    with pytest.raises(ValueError) as raised:
        cls(**kwargs)
    assert "\n" not in str(raised.value) and "Received: " in str(raised.value)
    del mode


@pytest.mark.unit
def test_tfdist_train_exits_2_in_one_line_before_any_task(tmp_path, capsys, monkeypatch):
    from tfdist.cli import main
    from tfdist.train import main as train

    from test_train_options import _argv

    started = []
    monkeypatch.setattr(train, "run_task", lambda *a, **k: started.append(a))
    monkeypatch.setattr(train, "launch_job", lambda *a, **k: started.append(a))
    argv = _argv(tmp_path / "out", "model_average", [
        "strategy.options.engine='horovod'", "strategy.options.period=4",
        "strategy.options.warmup_steps=2", "cluster.workers=2", "cluster.min_workers=1"])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "In an elastic job" in err, err
    assert "Received: warmup_steps=2" in err, err
    assert not started
