"""`tfdist train`: every config and data error is one line and exit 2, before anything
starts; the output directory is locked; the tasks read their own job's config.

In-process and fast: ``tfdist.cli.main`` is called with argv, and `run_task` and
`launch_job` are replaced by stubs that fail the test if anything starts.
"""

import fcntl
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tfdist.cli import main
from tfdist.config import ConfigError, load_config
from tfdist.train import main as train
from tfdist.train import outdir
from tfdist.train.checks import HOROVOD_RANK_VARIABLES

SMALL = ["train.epochs=1", "data.limit=64", "train.global_batch_size=16"]


@pytest.fixture
def nothing_starts(monkeypatch):
    """Fails the test if a task would run or a job would be launched."""
    started = []

    def refuse(*args, **kwargs):
        started.append(args)
        raise AssertionError("a task or a launch started")

    monkeypatch.setattr(train, "run_task", refuse)
    monkeypatch.setattr(train, "launch_job", refuse)
    return started


def _train(tmp_path, text="", sets=(), name="job.toml"):
    config = tmp_path / name
    config.write_text(text)
    argv = ["train", str(config), "--set", f'train.output_dir="{tmp_path / "out"}"']
    for item in [*SMALL, *sets]:
        argv += ["--set", item]
    return main(argv)


def _one_line_error(capsys, *needles):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tfdist train: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err
    return err


def _csv(tmp_path, text, name="d.csv"):
    path = tmp_path / name
    path.write_text(text)
    return path


def _npz(tmp_path, x, y, name="d.npz"):
    path = tmp_path / name
    np.savez(path, x=x, y=y)
    return path


def _data(kind, path, *extra):
    return [f'data.name="{kind}"', f'data.path="{path}"', "data.limit=0", *extra]


CSV_OK = "a,b,label\n" + "".join(f"{i},{i % 3},{i % 2}\n" for i in range(20))


@pytest.mark.unit
@pytest.mark.parametrize("case,sets,needles", [
    ("unknown strategy option",
     ['strategy.name="model_average"', "strategy.options.periodd=8"],
     ["job.toml: strategy.options.periodd is not an option of ModelAverageStrategy",
      "Received: periodd=8"]),
    ("option of another strategy", ["strategy.options.mode=\"sync\""],
     ["strategy.options.mode is not an option of MirroredStrategy"]),
    ("missing model module", ['model.name="no_such_module_xyz:build"'],
     ["job.toml: model.name 'no_such_module_xyz:build'", "no module named"]),
    ("missing model function", ['model.name="json:no_such_function"'],
     ["model.name 'json:no_such_function'", "defines no 'no_such_function'"]),
    ("learning rate inf", ["train.learning_rate=inf"],
     ["job.toml: train.learning_rate must be a finite number > 0. Received: inf"]),
    ("cnn on non-square data", lambda p: ['model.name="cnn"', *_data("csv", _csv(p, CSV_OK))],
     ["model.name = 'cnn' needs square images"]),
    ("spark master of no known scheme",
     ['strategy.name="multi_worker"', 'cluster.mode="spark"', 'cluster.master="nonsense://x"'],
     ["job.toml: cluster.master must be a Spark master URL", "Received: 'nonsense://x'"]),
    ("elastic mirrored",
     ['strategy.name="mirrored"', "cluster.min_workers=1"],
     ["job.toml: cluster.min_workers needs strategy.name = 'multi_worker' or "
      "'model_average' (with options.engine = 'horovod' or 'auto'",
      "Received: strategy.name = 'mirrored'"]),
    ("elastic engine tf",
     ['strategy.name="multi_worker"', 'strategy.options.engine="tf"', "cluster.min_workers=1"],
     ["In an elastic job", "needs engine='horovod'", "Received: engine='tf'"]),
    ("elastic spark",
     ['strategy.name="multi_worker"', 'strategy.options.engine="horovod"',
      "cluster.min_workers=1", 'cluster.mode="spark"'],
     ["cluster.min_workers needs cluster.mode = 'local' or 'nodes'",
      "Received: cluster.mode = 'spark'"]),
    ("ray address without a port",
     ['strategy.name="multi_worker"', 'cluster.mode="ray"', 'cluster.master="head node"'],
     ["job.toml: cluster.master must be a Ray address", "Received: 'head node'"]),
])
def test_config_error_is_one_line_before_anything_starts(tmp_path, capsys, nothing_starts,
                                                         case, sets, needles):
    assert _train(tmp_path, sets=sets(tmp_path) if callable(sets) else sets) == 2
    _one_line_error(capsys, *needles)
    assert not nothing_starts


