"""The fault matrix, measured: seconds from an injected fault to the first error that
names the faulty task, per mode, fault and launcher (docs/faults.md lists the outcomes).

Each cell is a small job of its own: 2 workers (parameter server: 1 chief + 2 workers +
1 ps) started by `tfdist.launch`, or 2 ranks under ``horovodrun --gloo``
(`benchmarks.horovodrun.run_horovod`). They train a tiny model; the fault is injected
at a known moment (after batch 1 of epoch 1; parameter server: once the chief's first
dispatch of steps has finished) and every process involved writes what it saw, each
with ``time.monotonic()`` (one clock for every process of this machine), into the
job's result directory:

- the faulty task writes the moment just before it SIGKILLs or SIGSTOPs itself (the
  parameter-server chief does it for worker-1, whose PID it reads);
- every other task writes the time and text of the exception it raises, and the time of
  each ``tfdist: ...`` line it prints (e.g. the chief's "worker-1 is overdue");
- in the kill cells the survivors ignore the launcher's SIGTERM (as the tests do) so they
  can still say what they saw; the moment that SIGTERM arrives (read from a wakeup fd
  by a thread, so a process blocked in TensorFlow still notes it) is when the launcher
  acted on the exit it names in its `LaunchError`;
- this process notes the launcher's own log lines (e.g. "restart 1/1: worker-1 exited
  with code -9") and the moment `tfdist.launch` raised `LaunchError` or
  ``run_horovod`` raised (horovodrun's output, which names the ranks that failed).

A report "names" the faulty task when its text contains the task's name (``worker-1``,
or TensorFlow's ``/job:worker/replica:0/task:1``; for horovodrun, when it gives that
rank as the first process that failed). The table gives the first report that names
it, beside the timeout configured for that path; the detailed table lists every report.
A cell that could not be measured says why.

Run from the repository root (about 5 minutes on a busy 2-core machine):

    .venv/bin/python -m benchmarks.faults [--quick] [--output DIR] [--cells KEY,...]

``--quick`` runs only the mirrored multi-worker (``engine="tf"``) and model-average
cells: a smoke run. Not part of ``python -m benchmarks`` (it would slow the suite).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import io
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.common import (horovod_missing, machine_info, markdown_table,
                               parse_section_args, section_parser, task_env, write_section)

NAME = "faults"
TITLE = "Faults: time from the fault to the first error naming the faulty task"
HEARTBEAT = 5       # heartbeat_timeout (engine="horovod": also Gloo's timeout)
STARTUP = 5         # startup_timeout of the "never starts" cell
STEP_TIMEOUT = 10   # parameter server: a silent worker is overdue after half of it
GLOO_TIMEOUT = 10   # HOROVOD_GLOO_TIMEOUT_SECONDS under horovodrun
JOB_TIMEOUT = 150   # seconds before a cell's job is killed

# key: (mode, engine, launcher, fault, victim, configured timeout)
CELLS = {
    "mwms_tf_kill": ("MultiWorkerMirroredStrategy", 'engine="tf"', "tfdist.launch",
                     "kill -9", "worker-1",
                     f"launcher: none (polls every 0.05 s); survivor: "
                     f"heartbeat_timeout={HEARTBEAT}s"),
    "mwms_tf_stop_leader": ("MultiWorkerMirroredStrategy", 'engine="tf"', "tfdist.launch",
                            "SIGSTOP", "worker-0",
                            f"heartbeat_timeout={HEARTBEAT}s (collective_timeout=None)"),
    "mwms_hvd_kill": ("MultiWorkerMirroredStrategy", 'engine="horovod"', "tfdist.launch",
                      "kill -9", "worker-1",
                      "launcher: none (polls every 0.05 s); survivor: none (its Gloo "
                      "connection breaks) + a liveness probe of at most 2 s"),
    "mwms_hvd_stop_leader": ("MultiWorkerMirroredStrategy", 'engine="horovod"',
                             "tfdist.launch", "SIGSTOP", "worker-0",
                             f"heartbeat_timeout={HEARTBEAT}s (Gloo's timeout) + a liveness "
                             "probe of at most 2 s"),
    "model_average_kill": ("ModelAverageStrategy", 'engine="auto"', "tfdist.launch",
                           "kill -9", "worker-1",
                           "launcher: none (polls every 0.05 s); survivor: as its engine"),
    "ps_kill": ("ParameterServerStrategy", "-", "tfdist.launch (max_restarts=1)",
                "kill -9", "worker-1", "none (the launcher polls every 0.05 s)"),
    "ps_stop": ("ParameterServerStrategy", "-", "tfdist.launch (max_restarts=1)",
                "SIGSTOP", "worker-1",
                f"step_timeout={STEP_TIMEOUT}s (silent for step_timeout / 2 = "
                f"{STEP_TIMEOUT // 2}s; probed every {min(STEP_TIMEOUT / 4, 2):g}s)"),
    "mwms_tf_never_starts": ("MultiWorkerMirroredStrategy", 'engine="tf"', "tfdist.launch",
                             "never starts", "worker-1", f"startup_timeout={STARTUP}s"),
    "horovodrun_kill": ("HorovodStrategy", "Horovod (Gloo)", "horovodrun --gloo",
                        "kill -9", "rank 1", "none (horovodrun polls its ranks)"),
    "horovodrun_stop": ("HorovodStrategy", "Horovod (Gloo)", "horovodrun --gloo",
                        "SIGSTOP", "rank 1", f"HOROVOD_GLOO_TIMEOUT_SECONDS={GLOO_TIMEOUT}"),
}
QUICK_CELLS = ("mwms_tf_kill", "mwms_tf_stop_leader", "model_average_kill")


# ---- notes written by the tasks (module level: the tasks import this module) -------------


def _note(result_dir, name, **fields):
    """Writes ``{"t": time.monotonic(), **fields}`` to ``result_dir/name.json`` at once
    (``wall``: time.time(), to place TF's own log lines)."""
    record = {"t": time.monotonic(), "wall": time.time(), **fields}
    path = os.path.join(result_dir, name + ".json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)
    return record


class _SaidTee:
    """A task's sys.stderr: passes everything on, and notes the time of each line that
    starts with ``tfdist:`` (tfdist's own messages) in ``result_dir/said-TASK.jsonl``."""

    def __init__(self, inner, path):
        self._inner, self._path, self._lock, self._line = inner, path, threading.Lock(), ""

    def write(self, text):
        now = time.monotonic()
        with self._lock:
            self._line += text
            *lines, self._line = self._line.split("\n")
            said = [line for line in lines if line.startswith("tfdist:")]
            if said:
                with open(self._path, "a") as f:
                    f.writelines(json.dumps({"t": now, "text": line}) + "\n" for line in said)
        return self._inner.write(text)

    def __getattr__(self, name):  # flush, fileno, encoding, isatty, ...
        return getattr(self._inner, name)


def _watch_sigterm(result_dir, me):
    """Ignores SIGTERM, but notes when it arrives: the C-level handler writes to a wakeup
    fd at once even while the main thread is blocked in TensorFlow, and a thread reads
    it. Call it again after the strategy is built: TF's coordination service installs
    its own SIGTERM handler (its preemption notifier)."""
    if getattr(_watch_sigterm, "armed", False):
        signal.signal(signal.SIGTERM, lambda *_: None)
        return
    _watch_sigterm.armed = True
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.set_wakeup_fd(write)

    def watch():
        while True:
            if signal.SIGTERM in os.read(read, 64):
                _note(result_dir, f"sigterm-{me}")
                return

    threading.Thread(target=watch, daemon=True, name="faults-sigterm").start()


def _fit(strategy, make_model, fault_at, on_fault, epochs=100, batch_size=16):
    """Keras fit of a tiny classifier; ``on_fault()`` once, at the first batch end of
    epoch ``fault_at[0]`` whose batch index is at least ``fault_at[1]`` (None: never).
    (A parameter-server chief ends batches per dispatch of several steps.)"""
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")

    class Fault(keras.callbacks.Callback):
        epoch, done = 0, False

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if fault_at is not None and not self.done and self.epoch == fault_at[0] and \
                    batch >= fault_at[1]:
                self.done = True
                on_fault()

    with strategy.scope():
        model = make_model()
        model.compile(keras.optimizers.SGD(0.01),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0,
                     callbacks=[Fault()])


def _tiny_model():
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(2)])


