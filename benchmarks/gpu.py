"""GPU throughput: `tfdist.MirroredStrategy` on every GPU, and Horovod with NCCL.

    .venv/bin/python -m benchmarks.gpu [--quick] [--output DIR]

Runs only when ``nvidia-smi -L`` lists GPUs *and* this TensorFlow can use them
(``tensorflow-cpu`` cannot); otherwise the section says why and is skipped. Same
workload as `benchmarks.throughput` (digits CNN) with a larger global batch (256 per
GPU), so the numbers compare across sections:

- ``single GPU``: one GPU, no strategy;
- ``mirrored``: `tfdist.MirroredStrategy` on all GPUs of one process (NCCL all-reduce);
- ``horovod``: `tfdist.HorovodStrategy`, one process per GPU under ``horovodrun``
  (NCCL if Horovod was built with it, which the table reports).
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import time

from benchmarks.common import (horovod_missing, machine_info, markdown_table,
                               parse_section_args, run_horovod, run_tasks, section_parser,
                               skip_section, write_section)

PER_GPU_BATCH = 256


def list_gpus() -> list[str]:
    """GPU names from ``nvidia-smi -L`` (empty without the tool or GPUs)."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                 timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if listing.returncode != 0:
        return []
    return [line.strip() for line in listing.stdout.splitlines() if line.startswith("GPU ")]


def tf_gpu_task() -> int:
    import tensorflow as tf

    return len(tf.config.list_physical_devices("GPU"))


def gpu_fit_task(mode: str, gpus: int, steps: int, epochs: int) -> dict:
    """Trains the digits CNN on GPU(s) for 1 + ``epochs`` epochs; times them."""
    import contextlib

    import tfdist

    if mode == "mirrored":
        strategy = tfdist.MirroredStrategy()  # every GPU
    elif mode == "horovod":
        strategy = tfdist.HorovodStrategy()  # this rank's GPU
    else:
        strategy = None
    from benchmarks.common import EpochTimer, compile_digits, digits_cnn, digits_dataset

    batch = PER_GPU_BATCH * (1 if mode == "single" else gpus)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = compile_digits(digits_cnn())
    timer = EpochTimer()
    model.fit(digits_dataset(batch), epochs=1 + epochs, steps_per_epoch=steps, verbose=0,
              callbacks=[timer])
    info = {}
    if mode == "horovod":
        from tfdist.engines.horovod import ops as comm

        info["nccl_built"] = bool(comm.hvd().nccl_built())
    return {"samples_per_second": batch * steps / statistics.median(timer.seconds[1:]),
            "epoch_seconds": timer.seconds[1:], "global_batch": batch, **info}


def main(argv=None) -> dict:
    args = parse_section_args(section_parser("benchmarks.gpu", __doc__), argv)
    out = args.output
    title = "GPU throughput (mirrored, Horovod/NCCL)"
    gpus = list_gpus()
    if not gpus:
        skip_section(out, "gpu", title, "no GPU (`nvidia-smi -L` lists none)" if shutil.which(
            "nvidia-smi") else "no GPU (`nvidia-smi` is not installed)")
        return {"skipped": "no GPU"}
    visible = run_tasks(tf_gpu_task, workers=1, timeout=300)[0]
    if not visible:
        reason = (f"{len(gpus)} GPU(s) listed by nvidia-smi, but this TensorFlow build sees "
                  "none (tensorflow-cpu, or CUDA libraries missing)")
        skip_section(out, "gpu", title, reason, {"nvidia_smi": gpus})
        return {"skipped": reason}
    steps, epochs = (4, 1) if args.quick else (40, 3)
    results = {}
    plan = [("single", lambda: run_tasks(gpu_fit_task, "single", visible, steps, epochs,
                                         workers=1, timeout=600)[0]),
            ("mirrored", lambda: run_tasks(gpu_fit_task, "mirrored", visible, steps, epochs,
                                           workers=1, timeout=600)[0])]
    why_hvd = horovod_missing()
    if why_hvd:
        results["horovod"] = {"skipped": why_hvd}
    else:
        plan.append(("horovod", lambda: run_horovod(gpu_fit_task, "horovod", visible, steps,
                                                    epochs, np=visible, timeout=600)[0]))
    for name, fn in plan:
        print(f"gpu: {name} ...", flush=True)
        start = time.perf_counter()
        try:
            results[name] = fn()
        except Exception as error:
            text = str(error).strip()
            results[name] = {"failed": f"{type(error).__name__}: {text[-300:]}"}
        print(f"gpu: {name}: {results[name]} ({time.perf_counter() - start:.0f}s)", flush=True)
    rows = [["mode", "GPUs", "global batch", "samples/s", "note"]]
    for name in ("single", "mirrored", "horovod"):
        r = results.get(name, {})
        if "samples_per_second" in r:
            note = ("NCCL" if r.get("nccl_built") else "Gloo (Horovod built without NCCL)"
                    ) if name == "horovod" else ""
            rows.append([name, 1 if name == "single" else visible, r["global_batch"],
                         f"{r['samples_per_second']:,.0f}", note])
        else:
            rows.append([name, "", "", r.get("skipped") and f"skipped: {r['skipped']}"
                         or f"failed: {r.get('failed')}", ""])
    text = [f"# {title}", "", "Command: `.venv/bin/python -m benchmarks.gpu`", "",
            "GPUs: " + "; ".join(gpus), "", markdown_table(rows), ""]
    data = {"machine": machine_info(), "gpus": gpus, "results": results}
    write_section(out, "gpu", "\n".join(text), data)
    print("\n".join(text), flush=True)
    return data


if __name__ == "__main__":
    sys.exit(main() and 0)
