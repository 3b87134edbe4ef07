"""The engine seam holds both ways: strategies never branch on an engine's name, and
``CommunicationOptions(timeout_seconds=...)`` ends a job with a frozen peer under every
engine, naming the peer."""

import ast
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

STRATEGIES = Path(__file__).resolve().parents[1] / "tfdist" / "strategies"
ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
BUILT_IN_ENGINES = {"tf", "horovod", "auto"}


def _engine_name_comparisons(source: str) -> list[int]:
    """Lines where an engine name (a string literal, or a tuple/list/set of them) is
    compared (``==``, ``!=``, ``in``, ``not in``) with anything, or where a ``match``
    case is one: a branch on the engine's name."""
    found = []

    def is_name(node) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in BUILT_IN_ENGINES
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(is_name(e) for e in node.elts)
        return False

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(
                isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
            if any(is_name(side) for side in [node.left, *node.comparators]):
                found.append(node.lineno)
        elif isinstance(node, ast.MatchValue) and is_name(node.value):
            found.append(node.lineno)
    return found


@pytest.mark.unit
def test_the_scan_finds_a_branch_on_an_engine_name():
    """The scan catches what main's multi_worker.py and model_average.py did."""
    assert _engine_name_comparisons('if self.engine != "horovod":\n    pass\n') == [1]
    assert _engine_name_comparisons('one = engine in ("tf", "auto")\n') == [1]
    assert _engine_name_comparisons('x = "tf" == name\n') == [1]
    assert _engine_name_comparisons('match e:\n    case "horovod":\n        pass\n') == [2]
    assert _engine_name_comparisons('engine = "tf"\nx = a == "tfdist"\n') == []


@pytest.mark.unit
def test_no_strategy_branches_on_an_engine_name():
    branches = {str(path.relative_to(ROOT)): lines for path in sorted(STRATEGIES.rglob("*.py"))
                if (lines := _engine_name_comparisons(path.read_text()))}
    assert branches == {}, (
        f"strategies compare engine names (ask the engine instead: supports_elastic, "
        f"membership(), serves_one_host): {branches}")


@pytest.mark.unit
def test_strategies_do_not_reach_into_the_horovod_engine_for_elastic_fit():
    """Elastic fit asks the engine (``strategy.membership()``), not Horovod's modules."""
    tree = ast.parse((STRATEGIES / "elastic" / "fit.py").read_text())
    imported = [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    imported += [a.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for a in node.names]
    assert not [m for m in imported if m and m.startswith("tfdist.engines")], imported


@pytest.mark.unit
@pytest.mark.parametrize("kind, op, refused", [
    ("gather", "sum", "kind must be one of ['all_gather', 'all_reduce', 'reduce_scatter']. "
                      "Received: kind='gather'"),
    ("all_reduce", "max", "op must be one of ['sum', 'mean']. Received: op='max'"),
    ("all_gather", "max", "op must be one of ['sum', 'mean']. Received: op='max'"),
])
def test_both_engines_refuse_a_collective_within_groups_in_the_same_words(kind, op, refused):
    """The TF and Horovod engines' communicators check ``in_group``'s kind and op at
    once (before any group, strategy or value is looked at), with one message."""
    from tfdist.comm.communicator import StrategyCommunicator
    from tfdist.engines.horovod.engine import HorovodCommunicator

    said = []
    for communicator in (StrategyCommunicator(), HorovodCommunicator()):
        with pytest.raises(ValueError) as error:
            communicator.in_group(None, kind, None, None, op=op)
        said.append(str(error.value))
    assert said == [refused, refused]


def test_engines_are_built_from_data():
    from tfdist.engines import engine_class
    from tfdist.engines.base import EngineSetup

    with pytest.raises(ValueError, match="Received: setup=<object"):
        engine_class("tf")(object())
    setup = EngineSetup(task_name="worker-0", collective_timeout=5.0,
                        collective_timeout_name="timeout_seconds")
    for name in ("tf", "horovod"):
        engine = engine_class(name)(setup)
        assert engine.setup is setup and engine.membership() is None
    assert engine_class("horovod").supports_elastic and not engine_class("tf").supports_elastic


_FROZEN_JOB = """
    import os, signal, sys

    import keras

    import tfdist
    from helpers import classification_data, mlp

    engine, out = sys.argv[1], sys.argv[2]
    me = os.environ["TFDIST_TASK"]
    with open(os.path.join(out, me + ".pid"), "w") as f:
        f.write(str(os.getpid()))
    strategy = tfdist.MultiWorkerMirroredStrategy(
        engine=engine, heartbeat_timeout=600,
        communication_options=tfdist.CommunicationOptions(timeout_seconds=5))
    assert strategy.engine == engine, strategy.engine


    class Freeze(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if me == "worker-1" and batch == 2:
                with open(os.path.join(out, "frozen"), "w") as f:
                    f.write("1")
                os.kill(os.getpid(), signal.SIGSTOP)


    x, y = classification_data(n=64)
    with strategy.scope():
        model = mlp()
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=8, epochs=500, verbose=0, callbacks=[Freeze()])
"""

# Seconds from the freeze to the job's end: timeout_seconds=5, a 2 s liveness probe,
# the launcher's 1 s grace period, and slack for a loaded 2-core host. The heartbeat in
# force (600 s) would end it far later.
BOUND = 60


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine", ["tf", pytest.param("horovod", marks=pytest.mark.horovod)])
def test_timeout_seconds_ends_a_job_with_a_frozen_peer_under_every_engine(
        engine, tmp_path):
    from helpers import RESULT_DIR_MARK, assert_no_leftover_processes, require_horovod

    if engine == "horovod":
        require_horovod()
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(_FROZEN_JOB))
    log = tmp_path / "output.txt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(ROOT),
                                                       os.environ.get("PYTHONPATH", "")]))
    env[RESULT_DIR_MARK] = str(tmp_path)
    with open(log, "w") as output:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tfdist.cli", "launch", "--workers", "2",
             "--grace-period", "1", str(script), engine, str(tmp_path)],
            stdout=output, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        frozen = tmp_path / "frozen"
        while not frozen.exists():  # start-up: TF and the engine in 2 processes
            try:
                proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                pass
        assert frozen.exists(), log.read_text()[-3000:]
        returncode = proc.wait(timeout=BOUND)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        assert_no_leftover_processes(tmp_path)
    text = log.read_text()
    assert returncode != 0, text[-3000:]
    assert ("worker-0: worker-1 did not answer" in text and "within timeout_seconds=5s"
            in text and "it is frozen (e.g. SIGSTOP)" in text), text[-3000:]