def _injector(result_dir, fault, pid=None):
    """A function that notes the moment and SIGKILLs or SIGSTOPs ``pid`` (default: this
    process)."""
    def inject():
        sig = signal.SIGKILL if fault == "kill" else signal.SIGSTOP
        _note(result_dir, "fault", signal=sig.name, pid=pid or os.getpid())
        os.kill(pid or os.getpid(), sig)
    return inject


def multi_worker_task(result_dir, kind, engine, fault, victim, timeouts):
    """A task of a 2-worker MultiWorkerMirroredStrategy or ModelAverageStrategy job.

    ``fault``: "kill" or "stop" (``victim`` SIGKILLs or SIGSTOPs itself after batch 1
    of epoch 1), or "missing" (it never starts: it returns at once)."""
    me = os.environ["TFDIST_TASK"]
    sys.stderr = _SaidTee(sys.stderr, os.path.join(result_dir, f"said-{me}.jsonl"))
    if fault == "missing" and me == victim:
        _note(result_dir, f"absent-{me}")
        return "absent"
    if fault == "kill" and me != victim:
        _watch_sigterm(result_dir, me)
    for module in ("tensorflow", "keras"):  # imported first: the wait below is timed
        importlib.import_module(module)

    import tfdist

    try:
        _note(result_dir, f"wait-{me}")  # the strategy waits for the other tasks here
        cls = tfdist.ModelAverageStrategy if kind == "model_average" else \
            tfdist.MultiWorkerMirroredStrategy
        extra = {"period": 2} if kind == "model_average" else {}
        strategy = cls(engine=engine, **extra, **timeouts)
        if fault == "kill" and me != victim:
            _watch_sigterm(result_dir, me)  # again: TF may have taken SIGTERM over
        _note(result_dir, f"engine-{me}", engine=strategy.engine)
        _fit(strategy, _tiny_model, (1, 1) if me == victim and fault != "missing" else None,
             _injector(result_dir, fault))
    except Exception as error:  # noqa: BLE001 - noted, then raised on
        _note(result_dir, f"error-{me}", text=f"{type(error).__name__}: {error}")
        if fault == "missing":
            return "error"
        raise
    return "finished"


