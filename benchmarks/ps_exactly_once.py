"""Parameter servers under crashing workers: is every requested step applied once?

One local cluster (1 chief + 2 workers + 1 ps) per configuration, started by
`tfdist.launch` with restarts. The model counts: y = x @ w + b with x = 1, trained on
loss = mean(y) with SGD(1.0), so every applied update lowers each weight by exactly 1
and ``-b`` is the number of updates applied. Worker-1 aborts its own process (SIGABRT)
right after every ``--period``-th step it ran, ``--crashes`` times, while its update is
on its way to the ps; TF's coordinator runs that step again on a live worker. The
chief also SIGKILLs worker-0 once in the middle of a fit. The launcher restarts each
worker alone, at its address.

Reported per configuration: steps requested, ``optimizer.iterations``, updates applied
(kernel and bias), and the surplus per crash. With ``exactly_once=True`` (the default)
every surplus must be 0; ``exactly_once=False`` shows what TF's coordinator alone does.

Run from the repository root:

    .venv/bin/python -m benchmarks.ps_exactly_once [--quick] [--output DIR]
"""

from __future__ import annotations

import datetime
import os
import signal
import time

from benchmarks.common import (machine_info, parse_section_args, section_parser, task_env,
                               write_section)

STEPS_PER_FIT = 40


def _write(work_dir, name, text):
    path = os.path.join(work_dir, name)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def counting_model(seen, by_worker, period, crashes):
    """The counting model: worker-1 aborts after every ``period``-th step it ran.

    ``seen`` counts the steps whose input came from worker-1, ``by_worker`` the steps
    per input's worker (both variables on the ps).
    """
    import keras
    import tensorflow as tf

    class Counting(keras.Model):
        def train_step(self, data):
            logs = super().train_step(data)
            tag = tf.cast(data[1][0, 0], tf.int64)
            by_worker.scatter_add(tf.IndexedSlices(tf.ones([1], tf.int64), tf.reshape(tag, [1])))
            n = seen.assign_add(tf.cast(tf.equal(tag, 1), tf.int64))
            crash = tf.equal(tag, 1) & tf.equal(n % period, 0) & (n <= period * crashes)

            def abort():
                message = "crash test: worker-1 aborts after running a step"
                with tf.control_dependencies([tf.raw_ops.Abort(error_msg=message)]):
                    return tf.constant(0, tf.int64)

            # Control dependencies, or tf.function prunes the cond (Abort is not stateful).
            done = tf.cond(crash, abort, lambda: tf.constant(0, tf.int64))
            with tf.control_dependencies([done]):
                seen.assign_add(0)
            return logs

    keras.utils.set_random_seed(1)
    inputs = keras.Input((2,))
    outputs = keras.layers.Dense(1, kernel_initializer="zeros")(inputs)
    model = Counting(inputs, outputs)
    model.compile(keras.optimizers.SGD(1.0), loss=lambda y, p: tf.reduce_mean(p))
    return model


