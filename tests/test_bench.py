"""`python -m benchmarks` (and `tfdist bench`): the quick run writes RESULTS.md with every
section; the runner reports crashing and skipping sections; the goals table, read from
docs/benchmarks.md; the launcher's cluster=/wrap= options."""

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import tfdist
from benchmarks import runner
from benchmarks.goal_table import goal_rows
from benchmarks.goals import read_analysis, read_goals
from tfdist import cli
from tfdist.cluster import ClusterSpec
from tfdist.launch import run

ROOT = Path(tfdist.__file__).resolve().parents[1]


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_launch_run_takes_a_prebuilt_cluster_and_wraps_each_task():
    cluster = ClusterSpec(worker=("127.0.0.1:1111", "127.0.0.1:2222"))
    script = ("import json, os; c = json.loads(os.environ['TF_CONFIG']); "
              "print(os.environ['WRAPPED'], c['cluster']['worker'], c['task']['index'])")
    out = io.StringIO()
    result = run([sys.executable, "-c", script], cluster=cluster, timeout=30, stream=out,
                 wrap=lambda task: ["env", f"WRAPPED=wrapped-{task.name}"])
    assert result.cluster == cluster
    lines = sorted(out.getvalue().splitlines())
    assert lines == [
        "[worker-0] wrapped-worker-0 ['127.0.0.1:1111', '127.0.0.1:2222'] 0",
        "[worker-1] wrapped-worker-1 ['127.0.0.1:1111', '127.0.0.1:2222'] 1"]


@pytest.mark.unit
def test_launch_run_rejects_a_cluster_that_is_not_a_cluster_spec():
    with pytest.raises(ValueError, match="cluster must be a tfdist.ClusterSpec"):
        run([sys.executable, "-c", "pass"], cluster={"worker": ["127.0.0.1:1"]})


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_runner_reports_crashing_skipping_and_missing_sections(tmp_path, monkeypatch):
    fake = tmp_path / "checkout"
    (fake / "benchmarks").mkdir(parents=True)
    (fake / "benchmarks" / "__init__.py").write_text("")
    common = "import argparse, json, pathlib, sys\n" \
             "p = argparse.ArgumentParser(); p.add_argument('--quick', action='store_true')\n" \
             "p.add_argument('--output'); a = p.parse_args(); out = pathlib.Path(a.output)\n"
    (fake / "benchmarks" / "crash.py").write_text(
        common + "print('working'); raise RuntimeError('boom: the engine is missing')\n")
    (fake / "benchmarks" / "skip.py").write_text(
        common + "(out / 'skip.md').write_text('# Skip\\n\\nskipped: no GPU\\n')\n"
                 "(out / 'skip.json').write_text(json.dumps({'skipped': 'no GPU'}))\n")
    (fake / "benchmarks" / "fine.py").write_text(
        common + "(out / 'fine.md').write_text('# Fine\\n\\n| a |\\n|---|\\n| 1 |\\n')\n"
                 "(out / 'fine.json').write_text('{}')\n")
    (fake / "benchmarks" / "hang.py").write_text(common + "import time; time.sleep(60)\n")
    monkeypatch.setattr(runner, "ROOT", fake)
    out, logs = tmp_path / "out", tmp_path / "out" / "logs"
    logs.mkdir(parents=True)
    crash = runner.run_section("crash", True, out, 60, logs)
    assert crash["status"] == "failed"
    assert "boom: the engine is missing" in crash["why"]
    skip = runner.run_section("skip", True, out, 60, logs)
    assert (skip["status"], skip["why"]) == ("skipped", "no GPU")
    fine = runner.run_section("fine", True, out, 60, logs)
    assert fine["status"] == "ok" and fine["markdown"].endswith("fine.md")
    hang = runner.run_section("hang", True, out, 3, logs)
    assert hang["status"] == "failed" and "timed out after 3 s" in hang["why"]
    missing = runner.run_section("nothing", True, out, 60, logs)
    assert missing["status"] == "skipped" and "does not exist" in missing["why"]


