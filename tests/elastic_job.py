"""The training script of tests/test_elastic.py, run by ``tfdist launch --min-workers``.

    python elastic_job.py OUT EPOCHS [TASK:EPOCH:BATCH]

Every task trains the same small regression with global batch `BATCH` through
``tfdist.MultiWorkerMirroredStrategy(engine="horovod")``. The task named in the third
argument SIGKILLs itself after that batch (0-based) of that epoch, on its first start
only (``TASK:EPOCH:BATCH:STOP``: SIGSTOP, it freezes). Each task appends ``<task> <pid>`` to ``OUT/starts`` when it starts and writes
``OUT/<task>.json`` when fit ends; the chief saves the model once, recording who did.
"""

import json
import os
import signal
import sys

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
    net.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    return net


def fit(net, epochs, callbacks=()):
    x, y = data()
    return net.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
                   callbacks=list(callbacks))


def main(out, epochs, kill=""):
    import keras

    import tfdist

    task = os.environ["TFDIST_TASK"]
    with open(os.path.join(out, "starts"), "a") as f:
        f.write(f"{task} {os.getpid()}\n")
    strategy = tfdist.MultiWorkerMirroredStrategy(engine="horovod", heartbeat_timeout=5)
    with strategy.scope():
        net = model()

    class Kill(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            name, epoch, at, how = (kill.split(":") + ["KILL"])[:4]
            if name == task and os.environ.get("TFDIST_TASK_RESTART", "0") == "0" and \
                    (self.epoch, batch) == (int(epoch), int(at)):
                os.kill(os.getpid(), getattr(signal, f"SIG{how}"))

    fit(net, epochs, [Kill()] if kill else [])
    if strategy.is_chief:
        net.save(os.path.join(out, "model.keras"))
        open(os.path.join(out, f"saved-by-{task}"), "w").close()
    fitting = getattr(strategy, "elastic_fit", None)
    with open(os.path.join(out, f"{task}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "weights": [w.tolist() for w in net.get_weights()],
                   "iterations": int(net.optimizer.iterations.numpy()),
                   "size": strategy.size, "rank": strategy.rank,
                   "recoveries": fitting.recoveries if fitting else None}, f)


if __name__ == "__main__":
    main(*sys.argv[1:2], int(sys.argv[2]), *sys.argv[3:4])