def crash_task(work_dir, mode, period=10, crashes=2, exactly_once=True, seconds=150):
    """Every task of the cluster: the chief fits until both workers ran steps after their
    last restart (or ``seconds`` passed) and returns the counts."""
    import keras
    import tensorflow as tf

    import tfdist

    _write(work_dir, f"{os.environ['TFDIST_TASK']}.pid", str(os.getpid()))
    strategy = tfdist.ParameterServerStrategy(mode=mode, startup_timeout=60,
                                              exactly_once=exactly_once)
    with strategy.scope():
        seen = tf.Variable(0, dtype=tf.int64)
        by_worker = tf.Variable(tf.zeros([2], tf.int64))
        model = counting_model(seen, by_worker, period, crashes)

    def dataset_fn(context):
        tag = float(context.input_pipeline_id)
        return tf.data.Dataset.from_tensors(
            (tf.ones([4, 2]), tf.fill([4, 1], tag))).repeat()

    class KillWorker0(keras.callbacks.Callback):
        """SIGKILLs worker-0's own process in the middle of a fit."""
        killed_after = None

        def on_train_batch_end(self, batch, logs=None):
            if KillWorker0.killed_after is None:
                KillWorker0.killed_after = int(by_worker[0].numpy())
                with open(os.path.join(work_dir, "worker-0.pid")) as f:
                    os.kill(int(f.read()), signal.SIGKILL)

    requested, fits = 0, 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        callbacks = [KillWorker0()] if fits == 1 else []
        model.fit(dataset_fn, epochs=1, steps_per_epoch=STEPS_PER_FIT, verbose=0,
                  callbacks=callbacks)
        requested, fits = requested + STEPS_PER_FIT, fits + 1
        back0 = KillWorker0.killed_after is not None and \
            by_worker[0].numpy() > KillWorker0.killed_after + STEPS_PER_FIT
        back1 = seen.numpy() > period * crashes  # after its last restart
        if back0 and back1:
            break
    return {"mode": mode, "exactly_once": exactly_once, "crashes": crashes,
            "requested": requested, "fits": fits,
            "iterations": int(model.optimizer.iterations.numpy()),
            "applied": -float(model.layers[-1].bias.numpy()[0]),
            "kernel": model.layers[-1].kernel.numpy().ravel().tolist(),
            "seen": int(seen.numpy()), "by_worker": by_worker.numpy().tolist()}


def run_crashes(mode, period, crashes, exactly_once, timeout=400, env=None, stream=None):
    """One cluster of `crash_task`; returns the chief's counts."""
    import tempfile

    import tfdist

    with tempfile.TemporaryDirectory(prefix="tfdist-once-") as work_dir:
        return tfdist.launch(crash_task, work_dir, mode, period, crashes, exactly_once,
                             workers=2, chief=True, ps=1, timeout=timeout,
                             max_restarts=crashes + 1, env=env or task_env(),
                             stream=stream)[0]


def _surplus(result):
    extra = [result["iterations"] - result["requested"],
             result["applied"] - result["requested"],
             *(-k - result["requested"] for k in result["kernel"])]
    return max(extra, key=abs)


def _markdown(report):
    lines = [
        "# Parameter servers under crashing workers: exactly-once updates",
        "",
        f"Measured {report['date']}; command: `{report['command']}`",
        "",
        "1 chief + 2 workers + 1 ps on this machine. Worker-1 aborts right after every "
        f"{report['period']}th step it ran, {report['crashes']} times; worker-0 is "
        "SIGKILLed once. A step cut short is run again by TF's coordinator.",
        "",
        "| mode | exactly_once | crashes | steps requested | iterations | updates applied "
        "(bias) | kernel | surplus |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        lines.append(f"| {r['mode']} | {r['exactly_once']} | {r['crashes']} + 1 kill | "
                     f"{r['requested']} | {r['iterations']} | {r['applied']:.0f} | "
                     f"{[-k for k in r['kernel']]} | {_surplus(r):+.0f} |")
    lines += ["", "surplus: the largest difference between what was applied (iterations, "
              "bias, each kernel weight) and the steps requested; 0 is exactly once.", ""]
    return "\n".join(lines)


def main(argv=None):
    parser = section_parser("benchmarks.ps_exactly_once", __doc__)
    parser.add_argument("--crashes", type=int, default=8)
    parser.add_argument("--period", type=int, default=4)
    args = parse_section_args(parser, argv)
    if args.quick:
        args.crashes = 2
    configs = [("async", True), ("async", False), ("sync", True)]
    results = []
    for mode, once in configs:
        print(f"{mode} exactly_once={once}: {args.crashes} crashes ...", flush=True)
        result = run_crashes(mode, args.period, args.crashes, once)
        print(f"  requested {result['requested']}, iterations {result['iterations']}, "
              f"applied {result['applied']:.0f}, surplus {_surplus(result):+.0f}", flush=True)
        results.append(result)
    report = {
        "command": "python -m benchmarks.ps_exactly_once" + (" --quick" if args.quick else ""),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_info(), "period": args.period, "crashes": args.crashes,
        "results": results,
    }
    write_section(args.output, "ps_exactly_once", _markdown(report), report)
    print(f"wrote {args.output / 'ps_exactly_once'}.{{md,json}}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
