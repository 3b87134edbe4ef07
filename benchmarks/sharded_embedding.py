"""Sharded embedding on parameter servers: peak memory of every process, and steps/s.

An embedding table (``--rows`` x ``--dim`` float32: 2M x 64 = 512 MB by default) trains
with Keras ``fit`` and Adam (two slots, so slots = 2 x table) under
``tfdist.ParameterServerStrategy(variable_partitioner=MinSizePartitioner(max_shards=P))``,
launched by ``tfdist.launch(..., chief=True, workers=W, ps=P)``, once with 1 ps and once
with 2 ps. Model: ``Input((1,), int32) -> Embedding -> Flatten -> Dense(1)``, MSE on
random ids, so every step touches ``batch`` random rows.

Every task writes its pid to a shared directory when it starts; at the end of training
the chief reads ``VmHWM`` (peak resident set) of every task from ``/proc/<pid>/status``
(the tasks still run: workers and ps wait for the chief). A baseline run of the same
cluster with a tiny table (1024 rows) gives what each role holds without the table; a
process's *net* peak is its peak minus the baseline of its role. The variant
``2 ps, tf.nn.embedding_lookup`` replaces Keras' ``Embedding`` by a layer that looks the
ids up shard by shard (TF's partitioned ``embedding_lookup``), to show where the worker's
memory goes.

In the full run, one more job gives the single ps an address-space limit
(``resource.setrlimit(RLIMIT_AS)``, what ``ulimit -v`` sets) below table + slots, and
records the error the user gets.

    .venv/bin/python -m benchmarks.sharded_embedding [--quick] [--output DIR]
    # DIR/sharded_embedding.{json,md,png}
"""

from __future__ import annotations

import io
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import (machine_info, markdown_table, parse_section_args, pyplot,
                               save_figure, section_parser, task_env, write_section)

NAME = "sharded_embedding"
TITLE = "Sharded embedding on parameter servers: memory per process"
BASELINE_ROWS = 1024
MiB = 2**20


def settings(quick: bool) -> dict:
    """Table size, cluster and steps: the full run, or a smoke run of a few MB."""
    if quick:
        return {"rows": 20_000, "dim": 64, "workers": 1, "batch": 64, "warmup": 2,
                "steps": 4, "baseline": False, "lookup_variant": False,
                "memory_limit": False}
    return {"rows": 2_000_000, "dim": 64, "workers": 2, "batch": 256, "warmup": 3,
            "steps": 20, "baseline": True, "lookup_variant": False, "memory_limit": True}


# ---- inside every task --------------------------------------------------------------------

