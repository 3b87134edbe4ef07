"""Config files: defaults, every bad-config case, and property-based fuzzing."""

import json
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tfdist.config import DEFAULTS, ConfigError, load_config, validate_config

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def _write(tmp_path, text, name="job.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.unit
def test_defaults_are_valid():
    assert load_config(None) == validate_config({})


@pytest.mark.unit
def test_every_config_file_loads():
    files = sorted((ROOT / "configs").glob("*.toml"))
    assert files, "configs/ has no TOML file"
    for path in files:
        load_config(path)


@pytest.mark.unit
@pytest.mark.parametrize("text,match", [
    ("[train]\nepochz = 3\n", r"job.toml: unknown key train.epochz"),
    ("[trainer]\nepochs = 3\n", r"job.toml: unknown section \[trainer\]"),
    ("[train]\nepochs = 'three'\n", r"job.toml: train.epochs must be an integer >= 1. "
                                     r"Received: 'three'"),
    ("[train]\nepochs = true\n", r"train.epochs must be an integer"),
    ("[train]\nepochs = 0\n", r"train.epochs must be an integer >= 1. Received: 0"),
    ("[strategy]\nname = 'magic'\n", r"strategy.name must be one of"),
    ("[data]\nname = 'csv'\npath = 'nope.csv'\n", r"data.path does not exist.*nope.csv"),
    ("[data]\nname = 'npz'\n", r"data.path is required"),
    ("[strategy]\nname = 'parameter_server'\n[cluster]\nchief = true\n",
     r"cluster.ps must be >= 1"),
    ("[strategy]\nname = 'parameter_server'\n[cluster]\nps = 1\n", r"cluster.chief must be"),
    ("[cluster]\nlogical_cpus = 3\n[train]\nglobal_batch_size = 64\n",
     r"global_batch_size=64 cannot be split evenly over 3 replicas"),
    ("[train\nepochs = 1\n", r"job.toml: not valid TOML"),
    ("[strategy]\nname = 'model_average'\noptions = { periodd = 8 }\n",
     r"job.toml: strategy.options.periodd is not an option of ModelAverageStrategy; "
     r"expected one of \[.*'period'.*\]. Received: periodd=8"),
    ("[strategy]\nname = 'parameter_server'\noptions = { period = 8 }\n"
     "[cluster]\nchief = true\nps = 1\n",
     r"strategy.options.period is not an option of ParameterServerStrategy"),
    ("[strategy]\nname = 'none'\noptions = { period = 8 }\n",
     r"strategy.options.period: strategy.name='none' takes no options"),
    ("[train]\nlearning_rate = inf\n", r"train.learning_rate must be a finite number > 0. "
                                        r"Received: inf"),
    ("[train]\nlearning_rate = nan\n", r"train.learning_rate must be a finite number > 0"),
    ("[cluster]\ntimeout = inf\n", r"cluster.timeout must be a finite number of seconds"),
])
def test_bad_config_names_key_and_file(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        load_config(_write(tmp_path, text))


@pytest.mark.multiprocess
def test_every_strategy_option_name_is_known_without_tensorflow():
    from tfdist.config import STRATEGY_CLASSES, strategy_option_names

    for name in STRATEGY_CLASSES:
        assert strategy_option_names(name), name
    assert {"period", "warmup_steps", "outer_optimizer", "startup_timeout"} <= \
        strategy_option_names("model_average")
    assert {"mode", "steps_per_dispatch"} <= strategy_option_names("parameter_server")
    code = ("import sys\nfrom tfdist.config import load_config\n"
            "load_config(None, ['strategy.name=\"model_average\"', 'strategy.options.period=2'])\n"
            "print('tensorflow' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, cwd=ROOT)
    assert result.stdout.strip() == "False", result.stderr


def test_strategy_options_match_the_classes():
    """The names read from the sources are the classes' own keyword arguments."""
    import inspect

    import tfdist
    from tfdist.config import STRATEGY_CLASSES, strategy_option_names

    for name, (_, class_name) in STRATEGY_CLASSES.items():
        cls = getattr(tfdist, class_name)
        own = set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs",
                                                                 "base_kwargs"}
        assert own - {"cluster_resolver", "variable_partitioner", "cross_device_ops"} <= \
            strategy_option_names(name), name


@pytest.mark.unit
def test_output_dir_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match="train.output_dir must be a directory, but .* is "
                                          "a file"):
        load_config(None, [f'train.output_dir="{tmp_path / "f" / "run"}"'])


@pytest.mark.unit
def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="missing.toml: config file does not exist"):
        load_config(tmp_path / "missing.toml")


@pytest.mark.unit
def test_overrides(tmp_path):
    config = load_config(None, ["train.epochs=2", 'strategy.name="model_average"',
                                "strategy.options.period=4", "train.output_dir=out/x"])
    assert config["train"]["epochs"] == 2
    assert config["strategy"]["options"] == {"period": 4}
    assert config["train"]["output_dir"] == "out/x"


@pytest.mark.multiprocess
def test_cli_prints_one_clear_error_without_traceback(tmp_path):
    path = _write(tmp_path, "[train]\nepochs = -1\n")
    result = subprocess.run([sys.executable, "-m", "tfdist.cli", "train", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "train.epochs must be an integer >= 1. Received: -1" in result.stderr
    assert "Traceback" not in result.stderr


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 100) | st.floats(allow_nan=True)
    | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(st.text(max_size=6), children, max_size=3), max_leaves=6)
_keys = st.sampled_from([f"{s}.{k}" for s in DEFAULTS for k in DEFAULTS[s]]
                        + ["train.bogus", "nope.x"])


@pytest.mark.unit
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_keys, _values, max_size=4))
def test_fuzzed_configs_give_config_errors_only(entries):
    raw = {}
    for key, value in entries.items():
        section, name = key.split(".")
        raw.setdefault(section, {})[name] = value
    try:
        config = validate_config(raw, "fuzz.toml")
    except ConfigError as error:
        assert str(error).startswith("fuzz.toml: ")
    else:
        json.dumps(config)  # a valid config is plain data


@pytest.mark.unit
@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_fuzzed_toml_text_gives_config_errors_only(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("fuzz") / "f.toml"
    path.write_text(text)
    try:
        load_config(path)
    except ConfigError:
        pass