def ps_task(result_dir, fault):
    """A task of 1 chief + 2 workers + 1 ps: the chief SIGKILLs or SIGSTOPs worker-1
    when its first dispatch of steps has finished; fit goes on (the launcher restarts
    worker-1 alone)."""
    me = os.environ["TFDIST_TASK"]
    restart = os.environ.get("TFDIST_TASK_RESTART", "0")
    _note(result_dir, f"pid-{me}-{restart}", pid=os.getpid())
    sys.stderr = _SaidTee(sys.stderr, os.path.join(result_dir, f"said-{me}.jsonl"))
    import tfdist

    try:  # workers and ps serve inside the constructor and exit there
        strategy = tfdist.ParameterServerStrategy(startup_timeout=60,
                                                  step_timeout=STEP_TIMEOUT)
        pid = json.loads(Path(result_dir, "pid-worker-1-0.json").read_text())["pid"]
        history = _fit(strategy, _tiny_model, (0, 0), _injector(result_dir, fault, pid),
                       epochs=4, batch_size=8)
    except Exception as error:  # noqa: BLE001 - noted, then raised on
        _note(result_dir, f"error-{me}", text=f"{type(error).__name__}: {error}")
        raise
    return {"epochs": history.epoch}


def horovod_task(result_dir, fault, victim):
    """A rank of ``horovodrun -np 2``: rank ``victim`` SIGKILLs or SIGSTOPs itself after
    batch 1 of epoch 1."""
    rank = int(os.environ["HOROVOD_RANK"])
    import tfdist

    try:
        strategy = tfdist.HorovodStrategy()
        _fit(strategy, _tiny_model, (1, 1) if rank == victim else None,
             _injector(result_dir, fault), batch_size=8)
    except Exception as error:  # noqa: BLE001 - noted, then raised on
        _note(result_dir, f"error-rank{rank}", text=f"{type(error).__name__}: {error}")
        raise
    return "finished"