def _status(pid) -> dict:
    """``VmHWM``, ``VmRSS``, ``VmPeak`` and ``VmSize`` of ``pid`` in bytes."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmHWM", "VmRSS", "VmPeak", "VmSize"):
            values[key] = int(rest.split()[0]) * 1024
    return values


def _task(rows, dim, workers, batch, warmup, steps, num_ps, pid_dir, lookup="keras",
          ps_extra_bytes=None):
    """One task of the job. Workers and ps serve inside the strategy's constructor and
    never return; the chief trains and returns what it measured."""
    import json

    name = os.environ.get("TFDIST_TASK", "task")
    import keras
    import numpy as np
    import tensorflow as tf

    import tfdist

    start = _status("self")
    Path(pid_dir, f"{name}.json").write_text(json.dumps({"pid": os.getpid(), "start": start}))
    if ps_extra_bytes is not None and name.startswith("ps-"):
        import resource

        limit = start["VmSize"] + ps_extra_bytes
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        print(f"{name}: address space limited to {limit / MiB:.0f} MiB (RLIMIT_AS, "
              f"{ps_extra_bytes / MiB:.0f} MiB above its start)", flush=True)
    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=256 << 10, max_shards=num_ps)
    strategy = tfdist.ParameterServerStrategy(variable_partitioner=partitioner)

    class ShardedLookup(keras.layers.Embedding):
        """Keras' Embedding, looked up shard by shard on the ps (TF's partitioned lookup)."""

        def call(self, inputs):
            table = self.embeddings.value  # the ShardedVariable
            return tf.nn.embedding_lookup(getattr(table, "variables", table), inputs)

    rng = np.random.default_rng(0)
    x = rng.integers(0, rows, size=(8192, 1)).astype("int32")
    y = rng.normal(size=(8192, 1)).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch)
    layer = ShardedLookup if lookup == "sharded" else keras.layers.Embedding
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((1,), dtype="int32"), layer(rows, dim),
                                  keras.layers.Flatten(), keras.layers.Dense(1)])
        model.compile(keras.optimizers.Adam(1e-3), loss="mse")
    tasks = {p.stem: json.loads(p.read_text()) for p in Path(pid_dir).glob("*.json")}
    built = {n: _status(t["pid"]) for n, t in tasks.items()}  # the table exists
    with strategy.scope():
        model.optimizer.build(model.trainable_variables)  # Adam's slots, before any step
    slots_built = {n: _status(t["pid"]) for n, t in tasks.items()}
    t0 = time.perf_counter()
    model.fit(dataset, epochs=1, steps_per_epoch=warmup, verbose=0)
    warm = time.perf_counter() - t0
    t0 = time.perf_counter()
    history = model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0)
    seconds = time.perf_counter() - t0
    end = {n: _status(t["pid"]) for n, t in tasks.items()}
    table = model.layers[0].embeddings

    def layout(variable):
        parts = getattr(variable.value, "variables", None) or [variable.value]
        return [[p.device, list(p.shape)] for p in parts]

    slots = [v for v in model.optimizer.variables if table.path.replace("/", "_") in v.path]
    return {"tasks": {n: {"pid": t["pid"], "start": t["start"], "built": built[n],
                          "slots_built": slots_built[n], "end": end[n]}
                      for n, t in tasks.items()},
            "table_layout": layout(table),
            "slot_layouts": {v.path: layout(v) for v in slots},
            "steps": steps, "seconds": seconds, "warmup_seconds": warm,
            "steps_per_s": steps / seconds, "loss": float(history.history["loss"][-1]),
            "iterations": int(model.optimizer.iterations.numpy())}


# ---- the runs -----------------------------------------------------------------------------

def run_job(cfg, num_ps, rows, lookup="keras", timeout=900.0, ps_extra_bytes=None,
            stream=None):
    """Launches one job; returns the chief's measurements."""
    import tfdist

    with tempfile.TemporaryDirectory(prefix="tfdist-bench-pids-") as pid_dir:
        values = tfdist.launch(_task, rows, cfg["dim"], cfg["workers"], cfg["batch"],
                               cfg["warmup"], cfg["steps"], num_ps, pid_dir, lookup,
                               ps_extra_bytes, workers=cfg["workers"], chief=True,
                               ps=num_ps, timeout=timeout, env=task_env(), stream=stream)
    return values[0]


def _role(task: str) -> str:
    return task.split("-")[0]


def summarize(run: dict, cfg: dict, baseline: dict | None) -> dict:
    """Per process: peak RSS, net of the baseline of its role, and the ratios."""
    table = cfg["rows"] * cfg["dim"] * 4
    state = 3 * table  # table + Adam's two slots
    base = {}
    if baseline:
        for task, t in baseline["tasks"].items():
            base.setdefault(_role(task), t["end"]["VmHWM"])
    out = {}
    for task, t in sorted(run["tasks"].items()):
        peak = t["end"]["VmHWM"]
        row = {"peak": peak, "start": t["start"]["VmRSS"], "after_table": t["built"]["VmHWM"],
               "after_slots": t["slots_built"]["VmHWM"], "rss_end": t["end"]["VmRSS"]}
        ref = base.get(_role(task), t["start"]["VmRSS"])
        row["baseline"] = ref
        row["net"] = peak - ref
        row["net_over_table"] = row["net"] / table
        row["net_over_state"] = row["net"] / state
        out[task] = row
    return out


def ratios(results: dict) -> dict:
    """The goal ratios of every run: the largest ps net peak / (table + slots), and the
    largest chief or worker net peak / table."""
    out = {}
    for label, r in results.items():
        procs = r["processes"]
        ps = [p["net_over_state"] for n, p in procs.items() if n.startswith("ps")]
        copy = {n: p["net_over_table"] for n, p in procs.items() if not n.startswith("ps")}
        worst = max(copy, key=copy.get)
        out[label] = {"ps_over_state": max(ps), "copy_over_table": copy[worst],
                      "copy_task": worst}
    return out