@pytest.mark.unit
def test_goals_compare_the_measured_ratios_with_the_targets(tmp_path):
    def section(name, data):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(data))
        return {"status": "ok", "json": str(path)}

    mb64 = str(64 << 20)
    results = {
        "overhead": section("overhead", {
            "mirrored_ratio": 1.01, "mirrored_ratio_default": 0.4, "multi_worker_ratio": 1.06,
            "multi_worker_ratio_no_timeout": 1.0,
            "multi_worker_samples": {"stock": [0.010, 0.012], "tfdist": [0.011, 0.013]},
            "multi_worker_threads_per_step": {"stock": 0.0, "tfdist": 2.0}}),
        "allreduce": section("allreduce", {"seconds": {
            "TF gRPC ring": {mb64: 0.5}, "loopback bound": {mb64: 0.025},
            "Horovod/Gloo": {mb64: 0.075}}}),
        "slow_link": section("slow_link", {"results": {
            "speedup_period16": 3.0, "sync": {"epoch_seconds": 1.8,
                                              "wire_tx_bytes_per_step": 550e3},
            "period=16": {"epoch_seconds": 0.6, "wire_tx_bytes_per_step": 40e3,
                          "payload_max_step_bytes": 500e3},
            "streaming": {"epoch_seconds": 0.5, "payload_max_step_bytes": 140e3},
            "streaming int4": {"wire_tx_bytes_per_step": 5e3, "test_accuracy": 0.9},
            "local": {"epoch_seconds": 0.4},
            "wide_speedup_period16": 8.0}}),
        "gpu": {"status": "skipped", "why": "no GPU"},
    }
    rows, notes = goal_rows(results)
    status = {row[0]: (row[2], row[3]) for row in rows}
    assert status["overhead: MirroredStrategy, same cross-device ops"] == ("1.010", "met")
    assert status["overhead: MultiWorkerMirroredStrategy, 2 workers"] == (
        "1.060", "missed by 1.029x")
    assert status["multi-worker all-reduce 64 MB / loopback TCP bound"] == (
        "20.0x", "missed by 10.0x")
    assert status["(Horovod/Gloo all-reduce 64 MB / loopback TCP bound)"] == (
        "3.0x", "missed by 1.5x")
    assert status["model average period=16 vs sync, 100 Mbit/s (digits CNN)"] == (
        "3.00x", "missed by 1.67x")
    wide = "model average period=16 vs sync, 100 Mbit/s (wide digits CNN, dense 512)"
    assert status[wide] == ("8.00x", "met")
    diloco = {key.split(",")[1].split(":")[0].strip(): value for key, value in status.items()
              if key.startswith("slow link, diloco-")}
    assert diloco == {"diloco-wire": ("110x", "met"),
                      "diloco-accuracy": ("not measured", "not in the section's results"),
                      "diloco-largest": ("0.28", "met"),
                      "diloco-hidden": ("1.25", "missed by 1.09x")}
    assert status["(overhead: MultiWorkerMirroredStrategy(collective_timeout=None))"] == (
        "1.000", "met")
    text = "\n".join(notes)
    assert "stock: 10.0-12.0 ms" in text and "collective_timeout=300" in text
    assert "tfdist: +2.00 threads per step" in text
    assert "Horovod with Gloo" in text and "20.0x" in text
    assert "550 KB per step" in text and "at most 3.5x" in text


@pytest.mark.unit
def test_goals_say_why_a_section_gave_no_numbers():
    rows, _ = goal_rows({"overhead": {"status": "failed", "why": "exited with code 1"},
                               "slow_link": {"status": "skipped", "why": "needs root"}})
    reasons = {row[0]: row[3] for row in rows}
    assert reasons["model average period=16 vs sync, 100 Mbit/s"] == "skipped: needs root"
    assert reasons["overhead: MultiWorkerMirroredStrategy, 2 workers"] == (
        "failed: exited with code 1")
    assert "not measured" in {row[2] for row in rows}


