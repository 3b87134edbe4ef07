"""The local launcher: exit codes, stopping, timeouts, TF_CONFIG and function mode."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

import tfdist
from tfdist.cluster import ClusterSpec

pytestmark = pytest.mark.timeout(120)


def _script(tmp_path, body, name="job.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); look at its state.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _cli(*args, timeout=90):
    return subprocess.run([sys.executable, "-m", "tfdist.cli", "launch", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.multiprocess
def test_all_succeed_and_tf_config_is_valid_and_distinct(tmp_path):
    script = _script(tmp_path, """
        import json, os, sys
        out = sys.argv[1]
        name = os.environ["TFDIST_TASK"]
        with open(os.path.join(out, name + ".json"), "w") as f:
            f.write(os.environ["TF_CONFIG"])
        print("hello from", name)
    """)
    result = _cli("--workers", 2, "--chief", script, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "[worker-1] hello from worker-1" in result.stdout
    configs = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert set(configs) == {"chief-0", "worker-0", "worker-1"}
    specs = [ClusterSpec.from_dict(c) for c in configs.values()]
    assert len({s.task for s in specs}) == 3
    assert len({json.dumps(c["cluster"], sort_keys=True) for c in configs.values()}) == 1
    addresses = [a for _, _, a in specs[0].addresses()]
    assert len(set(addresses)) == 3 and all(a.startswith("127.0.0.1:") for a in addresses)


@pytest.mark.multiprocess
def test_one_failure_stops_the_others_and_is_named(tmp_path):
    script = _script(tmp_path, """
        import os, sys, time
        name = os.environ["TFDIST_TASK"]
        open(os.path.join(sys.argv[1], name + ".pid"), "w").write(str(os.getpid()))
        if name == "worker-1":
            time.sleep(1)
            print("boom: something broke")
            sys.exit(3)
        time.sleep(600)
    """)
    start = time.monotonic()
    result = _cli("--workers", 3, "--grace-period", 2, script, tmp_path)
    assert result.returncode != 0
    assert time.monotonic() - start < 60
    assert "worker-1 exited with code 3" in result.stderr
    assert "boom: something broke" in result.stderr
    for pid_file in tmp_path.glob("*.pid"):
        assert not _alive(int(pid_file.read_text())), pid_file.stem


@pytest.mark.multiprocess
def test_timeout_kills_everything_including_grandchildren(tmp_path):
    script = _script(tmp_path, """
        import os, subprocess, sys, time, signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # forces the SIGKILL path
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        name = os.environ["TFDIST_TASK"]
        open(os.path.join(sys.argv[1], name + ".pid"), "w").write(f"{os.getpid()} {child.pid}")
        time.sleep(600)
    """)
    result = _cli("--workers", 2, "--timeout", 3, "--grace-period", 1, script, tmp_path)
    assert result.returncode != 0
    assert "timed out after 3s" in result.stderr
    pids = [int(p) for f in tmp_path.glob("*.pid") for p in f.read_text().split()]
    assert len(pids) == 4
    assert not [p for p in pids if _alive(p)]


@pytest.mark.multiprocess
def test_ps_tasks_are_stopped_when_workers_finish(tmp_path):
    script = _script(tmp_path, """
        import os, time
        if os.environ["TFDIST_TASK"].startswith("ps"):
            time.sleep(600)
    """)
    start = time.monotonic()
    result = _cli("--workers", 1, "--ps", 1, "--grace-period", 1, script, tmp_path)
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - start < 30


def _task_name(offset):
    return os.environ["TFDIST_TASK"], json.loads(os.environ["TF_CONFIG"])["task"]["index"] + offset


@pytest.mark.multiprocess
def test_function_mode_returns_each_task_value():
    values = tfdist.launch(_task_name, 10, workers=2, chief=True, timeout=60, stream=None)
    assert values == [("chief-0", 10), ("worker-0", 10), ("worker-1", 11)]


def _fail_on_worker_1():
    if os.environ["TFDIST_TASK"] == "worker-1":
        raise RuntimeError("worker one failed on purpose")
    time.sleep(600)


@pytest.mark.multiprocess
def test_function_mode_failure_raises_launch_error():
    with pytest.raises(tfdist.LaunchError, match="worker-1") as info:
        tfdist.launch(_fail_on_worker_1, workers=2, timeout=60, grace_period=1, stream=None)
    assert "worker one failed on purpose" in info.value.output_tail
    assert info.value.task == "worker-1"


@pytest.mark.unit
@pytest.mark.parametrize("kwargs,match", [
    ({"workers": 0}, "workers must be an integer >= 1"),
    ({"workers": 1, "ps": -1}, "ps must be"),
    ({"workers": 1, "timeout": 0}, "timeout must be"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tfdist.launch(_task_name, 0, **kwargs)


@pytest.mark.multiprocess
def test_missing_script_is_named(tmp_path):
    result = _cli("--workers", 1, tmp_path / "nope.py")
    assert result.returncode == 2
    assert "nope.py" in result.stderr and "does not exist" in result.stderr


def _can_make_namespaces():
    return subprocess.run(["unshare", "--net", "true"], capture_output=True).returncode == 0


@pytest.mark.multiprocess
@pytest.mark.slow
def test_isolated_network_keeps_task_ports_unreachable_from_outside(tmp_path):
    """Tasks listen on 0.0.0.0 as TF's servers do; in the private namespace they reach
    each other, and the host cannot reach them."""
    import socket
    import threading

    if not _can_make_namespaces():
        pytest.fail("this test needs root for `unshare --net` (the CI machine has it)")
    script = _script(tmp_path, """
        import json, os, socket, sys, time
        out = sys.argv[1]
        config = json.loads(os.environ["TF_CONFIG"])
        me = config["cluster"]["worker"][config["task"]["index"]]
        server = socket.socket()
        server.bind(("0.0.0.0", int(me.rsplit(":", 1)[1])))
        server.listen()
        def mark(suffix, text=""):  # atomic: the test never reads a half-written file
            path = os.path.join(out, os.environ["TFDIST_TASK"] + suffix)
            open(path + ".tmp", "w").write(text)
            os.replace(path + ".tmp", path)
        mark(".ready", me)
        for peer in config["cluster"]["worker"]:  # the peer may not listen yet: retry
            host, port = peer.rsplit(":", 1)
            deadline = time.time() + 60
            while True:
                try:
                    socket.create_connection((host, int(port)), timeout=10).close()
                    break
                except OSError as error:
                    if time.time() > deadline:
                        sys.exit(f"could not reach {peer} inside the namespace: {error!r}")
                    time.sleep(0.1)
        mark(".reached")
        # Stays up until the test has looked from outside and every peer has reached
        # this task: a task that left early would refuse a slower peer.
        def done():
            reached = [n for n in os.listdir(out) if n.endswith(".reached")]
            return os.path.exists(os.path.join(out, "checked")) and \
                len(reached) == len(config["cluster"]["worker"])
        deadline = time.time() + 60
        while not done() and time.time() < deadline:
            time.sleep(0.1)
    """)
    outcome = {}

    def run_job():
        try:
            outcome["result"] = tfdist.launch(script, tmp_path, workers=2, timeout=90,
                                              isolate_network=True, stream=None)
        except Exception as error:  # re-raised below, in the test's thread
            outcome["error"] = error

    job = threading.Thread(target=run_job)
    job.start()
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*.ready"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        addresses = [p.read_text() for p in tmp_path.glob("*.ready")]
        assert len(addresses) == 2
        for address in addresses:
            host, port = address.rsplit(":", 1)
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((host, int(port)), timeout=5)
    finally:
        (tmp_path / "checked").write_text("")
        job.join(120)
    if "error" in outcome:
        error = outcome["error"]
        pytest.fail(f"{error!r}\n{getattr(error, 'output_tail', '')}"[:3000])
    assert [t.returncode for t in outcome["result"].tasks] == [0, 0]
    # The namespace has no name, and this process no longer holds it open.
    assert not [link for link in _fd_links() if link.startswith("net:[")]


def _fd_links():
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the fd listdir used, closed since
            pass
    return links


# --- Live, prefixed output ---------------------------------------------------------------

def _read_in_background(process):
    """Collects ``process.stdout`` (bytes) as it comes; returns the growing buffer."""
    import threading

    buffer = bytearray()

    def read():
        for chunk in iter(lambda: process.stdout.read1(65536), b""):
            buffer.extend(chunk)

    threading.Thread(target=read, daemon=True).start()
    return buffer


def _wait_for(predicate, seconds=60.0):
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


@pytest.mark.multiprocess
def test_progress_updates_arrive_live_and_keep_the_task_prefix(tmp_path):
    """A Keras-style bar ("\\b...\\r" then the bar, no newline) is shown while the task
    still runs, and every update keeps its ``[worker-0]`` prefix. The task does not
    flush: the launcher makes its Python unbuffered."""
    script = _script(tmp_path, """
        import os, sys, time
        out = sys.argv[1]
        sys.stdout.write("start\\n")
        sys.stdout.write("\\rstep 1/3")
        deadline = time.time() + 90
        while not os.path.exists(os.path.join(out, "seen")) and time.time() < deadline:
            time.sleep(0.05)
        sys.stdout.write("\\b" * 8 + "\\rstep 2/3")
        sys.stdout.write("\\b" * 8 + "\\rstep 3/3\\n")
        sys.stdout.write("done\\n")
    """)
    process = subprocess.Popen([sys.executable, "-m", "tfdist.cli", "launch", str(script),
                                str(tmp_path)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    output = _read_in_background(process)
    try:
        seen_live = _wait_for(lambda: b"[worker-0] step 1/3" in output)
    finally:
        (tmp_path / "seen").write_text("")
        assert process.wait(90) == 0, process.stderr.read()
    assert seen_live, f"the update was not shown while the task ran: {bytes(output)!r}"
    assert output.decode() == ("[worker-0] start\n[worker-0] step 1/3\r[worker-0] step 2/3\r"
                               "[worker-0] step 3/3\n[worker-0] done\n")


@pytest.mark.multiprocess
def test_updates_of_a_failed_task_leave_a_short_tail(tmp_path):
    """The error message shows the last update and the error, not every update."""
    script = _script(tmp_path, """
        import sys
        for step in range(1, 501):
            sys.stdout.write(f"\\rstep {step}/500")
        print()
        sys.exit("boom: step 500 broke")
    """)
    with pytest.raises(tfdist.LaunchError) as info:
        tfdist.launch(script, timeout=60, stream=None)
    tail = info.value.output_tail.splitlines()
    assert tail == ["step 500/500", "boom: step 500 broke"]


@pytest.mark.unit
def test_relay_cuts_chunks_at_line_ends_and_keeps_split_characters(tmp_path):
    """Unit: `relay` with chunks cut inside "\\r\\n" and inside a UTF-8 character."""
    import io
    import threading

    from tfdist.launch import output as launch

    read_end, write_end = os.pipe()
    stream = io.StringIO()
    output = launch.TaskOutput("worker-3", stream, cpp_log_level=0)
    relay = threading.Thread(target=launch.relay, args=(os.fdopen(read_end, "rb"),
                                                         output.add))
    relay.start()
    for chunk in [b"a\r", b"\nbar \xe2\x94", b"\x81 1\r", b"bar \xe2\x94\x81 2\r", b"\n", b"end"]:
        os.write(write_end, chunk)
        time.sleep(0.01)
    os.close(write_end)
    relay.join(30)
    output.close()
    assert stream.getvalue() == ("[worker-3] a\r\n[worker-3] bar \u2501 1\r"
                                 "[worker-3] bar \u2501 2\r\n[worker-3] end\n")
    assert list(output.tail) == ["a", "bar \u2501 2", "end"]


@pytest.mark.unit
def test_lines_of_other_tasks_cover_an_open_update():
    """Unit: a line of another task, shorter than a bar on screen, covers all of it."""
    import io

    from tfdist.launch import output as launch

    stream, console = io.StringIO(), launch.Console()
    console.write(stream, "worker-0", "\x1b[1m1/9\x1b[0m =====", "\r")
    console.write(stream, "worker-1", "hi", "\n")
    console.write(stream, "worker-0", "2/9 =====", "\r")
    console.close(stream, "worker-0")
    assert stream.getvalue() == ("[worker-0] \x1b[1m1/9\x1b[0m =====\r[worker-1] hi" + " " * 7
                                 + "\n[worker-0] 2/9 =====\r\n")


@pytest.mark.unit
@pytest.mark.parametrize("line,level,hidden", [
    ("I0000 00:00:1795367414.655962    5257 port.cc:153] oneDNN custom operations", 2, True),
    ("W1122 17:06:12.345678   42 cpu_feature_guard.cc:1] slow", 2, True),
    ("W1122 17:06:12.345678   42 cpu_feature_guard.cc:1] slow", 1, False),
    ("E1122 17:06:12.345678   42 grpc_server.cc:9] could not bind", 2, False),
    ("WARNING: All log messages before absl::InitializeLog() is called are written to "
     "STDERR", 2, True),
    ("I0000 00:00:1795367414.655962    5257 port.cc:153] oneDNN custom operations", 0, False),
    ("Epoch 1/3", 3, False),
])
def test_cpp_log_lines_are_hidden_as_their_level_says(line, level, hidden):
    from tfdist.launch import output as launch

    assert launch.is_hidden(line, level) is hidden


@pytest.mark.multiprocess
def test_tf_start_up_banners_are_hidden_unless_the_user_sets_a_level(tmp_path):
    """TF 2.21 logs its oneDNN banner before it reads TF_CPP_MIN_LOG_LEVEL."""
    script = _script(tmp_path, """
        import tensorflow as tf
        print("sum", int(tf.constant(1) + 1))
    """)
    quiet = _cli(script, timeout=180)
    assert quiet.returncode == 0, quiet.stderr
    assert "[worker-0] sum 2" in quiet.stdout
    for banner in ("oneDNN custom operations", "cpu_feature_guard", "absl::InitializeLog"):
        assert banner not in quiet.stdout + quiet.stderr
    loud = subprocess.run([sys.executable, "-m", "tfdist.cli", "launch", str(script)],
                          capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0"))
    assert loud.returncode == 0, loud.stderr
    assert "[worker-0] I0000" in loud.stdout and "oneDNN custom operations" in loud.stdout


def _horovodrun_or_skip():
    path = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    if not os.path.exists(path) and not os.environ.get("TFDIST_REQUIRE_HOROVOD"):
        pytest.skip("horovodrun is not installed (make horovod)")


@pytest.mark.multiprocess
def test_horovod_mode_streams_with_the_launcher_prefix(tmp_path, monkeypatch):
    """`tfdist train`'s horovodrun path: "[1]<stdout>:x" is shown as "[worker-1] x", live."""
    import io
    import threading

    from tfdist.train import main as train

    _horovodrun_or_skip()
    rank_code = textwrap.dedent(f"""
        import os, sys, time
        rank = os.environ["HOROVOD_RANK"]
        print("hello from rank", rank)
        if rank == "0":
            sys.stdout.write("step 1/2\\r")
            deadline = time.time() + 90
            while not os.path.exists({str(tmp_path / "seen")!r}) and time.time() < deadline:
                time.sleep(0.05)
            sys.stdout.write("step 2/2\\n")
    """)

    class Recorder(io.StringIO):
        def write(self, text):  # StringIO is not safe across threads
            with lock:
                return super().write(text)

    lock = threading.Lock()
    recorder = Recorder()
    monkeypatch.setattr(sys, "stdout", recorder)
    result = {}
    job = threading.Thread(target=lambda: result.setdefault("code", train._horovodrun(
        {"workers": 2, "chief": False, "timeout": 150}, [sys.executable, "-c", rank_code])))
    job.start()
    try:
        seen_live = _wait_for(lambda: "[worker-0] step 1/2" in recorder.getvalue(), 120)
    finally:
        (tmp_path / "seen").write_text("")
        job.join(180)
    output = recorder.getvalue()
    assert result.get("code") == 0, output
    assert seen_live, output
    assert "[worker-0] hello from rank 0\n" in output
    assert "[worker-1] hello from rank 1\n" in output
    assert "[worker-0] step 2/2\n" in output
    assert "<stdout>" not in output and "<stderr>" not in output