TP = 'strategy.name="multi_worker_model_parallel"'
COLUMN = 'strategy.options.layout_map={"dense/kernel" = ["", "model"]}'


@pytest.mark.unit
@pytest.mark.parametrize("case,sets,needles", [
    ("model_parallel not dividing the workers",
     [TP, COLUMN, "cluster.workers=3", "strategy.options.model_parallel=2",
      "train.global_batch_size=18"],
     ["job.toml: strategy.options.model_parallel must divide the 3 replicas (cluster.workers "
      "= 3), which form an n // m x m mesh. Received: model_parallel=2"]),
    ("model_parallel not dividing the logical CPUs",
     ['strategy.name="model_parallel"', COLUMN, "cluster.logical_cpus=4",
      "strategy.options.model_parallel=3"],
     ["must divide the 4 replicas (cluster.logical_cpus = 4)", "Received: model_parallel=3"]),
    ("layout key not a regex", [TP, 'strategy.options.layout_map={"dense/(kernel" = ["", '
                                    '"model"]}'],
     ["job.toml: strategy.options: layout_map key 'dense/(kernel' is not a valid regular "
      "expression (missing ), unterminated subpattern at position 6)"]),
    ("layout of the wrong rank", [TP, 'strategy.options.layout_map={"dense/kernel" = '
                                      '["model"]}'],
     ["job.toml: strategy.options.layout_map: the layout of 'dense/kernel' must name 'model' "
      "once", "one entry per axis of its shape [64, 64]. Received: layout=['model']"]),
    ("layout not dividing model.hidden", [TP, COLUMN, "model.hidden=[63]"],
     ["job.toml: strategy.options.layout_map: variable 'dense/kernel' of shape [64, 63] "
      "cannot be split on axis 1 over 2 'model' replicas (63 is not a multiple of 2)",
      "model.name = 'mlp', model.hidden = [63]"]),
    ("cnn head not dividing", [TP, 'model.name="cnn"', "model.hidden=[20]",
                               'strategy.options.layout_map={"dense_1/kernel" = ["model", ""]}',
                               "cluster.workers=8", "train.global_batch_size=16"],
     ["variable 'dense_1/kernel' of shape [20, 10] cannot be split on axis 0 over 8 'model' "
      "replicas"]),
    ("batch axis not dividing on a mesh",
     [TP, 'strategy.options.layout_map={"dense/kernel" = ["batch", "model"]}',
      "cluster.workers=4", "strategy.options.model_parallel=2", "model.hidden=[8]",
      'data.name="csv"', "data.limit=0"],
     ["variable 'dense/kernel' of shape [3, 8] cannot be sharded on axis 0 over the 2 "
      "replicas of the 'batch' axis"]),
    ("two keys match a variable", [TP, 'strategy.options.layout_map={"dense/kernel" = '
                                       '["", "model"], "dense_1/.*el" = ["model", ""], '
                                       '".*_1/kernel" = ["model", ""]}'],
     ["variable 'dense_1/kernel' matches more than one key. Received: keys=['dense_1/.*el', "
      "'.*_1/kernel']"]),
    ("a last batch not splitting over a mesh", [TP, COLUMN],
     ["job.toml: the training split's last batch of 3 rows (51 samples in batches of "
      "train.global_batch_size = 16) does not split evenly over the 2 replicas of "
      "'multi_worker_model_parallel'", "Received: 51 training samples"]),
    ("negative seed", ["train.seed=-1"],
     ["job.toml: train.seed must be an integer in [0, 2**32). Received: -1"]),
    ("seed of 2**32", ["train.seed=4294967296"],
     ["train.seed must be an integer in [0, 2**32). Received: 4294967296"]),
    ("batch larger than the training split", ["train.global_batch_size=64"],
     ["job.toml: train.global_batch_size must be at most the 51 samples of the training "
      "split (data.limit = 64, data.validation_split = 0.2). Received: 64"]),
])
def test_job_error_is_one_line_before_any_process(tmp_path, capsys, nothing_starts, case,
                                                  sets, needles):
    """Issue 39 item 10: each of these started the workers, which printed tracebacks."""
    if any("csv" in item for item in sets):
        path = _csv(tmp_path, "a,b,c,label\n" + "1,2,3,0\n" * 40)
        sets = [*sets, f'data.path="{path}"']
    assert _train(tmp_path, sets=sets) == 2
    _one_line_error(capsys, *needles)
    assert not nothing_starts


