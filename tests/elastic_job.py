"""The training script of tests/test_elastic.py, run by ``tfdist launch --min-workers``.

    python elastic_job.py OUT EPOCHS [TASK:EPOCH:BATCH]

Every task trains the same small regression with global batch `BATCH` through
``tfdist.MultiWorkerMirroredStrategy(engine="horovod")``. The task named in the third
argument SIGKILLs itself after that batch (0-based) of that epoch, on its first start
only (``TASK:EPOCH:BATCH:BEGIN``: SIGKILL before that batch's step;
``TASK:EPOCH:BATCH:STOP``: SIGSTOP, it freezes; ``TASK:EPOCH:BATCH:GROW``: it
writes ``OUT/grow-EPOCH-BATCH``, and every member waits at its next batch's end, up to
120 s, until the launcher lists a worker more (so that none waits in a collective);
``TASK:EPOCH:BATCH:HOLD``: it writes ``OUT/hold-EPOCH-BATCH`` and waits, up to 120 s,
for ``OUT/release-EPOCH-BATCH``; ``TASK:EPOCH:BATCH:READ``: SIGKILL as Keras begins to
read that epoch's metrics, a collective after the epoch's last step; ``TASK:0:0:START``:
it exits 1 before it makes the strategy, and the others make theirs only once the
launcher published the membership after its loss, so that no Horovod formation listed
it). Several events are separated by commas; they run in the
job's first attempt only (``TFDIST_RESTART`` 0). Each task notes its weights
after every step. ``JOB_HEARTBEAT`` sets the strategy's ``heartbeat_timeout`` (5 s);
``JOB_PERIOD`` trains with ``tfdist.ModelAverageStrategy(period=JOB_PERIOD)`` instead;
``JOB_COMMIT_EVERY`` and ``JOB_STEPS_PER_EXECUTION`` set ``commit_every_steps`` and
Keras' ``steps_per_execution``; ``JOB_SHARD`` (sharded Adam) and ``JOB_ACCUMULATE``
set ``shard_optimizer_state=True`` with Adam, and ``accumulate_steps``; ``JOB_BACKUP`` adds
``tfdist.keras.callbacks.BackupAndRestore(OUT/backup)``.
Each task appends ``<task> <pid>`` to ``OUT/starts`` when it starts and writes
``OUT/<task>.json`` when fit ends; the chief saves the model once, recording who did.
"""

import json
import os
import signal
import sys
import time

import numpy as np

BATCH = 48
SAMPLES = 480  # 10 global batches per epoch


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 8)).astype("float32")
    w = rng.normal(size=(8, 1)).astype("float32")
    return x, x @ w + 0.1


def model():
    import keras

    keras.utils.set_random_seed(1)
    net = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, activation="tanh"),
                            keras.layers.Dense(1)])
    optimizer = keras.optimizers.Adam(0.01) if os.environ.get("JOB_SHARD") else \
        keras.optimizers.SGD(0.05, momentum=0.9)
    net.compile(optimizer=optimizer, loss="mse",
                steps_per_execution=int(os.environ.get("JOB_STEPS_PER_EXECUTION", 1)))
    return net


def fit(net, epochs, callbacks=()):
    x, y = data()
    return net.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
                   callbacks=list(callbacks))


