"""`tfdist train` checks every ``strategy.options`` value with the strategy class's own
checks (`tfdist.strategies.options.arguments`) before anything runs: one line, exit 2; and a
backup of another config is kept and refused, not removed.

Every option of every registry entry gets a bad value (`BAD`, which must cover every
option the registry lists). In-process through ``tfdist.cli.main`` with launching and
running stubbed out, plus two real ``tfdist train`` subprocesses.
"""

import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tfdist.cli import main
from tfdist.config import load_config
from tfdist.strategies import registry
from tfdist.strategies.options import arguments
from tfdist.train import main as train
from tfdist.train import outdir
from tfdist.train.checks import strategy_kwargs

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["train.epochs=1", "data.limit=64", "train.global_batch_size=16"]
# option -> a bad value (TOML), and what the one line must hold besides the option's name.
BAD = {
    "accumulate_steps": ("0", "must be an integer >= 1"),
    "communication_options": ("{accumulate_steps = 0}", "must be an integer >= 1"),
    "compression": ('"int3"', "Received: compression='int3'"),
    "devices": ("[]", "must name at least one device"),
    "shard_optimizer_state": ('"yes"', "shard_optimizer_state"),
    "shard_parameters": ('"yes"', "shard_parameters"),
    "min_shard_elements": ("0", "must be an integer >= 1"),
    "shard_filter": ('"kernel"', "Received: shard_filter='kernel'"),
    "reshard_after_forward": ('"yes"', "reshard_after_forward"),
    "collective_timeout": ("0", "must be a number of seconds > 0"),
    "commit_every_steps": ("0", "must be an integer >= 1"),
    "engine": ('"nccl2"', "Received: engine='nccl2'"),
    "heartbeat_timeout": ("-1", "must be a number of seconds > 0"),
    "startup_timeout": ("0", "> 0"),
    "chief_poll_seconds": ("0", "must be a number > 0"),
    "exactly_once": ('"yes"', "must be True or False"),
    "mode": ('"semi"', "Received: mode='semi'"),
    "step_timeout": ("0", "must be None or a number > 0"),
    "steps_per_dispatch": ("0", "must be an integer >= 1"),
    "update_block_bytes": ("0", "must be an integer >= 1"),
    "average_optimizer_state": ('"yes"', "must be True or False"),
    "fragments": ("0", "must be an integer >= 1"),
    "mix": ("1.5", "Received: mix=1.5"),
    "outer_compression": ('"int3"', "Received: outer_compression='int3'"),
    "outer_optimizer": ("5", "Received: outer_optimizer=5"),
    "period": ("0", "Received: period=0"),
    "sync_delay": ("8", "Received: sync_delay=8"),
    "warmup_steps": ("-1", "Received: warmup_steps=-1"),
    "layout_map": ("{}", "must map variable path patterns"),
    "model_parallel": ("0", "must be an integer >= 1"),
}
# What each strategy needs around it for its config to be valid.
CLUSTER = {"parameter_server": ["cluster.chief=true", "cluster.ps=1"],
           "model_parallel": ['strategy.options.layout_map={"dense/kernel" = ["", "model"]}'],
           "multi_worker_model_parallel": [
               'strategy.options.layout_map={"dense/kernel" = ["", "model"]}']}
CASES = [(name, option) for name, entry in registry.STRATEGIES.items() if entry.class_name
         for option in sorted(registry.option_names(name))]


def _argv(out, name, sets=()):
    argv = ["train", "--set", f'train.output_dir="{out}"', "--set", f'strategy.name="{name}"']
    for item in [*SMALL, *CLUSTER.get(name, []), *sets]:
        argv += ["--set", item]
    return argv


@pytest.fixture
def nothing_starts(monkeypatch):
    started = []

    def refuse(*args, **kwargs):
        started.append(args)
        raise AssertionError("a task or a launch started")

    monkeypatch.setattr(train, "run_task", refuse)
    monkeypatch.setattr(train, "launch_job", refuse)
    return started


@pytest.mark.unit
def test_every_option_of_the_registry_has_a_bad_value():
    assert {option for _, option in CASES} == set(BAD)