def memory_limit_run(cfg, baseline, timeout):
    """The job with 1 ps whose address space may grow by less than table + slots.

    The limit is the ps's address-space growth in the baseline run (threads, buffers:
    virtual memory that the table does not need) plus 0.5 x (table + slots).
    """
    import tfdist

    table = cfg["rows"] * cfg["dim"] * 4
    ps0 = baseline["tasks"]["ps-0"]
    overhead = max(0, ps0["end"]["VmPeak"] - ps0["start"]["VmSize"])
    extra = overhead + int(0.5 * 3 * table)
    log = io.StringIO()
    started = time.perf_counter()
    result = {"limit_above_start": extra, "baseline_growth": overhead,
              "state_bytes": 3 * table}
    try:
        value = run_job(cfg, 1, cfg["rows"], timeout=timeout, ps_extra_bytes=extra,
                        stream=log)
        result.update(outcome="trained", steps_per_s=value["steps_per_s"])
    except tfdist.LaunchError as error:
        result.update(outcome="failed", launcher_error=str(error), task=error.task,
                      returncode=error.returncode,
                      task_tail=(error.output_tail or "")[-3000:])
    result["seconds"] = time.perf_counter() - started
    lines = log.getvalue().splitlines()
    result["ps_lines"] = [ln for ln in lines if ln.startswith("[ps-0]")][-15:]
    result["chief_lines"] = [ln for ln in lines if ln.startswith("[chief-0]")
                             and ("Error" in ln or "error" in ln)][-6:]
    return result


# ---- report -------------------------------------------------------------------------------

def _task_of(device: str) -> str:
    """``ps-1`` for ``/job:ps/replica:0/task:1/device:CPU:0``."""
    parts = dict(p.split(":", 1) for p in device.strip("/").split("/") if ":" in p)
    return f"{parts.get('job', '?')}-{parts.get('task', '0')}"


def _mb(n) -> str:
    return f"{n / MiB:,.0f}"


def goal_rows(data: dict) -> list[list[str]]:
    """The rows of the two goals of docs/benchmarks.md for this run."""
    from benchmarks.goals import goal

    rows = []
    ps_goal, copy_goal = goal("sharded-embedding-ps"), goal("sharded-embedding-copy")
    for label, r in data["ratios"].items():
        if label.startswith("2 ps"):
            rows.append([f"`sharded-embedding-ps` ({label}): largest ps net peak / "
                         "(table + slots)", ps_goal.target, f"{r['ps_over_state']:.2f}",
                         ps_goal.status(r["ps_over_state"])])
        rows.append([f"`sharded-embedding-copy` ({label}): largest chief/worker net peak "
                     f"/ table ({r['copy_task']})", copy_goal.target,
                     f"{r['copy_over_table']:.2f}", copy_goal.status(r["copy_over_table"])])
    return rows


