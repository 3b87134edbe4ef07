"""The goals against the measured ratios, for RESULTS.md: `goal_rows` takes the ratios
from the sections' JSON and compares them with the goals of docs/benchmarks.md
(`benchmarks.goals`)."""

from __future__ import annotations

from benchmarks.common import load_json
from benchmarks.goals import Goal, read_analysis, read_goals


def _why_missing(results, name) -> str:
    r = results.get(name) or {}
    if r.get("status") in ("skipped", "failed"):
        return f"{r['status']}: {r.get('why', '')}"
    return "not in the section's results"


def goal_rows(results: dict) -> tuple[list[list[str]], list[str]]:
    """The goals against the measured ratios: table rows, and why missed goals were missed.

    Args:
        results: Section name -> the runner's result (``status``, ``json`` path).

    Returns:
        Rows ``[measurement, target, measured, status]`` and Markdown bullets.
    """
    goals, analysis = read_goals(), read_analysis()
    data = {name: load_json(r.get("json")) if r.get("status") == "ok" else None
            for name, r in results.items()}
    rows: list[list[str]] = []
    notes: list[str] = []
    _overhead(goals["overhead"], analysis, data, results, rows, notes)
    _allreduce(goals["allreduce"], analysis, data, results, rows, notes)
    _slow_link(goals["slow_link"], analysis, data, results, rows, notes)
    _diloco(goals, analysis, data, results, rows, notes)
    _engines(goals["engines-fit"], goals["engines-allreduce"], analysis, data, results, rows,
             notes)
    _straggler(goals["straggler"], analysis, data, results, rows, notes)
    _sharded_embedding(goals["sharded-embedding-ps"], goals["sharded-embedding-copy"],
                       analysis, data, results, rows, notes)
    _zero(goals, analysis, data, results, rows, notes)
    _elastic(goals, analysis, data, results, rows, notes)
    _declared(goals, analysis, data, rows, notes)
    return rows, notes


def _declared(goals, analysis, data, rows, notes):
    """Rows for goals a section declares in its JSON: ``"goal_values": {goal id:
    {label: value}}`` (a --quick run declares none: ``"goal_values_missing": why``)."""
    for name, section in sorted((n, d) for n, d in data.items() if d):
        if section.get("goal_values_missing"):
            rows.append([f"{name}: every goal", "-", "not measured",
                         section["goal_values_missing"]])
        for goal_id, values in (section.get("goal_values") or {}).items():
            goal_ = goals[goal_id]
            missed = []
            for label, value in values.items():
                if value is None:
                    rows.append([f"{name}: {label}", goal_.target, "not measured", "-"])
                    continue
                rows.append([f"{name}: {label}", goal_.target, f"{value:.2f}",
                             goal_.status(value)])
                if not goal_.is_met(value):
                    missed.append(f"{label}: {value:.2f}")
            if missed:
                notes.append(f"- {goal_.what} ({'; '.join(missed)}). "
                             + analysis.get(goal_id, ""))


def _overhead(goal_, analysis, data, results, rows, notes):
    overhead = data.get("overhead") or {}
    mirrored = data.get("mirrored") or {}
    checks = [
        ("MirroredStrategy, same cross-device ops", overhead.get("mirrored_ratio")),
        ("MirroredStrategy, same cross-device ops (mirrored section)",
         mirrored.get("overhead_ratio_same_ops")),
        ("MirroredStrategy default (ReductionToOneDevice + byte counter) vs stock with "
         "ReductionToOneDevice", overhead.get("mirrored_ratio_default")),
        ("MultiWorkerMirroredStrategy, 2 workers", overhead.get("multi_worker_ratio"))]
    for label, value in checks:
        if value is None:
            if "mirrored section" not in label:
                rows.append([f"overhead: {label}", goal_.target, "not measured",
                             _why_missing(results, "overhead")])
            continue
        rows.append([f"overhead: {label}", goal_.target, f"{value:.3f}",
                     goal_.status(value, 3)])
        if goal_.is_met(value):
            continue
        if label.startswith("MultiWorker"):
            notes.append(_multi_worker_note(overhead, value, goal_, analysis))
        else:
            notes.append(f"- Overhead ({label}) {value:.3f}. "
                         + analysis["overhead-mirrored"])
    no_timeout = overhead.get("multi_worker_ratio_no_timeout")
    if no_timeout is not None:
        rows.append(["(overhead: MultiWorkerMirroredStrategy(collective_timeout=None))",
                     goal_.target, f"{no_timeout:.3f}", goal_.status(no_timeout, 3)])