def test_the_layout_check_knows_the_built_in_models_variables():
    """`tfdist.train.layouts.builtin_variables` names and shapes every variable as
    `build_model` makes it (in a fresh process: here the names may carry a suffix)."""
    import re

    from tfdist.models import build_model
    from tfdist.train.layouts import builtin_variables

    for model, shape in (({"name": "mlp", "hidden": [7, 5], "dropout": 0.1}, (12,)),
                         ({"name": "cnn", "hidden": [6], "dropout": 0.0}, (49,)),
                         ({"name": "cnn", "hidden": [], "dropout": 0.0}, (64,))):
        built = build_model(model, shape, 3)
        base = [(re.sub(r"_\d+(?=/)", "", v.path), tuple(v.shape)) for v in built.weights]
        want = [(re.sub(r"_\d+(?=/)", "", path), shape)
                for path, shape in builtin_variables(model, shape, 3).items()]
        assert base == want, model
    assert builtin_variables({"name": "m:f", "hidden": []}, (3,), 2) is None


@pytest.mark.unit
def test_model_module_with_syntax_error(tmp_path, capsys, monkeypatch, nothing_starts):
    (tmp_path / "broken_model_xyz.py").write_text("def build(:\n")
    monkeypatch.chdir(tmp_path)
    assert _train(tmp_path, sets=['model.name="broken_model_xyz:build"']) == 2
    _one_line_error(capsys, "broken_model_xyz.py cannot be read or parsed")


@pytest.mark.unit
def test_model_from_working_directory_is_found(tmp_path, monkeypatch):
    (tmp_path / "my_model_xyz.py").write_text("import keras\n\ndef build(shape, k):\n"
                                              "    return None\n")
    monkeypatch.chdir(tmp_path)
    from tfdist.models import check_model_name

    check_model_name("my_model_xyz:build")
    with pytest.raises(ValueError, match="defines no 'other'"):
        check_model_name("my_model_xyz:other")


@pytest.mark.unit
@pytest.mark.parametrize("case,make,needles", [
    ("directory as data path", lambda p: _data("csv", p), ["data.path", "is a directory"]),
    ("empty csv", lambda p: _data("csv", _csv(p, "")),
     ["data.path", "needs a header and at least one row"]),
    ("csv without label column", lambda p: _data("csv", _csv(p, "a,b\n1,2\n")),
     ["job.toml: data.label", "no label column 'label'", "Received columns: ['a', 'b']"]),
    ("non-numeric cell", lambda p: _data("csv", _csv(p, CSV_OK + "1,x,0\n")),
     ["line 22, column 'b' is not a number. Received: 'x'"]),
    ("nan cell", lambda p: _data("csv", _csv(p, CSV_OK + "1,nan,0\n")),
     ["features must be finite numbers", "1 NaN or infinite"]),
    ("fractional label", lambda p: _data("csv", _csv(p, CSV_OK + "1,2,1.7\n")),
     ["labels must be whole numbers", "Received: 1.7"]),
    ("negative label", lambda p: _data("csv", _csv(p, CSV_OK + "1,2,-1\n")),
     ["labels must be class indices >= 0. Received: -1"]),
    ("huge label", lambda p: _data("npz", _npz(p, np.ones((200, 3)),
                                               np.r_[np.zeros(199), 100000])),
     ["K at most the number of samples (200). Received: a label of 100000"]),
    ("non-zip npz", lambda p: _data("npz", _csv(p, "not a zip", "d.npz")),
     ["data.path", "is not an .npz archive"]),
    ("npz without labels", lambda p: _data("npz", p / "x.npz") if np.savez(
        p / "x.npz", x=np.ones((4, 2))) is None else None,
     ["data.label", "needs arrays 'x' and 'label'"]),
    ("no validation sample", lambda p: _data("csv", _csv(p, "a,label\n1,0\n2,1\n")),
     ["data.validation_split", "leaves no validation sample"]),
    ("no training sample",
     lambda p: _data("csv", _csv(p, "a,label\n1,0\n"), "data.validation_split=0.9"),
     ["data.validation_split", "leaves no training sample"]),
])
def test_data_error_is_one_line_before_anything_starts(tmp_path, capsys, nothing_starts,
                                                       case, make, needles):
    assert _train(tmp_path, sets=make(tmp_path)) == 2
    _one_line_error(capsys, "job.toml: ", *needles)