def report(data: dict) -> str:
    cfg = data["settings"]
    table = data["table_bytes"]
    lines = [f"# {TITLE}", "",
             f"Command: `{data['command']}`", ""]
    if cfg["rows"] < 1_000_000:
        lines += ["A smoke run (--quick): the table is tiny, so the ratios below are "
                  "TensorFlow's own overhead, not the table's.", ""]
    lines += [
             f"Table: {cfg['rows']:,} x {cfg['dim']} float32 = {_mb(table)} MiB; Adam's two "
             f"slots {_mb(2 * table)} MiB; table + slots {_mb(3 * table)} MiB. Keras `fit` "
             f"(async), 1 chief + {cfg['workers']} worker(s) + P ps on this machine, batch "
             f"{cfg['batch']} random ids, {cfg['steps']} timed steps after "
             f"{cfg['warmup']} warm-up steps. Load average (1 min) before/after: "
             f"{data['load_average_1min']['before']} / {data['load_average_1min']['after']}.",
             "",
             "Peak RSS is `VmHWM` of each process at the end of training; the *table built* "
             "and *slots built* columns are `VmHWM` once the model is built and once "
             "`model.optimizer.build` has made Adam's slots (before any step); *RSS at end* "
             "is `VmRSS` after the last step. *Net* is a value minus the peak of the same "
             "role in "
             + ("a baseline run of the same cluster with a "
                f"{BASELINE_ROWS}-row table" if data.get("baseline") else
                "the process at its start (no baseline run in --quick)") + ".", ""]
    rows = [["run", "process", "peak RSS MiB", "net MiB", "net / table",
             "net / (table + slots)", "net peak: table built", "+ slots built",
             "net RSS at end"]]
    for label, r in data["results"].items():
        for task, p in r["processes"].items():
            rows.append([label, task, _mb(p["peak"]), _mb(p["net"]),
                         f"{p['net_over_table']:.2f}", f"{p['net_over_state']:.2f}",
                         _mb(p["after_table"] - p["baseline"]),
                         _mb(p["after_slots"] - p["baseline"]),
                         _mb(p["rss_end"] - p["baseline"])])
    lines += [markdown_table(rows), ""]
    rows = [["run", "steps/s", "vs first run", "table shards", "slot shards (each slot)"]]
    first = next(iter(data["results"].values()))["steps_per_s"]
    for label, r in data["results"].items():
        shards = ", ".join(f"{_task_of(d)} {s[0]:,} rows" for d, s in r["table_layout"])
        slot = next(iter(r["slot_layouts"].values()), [])
        slots = ", ".join(_task_of(d) for d, _ in slot)
        rows.append([label, f"{r['steps_per_s']:.2f}", f"{r['steps_per_s'] / first:.2f}x",
                     shards, f"{slots} ({len(r['slot_layouts'])} slots)"])
    lines += [markdown_table(rows), ""]
    lines += ["Goals (docs/benchmarks.md):", "", markdown_table(
        [["goal", "target", "measured", "status"]] + data["goal_rows"]), ""]
    lines += [f"![peak RSS per process]({NAME}.png)", ""]
    lines += _analysis(data)
    limit = data.get("memory_limit")
    if limit:
        lines += ["", "### A table bigger than one ps's memory", "",
                  f"The same job with 1 ps, whose address space may grow by "
                  f"{_mb(limit['limit_above_start'])} MiB after start-up "
                  f"(`resource.setrlimit(RLIMIT_AS)` in the ps task, as `ulimit -v` does): "
                  f"the baseline ps grew by {_mb(limit['baseline_growth'])} MiB of address "
                  f"space without the table, plus half of table + slots "
                  f"({_mb(limit['state_bytes'])} MiB).", ""]
        if limit["outcome"] == "failed":
            first = limit["launcher_error"].splitlines()[0]
            lines += [f"Outcome: the job failed after {limit['seconds']:.0f} s, while the "
                      "model was being built (before `fit`). The launcher raised "
                      f"`tfdist.LaunchError` naming `{limit['task']}` (exit code "
                      f"{limit['returncode']}): `{first}`, followed by that task's "
                      "traceback. The ps itself did not fail: TensorFlow returned the "
                      "allocation failure to the chief, whose error names the ps device "
                      "and the shape (the launcher's message does not name the ps: read "
                      "`/job:ps/replica:0/task:N` in the chief's error):", ""]
        else:
            lines += [f"Outcome: the job trained ({limit['steps_per_s']:.2f} steps/s).", ""]
        if limit.get("chief_lines"):
            lines += ["The chief's error (end of its traceback):", "", "```",
                      *[ln[:600] for ln in limit["chief_lines"]], "```", ""]
        if limit.get("ps_lines"):
            lines += ["What ps-0 printed (last lines):", "", "```",
                      *[ln[:300] for ln in limit["ps_lines"]], "```", ""]
        lines += limit.get("notes", [])
    return "\n".join(lines).rstrip() + "\n"


def _analysis(data: dict) -> list[str]:
    """Where the memory goes, from this run's numbers."""
    out = []
    for label, r in data["results"].items():
        procs = r["processes"]
        ps = {n: p for n, p in procs.items() if n.startswith("ps")}
        others = {n: p for n, p in procs.items() if not n.startswith("ps")}
        out.append(f"- {label}: each ps net " + ", ".join(
            f"{n} {p['net_over_state']:.2f}" for n, p in ps.items())
            + " x (table + slots); " + ", ".join(
            f"{n} {p['net_over_table']:.2f}" for n, p in others.items()) + " x table.")
    return ["Where the memory goes (net peaks):", ""] + out + [""] + data.get("notes", [])