def _multi_worker_note(overhead: dict, value: float, goal_: Goal, analysis) -> str:
    samples = overhead.get("multi_worker_samples") or {}
    threads = overhead.get("multi_worker_threads_per_step") or {}
    no_timeout = overhead.get("multi_worker_ratio_no_timeout")
    spread = "; ".join(f"{k}: {min(v) * 1e3:.1f}-{max(v) * 1e3:.1f} ms" for k, v in
                       samples.items() if v)
    text = (f"- Overhead (MultiWorkerMirroredStrategy) {value:.3f}. Per-block step times: "
            f"{spread}.")
    if no_timeout is None or no_timeout >= value:
        return text + " " + analysis["overhead-multi-worker"]
    text += (f" Without `collective_timeout=300` the ratio is {no_timeout:.3f}; OS threads "
             "gained per step: " + ", ".join(f"{k}: {v:+.2f}" for k, v in threads.items())
             + " threads per step. " + analysis["overhead-collective-timeout"])
    stock, bare = samples.get("stock"), samples.get("tfdist, no collective timeout")
    if not goal_.is_met(no_timeout) and stock and bare and min(bare) <= max(stock):
        text += (f" The remaining {no_timeout:.3f} (no timeout vs stock) is within the "
                 "spread: their per-block times overlap.")
    return text


def _allreduce(goal_, analysis, data, results, rows, notes):
    seconds = (data.get("allreduce") or {}).get("seconds") or {}
    ring, bound, hvd = (seconds.get("TF gRPC ring") or {}, seconds.get("loopback bound") or {},
                        seconds.get("Horovod/Gloo") or {})
    sizes = sorted((int(s) for s in ring if s in bound), reverse=True)
    if not sizes:
        rows.append(["multi-worker all-reduce 64 MB / loopback TCP bound", goal_.target,
                     "not measured", _why_missing(results, "allreduce")])
        return
    size = str(sizes[0])
    label = f"{sizes[0] / 2**20:g} MB" if sizes[0] >= 2**20 else f"{sizes[0] / 1024:g} KB"
    ratio = ring[size] / bound[size]
    rows.append([f"multi-worker all-reduce {label} / loopback TCP bound", goal_.target,
                 f"{ratio:.1f}x", goal_.status(ratio, 1)])
    hvd_ratio = hvd[size] / bound[size] if size in hvd else None
    if hvd_ratio is not None:
        rows.append([f"(Horovod/Gloo all-reduce {label} / loopback TCP bound)", goal_.target,
                     f"{hvd_ratio:.1f}x", goal_.status(hvd_ratio, 1)])
    if goal_.is_met(ratio):
        return
    note = (f"- All-reduce {label}: TF's gRPC ring {ring[size] * 1e3:.0f} ms against a "
            f"loopback TCP bound of {bound[size] * 1e3:.0f} ms ({ratio:.1f}x)")
    if hvd_ratio is not None:
        note += (f"; Horovod/Gloo {hvd[size] * 1e3:.0f} ms = {hvd_ratio:.1f}x the bound in "
                 "the same run")
    note += ". " + analysis["allreduce"]
    if hvd_ratio is not None and not goal_.is_met(hvd_ratio):
        note += " " + analysis["allreduce-gloo"]
    notes.append(note)


def _engines(fit_goal, allreduce_goal, analysis, data, results, rows, notes):
    summary = (data.get("engines") or {}).get("summary") or {}
    ratios = summary.get("ratios") or {}
    fit = ratios.get('engine="horovod" / engine="tf"')
    if fit is None:
        rows.append(['engines: engine="horovod" step / engine="tf" step in fit',
                     fit_goal.target, "not measured", _why_missing(results, "engines")])
    else:
        rows.append(['engines: engine="horovod" step / engine="tf" step in fit',
                     fit_goal.target, f"{fit:.2f}", fit_goal.status(fit)])
        if not fit_goal.is_met(fit):
            notes.append(f"- Engines in fit {fit:.2f}. " + analysis["engines-fit"])
    for label, value in (summary.get("allreduce_vs_two_streams") or {}).items():
        if not label.startswith("engine="):
            continue
        rows.append([f"engines: 64 MB all-reduce, {label} / two streams",
                     allreduce_goal.target, f"{value:.2f}x", allreduce_goal.status(value)])
        if not allreduce_goal.is_met(value):
            notes.append(f"- All-reduce 64 MB, {label}: {value:.2f}x the two-stream bound. "
                         + analysis["engines-allreduce"])


