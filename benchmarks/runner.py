"""``python -m benchmarks``: run every benchmark section, then write ``RESULTS.md``.

Each section is its own subprocess (``python -m benchmarks.<name> [--quick] --output
DIR``) with a deadline, so a crash, a hang or a missing optional piece (Horovod, GPUs,
network namespaces) in one section is reported in RESULTS.md as "failed: why" or
"skipped: why" and the others still run. Sections write ``DIR/<name>.md`` (shown in
RESULTS.md), ``<name>.json`` and PNG plots; RESULTS.md adds the machine, the goals of
docs/benchmarks.md with the measured ratios, and the command of each section.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import tfdist
from benchmarks.common import (HOROVOD_MISSING_ENV, horovod_missing, load_json, markdown_table,
                               output_dir, section_parser)
from benchmarks.goal_table import goal_rows

ROOT = Path(__file__).resolve().parents[1]

# name, title, needs root
SECTIONS = (
    ("allreduce", "All-reduce bus bandwidth, 2 processes, 4 KB - 64 MB", False),
    ("engines", "Engines in fit: step time and the 64 MB all-reduce, 2 workers", False),
    ("mirrored", "Mirrored strategy: cross-device ops, overhead", False),
    ("overhead", "Strategy overhead against stock TF", False),
    ("throughput", "Throughput by mode, 2 workers", False),
    ("parameter_server", "Parameter server: steps/s, async and sync", False),
    ("model_average", "Model averaging: accuracy against bytes", False),
    ("communication", "Compression and accumulation: time per step, 2 workers", False),
    ("slow_link", "Sync, model averaging and Streaming DiLoCo on a 100 Mbit/s link", True),
    ("straggler", "Model averaging with a 3x slower worker: the fast worker's step", False),
    ("sharded_embedding", "Sharded embedding on parameter servers: memory per process", False),
    ("zero", "Sharded optimizer state (ZeRO-2): memory, step time and bytes per worker",
     False),
    ("fsdp", "Fully sharded parameters (ZeRO-3): memory, bytes and step time per worker",
     False),
    ("tensor_parallel", "Tensor parallelism: the hybrid CNN and a transformer block, split "
     "against replicated", False),
    ("elastic", "Elastic training: a lost worker against restart-and-resume", False),
    ("gpu", "GPU throughput", False),
)
QUICK_TIMEOUT = 300.0
QUICK_JOBS = 3  # a smoke run: sections overlap (their launches wait on start-ups)
# The longest quick sections (most CPU: their launches), started first when sections
# overlap, so that the run does not end on one long section alone (RESULTS.md keeps
# SECTIONS' order). By a quick run's CPU seconds (elastic 70, fsdp 40, parameter_server
# 30, ..., tensor_parallel 22; the others 18 or less): tensor_parallel, 14th in SECTIONS,
# otherwise started last and ran its last 30-60 s alone.
LONGEST_FIRST = ("elastic", "fsdp", "parameter_server", "overhead", "slow_link", "zero",
                 "straggler", "model_average", "tensor_parallel", "allreduce")
FULL_TIMEOUT = 1800.0
_NOISE = re.compile(r"oneDNN custom operations|cpu_feature_guard|AVX2 AVX512|rebuild "
                    r"TensorFlow with|absl::InitializeLog|^\s*$|WARNING: All log messages")
_print_lock = threading.Lock()
_running: set = set()  # section processes, stopped if the bench itself is interrupted


def _say(line: str) -> None:
    with _print_lock:
        print(line, flush=True)


def section_argv(name: str, quick: bool, out: Path) -> list[str]:
    """The command of a section: every section takes ``[--quick] --output DIR``."""
    return ([sys.executable, "-m", f"benchmarks.{name}"] + (["--quick"] if quick else [])
            + ["--output", str(out)])


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def _newest(out: Path, name: str, suffix: str, since: float) -> Path | None:
    found = [p for p in out.glob(f"{name}*{suffix}") if p.stat().st_mtime >= since - 1]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def run_section(name: str, quick: bool, out: Path, timeout: float, log_dir: Path) -> dict:
    """Runs one section in a subprocess; returns its status, files and output tail."""
    started = time.time()
    module = ROOT / "benchmarks" / f"{name}.py"
    if not module.exists():
        return {"status": "skipped", "why": f"benchmarks/{name}.py does not exist yet",
                "seconds": 0.0}
    argv = section_argv(name, quick, out)
    try:
        out_shown = str(out.relative_to(ROOT))  # e.g. "benchmarks"
    except ValueError:
        out_shown = "OUT"
    shown = " ".join(["python"] + argv[1:]).replace(str(out), out_shown)
    _say(f"[{name}] $ {shown}")
    log_path = log_dir / f"{name}.log"
    tail: list[str] = []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                text=True, errors="replace", start_new_session=True)
        _running.add(proc)
        timed_out = threading.Event()

        def expire():
            timed_out.set()
            _stop_group(proc)

        timer = threading.Timer(timeout, expire)
        timer.start()
        try:
            for line in proc.stdout:
                log.write(line)
                line = line.rstrip("\n")
                if not _NOISE.search(line):
                    tail = (tail + [line])[-60:]
                    if not line.startswith("[") or line.startswith(f"[{name}]"):
                        _say(line if line.startswith(f"[{name}]") else f"[{name}] {line}")
            code, cpu = _reap(proc)
        except BaseException:
            _stop_group(proc)
            raise
        finally:
            timer.cancel()
            _running.discard(proc)
    seconds = time.time() - started
    result = {"command": shown, "seconds": seconds, "cpu_seconds": cpu, "returncode": code,
              "log": str(log_path), "tail": "\n".join(tail[-25:])}
    md, js = _newest(out, name, ".md", started), _newest(out, name, ".json", started)
    result["markdown"] = str(md) if md else None
    result["json"] = str(js) if js else None
    result["pngs"] = sorted(str(p) for p in out.glob(f"{name}*.png")
                            if p.stat().st_mtime >= started - 1)
    if code == 0 and md is not None:
        data = load_json(js)
        if isinstance(data, dict) and data.get("skipped"):
            result.update(status="skipped", why=str(data["skipped"]))
        else:
            result["status"] = "ok"
    elif code == 0:  # ran fine but wrote no report (some sections write none in --quick)
        result.update(status="ok", why="wrote no report; its output is shown")
    else:
        if timed_out.is_set():
            why = f"timed out after {timeout:g} s (every process of the section was killed)"
        elif code != 0:
            why = f"exited with code {code}: {_last_error(tail)}"
        result.update(status="failed", why=why)
    _say(f"[{name}] {result['status']}" + (f": {result['why']}" if result.get("why") else "")
         + f" ({seconds:.0f} s" + ("" if cpu is None else f", {cpu:.0f} s of CPU") + ")")
    return result


def _reap(proc) -> tuple[int, float]:
    """Waits for ``proc``: its exit code, and the CPU seconds (user and system) of it and
    of every descendant it waited for (its launched tasks); None if a deadline's stop
    reaped it first."""
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    except ChildProcessError:
        return proc.wait(), None
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_utime + usage.ru_stime


def _stop_group(proc, grace: float = 20.0):
    """SIGINT the section's process group (Python unwinds: the launcher stops its tasks,
    which run in their own sessions, and slow_link removes its namespaces), then SIGKILL
    whatever is left after ``grace`` seconds."""
    for signum in (signal.SIGINT, signal.SIGKILL):
        try:
            os.killpg(proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _last_error(lines: list[str]) -> str:
    for line in reversed(lines):
        if re.search(r"(Error|Exception|error:)", line) and "Traceback" not in line:
            return line.strip()[:400]
    return (lines[-1].strip()[:400] if lines else "no output")


# ---- machine -------------------------------------------------------------------------------

def machine_facts() -> dict:
    """The machine and the versions (from package metadata: no TensorFlow import)."""
    from importlib import metadata

    facts = {"python": platform.python_version(), "tfdist": tfdist.__version__,
             "cpus": os.cpu_count(), "kernel": platform.release(),
             "platform": platform.platform()}
    for label, packages in (("tensorflow", ("tensorflow-cpu", "tensorflow", "tf-nightly")),
                            ("keras", ("keras",)), ("horovod", ("horovod",)),
                            ("numpy", ("numpy",))):
        for package in packages:
            try:
                facts[label] = f"{metadata.version(package)} ({package})" if label == \
                    "tensorflow" else metadata.version(package)
                break
            except metadata.PackageNotFoundError:
                continue
        else:
            facts[label] = "not installed"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                facts["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                facts["memory"] = f"{int(line.split()[1]) / 2**20:.1f} GiB"
                break
    except OSError:
        pass
    try:
        facts["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                         capture_output=True, text=True,
                                         timeout=30).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        pass
    facts["gpus"] = _gpus()
    return facts


def _gpus() -> str:
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        names = [line for line in listing.stdout.splitlines() if line.startswith("GPU ")]
        return "; ".join(names) if names else "none"
    except (OSError, subprocess.TimeoutExpired):
        return "none (no nvidia-smi)"


# ---- report --------------------------------------------------------------------------------

def _demote(markdown: str) -> str:
    return re.sub(r"^(#+) ", lambda m: "#" + m.group(1) + " ", markdown, flags=re.M)


def write_results(out: Path, results: dict, facts: dict, quick: bool, seconds: float) -> Path:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = ["# tfdist benchmarks", "",
             f"Generated by `python -m benchmarks{' --quick' if quick else ''}` on {now} in "
             f"{seconds / 60:.1f} min" + (" (**quick mode: tiny sizes, one repetition; the "
                                          "numbers are smoke-test values, not results**)"
                                          if quick else "") + ".",
             "Every number below was measured in this one run, side by side; ratios "
             "(not absolute times) are what carries over to other machines.", "",
             "## Machine and versions", "",
             markdown_table([["", ""]] + [[k, v] for k, v in facts.items() if v is not None]),
             "", "## Goals", ""]
    rows, notes = goal_rows(results)
    lines += ["The goals and their analysis: docs/benchmarks.md.", "",
              markdown_table([["goal", "target", "measured", "status"]] + rows), ""]
    if notes:
        lines += ["Why goals were missed, and what would close the gap:", ""] + notes + [""]
    lines += ["## Sections", "",
              markdown_table([["section", "status", "time", "command"]] + [
                  [name, r["status"] + (f": {r['why']}" if r.get("why") else ""),
                   f"{r.get('seconds', 0):.0f} s" + (f" ({r['cpu_seconds']:.0f} s CPU)"
                                                     if r.get("cpu_seconds") else ""),
                   f"`{r['command']}`" if r.get("command")
                   else "-"] for name, r in results.items()]), "",
              "Run any section alone from the checkout: `python -m benchmarks.<name> "
              "[--quick]` (slow_link needs root for `ip netns`). Raw numbers: "
              "`<name>.json` next to this file; logs of this run: `logs/`.", ""]
    for name, title, _ in SECTIONS:
        r = results[name]
        lines += [f"## {title}", ""]
        body = ""
        if r.get("markdown") and r["status"] in ("ok", "skipped"):
            body = Path(r["markdown"]).read_text().strip()
            body = re.sub(r"\A#[^\n]*\n", "", body).strip()  # our own heading replaces it
        if r.get("command") and not re.search(r"Command|Reproduce", body):
            lines += [f"Command: `{r['command']}`", ""]
        if r["status"] == "ok" and not body:
            lines += ["The section wrote no report; the end of its output:", "", "```",
                      r.get("tail", "")[-1500:], "```", ""]
        elif body:
            lines += [_demote(body), ""]
            shown = set(re.findall(r"!\[[^\]]*\]\(([^)]+)\)", body))
            for png in r.get("pngs", []):
                rel = os.path.relpath(png, out)
                if rel not in shown:
                    lines += [f"![{name}]({rel})", ""]
        else:
            lines += [f"**{r['status']}: {r.get('why', '')}**", ""]
            if r["status"] == "failed" and r.get("tail"):
                lines += ["```", r["tail"][-1500:], "```", ""]
    path = out / "RESULTS.md"
    path.write_text("\n".join(lines).rstrip() + "\n")
    summary = {name: {k: v for k, v in r.items() if k != "tail"} for name, r in results.items()}
    (out / "bench_status.json").write_text(json.dumps(
        {"quick": quick, "seconds": seconds, "machine": facts, "sections": summary,
         "goals": rows}, indent=2))
    return path


def main(args) -> int:
    """Runs the sections: ``args.quick``, ``args.output`` (a directory, or None for the
    default), and optional ``args.sections`` (comma-separated), ``args.jobs`` and
    ``args.timeout``."""
    quick = bool(getattr(args, "quick", False))
    out = output_dir(getattr(args, "output", None), quick)
    log_dir = out / "logs"
    log_dir.mkdir(exist_ok=True)
    wanted = getattr(args, "sections", None)
    names = [n for n, _, _ in SECTIONS]
    if wanted:
        chosen = [s.strip() for s in wanted.split(",") if s.strip()]
        unknown = [s for s in chosen if s not in names]
        if unknown:
            print(f"benchmarks: unknown section(s) {unknown}; choose from {names}",
                  file=sys.stderr)
            return 2
        names = [n for n in names if n in chosen]
    timeout = getattr(args, "timeout", None) or (QUICK_TIMEOUT if quick else FULL_TIMEOUT)
    # Timing sections run one at a time; the quick smoke run may overlap two.
    jobs = getattr(args, "jobs", None) or (QUICK_JOBS if quick else 1)
    started = time.time()
    _say(f"benchmarks: {len(names)} section(s) into {out}"
         + (" (quick)" if quick else "") + f", {jobs} at a time, {timeout:g} s limit each")
    facts = machine_facts()
    if HOROVOD_MISSING_ENV not in os.environ:  # probed once here, not in every section
        os.environ[HOROVOD_MISSING_ENV] = horovod_missing() or ""
    results = {n: {"status": "skipped", "why": "not selected (--sections)", "seconds": 0.0}
               for n, _, _ in SECTIONS}
    for name in names:
        results[name] = {"status": "pending", "why": "not finished when this was written",
                         "seconds": 0.0}
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=jobs)
    try:
        order = sorted(names, key=lambda n: LONGEST_FIRST.index(n) if n in LONGEST_FIRST
                       else len(LONGEST_FIRST)) if jobs > 1 else names
        futures = {pool.submit(run_section, n, quick, out, timeout, log_dir): n for n in order}
        for i, future in enumerate(concurrent.futures.as_completed(futures), 1):
            name = futures[future]
            try:
                results[name] = future.result()
            except Exception as error:  # the runner itself: report, go on
                results[name] = {"status": "failed", "why": f"{type(error).__name__}: {error}",
                                 "seconds": 0.0}
            # Rewritten after every section, so an interrupted run still leaves a report.
            write_results(out, results, facts, quick, time.time() - started)
            _say(f"benchmarks: {i}/{len(names)} done ({name}), "
                 f"{(time.time() - started) / 60:.1f} min so far")
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in list(_running):
            _stop_group(proc)
        raise
    pool.shutdown()
    path = write_results(out, results, facts, quick, time.time() - started)
    ok = sum(r["status"] == "ok" for r in results.values())
    _say(f"benchmarks: wrote {path} ({ok} ok, "
         f"{sum(r['status'] == 'skipped' for r in results.values())} skipped, "
         f"{sum(r['status'] == 'failed' for r in results.values())} failed) in "
         f"{(time.time() - started) / 60:.1f} min")
    return 0


def build_parser():
    """The arguments of ``python -m benchmarks``: a section's, plus which and how long."""
    parser = section_parser("benchmarks", __doc__)
    parser.add_argument("--sections", default=None,
                        help="comma-separated subset of: " + ", ".join(n for n, _, _ in SECTIONS))
    parser.add_argument("--jobs", type=int, default=None,
                        help=f"sections run at once (default: 1; {QUICK_JOBS} with --quick)")
    parser.add_argument("--timeout", type=float, default=None,
                        help=f"seconds per section (default: {QUICK_TIMEOUT:g} quick, "
                             f"{FULL_TIMEOUT:g} full)")
    return parser