# --- python -m ---------------------------------------------------------------------------

def _package(tmp_path):
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "job.py").write_text(textwrap.dedent("""
        import os, sys
        print("module", __name__, os.environ["TFDIST_TASK"], sys.argv[1:])
    """))


@pytest.mark.multiprocess
def test_cli_runs_a_module_like_python_m(tmp_path):
    _package(tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "tfdist.cli", "launch", "--workers", "2", "-m", "mypkg.job",
         "--lr", "0.1", "x"], capture_output=True, text=True, timeout=90, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for task in ("worker-0", "worker-1"):
        assert f"[{task}] module __main__ {task} ['--lr', '0.1', 'x']" in result.stdout


@pytest.mark.multiprocess
def test_cli_names_a_missing_module(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "tfdist.cli", "launch", "-m", "nosuchpkg.job"],
        capture_output=True, text=True, timeout=90, cwd=tmp_path)
    assert result.returncode == 2
    assert "no module named 'nosuchpkg'" in result.stderr
    assert "module='nosuchpkg.job'" in result.stderr


@pytest.mark.multiprocess
def test_python_api_runs_a_module(tmp_path, monkeypatch):
    import io

    _package(tmp_path)
    monkeypatch.chdir(tmp_path)
    stream = io.StringIO()
    result = tfdist.launch("--epochs", 3, module="mypkg.job", timeout=60, stream=stream)
    assert [t.returncode for t in result.tasks] == [0]
    assert "[worker-0] module __main__ worker-0 ['--epochs', '3']" in stream.getvalue()
    with pytest.raises(ValueError, match="module must be a dotted module name"):
        tfdist.launch(module="my-pkg.job")
    with pytest.raises(TypeError, match="launch needs a script path, a function or module="):
        tfdist.launch()