def _slow_link(goal_, analysis, data, results, rows, notes):
    slow = data.get("slow_link") or {}
    res = slow.get("results") or {}
    measured = False
    for key, label in (("", "digits CNN"), ("wide_", "wide digits CNN, dense 512")):
        speedup = res.get(f"{key}speedup_period16")
        if speedup is None:
            continue
        measured = True
        rows.append([f"model average period=16 vs sync, 100 Mbit/s ({label})",
                     f"{goal_.target}x", f"{speedup:.2f}x", goal_.status(speedup, 2)])
        sync, p16 = res.get(f"{key}sync", {}), res.get(f"{key}period=16", {})
        if goal_.is_met(speedup) or not (sync and p16):
            continue
        steps = slow.get("steps") or 28
        t_sync, t_16 = sync["epoch_seconds"] / steps, p16["epoch_seconds"] / steps
        # Per step: t_sync = rest + comm and t_16 = rest + comm / 16.
        comm = max(0.0, (t_sync - t_16) * 16 / 15)
        rest = max(1e-9, t_sync - comm)
        sent = sync["wire_tx_bytes_per_step"]
        notes.append(
            f"- Slow link ({label}): sync {sync['epoch_seconds']:.2f} s/epoch vs period=16 "
            f"{p16['epoch_seconds']:.2f} s/epoch. Sync sends {sent / 1e3:.0f} KB per step "
            f"per worker ({sent * 8 / 100e6 * 1e3:.0f} ms at 100 Mbit/s). Solving the two "
            f"step times gives comm = {comm * 1e3:.0f} ms and rest = {rest * 1e3:.0f} ms, "
            f"so the speed-up is at most {t_sync / rest:.1f}x. " + analysis["slow_link"])
    if not measured:
        rows.append(["model average period=16 vs sync, 100 Mbit/s", f"{goal_.target}x",
                     "not measured", _why_missing(results, "slow_link")])


def _diloco(goals, analysis, data, results, rows, notes):
    """Streaming DiLoCo on the slow link: bytes, accuracy, largest exchange, hidden sync."""
    res = (data.get("slow_link") or {}).get("results") or {}
    sync, int4 = res.get("sync", {}), res.get("streaming int4", {})
    p16, streaming, local = (res.get("period=16", {}), res.get("streaming", {}),
                             res.get("local", {}))
    measured = {
        "diloco-wire": ("wire_tx_bytes_per_step", sync, int4,
                        lambda a, b: a / b, "{:.0f}x"),
        "diloco-accuracy": ("test_accuracy", sync, int4,
                            lambda a, b: 100 * (a - b), "{:.1f} points"),
        "diloco-largest": ("payload_max_step_bytes", streaming, p16,
                           lambda a, b: a / b, "{:.2f}"),
        "diloco-hidden": ("epoch_seconds", streaming, local, lambda a, b: a / b, "{:.2f}"),
    }
    for goal_id, (key, top, bottom, ratio, fmt) in measured.items():
        goal_ = goals[goal_id]
        label = f"slow link, {goal_id}: {goal_.what.split(' (section')[0]}"
        if key not in top or key not in bottom:
            rows.append([label, goal_.target, "not measured",
                         _why_missing(results, "slow_link")])
            continue
        value = ratio(top[key], bottom[key])
        rows.append([label, goal_.target, fmt.format(value), goal_.status(value)])
        if not goal_.is_met(value) and goal_id in analysis:
            notes.append(f"- {goal_id}: {fmt.format(value)}. " + analysis[goal_id])


def _straggler(goal_, analysis, data, results, rows, notes):
    section = data.get("straggler") or {}
    label = "straggler: fast worker's inner step with a 3x slower peer / alone, period=16"
    ratio = section.get("ratio_period16")
    if ratio is None:
        rows.append([label, goal_.target, "not measured", _why_missing(results, "straggler")])
        return
    rows.append([label, goal_.target, f"{ratio:.2f}", goal_.status(ratio)])
    if not goal_.is_met(ratio):
        notes.append(f"- Straggler {ratio:.2f} (sync in the same run: "
                     f"{section.get('ratio_sync', float('nan')):.2f}). " + analysis["straggler"])