def plot(data: dict, path) -> None:
    """Bars: peak RSS of every process per run, against table + slots."""
    plt = pyplot()
    labels = list(data["results"])
    fig, axes = plt.subplots(1, len(labels), figsize=(4.2 * len(labels), 4), sharey=True,
                             squeeze=False)
    state = 3 * data["table_bytes"] / MiB
    for ax, label in zip(axes[0], labels):
        procs = data["results"][label]["processes"]
        names = list(procs)
        ax.bar(names, [procs[n]["peak"] / MiB for n in names], color="#9bb7d4",
               label="peak RSS")
        ax.bar(names, [max(0, procs[n]["net"]) / MiB for n in names], color="#2f5d8a",
               width=0.5, label="net of baseline")
        ax.axhline(state, color="#c0392b", ls="--", label="table + slots")
        ax.axhline(data["table_bytes"] / MiB, color="#e67e22", ls=":", label="table")
        ax.set_title(label, fontsize=9)
        ax.tick_params(axis="x", rotation=45, labelsize=8)
    axes[0][0].set_ylabel("MiB")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Peak RSS per process, {_mb(data['table_bytes'])} MiB table + Adam",
                 fontsize=10)
    save_figure(fig, path)


def main(argv=None) -> dict:
    parser = section_parser(f"benchmarks.{NAME}", __doc__)
    parser.add_argument("--timeout", type=float, default=900,
                        help="seconds per launch before its processes are killed")
    args = parse_section_args(parser, argv)
    cfg = settings(args.quick)
    command = f".venv/bin/python -m benchmarks.{NAME}" + (" --quick" if args.quick else "")
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    table = cfg["rows"] * cfg["dim"] * 4
    print(f"[{NAME}] table {_mb(table)} MiB, table + Adam slots {_mb(3 * table)} MiB, "
          f"{cfg['workers']} worker(s)", flush=True)
    baseline = None
    if cfg["baseline"]:
        t0 = time.perf_counter()
        baseline = run_job(dict(cfg, rows=BASELINE_ROWS), 2, BASELINE_ROWS,
                           timeout=args.timeout)
        print(f"[{NAME}] baseline ({BASELINE_ROWS} rows, 2 ps): " + ", ".join(
            f"{n} {_mb(t['end']['VmHWM'])} MiB" for n, t in sorted(baseline["tasks"].items()))
            + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
    # --quick: the 2-ps job only (every launch costs TensorFlow start-ups).
    jobs = [("2 ps", 2, "keras")] if args.quick else [("1 ps", 1, "keras"), ("2 ps", 2, "keras")]
    if cfg["lookup_variant"]:
        jobs.append(("2 ps, tf.nn.embedding_lookup", 2, "sharded"))
    results = {}
    for label, num_ps, lookup in jobs:
        t0 = time.perf_counter()
        run = run_job(cfg, num_ps, cfg["rows"], lookup, timeout=args.timeout)
        run["processes"] = summarize(run, cfg, baseline)
        results[label] = run
        print(f"[{NAME}] {label}: {run['steps_per_s']:.2f} steps/s; peak RSS MiB " + ", ".join(
            f"{n} {_mb(p['peak'])} (net {_mb(p['net'])})" for n, p in run["processes"].items())
            + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
    data = {"command": command, "settings": cfg, "table_bytes": table,
            "state_bytes": 3 * table, "baseline": baseline, "results": results,
            "ratios": ratios(results),
            # machine_info imports TensorFlow and Horovod here: seconds a smoke run skips
            "machine": {"cpus": os.cpu_count()} if args.quick else machine_info()}
    data["goal_rows"] = goal_rows(data)
    data["notes"] = notes(data)
    if cfg["memory_limit"]:
        t0 = time.perf_counter()
        data["memory_limit"] = memory_limit_run(cfg, baseline, args.timeout)
        print(f"[{NAME}] 1 ps with a memory limit: {data['memory_limit']['outcome']}"
              + (f" ({data['memory_limit'].get('task')}: "
                 f"{str(data['memory_limit'].get('launcher_error', ''))[:300]})"
                 if data["memory_limit"]["outcome"] == "failed" else "")
              + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
    data["load_average_1min"] = {"before": round(load_before, 2),
                                 "after": round(os.getloadavg()[0], 2)}
    data["seconds"] = time.perf_counter() - started
    data["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    markdown = report(data)
    write_section(args.output, NAME, markdown, data)
    plot(data, args.output / f"{NAME}.png")
    print(f"[{NAME}] wrote {args.output / NAME}.{{md,json,png}} "
          f"({data['seconds']:.0f} s)", flush=True)
    return data


def notes(data: dict) -> list[str]:
    """Where the memory goes, in words, with this run's ratios (full runs only)."""
    res = data["results"]
    one, two = res.get("1 ps"), res.get("2 ps")
    look = res.get("2 ps, tf.nn.embedding_lookup")
    if data["settings"]["rows"] < 1_000_000 or not (one and two):
        return []
    table, state = data["table_bytes"], data["state_bytes"]

    def net(run, task, key):
        p = run["processes"][task]
        return (p[key] - p["baseline"]) / table

    worker = max(p["net_over_table"] for n, p in two["processes"].items()
                 if n.startswith("worker"))
    out = [
        f"- **Creating the table**: the chief's net peak is "
        f"{net(two, 'chief-0', 'after_table'):.2f} x table with 2 ps "
        f"({net(one, 'chief-0', 'after_table'):.2f} x with 1 ps). Under a partitioner tfdist "
        "passes `shape=` to the `tf.Variable` Keras creates, so TF runs the initializer "
        "inside each shard's creation, on its ps, and each ps draws only its own rows "
        "(`tfdist._hooks.sharded.initialization.initial_rows`: TF's Philox counter advanced to the shard's first "
        "row, so the values are the unsharded table's, bit for bit). ps-0 is at "
        f"{net(two, 'ps-0', 'after_table'):.2f} x table after creation with 2 ps (the "
        "shard, and its draw, scale and shift made one after the other in eager mode).",
        "- **Adam's slots** add nothing to any peak (the *slots built* column equals *table "
        "built*): they fit in memory freed after the table was created. They are sharded "
        "like the table (the shards table above).",
        f"- **The ps during `fit`**: ps-0's net peak goes from "
        f"{net(one, 'ps-0', 'after_slots') * table / state:.2f} to "
        f"{one['processes']['ps-0']['net_over_state']:.2f} x (table + slots) with 1 ps, and "
        f"from {net(two, 'ps-0', 'after_slots') * table / state:.2f} to "
        f"{two['processes']['ps-0']['net_over_state']:.2f} with 2 ps. Keras' Adam update is "
        "dense (every row's moments decay every step): `m += (g - m)(1 - beta_1)`, "
        "`v += (g^2 - v)(1 - beta_2)`, `w -= alpha m / (sqrt(v) + eps)`. On a whole "
        "variable that makes several variable-sized temporaries: that is the 1-ps run, "
        "whose table is one variable. A shard of a sharded variable is updated in blocks "
        "of 16 MiB of rows, one after the other (`tfdist._hooks.sharded.row_blocks.UPDATE_BLOCK_BYTES`: "
        "gather, Keras' own `update_step`, scatter; each row's result is the whole "
        "shard's, bit for bit), so its temporaries are a block's. What is left above "
        "half of table + slots is those blocks and the update's graph on the ps. The "
        "allocator keeps the memory it used (*RSS at end* equals the peak).",
        f"- **The workers** hold at most {worker:.2f} x table (2 ps), and no copy of it: "
        "with a sharded table tfdist's `Embedding` looks ids up shard by shard (TF's "
        "partitioned `embedding_lookup`), so only the batch's rows leave the ps. What they "
        "hold is the step's function, which carries the blocked update of each shard (a "
        "worker prepares the ps' parts of the function it runs). With 1 ps the table is "
        "one variable and Keras' `Embedding` still reads it whole on each worker every step "
        f"({max(p['net_over_table'] for n, p in one['processes'].items() if n.startswith('worker')):.2f} x table).",
    ]
    if look:
        worker = max(p["net_over_table"] for n, p in look["processes"].items()
                     if n.startswith("worker"))
        out.append(
            f"- **Looking up shard by shard** (`tf.nn.embedding_lookup(table.variables, ids)` "
            f"in a subclass of `Embedding`: the gather runs on each ps and only the batch's "
            f"rows move) the workers' net peak is {worker:.2f} x table and steps/s is "
            f"{look['steps_per_s'] / two['steps_per_s']:.2f} x that of Keras' `Embedding` "
            "(2 ps both). The chief and the ps are unchanged: their peaks come from "
            "creating the table and from Adam.")
    return out


if __name__ == "__main__":
    sys.exit(main() and 0)
