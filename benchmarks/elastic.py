"""Elastic training, measured: what a lost worker costs, against restart-and-resume.

Every cell is one job of 3 workers (engine "horovod") training the digits CNN with a
global batch of 48 for 3 epochs (33 steps each); worker-2 SIGKILLs itself after batch
7 of epoch 1, writing ``time.monotonic()`` (one clock for every process of this
machine) just before. Each task notes the time of every completed step.

- ``elastic k=1`` / ``elastic k=5``: ``tfdist launch --min-workers 2`` with
  ``commit_every_steps`` 1 and 5; the survivors roll back, re-form and go on.
- ``restart + BackupAndRestore``: today's way, ``--max-restarts 1`` and Keras'
  ``BackupAndRestore`` (a backup at each epoch's end): every task restarts and the
  epoch resumes from its start.

Per cell: seconds from the kill to the next completed step (on any task), steps lost
(the steps rolled back, the one in flight included; after a restart: the steps a
task trained twice), the same summed over the tasks, and the whole run's seconds. A
fourth job (2 workers, no fault) measures what a commit costs: one fit whose epochs
alternate between committing every step and committing once per epoch (a callback sets
the elastic fit's ``commit_every_steps`` at each epoch's start); the ratio is the median
over pairs of adjacent epochs of their median steps, so that a drift in the machine's
load cancels (a commit after a step is read inside the step's traced function, so it has
no time of its own to measure). The goals (docs/benchmarks.md) read ``ratios``.

Run from the repository root (about 3 minutes on a busy 2-core machine; ``--quick``
leaves out the k=5 cell; ``--only commit`` runs the commit-cost job alone and, unless
``--output`` says where, writes to the quick directory, never over the committed results):

    .venv/bin/python -m benchmarks.elastic [--quick] [--only commit] [--output DIR]

It kills only the processes of its own jobs; docs/elastic.md quotes it.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import (horovod_missing, machine_info, markdown_table, output_dir,
                               section_parser, skip_section, task_env, write_section)

NAME = "elastic"
TITLE = "Elastic training: a lost worker against restart-and-resume"
BATCH = 48
EPOCHS = 3
KILL_AT = (1, 7)  # (epoch, batch) after which worker-2 SIGKILLs itself
HEARTBEAT = 5  # heartbeat_timeout: Gloo's timeout for the members not next to the loss


def _cnn():
    import keras

    keras.utils.set_random_seed(1)
    model = keras.Sequential([
        keras.Input((8, 8, 1)), keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def job(out, commit_every, kill, epochs, backup=False, alternate=False):
    """One task: trains, noting each completed step's time in ``OUT/<task>-<pid>.json``."""
    import signal

    import keras

    import tfdist
    from tfdist.data import load_digits_data

    x, y = load_digits_data()
    x = x.reshape(-1, 8, 8, 1)[:1584]  # 33 global batches of 48
    y = y[:1584]
    task, restart = os.environ["TFDIST_TASK"], os.environ.get("TFDIST_RESTART", "0")
    strategy = tfdist.MultiWorkerMirroredStrategy(
        engine="horovod", heartbeat_timeout=HEARTBEAT, commit_every_steps=commit_every)
    with strategy.scope():
        model = _cnn()
    steps = []

    class Note(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            steps.append((self.epoch, batch, time.monotonic()))
            with open(os.path.join(out, f"steps-{task}-{os.getpid()}"), "a") as f:
                f.write(f"{self.epoch} {batch} {steps[-1][2]}\n")  # kept if killed
            if kill and task == "worker-2" and restart == "0" and \
                    os.environ.get("TFDIST_TASK_RESTART", "0") == "0" and \
                    (self.epoch, batch) == KILL_AT:
                Path(out, "killed").write_text(str(time.monotonic()))
                os.kill(os.getpid(), signal.SIGKILL)

    commit_every_of_epoch = {}

    class Alternate(keras.callbacks.Callback):
        """Even epochs commit every step, odd ones once (at the epoch's start)."""

        def on_epoch_begin(self, epoch, logs=None):
            every = 1 if epoch % 2 == 0 else 10**9
            strategy.elastic_fit.commit_every_steps = commit_every_of_epoch[epoch] = every

    callbacks = [Note()]
    if backup:
        callbacks.append(keras.callbacks.BackupAndRestore(os.path.join(out, "backup")))
    if alternate:
        callbacks.append(Alternate())
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
              callbacks=callbacks)
    fitting = getattr(strategy, "elastic_fit", None)
    Path(out, f"{task}-{os.getpid()}.json").write_text(json.dumps({
        "steps": steps, "restart": restart, "commit_every": commit_every_of_epoch,
        "commits": fitting.commits if fitting else 0,
        "fused_commits": fitting.fused_commits if fitting else 0,
        "steps_lost": fitting.steps_lost if fitting else None}))