@pytest.mark.unit
def test_output_dir_that_is_a_file(tmp_path, capsys, nothing_starts):
    (tmp_path / "taken").write_text("")
    assert _train(tmp_path, sets=[f'train.output_dir="{tmp_path / "taken" / "run"}"']) == 2
    _one_line_error(capsys, "train.output_dir must be a directory", "is a file")


@pytest.mark.unit
def test_env_mode_without_tf_config(tmp_path, capsys, monkeypatch, nothing_starts):
    for name in ("TF_CONFIG", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    assert _train(tmp_path, "[strategy]\nname = 'multi_worker'\n[cluster]\nmode = 'env'\n") == 2
    _one_line_error(capsys, "job.toml: cluster.mode = 'env' needs TF_CONFIG")


@pytest.mark.unit
def test_env_mode_with_a_broken_tf_config(tmp_path, capsys, monkeypatch, nothing_starts):
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": "nope"}}')
    assert _train(tmp_path, "[strategy]\nname = 'multi_worker'\n[cluster]\nmode = 'env'\n") == 2
    _one_line_error(capsys, "job.toml: cluster.mode = 'env': the environment does not")


@pytest.mark.unit
def test_horovod_env_mode_outside_horovodrun(tmp_path, capsys, monkeypatch, nothing_starts):
    for name in HOROVOD_RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert _train(tmp_path, "[strategy]\nname = 'horovod'\n[cluster]\nmode = 'env'\n") == 2
    _one_line_error(capsys, "HOROVOD_RANK is not set")


@pytest.mark.unit
def test_horovod_without_horovodrun(tmp_path, capsys, monkeypatch, nothing_starts):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    assert _train(tmp_path, "[strategy]\nname = 'horovod'\n") == 2
    _one_line_error(capsys, "job.toml: strategy.name = 'horovod'", "no horovodrun on PATH")


# ---- the output directory's lock and the job's own config -------------------------------


@pytest.mark.multiprocess
def test_second_job_on_a_locked_output_dir_is_refused(tmp_path, capsys, nothing_starts):
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time\n"
         f"fd = os.open({str(out / '.tfdist.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX)\n"
         "os.write(fd, f'pid {os.getpid()} on host h'.encode())\n"
         "print('locked', flush=True)\ntime.sleep(120)\n"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert _train(tmp_path) == 2
        _one_line_error(capsys, f"train.output_dir '{out}' is in use by another tfdist train "
                        f"job (pid {holder.pid} on host h)")
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.unit
def test_stale_lock_of_a_dead_job_is_taken_over(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / ".tfdist.lock").write_text("pid 999999 on host h\n")  # no live flock
    seen = {}

    def fake_run_task(config, name=None):
        fd = os.open(out / ".tfdist.lock", os.O_RDWR)
        with pytest.raises(BlockingIOError):  # held by this job now
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(fd)
        seen["holder"] = (out / ".tfdist.lock").read_text()

    monkeypatch.setattr(train, "run_task", fake_run_task)
    assert _train(tmp_path, sets=['strategy.name="none"']) == 0
    assert seen["holder"].startswith(f"pid {os.getpid()} on host ")
    fd = os.open(out / ".tfdist.lock", os.O_RDWR)  # released at the end
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(fd)


@pytest.mark.unit
def test_tasks_read_their_own_snapshot(tmp_path, monkeypatch):
    seen = {}

    def fake_launch(config, config_path):
        seen["snapshot"] = json.loads(config_path.read_text())
        seen["path"] = config_path
        (tmp_path / "out" / "config.resolved.json").write_text("{}")  # another job's write
        seen["again"] = json.loads(config_path.read_text())
        return 0

    monkeypatch.setattr(train, "launch_job", fake_launch)
    assert _train(tmp_path, "[strategy]\nname = 'multi_worker'\n", name="mw.toml") == 0
    assert seen["snapshot"]["name"] == "mw"
    assert seen["snapshot"]["config"]["strategy"]["name"] == "multi_worker"
    assert seen["again"] == seen["snapshot"]
    assert not seen["path"].exists()  # removed with the job
    assert (tmp_path / "out" / "backup" / outdir.BACKUP_CONFIG_FILE).is_file()


@pytest.mark.unit
def test_backup_of_another_config_is_kept_and_refused_unless_fresh(tmp_path, capsys):
    config = load_config(None, ['train.output_dir="x"'])
    backup = tmp_path / "backup"
    outdir.prepare_backup(config, backup)
    (backup / "state.json").write_text("{}")
    outdir.prepare_backup(config, backup)
    assert (backup / "state.json").exists()
    assert "holds a backup of this config; the job resumes from it" in \
        capsys.readouterr().out
    other = load_config(None, ["train.learning_rate=0.1"])
    with pytest.raises(ConfigError, match=r"holds a backup of another config \(it differs "
                       r"in train.learning_rate\); it is kept.*tfdist train --fresh"):
        outdir.prepare_backup(other, backup)
    assert (backup / "state.json").exists()
    outdir.prepare_backup(other, backup, fresh=True)
    assert not (backup / "state.json").exists()
    assert "removed" in capsys.readouterr().out
    outdir.prepare_backup(other, backup)  # now marked as the other config's


def _users_directory(path):
    """A directory of the user's: 3 files and a subdirectory, none tfdist's."""
    (path / "data").mkdir(parents=True)
    (path / "data" / "x.npy").write_bytes(b"the user's data")
    for name in ("notes.txt", "a.txt", "b.txt"):
        (path / name).write_text(name)
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.mark.unit
@pytest.mark.parametrize("fresh", [False, True], ids=["kept", "fresh"])
@pytest.mark.parametrize("where", ["TFDIST_BACKUP_DIR", "train.output_dir"])
def test_a_directory_tfdist_did_not_write_is_never_used_or_removed(
        tmp_path, capsys, monkeypatch, nothing_starts, where, fresh):
    """Issue 39 item 3: --fresh removed the user's directory; without it the directory
    was called "a backup of another config"."""
    users = tmp_path / "mine" if where == "TFDIST_BACKUP_DIR" else tmp_path / "out" / "backup"
    if where == "TFDIST_BACKUP_DIR":
        monkeypatch.setenv("TFDIST_BACKUP_DIR", str(users))
    else:
        monkeypatch.delenv("TFDIST_BACKUP_DIR", raising=False)
    before = _users_directory(users)
    config = tmp_path / "job.toml"
    config.write_text("[strategy]\nname = 'none'\n")
    argv = ["train", str(config), "--set", f'train.output_dir="{tmp_path / "out"}"',
            *(f"--set={item}" for item in SMALL), *(["--fresh"] if fresh else [])]
    assert main(argv) == 2
    err = _one_line_error(capsys, f"{users} holds 3 files and 1 directory that tfdist did "
                          "not write (a.txt, b.txt, data/, notes.txt); it is not a tfdist "
                          "backup, so it is neither used nor removed",
                          f"Point {where} at a new or empty directory")
    assert "another config" not in err and ("--fresh removes only" in err) is fresh, err
    assert sorted(str(p.relative_to(users)) for p in users.rglob("*")) == before
    assert not (users / outdir.BACKUP_CONFIG_FILE).exists()
    assert not nothing_starts


@pytest.mark.unit
def test_a_file_as_the_backup_directory_is_kept(tmp_path, capsys, monkeypatch,
                                                nothing_starts):
    target = tmp_path / "a_file"
    target.write_text("keep me")
    monkeypatch.setenv("TFDIST_BACKUP_DIR", str(target))
    config = tmp_path / "job.toml"
    config.write_text("[strategy]\nname = 'none'\n")
    assert main(["train", str(config), "--fresh", "--set",
                 f'train.output_dir="{tmp_path / "out"}"']) == 2
    _one_line_error(capsys, f"{target} is not a directory", "Point TFDIST_BACKUP_DIR at")
    assert target.read_text() == "keep me"


@pytest.mark.unit
def test_a_backup_known_by_its_files_alone_is_refused_then_removed_with_fresh(
        tmp_path, capsys, monkeypatch):
    """A tfdist backup without the marker (e.g. a `tfdist launch --backup-dir` job's) is
    told by its files: kept without --fresh, removed with it."""
    backup = tmp_path / "out" / "backup"
    backup.mkdir(parents=True)
    names = ["tfdist_backup.json", "tfdist_backup.prev.json", "backup-3.weights.h5",
             "backup-2.weights.h5.corrupt", ".tmp-4242-backup-4.weights.h5",
             "tfdist_history.json"]
    for name in names:
        (backup / name).write_text("{}")
    monkeypatch.delenv("TFDIST_BACKUP_DIR", raising=False)
    ran = []
    monkeypatch.setattr(train, "run_task", lambda config, name=None: ran.append(name))
    assert _train(tmp_path, "[strategy]\nname = 'none'\n") == 2
    _one_line_error(capsys, f"{backup} holds a tfdist backup that names no tfdist train "
                    "config (.tmp-4242-backup-4.weights.h5, backup-2.weights.h5.corrupt, "
                    "backup-3.weights.h5, tfdist_backup.json, ...); it is kept",
                    "tfdist train --fresh")
    assert sorted(p.name for p in backup.iterdir()) == sorted(names) and not ran
    config = tmp_path / "job.toml"
    assert main(["train", str(config), "--fresh", "--set",
                 f'train.output_dir="{tmp_path / "out"}"', *(f"--set={i}" for i in SMALL)]) == 0
    assert f"removed {backup} (--fresh)" in capsys.readouterr().out
    assert [p.name for p in backup.iterdir()] == [outdir.BACKUP_CONFIG_FILE] and ran


# ---- an engine that cannot be reached -------------------------------------------------------


@pytest.mark.multiprocess
def test_unreachable_ray_master_fails_in_one_line_leaving_nothing(tmp_path):
    """Ray retries an unreachable GCS forever: tfdist fails at once, naming the address."""
    config = tmp_path / "job.toml"
    config.write_text("")
    argv = [sys.executable, "-m", "tfdist.cli", "train", str(config),
            "--set", f'train.output_dir="{tmp_path / "out"}"', *(
                f"--set={item}" for item in [*SMALL, 'strategy.name="multi_worker"',
                                             'cluster.mode="ray"',
                                             'cluster.master="127.0.0.1:1"'])]
    job = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        out, err = job.communicate(timeout=240)  # a hang guard: it used to hang forever
    finally:
        if job.poll() is None:
            os.killpg(job.pid, 9)
            job.wait()
    lines = [line for line in err.splitlines() if line.strip()]
    assert job.returncode == 2, err
    assert lines == [lines[-1]] and lines[0].startswith("tfdist train: error: cluster.master"), err
    assert "127.0.0.1:1" in lines[0], err
    left = subprocess.run(["ps", "-o", "pid=,stat=,args=", "-s", str(job.pid)],
                          capture_output=True, text=True).stdout.strip()
    assert not left, left