# ---- the parent: run a cell, collect what was said and when -----------------------------


class _Stamped(io.TextIOBase):
    """A stream that keeps each line written to it with the time it was completed."""

    def __init__(self):
        super().__init__()
        self.lines, self._part, self._lock = [], "", threading.Lock()

    def write(self, text):
        now = time.monotonic()
        with self._lock:
            self._part += text
            *done, self._part = self._part.split("\n")
            self.lines += [(now, line) for line in done if line.strip()]
        return len(text)


def _names(text: str, victim: str) -> bool:
    """Whether ``text`` names task ``victim`` (``worker-1``), also in TF's form."""
    kind, index = victim.rsplit("-", 1)
    return victim in text or f"/job:{kind}/replica:0/task:{index}" in text


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def _shown(text: str, victim: str) -> str:
    """The first line of ``text``; when it does not name ``victim``, also the first line
    that does (TF's errors start with "Graph execution error:")."""
    first = _first_line(text)
    if _names(first, victim):
        return first
    naming = next((line.strip() for line in text.splitlines() if _names(line, victim)), None)
    return first if naming is None else f"{first} ... {naming}"


def _read_notes(result_dir: Path) -> dict:
    notes = {}
    for path in result_dir.glob("*.json"):
        with contextlib.suppress(ValueError):
            notes[path.stem] = json.loads(path.read_text())
    for path in result_dir.glob("said-*.jsonl"):
        notes[path.stem] = [json.loads(line) for line in path.read_text().splitlines()]
    return notes


def _task_reports(notes: dict, victim: str) -> list[dict]:
    """Reports of the tasks: exceptions, ``tfdist:`` lines and SIGTERMs received."""
    reports = []
    for name, note in notes.items():
        if name.startswith("error-"):
            task = name[len("error-"):]
            reports.append({"by": task, "what": "raised", "t": note["t"],
                            "text": _shown(note["text"], victim),
                            "names": _names(note["text"], victim)})
        elif name.startswith("said-"):
            task = name[len("said-"):]
            reports += [{"by": task, "what": "printed", "t": said["t"], "text": said["text"],
                         "names": _names(said["text"], victim)} for said in note
                        if _names(said["text"], victim)]
    return reports


def _run_launch(fn, args, victim, result_dir, **options):
    """Runs ``fn`` under `tfdist.launch`; returns the parent's reports and the values."""
    import tfdist

    log, stream = _Stamped(), _Stamped()
    reports, values = [], None
    with contextlib.redirect_stderr(log):  # the launcher's own messages
        try:
            values = tfdist.launch(fn, *args, timeout=JOB_TIMEOUT, env=task_env(),
                                   stream=stream, **options)
        except tfdist.LaunchError as error:
            now = time.monotonic()
            first = _first_line(str(error))
            reports.append({"by": "launcher", "what": "LaunchError in the parent", "t": now,
                            "text": first, "names": _names(first, victim)})
    reports += [{"by": "launcher", "what": "logged", "t": t, "text": line.strip(),
                 "names": _names(line, victim)} for t, line in log.lines
                if line.startswith("tfdist launch:")]
    return reports, values, stream.lines


def _sigterm_reports(notes, reports):
    """A survivor's SIGTERM: when the launcher acted on the exit its LaunchError names."""
    error = next((r for r in reports if r["what"] == "LaunchError in the parent"), None)
    out = []
    for name, note in notes.items():
        if name.startswith("sigterm-") and error is not None:
            out.append({"by": "launcher", "t": note["t"], "text": error["text"],
                        "names": error["names"],
                        "what": f"stopped the job (its SIGTERM reached {name[8:]})"})
    return out


def _engines(notes):
    return sorted({n["engine"] for k, n in notes.items() if k.startswith("engine-")})