@pytest.mark.unit
@pytest.mark.parametrize("name,option", CASES)
def test_bad_option_is_one_line_and_exit_2_before_anything(tmp_path, capsys, nothing_starts,
                                                           name, option):
    value, needle = BAD[option]
    assert main(_argv(tmp_path / "out", name, [f"strategy.options.{option}={value}"])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tfdist train: error: "), err
    assert option in err and needle in err and "Received" in err, err
    assert not nothing_starts
    assert not (tmp_path / "out" / "backup").exists()  # checked before the backup too


@pytest.mark.parametrize("name,option", CASES)
def test_the_class_itself_refuses_the_value_with_the_same_check(name, option):
    """The train check is the constructor's own: same exception and message."""
    import importlib

    value, _ = BAD[option]
    config = load_config(None, [f'strategy.name="{name}"', *CLUSTER.get(name, []),
                                f"strategy.options.{option}={value}"])
    if option == "communication_options":  # the table is CommunicationOptions' own check
        from tfdist import CommunicationOptions

        with pytest.raises(ValueError) as own:
            CommunicationOptions(**config["strategy"]["options"][option])
        with pytest.raises(ValueError, match=re.escape(str(own.value))):
            strategy_kwargs(config)
        return
    kwargs = strategy_kwargs(config)
    with pytest.raises(ValueError) as checked:
        arguments.check_options(name, kwargs)
    entry = registry.get(name)
    cls = getattr(importlib.import_module(entry.module), entry.class_name)
    with pytest.raises(ValueError) as constructed:
        cls(**kwargs)
    assert str(constructed.value) == str(checked.value)


@pytest.mark.parametrize("name", [n for n, e in registry.STRATEGIES.items() if e.class_name])
def test_check_functions_take_the_classes_arguments_and_defaults(name):
    """Fails when a class's keyword or default changes and its check does not."""
    import importlib

    entry = registry.get(name)
    cls = getattr(importlib.import_module(entry.module), entry.class_name)

    def parameters(function, skip=1):
        return {p.name: (p.kind, p.default)
                for p in list(inspect.signature(function).parameters.values())[skip:]
                if p.name not in registry.NOT_FROM_CONFIG}

    assert parameters(getattr(arguments, f"check_{name}"), 0) == parameters(cls.__init__)


@pytest.mark.parametrize("option,value,needle", [
    ("outer_optimizer", '{name = "rmsprop"}', "outer_optimizer.name must be 'sgd' or 'adam'"),
    ("outer_optimizer", '{name = "sgd", learning_rat = 0.1}', "learning_rat"),
    ("communication_options", '{timeout = 3}', "timeout"),
    ("compression", '["fp16"]', "Received: compression=['fp16']"),
    ("outer_compression", '["int4"]', "Received: outer_compression=['int4']"),
])
def test_tables_and_lists_are_named(tmp_path, capsys, nothing_starts, option, value, needle):
    sets = [f"strategy.options.{option}={value}"]
    assert main(_argv(tmp_path / "out", "model_average", sets)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and option in err, err


def test_good_tables_become_the_classes_arguments():
    from tfdist import CommunicationOptions

    config = load_config(None, [
        'strategy.name="model_average"', "strategy.options.communication_options="
        "{timeout_seconds = 30}", 'strategy.options.outer_optimizer={name = "sgd", '
        "learning_rate = 0.7, momentum = 0.9}", "strategy.options.period=4"])
    kwargs = strategy_kwargs(config)
    assert kwargs["communication_options"] == CommunicationOptions(timeout_seconds=30)
    assert kwargs["outer_optimizer"]().get_config()["momentum"] == 0.9
    arguments.check_options("model_average", kwargs)


# ---- the backup of an interrupted run ------------------------------------------------------


def _backup_of_another_config(out: Path) -> Path:
    other = load_config(None, ['strategy.name="model_average"', "train.learning_rate=0.1"])
    backup = out / "backup"
    outdir.prepare_backup(other, backup)
    (backup / "chief").mkdir()
    (backup / "chief" / "epoch_32.weights.h5").write_bytes(b"32 epochs of work")
    return backup


def _run(argv):
    return subprocess.run([sys.executable, "-m", "tfdist.cli", *argv], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


@pytest.mark.multiprocess
def test_cli_bad_option_exits_2_in_one_line_and_keeps_the_backup(tmp_path):
    out = tmp_path / "out"
    backup = _backup_of_another_config(out)
    result = _run(_argv(out, "model_average", ["strategy.options.mix=1.5"]))
    assert result.returncode == 2, result
    assert result.stderr == ("tfdist train: error: <defaults>: strategy.options: mix must be "
                             "a number in [0, 1]. Received: mix=1.5\n")
    assert result.stdout == ""  # no task started (a task prints its progress)
    assert (backup / "chief" / "epoch_32.weights.h5").read_bytes() == b"32 epochs of work"
    assert sorted(p.name for p in out.iterdir()) == ["backup"]


@pytest.mark.multiprocess
def test_cli_refuses_a_backup_of_another_config_naming_it_and_fresh(tmp_path):
    out = tmp_path / "out"
    backup = _backup_of_another_config(out)
    result = _run(_argv(out, "model_average", ["strategy.options.period=4"]))
    assert result.returncode == 2, result
    assert result.stderr.count("\n") == 1, result.stderr
    for needle in (f"tfdist train: error: {backup} holds a backup of another config",
                   "train.learning_rate", "it is kept", "--fresh"):
        assert needle in result.stderr, result.stderr
    assert result.stdout == ""
    assert (backup / "chief" / "epoch_32.weights.h5").read_bytes() == b"32 epochs of work"
    marker = json.loads((backup / outdir.BACKUP_CONFIG_FILE).read_text())
    assert marker["train"]["learning_rate"] == 0.1  # still the other config's