@pytest.mark.unit
def test_goals_and_their_analysis_come_from_the_docs():
    goals = read_goals()
    assert {g: goals[g].target for g in ("overhead", "allreduce", "slow_link")} == {
        "overhead": "<= 1.03", "allreduce": "<= 2", "slow_link": ">= 5"}
    assert goals["slow_link"].status(3.0) == "missed by 1.67x"
    analysis = read_analysis()
    assert "Horovod with Gloo" in analysis["allreduce"]
    assert "\n" not in analysis["slow_link"]


@pytest.mark.unit
def test_bench_outside_a_source_checkout_points_to_python_m_benchmarks(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_source_checkout", lambda: None)
    assert cli.main(["bench", "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "python -m benchmarks" in err, err


@pytest.mark.unit
def test_engine_sections_default_to_horovod_where_it_works(tmp_path, monkeypatch):
    """benchmarks/{fsdp,zero,tensor_parallel}.py's arguments: --engine, else horovod if
    the runner found it working, else tf; a section's own arguments after them."""
    from benchmarks.common import HOROVOD_MISSING_ENV, engine_section_args

    out = ["--quick", "--output", str(tmp_path)]
    for missing, engine in (("", "horovod"), ("not installed", "tf")):
        monkeypatch.setenv(HOROVOD_MISSING_ENV, missing)
        assert engine_section_args("zero", None, out).engine == engine
    assert engine_section_args("zero", None, [*out, "--engine", "tf"]).engine == "tf"
    args = engine_section_args("fsdp", None, [*out, "--cap-mb", "7"], lambda parser:
                               parser.add_argument("--cap-mb", type=int, default=1))
    assert (args.engine, args.cap_mb, args.output) == ("tf", 7, tmp_path)


def _log_tail(section: dict, characters: int = 6000) -> str:
    """The end of a section's log: the worker's own error is above the launcher's line."""
    log = section.get("log")
    if not log or not Path(log).exists():
        return "(no log)"
    return Path(log).read_text(errors="replace")[-characters:]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quick_bench_writes_a_report_with_every_section(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tfdist.cli", "bench", "--quick", "--output", str(out)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    try:
        output, _ = proc.communicate(timeout=840)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)  # the bench stops its sections and their tasks
        try:
            output, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        pytest.fail("tfdist bench --quick did not finish in 840 s:\n" + output[-3000:])
    assert proc.returncode == 0, output[-3000:]
    report = (out / "RESULTS.md").read_text()
    status = json.loads((out / "bench_status.json").read_text())
    for name, title, _ in runner.SECTIONS:
        assert f"## {title}" in report, f"section {name} missing from RESULTS.md"
        section = status["sections"][name]
        assert section["status"] in ("ok", "skipped"), textwrap.shorten(
            f"{name} {section}", 3000) + "\n" + _log_tail(section)
    for heading in ("## Machine and versions", "## Goals", "## Sections"):
        assert heading in report


@pytest.mark.unit
def test_goals_read_the_straggler_ratio(tmp_path):
    path = tmp_path / "straggler.json"
    path.write_text(json.dumps({"ratio_period16": 1.32, "ratio_sync": 3.0}))
    rows, notes = goal_rows({"straggler": {"status": "ok", "json": str(path)}})
    label = "straggler: fast worker's inner step with a 3x slower peer / alone, period=16"
    assert {row[0]: (row[2], row[3]) for row in rows}[label] == ("1.32", "missed by 1.20x")
    assert any("sync in the same run: 3.00" in note for note in notes)
    assert read_goals()["straggler"].target == "<= 1.1"


@pytest.mark.unit
def test_goals_read_the_zero_ratios(tmp_path):
    path = tmp_path / "zero.json"
    ratios = {"optimizer_bytes_times_n": 1.0, "model_state": 0.6, "step_time": 1.05,
              "wire_bytes": 1.0, "optimizer_bytes": 0.5, "net_peak_rss": 0.7}
    path.write_text(json.dumps({"engine": "horovod", "settings": {"width": 2048},
                                "ratios": {"2": ratios, "4": dict(ratios, model_state=0.47)}}))
    rows, notes = goal_rows({"zero": {"status": "ok", "json": str(path)}})
    found = {row[0]: (row[2], row[3]) for row in rows}
    assert found["ZeRO, 4 workers (horovod): model state sharded / unsharded"] == (
        "0.47", "met")
    assert "ZeRO, 2 workers (horovod): model state sharded / unsharded" not in found
    assert found["ZeRO, 2 workers (horovod): step time sharded / unsharded"] == ("1.05", "met")
    assert not any("ZeRO" in note for note in notes)
    assert read_goals()["zero-wire"].target == "<= 1.05"


@pytest.mark.unit
def test_zero_section_says_what_its_ratios_are_made_of():
    """benchmarks/zero.py's report splits optimizer bytes x N - 1 into counters and slot
    slices (with what the padding accounts for), so a miss is explained by its numbers."""
    from benchmarks.zero import _ratios, explain

    weights = 1000
    plain = {"workers": 2, "weights_bytes": weights, "optimizer_counter_bytes": 12,
             "optimizer_slot_bytes": 2 * weights, "optimizer_bytes": 2 * weights + 12,
             "model_state_bytes": 4 * weights + 12, "padding_bytes": 0, "net_peak_rss": 1,
             "step_seconds": 1, "wire_bytes_per_step": 1}
    # A sharded worker holding twice its slots (the slices counted twice).
    shard = dict(plain, optimizer_counter_bytes=36, optimizer_slot_bytes=2 * weights,
                 optimizer_bytes=2 * weights + 36, padding_bytes=8)
    runs = {"2 workers, unsharded": plain, "2 workers, sharded": shard}
    assert _ratios(runs)["2"]["optimizer_bytes_times_n"] == pytest.approx(
        (4 * weights + 72) / (2 * weights + 12))
    line, = explain(runs)
    assert line.startswith("- 2 workers: optimizer bytes x N = 2.0239 = 1 +0.0298 from "
                           "the counters (36 B per worker sharded, 12 B unsharded")
    assert "+0.9940 from the slot slices (the padding of each bucket to a multiple of N " \
           "accounts for +0.0080)" in line


@pytest.mark.unit
def test_goals_read_the_tensor_parallel_values(tmp_path):
    path = tmp_path / "tensor_parallel.json"
    path.write_text(json.dumps({"goal_values": {
        "tp-wire": {"2 workers: counted bytes": 0.04},
        "tp-head": {"2 workers: head split elements x m": 1.0},
        "tp-accuracy": {"4 workers: test accuracy gap (points)": 0.8},
        "tp-block-params": {"4 workers: split layers' bytes x m": 1.004}}}))
    rows, notes = goal_rows({"tensor_parallel": {"status": "ok", "json": str(path)}})
    found = {row[0]: (row[1], row[3]) for row in rows if row[0].startswith("tensor_parallel")}
    assert found == {
        "tensor_parallel: 2 workers: counted bytes": ("<= 0.2", "met"),
        "tensor_parallel: 2 workers: head split elements x m": ("<= 1", "met"),
        "tensor_parallel: 4 workers: test accuracy gap (points)": ("<= 0.5", "missed by 1.60x"),
        "tensor_parallel: 4 workers: split layers' bytes x m": ("<= 1.05", "met")}
    assert [note for note in notes if "test accuracy" in note]


@pytest.mark.unit
def test_a_horovodrun_failure_keeps_each_ranks_exit_line_before_the_tail():
    """horovodrun says which rank exited how before the ranks' tracebacks; a long one
    pushed that line out of the error's last 4000 characters (tests/test_faults.py
    reads it)."""
    from benchmarks.horovodrun import _exits

    output = ("[1]<stderr>:Process 0 exit with status code 9. (a rank's own line)\n"
              "Process 1 exit with status code 137.\n" + "[0]<stderr>:" + "x" * 5000 + "\n"
              "Process 0 exit with status code 1.\n")
    assert _exits(output) == ("Process 1 exit with status code 137.\n"
                              "Process 0 exit with status code 1.\n")