def run_multi_worker(key, tmp):
    mode, engine_label, _, fault_label, victim, _ = CELLS[key]
    fault = {"kill -9": "kill", "SIGSTOP": "stop", "never starts": "missing"}[fault_label]
    kind = "model_average" if mode == "ModelAverageStrategy" else "multi_worker"
    engine = engine_label.split('"')[1]
    timeouts = {"heartbeat_timeout": HEARTBEAT, "collective_timeout": None,
                "startup_timeout": STARTUP if fault == "missing" else 60}
    grace = {"kill": 4 * HEARTBEAT, "stop": 1, "missing": 1}[fault]
    reports, values, output = _run_launch(
        _self().multi_worker_task, (str(tmp), kind, engine, fault, victim, timeouts),
        victim, tmp, workers=2, grace_period=grace)
    notes = _read_notes(tmp)
    reports += _task_reports(notes, victim) + _sigterm_reports(notes, reports)
    if fault == "missing":
        zero = notes.get("wait-worker-0")
        start = "the chief's strategy constructor (the start of its wait)"
    else:
        zero, start = notes.get("fault"), f"{victim}'s {fault_label}"
    engines = _engines(notes)
    return {"t0": zero and zero["t"], "t0_is": start, "reports": reports,
            "engine_used": engines, "values": values, "output_tail": _tail(output)}


def run_parameter_server(key, tmp):
    _, _, _, fault_label, victim, _ = CELLS[key]
    fault = "kill" if fault_label == "kill -9" else "stop"
    reports, values, output = _run_launch(_self().ps_task, (str(tmp), fault), victim, tmp,
                                          workers=2, chief=True, ps=1, max_restarts=1,
                                          grace_period=1)
    notes = _read_notes(tmp)
    reports += _task_reports(notes, victim)
    zero = notes.get("fault")
    return {"t0": zero and zero["t"], "t0_is": f"the chief's {fault_label} of {victim}",
            "reports": reports, "values": values, "output_tail": _tail(output)}


def run_horovodrun(key, tmp):
    from benchmarks.horovodrun import HorovodrunError, run_horovod

    _, _, _, fault_label, _, _ = CELLS[key]
    fault, victim = ("kill" if fault_label == "kill -9" else "stop"), 1
    reports, output = [], ""
    try:
        run_horovod(_self().horovod_task, str(tmp), fault, victim, np=2, timeout=JOB_TIMEOUT,
                    env={"HOROVOD_GLOO_TIMEOUT_SECONDS": str(GLOO_TIMEOUT)})
    except HorovodrunError as error:
        now, output = time.monotonic(), str(error)
        first = re.search(r"first process to do so was:\s*Process name: (\d+)\s*"
                          r"Exit code: (-?\d+)", output)
        exits = re.findall(r"Process (\d+) exit with status code (-?\d+)", output)
        text = (f"horovodrun: the first process to fail was rank {first[1]} (exit code "
                f"{first[2]})" if first else "horovodrun: no first failure given")
        if exits:
            text += "; " + ", ".join(f"Process {r} exit with status code {c}"
                                     for r, c in exits)
        reports.append({"by": "horovodrun", "what": "run_horovod raised in the parent",
                        "t": now, "text": text,
                        "names": bool(first) and int(first[1]) == victim,
                        "rank_error": _first_line(output)})
    notes = _read_notes(tmp)
    for name, note in notes.items():
        if name.startswith("error-"):  # a rank's own error: names a rank only by number
            reports.append({"by": name[6:], "what": "raised", "t": note["t"],
                            "text": _horovod_line(note["text"]),
                            "names": bool(re.search(rf"\brank {victim}\b",
                                                    note["text"]))})
    zero = notes.get("fault")
    return {"t0": zero and zero["t"], "t0_is": f"rank {victim}'s {fault_label}",
            "reports": reports, "output_tail": output[-3000:]}


def _horovod_line(text: str) -> str:
    """The first line of a rank's error, and Horovod's own line if that is another."""
    first = _first_line(text)
    said = next((line.strip() for line in text.splitlines() if "Horovod" in line), None)
    return first if said is None or said == first else f"{first} ... {said}"


def _tail(lines, n=30):
    return [line for _, line in lines[-n:]]


def _self():
    """This module by its importable name, so tasks import it rather than unpickle it."""
    return importlib.import_module("benchmarks.faults")