@pytest.mark.unit
def test_launch_options_hold_the_defaults_of_launch_and_the_cli():
    """Unit: `tfdist.launch`'s and ``tfdist launch``'s defaults are `LaunchOptions`'."""
    import dataclasses
    import inspect

    from tfdist import cli
    from tfdist.launch import LaunchOptions

    defaults = LaunchOptions()
    parameters = inspect.signature(tfdist.launch).parameters
    args = cli.build_parser().parse_args(["launch", "job.py"])
    for field in dataclasses.fields(LaunchOptions):
        if field.name in parameters:
            assert parameters[field.name].default == getattr(defaults, field.name), field.name
        if hasattr(args, field.name):
            assert getattr(args, field.name) == getattr(defaults, field.name), field.name


@pytest.mark.unit
def test_restart_policies_share_max_restarts():
    """Unit: a ps worker's restarts and the job's come out of the same ``max_restarts``."""
    import io

    from tfdist.launch import JobRestarts, PsWorkerRestarts
    from tfdist.launch.api import restarts_for

    assert restarts_for(chief=True, ps=1) is PsWorkerRestarts
    assert restarts_for(chief=False, ps=1) is JobRestarts
    assert restarts_for(chief=True, ps=0) is JobRestarts
    job = JobRestarts(2, io.StringIO())
    assert [job.restart_job(), job.restart_job(), job.restart_job()] == [1, 2, None]
    ps = PsWorkerRestarts(2, io.StringIO())
    ps.used = 1  # one worker restarted alone
    assert [ps.restart_job(), ps.restart_job()] == [2, None]
    with ps.attempt():
        env = ps.task_env(1)
        assert env["TFDIST_TASK_RESTART"] == "1" and os.path.isdir(env["TFDIST_CONTROL_DIR"])
    assert not os.path.exists(env["TFDIST_CONTROL_DIR"])


