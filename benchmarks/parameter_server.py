"""Parameter-server training speed: steps/s for async and sync, with 1 and 2 workers.

All four configurations run one after the other in one invocation (same machine, same
load), each as its own local cluster (1 chief + K workers + 1 ps) started by
`tfdist.launch`. Each chief runs Keras ``model.fit`` on a small MLP: a warm-up fit
(tracing, connection set-up), then a timed fit of ``--steps`` steps. A sync step uses one
batch per worker, so its examples/s is K x batch x steps/s.

Run from the repository root:

    .venv/bin/python -m benchmarks.parameter_server [--quick] [--output DIR]
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time

from benchmarks.common import parse_section_args, section_parser, task_env

CONFIGS = [("async", 1), ("async", 2), ("sync", 1), ("sync", 2)]
QUICK_CONFIGS = [("async", 1), ("sync", 2)]  # the smoke run: each mode once


def _chief_task(mode, steps, warmup, batch, features, hidden):
    import tfdist

    strategy = tfdist.ParameterServerStrategy(mode=mode)  # workers and ps serve here

    import keras
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(4096, features)).astype("float32")
    y = (x @ rng.normal(size=(features, 1))).astype("float32")
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((features,)),
                                  keras.layers.Dense(hidden, activation="relu"),
                                  keras.layers.Dense(hidden, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.001), loss="mse")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    model.fit(dataset, epochs=1, steps_per_epoch=warmup, verbose=0)
    start_iterations = int(model.optimizer.iterations.numpy())
    start = time.perf_counter()
    history = model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0)
    seconds = time.perf_counter() - start
    k = strategy.num_workers
    done = int(model.optimizer.iterations.numpy()) - start_iterations
    return {"mode": mode, "workers": k, "steps": steps, "seconds": seconds,
            "steps_per_s": steps / seconds,
            "examples_per_s": steps * batch * (k if mode == "sync" else 1) / seconds,
            "updates_applied": done, "final_loss": float(history.history["loss"][-1]),
            "parameters": int(model.count_params())}


def run(steps, warmup, batch, features, hidden, timeout, configs=CONFIGS):
    import tfdist

    results = []
    for mode, workers in configs:
        values = tfdist.launch(_chief_task, mode, steps, warmup, batch, features, hidden,
                               workers=workers, chief=True, ps=1, timeout=timeout,
                               env=task_env(), stream=None)
        result = values[0]
        print(f"{mode:5s} workers={workers}: {result['steps_per_s']:7.1f} steps/s "
              f"{result['examples_per_s']:9.0f} examples/s", flush=True)
        results.append(result)
    return results


def _markdown(report):
    lines = [
        "# Parameter-server training speed (tfdist.ParameterServerStrategy)",
        "",
        f"Measured {report['date']} on {report['machine']}; load average before the run: "
        f"{report['load_before']}.",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Model: MLP {report['features']}-{report['hidden']}-{report['hidden']}-1 "
        f"({report['results'][0]['parameters']} parameters), batch {report['batch']} per "
        f"worker step, {report['steps']} timed steps after {report['warmup']} warm-up steps; "
        "1 chief + K workers + 1 ps, all on this machine (loopback gRPC).",
        "",
        "| mode | workers | steps/s | examples/s | updates applied | vs async 1 worker |",
        "|---|---|---|---|---|---|",
    ]
    base = report["results"][0]["steps_per_s"]
    for r in report["results"]:
        lines.append(f"| {r['mode']} | {r['workers']} | {r['steps_per_s']:.1f} | "
                     f"{r['examples_per_s']:.0f} | {r['updates_applied']} | "
                     f"{r['steps_per_s'] / base:.2f}x |")
    lines += [
        "",
        "A sync step reads one batch on each worker, sums the K gradients on the ps and "
        "applies them once (two barriers per step: gradients, then the update), so its "
        "examples/s is K x batch x steps/s. Async steps need no barrier. Every process "
        "(chief, K workers, ps) shares the machine's cores with whatever else runs there "
        "(see the load average above), so a second worker adds compute only where cores "
        "are idle; on a 2-core machine that is already busy it mostly cannot.",
        "",
    ]
    return "\n".join(lines)


def main(argv=None):
    parser = section_parser("benchmarks.parameter_server", __doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--timeout", type=float, default=600)
    args = parse_section_args(parser, argv)
    if args.quick:
        args.steps, args.warmup = 20, 4
    load = " ".join(f"{v:.1f}" for v in os.getloadavg())
    results = run(args.steps, args.warmup, args.batch, args.features, args.hidden,
                  args.timeout, QUICK_CONFIGS if args.quick else CONFIGS)
    report = {
        "command": "python -m benchmarks.parameter_server" + (" --quick" if args.quick else ""),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python "
                   f"{platform.python_version()}",
        "load_before": load, "steps": args.steps, "warmup": args.warmup,
        "batch": args.batch, "features": args.features, "hidden": args.hidden,
        "results": results,
    }
    out = args.output
    (out / "parameter_server.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "parameter_server.md").write_text(_markdown(report))
    print(f"wrote {out / 'parameter_server.json'} and {out / 'parameter_server.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