def run_cell(key: str) -> dict:
    mode, engine, launcher, fault, victim, configured = CELLS[key]
    cell = {"key": key, "mode": mode, "engine": engine, "launcher": launcher,
            "fault": fault, "victim": victim, "configured_timeout": configured}
    if launcher.startswith("horovodrun"):
        missing = horovod_missing()
        if missing:
            return {**cell, "skipped": missing}
    runner = (run_horovodrun if launcher.startswith("horovodrun") else
              run_parameter_server if mode == "ParameterServerStrategy" else run_multi_worker)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"tfdist-faults-{key}-") as tmp:
        try:
            found = runner(key, Path(tmp))
        except Exception as error:  # noqa: BLE001 - the table says why
            return {**cell, "skipped": f"the job failed unexpectedly: "
                                       f"{type(error).__name__}: {_first_line(str(error))}",
                    "job_seconds": time.monotonic() - start}
    cell.update(found, job_seconds=time.monotonic() - start)
    t0 = cell["t0"]
    if t0 is None:
        cell["skipped"] = "the fault was never injected (no note of it)"
        return cell
    for report in cell["reports"]:
        report["seconds"] = report["t"] - t0
    cell["reports"].sort(key=lambda r: r["t"])
    named = [r for r in cell["reports"] if r["names"] and r["seconds"] >= 0]
    cell["first_named"] = named[0] if named else None
    return cell


# ---- report ------------------------------------------------------------------------------


def _short(text: str, limit: int = 240) -> str:
    text = text.replace("|", "\\|")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _summary_line(cell: dict) -> str:
    head = f"{cell['mode']} {cell['engine']} ({cell['launcher']}), {cell['fault']} " \
           f"of {cell['victim']}"
    if cell.get("skipped"):
        return f"{head}: not measured: {cell['skipped']}"
    first = cell["first_named"]
    if first is None:
        return f"{head}: no report names {cell['victim']} (see the details)"
    return f"{head}: {first['seconds']:.2f} s, {first['by']}: {first['text'][:150]}"


def markdown(report: dict) -> str:
    rows = [["mode", "engine", "launcher", "fault", "configured timeout",
             "first named by", "measured s", "first line of the error"]]
    details = [["cell", "from", "report by", "what", "s after the fault", "names it",
                "first line"]]
    for cell in report["cells"]:
        label = [cell["mode"], cell["engine"], cell["launcher"],
                 f"{cell['fault']} of {cell['victim']}", cell["configured_timeout"]]
        if cell.get("skipped"):
            rows.append(label + ["not measured", "-", _short(cell["skipped"])])
            continue
        first = cell["first_named"]
        if first is None:
            any_first = cell["reports"][0] if cell["reports"] else None
            rows.append(label + [
                f"nobody names {cell['victim']}" + (
                    f"; first error: {any_first['by']} ({any_first['what']})"
                    if any_first else ""),
                f"{any_first['seconds']:.2f} (unnamed)" if any_first else "-",
                f"`{_short(any_first['text'])}`" if any_first else "no error at all"])
        else:
            rows.append(label + [f"{first['by']} ({first['what']})",
                                 f"{first['seconds']:.2f}", f"`{_short(first['text'])}`"])
        for r in cell["reports"]:
            details.append([cell["key"], cell["t0_is"], r["by"], r["what"],
                            f"{r['seconds']:.2f}", "yes" if r["names"] else "no",
                            f"`{_short(r['text'], 300)}`"])
    lines = [
        f"# {TITLE}",
        "",
        f"Measured {report['date']} on {report['machine']['machine']}, "
        f"{report['machine']['cpus']} CPUs (TF {report['machine'].get('tensorflow')}, "
        f"Keras {report['machine'].get('keras')}, Horovod {report['machine'].get('horovod')}"
        f"); load average before the run: {report['load_before']}; the whole run took "
        f"{report['seconds']:.0f} s.",
        "",
        f"Command: `{report['command']}`",
        "",
        "Each cell is one small job (2 workers, or 1 chief + 2 workers + 1 ps, or 2 "
        "horovodrun ranks) training a tiny model on this machine. The fault is injected "
        "after batch 1 of epoch 1 (parameter server: once the chief's first dispatch of "
        "steps has finished); "
        "\"measured s\" runs from the moment just before the fault (noted by the task that "
        "injects it, with `time.monotonic()`) to the first report that names the faulty "
        "task, noted by the process that made it (or by the launcher's parent process). "
        "The never-starting worker is timed from the start of the chief's wait (its "
        "strategy constructor). One run per cell on a shared machine: times set by a "
        "heartbeat or a probe vary by about their interval (a second or two).",
        "",
        markdown_table(rows),
        "",
        "## Every report",
        "",
        "\"launcher, stopped the job\": the moment the launcher's SIGTERM reached the "
        "survivor, i.e. when it acted on the exit its `LaunchError` names (its first line "
        "is shown; that error is raised in the parent only once the survivors have "
        "exited: they ignore SIGTERM here so that they can report too). A frozen task "
        "never reports.",
        "",
        markdown_table(details),
        "",
    ]
    if report.get("notes"):
        lines += ["## Notes", ""] + [f"- {note}" for note in report["notes"]] + [""]
    return "\n".join(lines)


