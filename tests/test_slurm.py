"""configs/slurm/ on a real single-node Slurm cluster (Debian's slurm-wlm and munge).

The module brings up munged (as the munge user, its socket in a temporary directory),
slurmctld and slurmd (``SLURM_CONF`` in the same directory: 2 CPUs, root as SlurmUser,
private ports), then ``sbatch --wait`` runs configs/slurm/multi_worker.sbatch as 2 tasks
on the node. The job's weights must equal the same training in one process (atol 1e-5).
The daemons are stopped by their pid files, and the directory removed, at the end.
Skipped (saying why) without root or without the packages: `make test` installs them
as root where apt-get exists.
"""

import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from tfdist.launch import find_free_ports

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[1]
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo", "scancel")
MUNGE_KEY = Path("/etc/munge/munge.key")
# A tiny job: 128 training samples, 4 steps of 32, one epoch.
OVERRIDES = ["--set", "train.epochs=1", "--set", "data.limit=160",
             "--set", "train.global_batch_size=32", "--set", "train.verbose=0"]
SLURM_CONF = """\
ClusterName=tfdisttest
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge/munge.socket
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
MpiDefault=none
ReturnToService=2
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName={host} CPUs=2 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def _why_not_available():
    """None when a Slurm cluster can be brought up here, else the reason."""
    if os.geteuid() != 0:
        return "needs root to run munged as the munge user and slurmd"
    missing = [b for b in BINARIES if shutil.which(b) is None and
               not os.access(f"/usr/sbin/{b}", os.X_OK)]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} missing): apt-get install "
                "slurm-wlm munge (make test does it as root)")
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "the munge user does not exist (install the munge package)"
    return None


def _binary(name):
    return shutil.which(name) or f"/usr/sbin/{name}"


def _ensure_munge_key():
    """Makes /etc/munge/munge.key (munge's, mode 400) unless there is one."""
    if MUNGE_KEY.exists():
        return
    munge = pwd.getpwnam("munge")
    MUNGE_KEY.parent.mkdir(mode=0o700, exist_ok=True)
    os.chown(MUNGE_KEY.parent, munge.pw_uid, munge.pw_gid)
    fd = os.open(MUNGE_KEY, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    with os.fdopen(fd, "wb") as key:
        key.write(os.urandom(1024))
    os.chown(MUNGE_KEY, munge.pw_uid, munge.pw_gid)


def _two_free_ports():
    """A free port P with P+1 also free (tasks on one node use consecutive ports)."""
    for _ in range(50):
        port = find_free_ports(1)[0]
        if port < 65535:
            with socket.socket() as probe:
                try:
                    probe.bind(("", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no two consecutive free ports")


def _stop_by_pid_file(path, grace=15.0):
    """SIGTERM to the daemon whose pid ``path`` holds, SIGKILL if it outlives ``grace``."""
    try:
        pid = int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _wait_idle(env, timeout=90.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = subprocess.run([_binary("sinfo"), "-h", "-o", "%T"], env=env,
                               capture_output=True, text=True).stdout.strip()
        if state == "idle":
            return
        time.sleep(0.5)
    raise RuntimeError(f"the Slurm node is not idle after {timeout:g}s (state {state!r})")


@pytest.fixture(scope="module")
def slurm():
    """The environment (``SLURM_CONF``) of a running single-node Slurm cluster."""
    reason = _why_not_available()
    if reason:
        pytest.skip(reason)
    _ensure_munge_key()
    work = Path(tempfile.mkdtemp(prefix="tfdist-slurm-"))
    munge = pwd.getpwnam("munge")
    pid_files = [work / "slurmd.pid", work / "slurmctld.pid", work / "munge" / "munged.pid"]
    try:
        work.chmod(0o755)  # munged needs every directory above its socket searchable
        for name in ("munge", "state", "spool", "job"):
            (work / name).mkdir(mode=0o755)
        os.chown(work / "munge", munge.pw_uid, munge.pw_gid)
        ctld_port, slurmd_port = find_free_ports(2)
        conf = work / "slurm.conf"
        conf.write_text(SLURM_CONF.format(host=socket.gethostname().split(".")[0],
                                          dir=work, ctld_port=ctld_port,
                                          slurmd_port=slurmd_port))
        env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        env["SLURM_CONF"] = str(conf)
        munged = [_binary("munged"), f"--socket={work}/munge/munge.socket",
                  f"--pid-file={work}/munge/munged.pid",
                  f"--log-file={work}/munge/munged.log", f"--seed-file={work}/munge/seed"]
        subprocess.run(["runuser", "-u", "munge", "--", *munged], check=True,
                       capture_output=True, text=True, env=env)
        for daemon in ("slurmctld", "slurmd"):  # each forks and writes its pid file
            subprocess.run([_binary(daemon)], check=True, capture_output=True, text=True,
                           env=env)
        _wait_idle(env)
        yield {"env": env, "dir": work}
    except (subprocess.CalledProcessError, RuntimeError) as error:
        logs = "\n".join(f"--- {p.name}:\n{p.read_text()[-1500:]}"
                         for p in work.rglob("*.log") if p.is_file())
        output = getattr(error, "stderr", "") or ""
        pytest.fail(f"could not start the Slurm cluster: {error} {output}\n{logs}")
    finally:
        for path in pid_files:
            _stop_by_pid_file(path)
        shutil.rmtree(work, ignore_errors=True)


def _weights(path):
    import keras

    return keras.saving.load_model(path / "model.keras").get_weights()


def test_sbatch_runs_the_multi_worker_job_and_equals_one_process(slurm):
    env, work = dict(slurm["env"]), slurm["dir"]
    run_dir = work / "job" / "run"
    env.update(TFDIST=str(Path(sys.executable).with_name("tfdist")),
               TFDIST_SLURM_PORT=str(_two_free_ports()), TF_CPP_MIN_LOG_LEVEL="2")
    sbatch = [_binary("sbatch"), "--wait", "--parsable", "--nodes=1", "--ntasks=2",
              "--ntasks-per-node=2", "--cpus-per-task=1", "--time=10",
              f"--output={work}/job/slurm-%j.log", "configs/slurm/multi_worker.sbatch",
              *OVERRIDES, "--set", f'train.output_dir="{run_dir}"']
    job = subprocess.Popen(sbatch, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        out, err = job.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        job.kill()
        out, err = job.communicate()
        subprocess.run([_binary("scancel"), "--name=tfdist-multi-worker"], env=env)
    logs = "\n".join(p.read_text()[-3000:] for p in (work / "job").glob("slurm-*.log"))
    assert job.returncode == 0, f"sbatch: {out} {err}\n{logs}"
    assert logs.count("this task finished; the chief writes the report") == 1, logs
    assert "val_accuracy" in logs

    reference = work / "reference"
    run = subprocess.run([sys.executable, "-m", "tfdist.cli", "train",
                          "configs/multi_worker.toml", *OVERRIDES,
                          "--set", 'strategy.name="none"',
                          "--set", f'train.output_dir="{reference}"'],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for a, b in zip(_weights(run_dir), _weights(reference), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