_PS_DIES_FIRST = """
    import os, signal, sys, time
    me, gone = os.environ["TFDIST_TASK"], os.path.join(sys.argv[1], "ps-gone")
    if me == "ps-0":  # runs out of memory while the model is built
        print("ps-0: out of memory")
        open(gone, "w").close()
        if sys.argv[2] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(1)
    if me == "chief-0":  # fails because the ps is gone
        while not os.path.exists(gone):
            time.sleep(0.01)
        time.sleep(1)
        print("chief-0: ps-0 is unreachable")
        sys.exit(1)
    time.sleep(600)
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("how, cause", [("exit", "ps-0 exited with code 1"),
                                        ("kill", "ps-0 exited with code -9 (signal SIGKILL)")],
                         ids=["exit", "kill"])
def test_the_task_that_failed_first_is_named_not_the_chief_that_followed(tmp_path, how,
                                                                         cause):
    from tfdist.launch import LaunchError, PsWorkerRestarts, run

    class LatePolls(PsWorkerRestarts):
        """A launcher on a loaded host: it looks at its tasks only once both ended."""

        def check(self, tasks):
            super().check(tasks)
            deadline = time.monotonic() + 60  # hang guard
            while time.monotonic() < deadline and any(
                    t.poll() is None for t in tasks if t.spec.type in ("chief", "ps")):
                time.sleep(0.05)

    script = _script(tmp_path, _PS_DIES_FIRST)
    with pytest.raises(LaunchError) as info:
        run([sys.executable, str(script), str(tmp_path), how], chief=True, ps=1, workers=1,
            grace_period=1, timeout=90, stream=None, restarts=LatePolls)
    assert info.value.task == "ps-0", info.value
    assert str(info.value).startswith(cause), info.value
    assert "ps-0: out of memory" in info.value.output_tail


_CHIEF_FAILS_ON_THE_PS = '''
    import os, sys, time
    if os.environ["TFDIST_TASK"] != "chief-0":
        time.sleep(600)
    # What the chief printed when ps-0 ran out of memory while the model was built
    # (benchmarks/RESULTS.md): the ps lives on, the chief fails with the ps's error.
    print("tensorflow.python.framework.errors_impl.ResourceExhaustedError: OOM when "
          "allocating tensor with shape[2000000,64] and type float on "
          "/job:ps/replica:0/task:0/device:CPU:0 by allocator mklcpu")
    print("Additional GRPC error information from remote target /job:ps/replica:0/task:0 "
          "while calling /tensorflow.eager.EagerService/Enqueue:")
    print(':UNKNOWN:Error received from peer  {grpc_message:"OOM when allocating"}')
    sys.exit(1)
'''


@pytest.mark.multiprocess
def test_an_error_the_chief_received_from_a_ps_names_the_ps(tmp_path):
    script = _script(tmp_path, _CHIEF_FAILS_ON_THE_PS)
    with pytest.raises(tfdist.LaunchError) as info:
        tfdist.launch(script, chief=True, ps=1, workers=1, grace_period=1, timeout=90,
                      stream=None)
    assert str(info.value).startswith(
        "chief-0 exited with code 1: its error came from ps-0 (ResourceExhaustedError: OOM "
        "when allocating tensor with shape[2000000,64]"), info.value
    assert info.value.task == "chief-0"


@pytest.mark.unit
def test_failure_cause_names_only_another_task():
    """Unit: no remote error (or one from the task itself) adds nothing to `exit_cause`."""
    from tfdist.launch.results import failure_cause

    assert failure_cause("worker-1", 3, "Traceback ...\nValueError: bad") == \
        "worker-1 exited with code 3"
    own = "UnavailableError: x\nfrom remote target /job:worker/replica:0/task:1 while ..."
    assert failure_cause("worker-1", 1, own) == "worker-1 exited with code 1"
    other = own.replace("task:1", "task:0")
    assert failure_cause("worker-1", 1, other) == \
        "worker-1 exited with code 1: its error came from worker-0 (UnavailableError: x)"


@pytest.mark.unit
def test_failure_cause_quotes_a_full_disk_and_a_peer_not_responding():
    """Unit (issue 39): a task's own line about a full disk, or about a peer it found not
    responding before Gloo aborted it (SIGABRT), is the cause the launcher gives."""
    from tfdist.launch.results import failure_cause, is_peer_failure

    full = ("Traceback ...\ntfdist train: FAILED: disk full: cannot write /d/b.weights.h5: "
            "it needs about 93,000 bytes and /d has 56,000 free")
    assert failure_cause("worker-0", 1, full) == (
        "worker-0 exited with code 1: disk full: cannot write /d/b.weights.h5: it needs "
        "about 93,000 bytes and /d has 56,000 free")
    aborted = ("tfdist: worker-3: worker-1 is not responding: two liveness probes in a row "
               "at 127.0.0.1:5 failed (no answer within 2s): it is frozen (e.g. SIGSTOP), "
               "overloaded or unreachable; Gloo's timeout (heartbeat_timeout=10s) ends the "
               "job unless it answers again\n[0]: Horovod background loop uncaught "
               "exception: Timed out waiting 10000ms for recv operation to complete\n"
               "terminate called after throwing an instance of 'gloo::IoException'")
    assert failure_cause("worker-3", -6, aborted) == (
        "worker-3 exited with code -6 (signal SIGABRT): it found worker-1 not responding "
        "(two liveness probes in a row at 127.0.0.1:5 failed (no answer within 2s): it is "
        "frozen (e.g. SIGSTOP), overloaded or unreachable)")
    assert is_peer_failure(aborted) and not is_peer_failure(full)
    assert is_peer_failure("UnknownError: Horovod has been shut down. This was caused by")


# worker-0 fills its disk (its line), then exits only after worker-1 has, as a chief in
# TensorFlow's teardown may; worker-1, told that Horovod was shut down, exits first.
_DISK_FULL_FIRST = """
    import os, sys, time
    me, work = os.environ["TFDIST_TASK"], sys.argv[1]
    if me == "worker-0":
        print("tfdist train: FAILED: disk full: cannot write /d/backup-3.weights.h5: it "
              "needs about 93,000 bytes and /d has 56,000 free", flush=True)
        open(os.path.join(work, "full"), "w").close()
        while not os.path.exists(os.path.join(work, "worker-1.pid")):
            time.sleep(0.01)
        pid = open(os.path.join(work, "worker-1.pid")).read()
        while os.path.exists(f"/proc/{pid}") and \
                open(f"/proc/{pid}/stat").read().split()[2] != "Z":
            time.sleep(0.01)
        sys.exit(1)
    while not os.path.exists(os.path.join(work, "full")):
        time.sleep(0.01)
    print("tensorflow.python.framework.errors_impl.UnknownError: Horovod has been shut "
          "down. This was caused by an exception on one of the ranks", flush=True)
    with open(os.path.join(work, "worker-1.pid.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.path.join(work, "worker-1.pid.tmp"), os.path.join(work, "worker-1.pid"))
    sys.exit(1)
"""


@pytest.mark.multiprocess
def test_the_task_whose_failure_came_first_is_named(tmp_path):
    """Issue 39: a chief whose disk is full stops Horovod as it exits, and the other
    worker, told "Horovod has been shut down", exits first: the launcher names the chief
    and the full disk, not the worker that only saw the consequence."""
    script = _script(tmp_path, _DISK_FULL_FIRST)
    with pytest.raises(tfdist.LaunchError) as info:
        tfdist.launch(script, str(tmp_path), workers=2, grace_period=1, timeout=60,
                      stream=None)
    assert info.value.task == "worker-0", info.value
    assert str(info.value).startswith(
        "worker-0 exited with code 1: disk full: cannot write /d/backup-3.weights.h5: it "
        "needs about 93,000 bytes and /d has 56,000 free after "), info.value


# A parameter-server job of fake tasks. A worker named in argv[2] SIGKILLs itself once
# (on its first start), the next victim only after the launcher said it carries on
# without the previous one. The chief ends (0) once the launcher has said everything
# argv[3] lists; a live worker then ends (0) after the chief, as a real one does.
_PS_WORKERS_DIE = """
    import os, signal, sys, time
    me, work = os.environ["TFDIST_TASK"], sys.argv[1]
    victims, waits = sys.argv[2].split(","), [w for w in sys.argv[3].split("|") if w]
    log = os.path.join(work, "launcher.log")

    def said(text):
        return os.path.exists(log) and text in open(log).read()

    def wait(predicate):
        deadline = time.monotonic() + 60  # hang guard
        while not predicate() and time.monotonic() < deadline:
            time.sleep(0.02)

    if me in victims and os.environ.get("TFDIST_TASK_RESTART", "0") == "0":
        wait(lambda: all(said(f"{v} exited") for v in victims[:victims.index(me)]))
        os.kill(os.getpid(), signal.SIGKILL)
    if me == "chief-0":
        wait(lambda: all(said(w) for w in waits))
        open(os.path.join(work, "chief-done"), "w").close()
        sys.exit(0)
    if me.startswith("worker"):
        wait(lambda: os.path.exists(os.path.join(work, "chief-done")))
        sys.exit(0)
    time.sleep(600)  # ps
"""


class _LogFile:
    """The launcher's log, appended to a file the tasks read."""

    def __init__(self, path):
        self.path, self.text = path, ""

    def write(self, text):
        self.text += text
        with open(self.path, "a") as f:
            f.write(text)

    def flush(self):
        pass


def _ps_workers_die(tmp_path, victims, waits, **options):
    from tfdist.launch import LaunchError, run
    from tfdist.launch.api import restarts_for

    script = _script(tmp_path, _PS_WORKERS_DIE)
    log = _LogFile(tmp_path / "launcher.log")
    try:
        result = run([sys.executable, str(script), str(tmp_path), ",".join(victims),
                      "|".join(waits)], chief=True, ps=1, workers=2, grace_period=1,
                     timeout=90, stream=None, log=log, restarts=restarts_for(True, 1),
                     **options)
    except LaunchError as error:
        return error, log.text
    return result, log.text


@pytest.mark.multiprocess
def test_a_ps_job_carries_on_without_a_dead_worker_by_default(tmp_path):
    carry_on = ("tfdist launch: worker-1 exited with code -9 (signal SIGKILL); the "
                "parameter-server job carries on with 1 worker (no restarts left: "
                "--max-restarts 0)")
    result, log = _ps_workers_die(tmp_path, ["worker-1"], [carry_on])
    assert isinstance(result, tfdist.LaunchResult), result
    assert carry_on in log, log
    codes = {t.name: t.returncode for t in result.tasks}
    assert codes["chief-0"] == 0 and codes["worker-0"] == 0 and codes["worker-1"] == -9


@pytest.mark.multiprocess
def test_a_dead_ps_worker_is_restarted_while_restarts_are_left(tmp_path):
    restart = ("tfdist launch: restart 1/1: worker-1 exited with code -9; restarting "
               "worker-1 alone (parameter-server job)")
    result, log = _ps_workers_die(tmp_path, ["worker-1"], [restart], max_restarts=1)
    assert isinstance(result, tfdist.LaunchResult), result
    assert restart in log and "carries on" not in log, log
    assert all(t.returncode == 0 for t in result.tasks if t.name != "ps-0"), result


@pytest.mark.multiprocess
def test_a_ps_job_whose_workers_are_all_gone_fails_naming_them(tmp_path):
    # worker-1 dies, then worker-0 after the launcher carried on without worker-1; the
    # chief would wait forever (hang guard: 60 s), so only the launcher can end it.
    error, log = _ps_workers_die(tmp_path, ["worker-1", "worker-0"], ["never said"])
    assert isinstance(error, tfdist.LaunchError), error
    assert error.task == "worker-0", error
    assert "carries on with 1 worker" in log, log
    assert str(error).startswith(
        "worker-0 exited with code -9 (signal SIGKILL): every worker of the "
        "parameter-server job is gone (worker-1 exited with code -9 (signal SIGKILL) "
        "earlier), with no restarts left: --max-restarts 0, so nothing can run the "
        "chief's steps (TF's coordinator would wait for a worker forever) after "), error


class _FakeTask:
    def __init__(self, name, code=None):
        from tfdist.cluster import TaskSpec

        kind, index = name.rsplit("-", 1)
        self.spec, self.name, self.code = TaskSpec(kind, int(index)), name, code

    def poll(self):
        return self.code

    def signal_group(self, signum):
        pass

    def finish_output(self):
        pass

    def tail_text(self):
        return ""


@pytest.mark.unit
def test_a_node_of_a_ps_job_carries_on_while_other_nodes_have_workers():
    """Unit: on a node without the chief, a dead worker is left out while any worker of
    the cluster may run (those of other nodes count as alive); the last one fails."""
    import io

    from tfdist.launch.restarts import NodePsWorkers

    log = io.StringIO()
    policy = NodePsWorkers(1, log, restarts_done=1, other_workers=1)
    worker = _FakeTask("worker-1", -9)
    tasks = [worker, _FakeTask("ps-1")]
    with policy.attempt():
        assert policy.task_env(0) == {}
        assert policy.replace(tasks, worker, start=None) and policy.is_lost(worker)
        assert log.getvalue() == (
            "tfdist launch: worker-1 exited with code -9 (signal SIGKILL); the parameter-"
            "server job carries on with 1 worker (no restarts left: 1/1 used)\n")
    alone = NodePsWorkers(0, log, restarts_done=0, other_workers=0)
    with alone.attempt():
        assert not alone.replace(tasks, worker, start=None)
        assert alone.failure_note(worker).startswith(
            ": every worker of the parameter-server job is gone, with no restarts left: "
            "--max-restarts 0")
        ps = _FakeTask("ps-1", 1)
        assert not alone.replace(tasks, ps, start=None) and alone.failure_note(ps) == ""