def _notes(cells: list[dict]) -> list[str]:
    """What a reader needs to read the table: derived from the measurements."""
    notes = []
    for cell in cells:
        key = cell["key"]
        if cell.get("engine_used") and cell["engine"] == 'engine="auto"':
            notes.append(f"{key}: engine=\"auto\" chose {', '.join(cell['engine_used'])} "
                         "(a CPU host with Horovod installed).")
        if cell.get("skipped"):
            continue
        first = cell["first_named"]
        if first is None:
            notes.append(f"{key}: no report names {cell['victim']} as the faulty task "
                         "(horovodrun names the first rank to exit, here the one that "
                         "raised): "
                         + "; ".join(f"{r['by']} at {r['seconds']:.2f} s: {r['text'][:160]}"
                                     for r in cell["reports"][:3]))
            continue
        if key == "mwms_tf_stop_leader" and first["seconds"] < HEARTBEAT:
            notes.append(f"{key}: {first['seconds']:.2f} s is less than heartbeat_timeout="
                         f"{HEARTBEAT}s: the timeout runs from worker-1's last heartbeat "
                         "to the leader, sent before the SIGSTOP, not from the SIGSTOP.")
        late = [r for r in cell["reports"] if r["what"] == "LaunchError in the parent"]
        if cell["fault"] == "kill -9" and late and late[0]["seconds"] > first["seconds"] + 1:
            notes.append(f"{key}: the LaunchError reached the parent only at "
                         f"{late[0]['seconds']:.2f} s: the launcher waits for the other "
                         "tasks to exit first (here they ignore SIGTERM until they have "
                         "reported, up to grace_period).")
    return notes


def main(argv=None):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # this process imports TF too
    parser = section_parser("benchmarks.faults", __doc__)
    parser.add_argument("--cells", default=None,
                        help=f"comma-separated cells to run (default: all; --quick: "
                             f"{','.join(QUICK_CELLS)}). Cells: {', '.join(CELLS)}")
    args = parse_section_args(parser, argv)
    keys = args.cells.split(",") if args.cells else list(QUICK_CELLS if args.quick else CELLS)
    unknown = [k for k in keys if k not in CELLS]
    if unknown:
        parser.error(f"unknown cells {unknown}; choose from {list(CELLS)}")
    load = " ".join(f"{v:.1f}" for v in os.getloadavg())
    start = time.monotonic()
    cells = []
    for key in keys:
        cell = run_cell(key)
        print(f"{key}: {_summary_line(cell)}", flush=True)
        cells.append(cell)
    command = "python -m benchmarks.faults" + (" --quick" if args.quick else "") + (
        f" --cells {args.cells}" if args.cells else "")
    report = {
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_info(), "load_before": load,
        "seconds": time.monotonic() - start,
        "timeouts": {"heartbeat_timeout": HEARTBEAT, "startup_timeout": STARTUP,
                     "step_timeout": STEP_TIMEOUT, "HOROVOD_GLOO_TIMEOUT_SECONDS": GLOO_TIMEOUT},
        "cells": cells, "notes": _notes(cells),
    }
    write_section(args.output, NAME, markdown(report), report)
    print(f"wrote {args.output / 'faults.json'} and {args.output / 'faults.md'} "
          f"({report['seconds']:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