def _launch(out, *, min_workers, max_restarts, commit_every=1, kill=True, backup=False,
            workers=3, epochs=EPOCHS, alternate=False):
    import tfdist

    started = time.monotonic()
    try:
        tfdist.launch(job, out, commit_every, kill, epochs, backup, alternate,
                      workers=workers, min_workers=min_workers, max_restarts=max_restarts,
                      timeout=600, env=task_env(), stream=None)
        error = None
    except Exception as e:  # noqa: BLE001 - recorded in the report
        error = f"{type(e).__name__}: {str(e)[:300]}"
    return time.monotonic() - started, error


def _fault_cell(name, **launch):
    with tempfile.TemporaryDirectory(prefix="tfdist-elastic-") as out:
        seconds, error = _launch(out, **launch)
        killed = float(Path(out, "killed").read_text()) if Path(out, "killed").exists() \
            else None
        tasks = [json.loads(p.read_text()) for p in Path(out).glob("worker-*.json")]
        noted = {p.name: [tuple(map(float, line.split())) for line in p.read_text().split("\n")
                          if line] for p in Path(out).glob("steps-*")}
    after = sorted(t for steps in noted.values() for e, b, t in steps
                   if (int(e), int(b)) > KILL_AT)
    # Steps trained twice by one task: noted by two of its processes (a restart).
    by_task: dict = {}
    for file, steps in noted.items():
        by_task.setdefault(file.split("-")[1] + "-" + file.split("-")[2], []).append(
            {(int(e), int(b)) for e, b, _ in steps})
    twice = [len(runs[0] & runs[1]) for runs in by_task.values() if len(runs) > 1]
    rolled_back = [t["steps_lost"] or 0 for t in tasks]
    elastic = bool(launch.get("min_workers"))
    return {"cell": name, "seconds": seconds, "error": error,
            "kill_to_next_step": after[0] - killed if after and killed else None,
            "twice": max(twice, default=0),
            "steps_lost": max(rolled_back if elastic else twice, default=0),
            # summed over the tasks: the work the failure undid
            "task_steps_lost": sum(rolled_back if elastic else twice)}


COMMIT_PAIRS = 30  # pairs of epochs of the commit-cost job, after a warm-up pair


def _commit_cell(quick):
    pairs_asked = 1 if quick else COMMIT_PAIRS
    with tempfile.TemporaryDirectory(prefix="tfdist-elastic-") as out:
        seconds, error = _launch(out, min_workers=1, max_restarts=0, kill=False, workers=2,
                                 epochs=2 * (pairs_asked + 1), alternate=True)
        tasks = [json.loads(p.read_text()) for p in Path(out).glob("worker-*.json")]
    times = {1: [], 10**9: []}
    pairs = []  # per pair of adjacent epochs: median step committing every step / once
    commits = fused = 0
    for task in tasks:
        medians = {}
        for epoch, every in sorted((int(e), k) for e, k in task["commit_every"].items()):
            if epoch < 2:
                continue  # the warm-up pair: each epoch traces its train function
            stamps = [t for e, _, t in task["steps"] if e == epoch]
            steps = [b - a for a, b in zip(stamps, stamps[1:])]  # within the epoch
            times[every] += steps
            medians[every] = statistics.median(steps) if steps else None
            if epoch % 2 and all(medians.values()):
                pairs.append(medians[1] / medians[10**9])
        commits, fused = commits + task["commits"], fused + task["fused_commits"]
    every, once = (statistics.median(times[k]) if times[k] else None for k in (1, 10**9))
    return {"cell": "commit cost", "seconds": seconds, "error": error,
            "epochs": 2 * (pairs_asked + 1),
            "step_commit_every_step": every, "step_commit_once_per_epoch": once,
            # every commit of the fit (each epoch's first included), and those read
            # inside a train step
            "commits": commits, "fused_commits": fused,
            # the two medians over every epoch (drifts with the machine's load)
            "ratio_pooled": every / once if every and once else None,
            # the median over pairs of adjacent epochs: a drift in load cancels in a pair
            "pair_ratios": pairs,
            "ratio": statistics.median(pairs) if pairs else None}


