"""Tensor parallelism on both engines and what the mesh keeps doing (issue #34):
Horovod on a 2 x 2 data x model mesh (its allgather, allreduce and reducescatter within
process sets), in a job that restarts (``tfdist launch --max-restarts``) and resumes from
its backup; and a tied head (keras.layers.ReversibleEmbedding) split over 2 logical
CPUs. Each is compared with one process holding the same initial weights and seeing the
same global batch (atol 1e-5)."""

import numpy as np
import pytest

from helpers import assert_weights_close

from test_tensor_parallel_features import _restarted_task
from test_tensor_parallel_mesh import pair_floats

RESUMED_STEPS = 2 * (32 // 8)  # epochs 1 and 2 of 32 rows, global batch 8


def _horovod_mesh_task():
    """`_restarted_task` on a 2 x 2 mesh under engine "horovod", worker-1 frozen
    (SIGSTOP), with the process sets Horovod was started with."""
    import signal

    from tfdist.engines.horovod import ops

    from tp_jobs import train_wide

    out = _restarted_task(engine="horovod", model_parallel=2, fault=signal.SIGSTOP,
                          then=train_wide)
    out["process_sets"] = ops.process_sets()
    return out


@pytest.mark.multiprocess
@pytest.mark.horovod
@pytest.mark.timeout(480)
def test_horovod_2_x_2_mesh_restarts_and_matches_one_process(tmp_path, capfd):
    """4 workers under engine "horovod" as a 2 x 2 mesh, splitting the pair (Adam,
    clipped by global norm), with ``--max-restarts 1``: worker-1 freezes (SIGSTOP) in
    epoch 1; the launcher's restart names it as not responding (issue 39: the others
    abort inside Gloo, SIGABRT, and the launcher named only the first of them), the job
    restarts and every worker resumes from the chief's BackupAndRestore backup and
    ends equal to the uninterrupted run in one process. Horovod started with the mesh's
    4 process sets (2 "model" groups, 2 "batch" groups), each worker holds half of each
    split variable, and the resumed run counts the mesh's exact bytes. Then the wide pair
    (issue 39 item 2: Adam and AdamW, float64) equals one device at 1e-9."""
    import re

    from helpers import require_horovod, run_cluster

    require_horovod()
    results = run_cluster(_horovod_mesh_task, workers=4, timeout=460, max_restarts=1,
                          backup_dir=str(tmp_path / "backup"), grace_period=2)
    said = capfd.readouterr().err
    restart = re.search(r"tfdist launch: restart 1/1: (worker-\d) exited with code .*", said)
    assert restart is not None, said[-3000:]
    assert restart[1] in ("worker-0", "worker-2", "worker-3"), restart[0]
    assert re.search(r"\): it found worker-1 not responding \(two liveness probes in a row "
                     r"at [\d.:]+ failed \(no answer within 2s\): it is frozen \(e\.g\. "
                     r"SIGSTOP\), overloaded or unreachable\)$", restart[0]), restart[0]
    reference = results[0]["reference"]
    assert max(np.max(np.abs(a - b)) for a, b in zip(reference,
                                                      results[0]["unclipped"])) > 1e-3
    for result in results:
        assert result["engine"] == "horovod"
        assert result["process_sets"] == [(0, 1), (0, 2), (1, 3), (2, 3)]
        assert result["restart"] == 1
        assert result["epochs_run"] == [1, 2]  # resumed at epoch 1
        assert_weights_close(result["weights"], results[0]["weights"], atol=0)
        assert_weights_close(result["weights"], reference, atol=1e-5)
        assert result["held"] * 2 == result["whole"] > 0  # weights and Adam slots
        # The mesh's collectives per step, plus the clip's one value per split variable
        # (its squares summed over every replica).
        assert result["bytes"] == 4 * (pair_floats() + 3) * RESUMED_STEPS
        # Issue 39 item 2: the wide pair, Adam and AdamW, in float64 (tp_jobs.wide).
        for name in ("adam", "adamw"):
            assert_weights_close(result["then"][name], results[0]["then_reference"][name],
                                 atol=1e-9)


def _tied_bytes():
    """Per step, one of 2 replicas (m = 2, d = 1: rows B = 4, the group's rows G = 8),
    in bytes: its rows' ids gathered (int32) and the lookups (3 x 8 each)
    reduce-scattered; the head's input rows (8 wide) gathered and its logits' slices (8
    of 16) gathered whole; backward their rows' gradients gathered, the head's input
    gradient and the lookups' gradient reduce-scattered; the replicated Dense's gradient
    (24 x 8 + 8) all-reduced. The table's gradient is its own slice's: nothing to sum."""
    rows, group = 8 // 2, 8
    floats = (group * 3 * 8 + rows * 8 + group * 8 + rows * 16 + group * 8 + rows * 3 * 8
              + 24 * 8 + 8)
    return 4 * (floats + rows * 3)


def test_tied_head_on_2_logical_cpus_matches_one_device(logical_cpus):
    """A ReversibleEmbedding laid out ("model", None) whose reverse call is the head:
    vocab-parallel lookups and logits from the same split table, trained on 2 replicas
    (d = 1), end equal to one device; each replica holds half of the table and its Adam
    slots; predict and evaluate equal too."""
    import tfdist
    from tfdist._hooks.tensor_parallel import split_of, tf_value

    from tp_jobs import BATCH, train
    from tp_mesh_jobs import TIED, VOCAB_SIZE, WIDTH, tied, token_data

    x, y = token_data()
    strategy = tfdist.ModelParallelStrategy(layout_map=TIED)
    got, model = train(strategy, tied, x=x, y=y)
    ref, reference = train(None, tied, x=x, y=y)
    assert_weights_close(got, ref, atol=1e-5)
    table = model.get_layer("tied").embeddings
    assert split_of(table).full_shape == (VOCAB_SIZE, WIDTH)
    slots = [v for v in model.optimizer.variables if split_of(v) is not None]
    assert len(slots) == 2  # Adam's two slots of the table
    for variable in [table] + slots:
        assert [tuple(p.shape) for p in tf_value(variable).values] == [
            (VOCAB_SIZE // 2, WIDTH)] * 2
    assert strategy.bytes_communicated == _tied_bytes() * 2 * (32 // BATCH)
    np.testing.assert_allclose(model.predict(x, batch_size=BATCH, verbose=0),
                               reference.predict(x, batch_size=BATCH, verbose=0), atol=1e-5)
    np.testing.assert_allclose(model.evaluate(x, y, batch_size=BATCH, verbose=0),
                               reference.evaluate(x, y, batch_size=BATCH, verbose=0),
                               rtol=1e-5)


def test_horovod_mesh_needs_one_replica_per_process():
    """Horovod's process sets group processes: a mesh over several local replicas (a
    worker's GPUs) is refused in one line before Horovod starts."""
    from tfdist.engines.base import EngineSetup
    from tfdist.engines.horovod.engine import HorovodEngine

    setup = EngineSetup(devices=("/cpu:0", "/cpu:1"), model_parallel=1)
    with pytest.raises(ValueError, match=r"one replica per process .*use engine='tf'\. "
                                         r"Received: model_parallel=1, 2 local replicas"):
        HorovodEngine(setup).create_extended(None, None, None)


def test_process_sets_are_refused_once_horovod_runs_without_them(monkeypatch):
    """Horovod makes process sets when it starts: a mesh whose strategy comes after
    Horovod started (a world of 4 here, without them) is refused in one line."""
    import types

    from tfdist.engines.horovod import ops

    monkeypatch.setattr(ops, "_hvd", types.SimpleNamespace(size=lambda: 4))
    monkeypatch.setattr(ops, "_sets", ops.ProcessSets())
    ops.declare_process_sets([[0, 1, 2, 3], [5]])  # every rank, or one: no set needed
    with pytest.raises(ValueError, match=r"already running .* without the process sets .*"
                                         r"Received: process sets=\[\[0, 1\], \[2, 3\]\]"):
        ops.declare_process_sets([[1, 0], [2, 3], [0, 1]])


def test_horovod_declares_the_strategys_mesh_groups(monkeypatch):
    """The engine declares the process sets of the mesh by the strategy's rule
    (`tfdist.comm.groups.is_mesh`): an m that does not divide the world is refused in
    the strategy's words before Horovod starts; m = n declares none."""
    from tfdist.engines.base import EngineSetup
    from tfdist.engines.horovod import ops
    from tfdist.engines.horovod.engine import HorovodEngine

    monkeypatch.setenv("HOROVOD_SIZE", "4")
    monkeypatch.setattr(ops, "_hvd", None)  # Horovod not started in this process
    declared = {}
    for m in (2, 4):
        monkeypatch.setattr(ops, "_sets", ops.ProcessSets())
        HorovodEngine(EngineSetup(devices=("/cpu:0",), model_parallel=m))._declare_mesh(1)
        declared[m] = ops._sets.declared
    assert declared == {2: [(0, 1), (2, 3), (0, 2), (1, 3)], 4: []}
    with pytest.raises(ValueError, match=r"^model_parallel must divide the 4 replicas in "
                                         r"sync \(a 4 // m x m mesh\)\. Received: "
                                         r"model_parallel=3$"):
        HorovodEngine(EngineSetup(devices=("/cpu:0",), model_parallel=3)).create_extended(
            None, None, None)