def _sharded_embedding(ps_goal, copy_goal, analysis, data, results, rows, notes):
    """Rows for ``sharded-embedding-ps`` (2 ps) and ``sharded-embedding-copy`` (every run)
    from the ``ratios`` of section ``sharded_embedding``; one note per missed goal."""
    section = data.get("sharded_embedding") or {}
    measured = section.get("ratios") or {}
    if not measured or (section.get("settings") or {}).get("rows", 0) < 1_000_000:
        why = ("a --quick run (tiny table)" if measured else
               _why_missing(results, "sharded_embedding"))
        for goal_ in (ps_goal, copy_goal):
            rows.append([f"sharded embedding: {goal_.what.split(',')[0]}", goal_.target,
                         "not measured", why])
        return
    table_mb = section.get("table_bytes", 0) / 1e6
    missed = {"ps": [], "copy": []}
    for label, r in measured.items():
        name = f"sharded embedding {table_mb:.0f} MB + Adam, {label}"
        if label.startswith("2 ps"):
            value = r["ps_over_state"]
            rows.append([f"{name}: largest ps net peak RSS / (table + slots)",
                         ps_goal.target, f"{value:.2f}", ps_goal.status(value)])
            if not ps_goal.is_met(value):
                missed["ps"].append(f"{label}: {value:.2f}")
        value = r["copy_over_table"]
        rows.append([f"{name}: largest chief/worker net peak RSS / table ({r['copy_task']})",
                     copy_goal.target, f"{value:.2f}", copy_goal.status(value)])
        if not copy_goal.is_met(value):
            missed["copy"].append(f"{label}: {r['copy_task']} {value:.2f}")
    if missed["ps"]:
        notes.append("- Sharded embedding, largest ps net peak / (table + slots) ("
                     + "; ".join(missed["ps"]) + "). "
                     + analysis.get("sharded-embedding-ps", ""))
    if missed["copy"]:
        notes.append("- Sharded embedding, chief/worker net peak / table ("
                     + "; ".join(missed["copy"]) + "). "
                     + analysis.get("sharded-embedding-copy", ""))


# goal id -> (ratio key in section zero's "ratios", what is shown, the worker counts)
_ZERO_GOALS = {
    "zero-optimizer": ("optimizer_bytes_times_n", "optimizer bytes sharded / unsharded x N",
                       None),
    "zero-model-state": ("model_state", "model state sharded / unsharded", ("4",)),
    "zero-step": ("step_time", "step time sharded / unsharded", None),
    "zero-wire": ("wire_bytes", "ring wire bytes per step sharded / unsharded", None),
}


def _zero(goals, analysis, data, results, rows, notes):
    """Rows for the ``zero-*`` goals from the ``ratios`` of section ``zero``."""
    section = data.get("zero") or {}
    measured = section.get("ratios") or {}
    quick = (section.get("settings") or {}).get("width", 0) < 2048
    for goal_id, (key, what, counts) in _ZERO_GOALS.items():
        goal_ = goals[goal_id]
        if not measured or quick:
            rows.append([f"ZeRO: {what}", goal_.target, "not measured",
                         "a --quick run (small model)" if measured else
                         _why_missing(results, "zero")])
            continue
        missed = []
        for n, ratios in measured.items():
            if counts and n not in counts:
                continue
            value = ratios[key]
            rows.append([f"ZeRO, {n} workers ({section.get('engine')}): {what}", goal_.target,
                         f"{value:.2f}", goal_.status(value)])
            if not goal_.is_met(value):
                missed.append(f"{n} workers: {value:.2f}")
        if missed:
            notes.append(f"- ZeRO, {what} ({'; '.join(missed)}). "
                         + analysis.get(goal_id, ""))


_ELASTIC_GOALS = {  # goal id -> (key in the section's ratios, label, digits)
    "elastic-next-step": ("next_step_seconds", "kill -> next completed step (s)", 2),
    "elastic-steps-lost": ("steps_lost_per_k", "steps lost / k, commit every k=5", 2),
    "elastic-work-lost": ("work_lost_ratio", "task-steps lost, restart-and-resume / "
                          "elastic", 1),
    "elastic-commit": ("commit_ratio", "step committing every step / once per epoch", 3),
}


def _elastic(goals, analysis, data, results, rows, notes):
    """Rows for the ``elastic-*`` goals from the ``ratios`` of section ``elastic``."""
    measured = (data.get("elastic") or {}).get("ratios") or {}
    for goal_id, (key, label, digits) in _ELASTIC_GOALS.items():
        goal_, value = goals[goal_id], measured.get(key)
        if value is None:
            rows.append([f"elastic: {label}", goal_.target, "not measured",
                         "not in the section's results" if measured else
                         _why_missing(results, "elastic")])
            continue
        rows.append([f"elastic: {label}", goal_.target, f"{value:.{digits}f}",
                     goal_.status(value)])
        if not goal_.is_met(value):
            notes.append(f"- Elastic, {label}: {value:.{digits}f}. "
                         + analysis.get(goal_id, ""))