def ratios(faults, commit) -> dict:
    """What benchmarks/goal_table.py compares: ``next_step_seconds`` (elastic k=1),
    ``steps_lost_per_k`` (elastic k=5: steps lost / 5), ``work_lost_ratio`` (task-steps
    lost by restart-and-resume / by elastic k=1) and ``commit_ratio``."""
    cells = {c["cell"]: c for c in faults if not c["error"]}
    one, five = cells.get("elastic k=1", {}), cells.get("elastic k=5", {})
    restart = cells.get("restart + BackupAndRestore", {})
    work = (restart["task_steps_lost"] / one["task_steps_lost"]
            if restart.get("task_steps_lost") and one.get("task_steps_lost") else None)
    return {"next_step_seconds": one.get("kill_to_next_step"),
            "steps_lost_per_k": five["steps_lost"] / 5 if five.get("steps_lost") else None,
            "work_lost_ratio": work, "commit_ratio": commit["ratio"]}


def markdown(report) -> str:
    rows = [["cell", "kill → next completed step (s)", "steps lost (per task)",
             "task-steps lost (sum)", "run (s)", "error"]]
    for c in report["faults"]:
        kill = "n/a" if c["kill_to_next_step"] is None else f"{c['kill_to_next_step']:.2f}"
        rows.append([c["cell"], kill, c["steps_lost"], c["task_steps_lost"],
                     f"{c['seconds']:.1f}", c["error"] or ""])
    commit = report["commit"]
    ratio = "n/a" if commit["ratio"] is None else f"{commit['ratio']:.3f}"
    pooled = "n/a" if commit["ratio_pooled"] is None else f"{commit['ratio_pooled']:.3f}"
    return "\n".join([
        f"# {TITLE}", "", f"`{report['command']}`, {report['date']}, "
        f"{report['machine'].get('cpus')} CPUs, load before {report['load_before']}.", "",
        f"3 workers, digits CNN, global batch {BATCH}, {EPOCHS} epochs of 33 steps; "
        f"worker-2 SIGKILLed after batch {KILL_AT[1]} of epoch {KILL_AT[0]}; "
        f"heartbeat_timeout {HEARTBEAT} s (Gloo's timeout).", "",
        markdown_table(rows), "",
        f"Commit cost (2 workers, no fault): one fit of {commit['epochs']} epochs committing "
        f"every step and once per epoch in turn (the first two a warm-up); the median step "
        f"committing every step over the median step committing once per epoch, the "
        f"median over {len(commit['pair_ratios'])} pairs of adjacent epochs (both tasks): "
        f"ratio **{ratio}** (goal `elastic-commit`: <= 1.05); over all epochs, "
        f"{_ms(commit['step_commit_every_step'])} against "
        f"{_ms(commit['step_commit_once_per_epoch'])} ({pooled}). Of its "
        f"{commit['commits']} commits, {commit['fused_commits']} were read inside the "
        f"train step (the others: each epoch's first, by a call of their own).", ""])


def _ms(seconds):
    return "n/a" if seconds is None else f"{seconds * 1000:.2f} ms"


def main(argv=None):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    parser = section_parser("benchmarks.elastic", __doc__)
    parser.add_argument("--only", choices=["commit"], default=None,
                        help="run only this cell (commit: the commit-cost job)")
    args = parser.parse_args(argv)
    args.output = output_dir(args.output, args.quick or args.only is not None)
    missing = horovod_missing()
    if missing:
        skip_section(args.output, NAME, TITLE, missing)
        return 0
    load = " ".join(f"{v:.1f}" for v in os.getloadavg())
    start = time.monotonic()
    cells = [("elastic k=1", {"min_workers": 2, "max_restarts": 0}),
             ("elastic k=5", {"min_workers": 2, "max_restarts": 0, "commit_every": 5}),
             ("restart + BackupAndRestore", {"min_workers": None, "max_restarts": 1,
                                             "backup": True})]
    faults = []
    for index, (name, launch) in enumerate(cells):
        if (args.quick and name == "elastic k=5") or args.only == "commit":
            continue
        print(f"elastic: {name} ({index + 1}/{len(cells) + 1}) ...", flush=True)
        faults.append(_fault_cell(name, **launch))
        print(faults[-1], flush=True)
    print(f"elastic: commit cost ({len(cells) + 1}/{len(cells) + 1}) ...", flush=True)
    commit = _commit_cell(args.quick)
    print(commit, flush=True)
    report = {"command": "python -m benchmarks.elastic" + (" --quick" if args.quick else "")
              + (f" --only {args.only}" if args.only else ""),
              "date": datetime.datetime.now(datetime.timezone.utc).strftime(
                  "%Y-%m-%d %H:%M UTC"),
              "machine": machine_info(), "load_before": load,
              "seconds": time.monotonic() - start, "faults": faults, "commit": commit,
              "ratios": ratios(faults, commit)}
    write_section(args.output, NAME, markdown(report), report)
    print(f"wrote {args.output / 'elastic.md'} ({report['seconds']:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