def main(out, epochs, kill=""):
    import keras

    import tfdist
    from tfdist.engines.horovod.elastic import member as elastic_member

    task = os.environ["TFDIST_TASK"]
    with open(os.path.join(out, "starts"), "a") as f:
        f.write(f"{task} {os.getpid()}\n")
    first_start = os.environ.get("TFDIST_TASK_RESTART", "0") == "0" and \
        os.environ.get("TFDIST_RESTART", "0") == "0"
    for name, _, _, how in parse_events(kill):
        if how == "START" and first_start:
            _die_at_start(name, task)
    heartbeat = float(os.environ.get("JOB_HEARTBEAT", 5))
    if os.environ.get("JOB_PERIOD"):
        strategy = tfdist.ModelAverageStrategy(period=int(os.environ["JOB_PERIOD"]),
                                               engine="horovod", heartbeat_timeout=heartbeat)
    else:
        strategy = tfdist.MultiWorkerMirroredStrategy(
            engine="horovod", heartbeat_timeout=heartbeat,
            commit_every_steps=int(os.environ.get("JOB_COMMIT_EVERY", 1)),
            shard_optimizer_state=bool(os.environ.get("JOB_SHARD")),
            accumulate_steps=int(os.environ.get("JOB_ACCUMULATE", 1)))
    with strategy.scope():
        net = model()

    class Events(keras.callbacks.Callback):
        """Runs the events of ``kill`` (comma-separated) and notes the weights after
        every step."""
        grow_to = None

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            for name, epoch, at, how in events():
                if how == "BEGIN" and name == task and first_start and \
                        (self.epoch, batch) == (int(epoch), int(at)):
                    os.kill(os.getpid(), signal.SIGKILL)

        def on_train_batch_end(self, batch, logs=None):
            if logs:  # a joiner's calls before its first step return no logs
                steps[f"{self.epoch}:{batch}"] = [float(v) for w in net.get_weights()
                                                  for v in np.ravel(w)]
            member = elastic_member()
            while self.grow_to is not None and strategy.size < self.grow_to and \
                    not member.changed() and time.monotonic() < self.deadline:
                time.sleep(0.2)  # the test adds a worker: wait until the launcher lists it
            for name, epoch, at, how in events():
                if how == "GROW" and name != task and not member.joined_running and \
                        (self.epoch, batch) == (int(epoch), int(at)) and \
                        self.grow_to is None:  # every member waits, none in a collective
                    self.grow_to, self.deadline = strategy.size + 1, time.monotonic() + 120
                if name != task or not first_start or how in ("BEGIN", "READ") or \
                        (self.epoch, batch) != (int(epoch), int(at)):
                    continue
                if how == "GROW":
                    self.grow_to, self.deadline = strategy.size + 1, time.monotonic() + 120
                    open(os.path.join(out, f"grow-{epoch}-{at}"), "w").close()
                elif how == "HOLD":
                    open(os.path.join(out, f"hold-{epoch}-{at}"), "w").close()
                    release, deadline = os.path.join(out, f"release-{epoch}-{at}"), \
                        time.monotonic() + 120
                    while not os.path.exists(release) and time.monotonic() < deadline:
                        time.sleep(0.1)
                else:
                    os.kill(os.getpid(), getattr(signal, f"SIG{how}"))

    def events():
        return parse_events(kill)

    steps = {}  # "epoch:batch" -> the weights after that step
    noting = Events()
    reads = {int(epoch) for name, epoch, _, how in events() if how == "READ" and name == task}
    if reads and first_start:
        keras_read = net.get_metrics_result

        def read():  # Keras' read of the epoch's metrics (fit's last read included)
            if noting.epoch in reads:
                os.kill(os.getpid(), signal.SIGKILL)
            return keras_read()

        net.get_metrics_result = read
    callbacks = [noting]
    if os.environ.get("JOB_BACKUP"):
        callbacks.append(tfdist.keras.callbacks.BackupAndRestore(os.path.join(out, "backup")))
    fit(net, epochs, callbacks)
    if strategy.is_chief:
        net.save(os.path.join(out, "model.keras"))
        open(os.path.join(out, f"saved-by-{task}"), "w").close()
    elif getattr(strategy, "save_needs_every_worker", False):  # sharded state: gathered
        net.save(os.path.join(out, f"{task}-scratch.keras"))
    fitting = getattr(strategy, "elastic_fit", None)
    with open(os.path.join(out, f"{task}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "weights": [w.tolist() for w in net.get_weights()],
                   "iterations": int(net.optimizer.iterations.numpy()),
                   "size": strategy.size, "rank": strategy.rank,
                   "recoveries": fitting.recoveries if fitting else None,
                   "steps_lost": fitting.steps_lost if fitting else None,
                   "commits": fitting.commits if fitting else None,
                   "fused_commits": fitting.fused_commits if fitting else None,
                   "steps": steps}, f)


def parse_events(kill):
    """``[[task, epoch, batch, how], ...]`` of the events in ``kill``."""
    return [(event.split(":") + ["KILL"])[:4] for event in filter(None, kill.split(","))]


def _die_at_start(name, task):
    """Task ``name`` exits 1 (a crash at import); the others wait, up to 120 s, until the
    launcher publishes the membership after its loss (without it, or with its
    replacement)."""
    from tfdist.engines.horovod import membership

    if name == task:
        os._exit(1)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            state = membership.fetch_state(membership.elastic_address())
        except OSError:
            state = {"version": 0, "members": []}
        if state["version"] > 1:
            return
        time.sleep(0.05)


if __name__ == "__main__":
    from helpers import exit_without_a_last_collection

    main(*sys.argv[1:2], int(sys.argv[2]), *sys.argv[3:4])
    exit_without_a_last_collection()  # as a function's task: no wait on the last GC
