"""Count the Keras <-> tfdist crossings on one gradient's path, per mode.

A gradient's path is everything Python runs under Keras' ``train_step`` while the first
training step is traced: the forward pass, the gradient, the optimizer and the strategy's
reduction and update. A crossing is a call from Keras code into tfdist code, or back,
with TensorFlow's own frames in between ignored. Each distinct (caller, callee) pair is
counted once, so the figure is the number of places where control changes hands.

It also counts the files a reader must open to follow one step: every tfdist file
whose code runs during ``fit``'s one step (the wrappers around Keras' train function
included), in any thread.

Usage: ``.venv/bin/python scripts/gradient_path.py [MODE ...]`` (modes: mirrored,
multi_worker, model_average, horovod, sharded_elastic; default all). Each mode runs in a
fresh process on one host with 2 logical CPUs (multi_worker and horovod with one
worker); ``sharded_elastic`` runs one worker of an elastic job (``tfdist launch
--workers 1 --min-workers 1 --max-workers 2``) with ``shard_optimizer_state=True``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

MODES = {
    "mirrored": "tfdist.MirroredStrategy()",
    "multi_worker": "tfdist.MultiWorkerMirroredStrategy()",
    "model_average": "tfdist.ModelAverageStrategy(period=2)",
    "horovod": "tfdist.HorovodStrategy()",
    "sharded_elastic": "tfdist.MultiWorkerMirroredStrategy(shard_optimizer_state=True)",
}
ELASTIC_MODES = ("sharded_elastic",)


def _owner(filename: str) -> str | None:
    if "/tfdist/" in filename:
        return "tfdist"
    if "/keras/" in filename:
        return "keras"
    return None


def _short(code) -> str:
    path = code.co_filename
    for root in ("/tfdist/", "/keras/"):
        if root in path:
            path = root.strip("/") + "/" + path.split(root, 1)[1]
            break
    return f"{path}:{code.co_name}"


def count(make_strategy: str) -> dict:
    """Runs one traced step under ``make_strategy`` and returns the crossings."""
    import numpy as np

    import tfdist

    if not os.environ.get("TF_CONFIG"):
        tfdist.devices.use_logical_cpus(2)
    import keras

    strategy = eval(make_strategy, {"tfdist": tfdist})  # noqa: S307 - our own table
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    crossings: set[tuple[str, str]] = set()
    files: set[str] = set()
    local = threading.local()  # Mirrored replicas run in threads of their own

    def profile(frame, event, _arg):
        if not hasattr(local, "stack"):
            local.stack, local.depth = [], 0  # nearest non-TF frame's (owner, name)
        stack = local.stack
        if event == "call":
            code = frame.f_code
            owner = _owner(code.co_filename)
            parent = stack[-1] if stack else None
            if owner == "tfdist":
                files.add(_short(code).split(":")[0])
            if code.co_name == "train_step" and owner == "keras":
                local.depth += 1
            if (local.depth or threading.current_thread() is not main) and owner and parent and owner != parent[0]:
                crossings.add((parent[1], _short(code)))
            stack.append((owner, _short(code)) if owner else parent)
        elif event == "return" and stack:
            stack.pop()
            code = frame.f_code
            if code.co_name == "train_step" and _owner(code.co_filename) == "keras":
                local.depth -= 1

    x = np.ones((8, 4), "float32")
    y = np.ones((8, 1), "float32")
    main = threading.current_thread()
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        model.fit(x, y, batch_size=4, epochs=1, steps_per_epoch=1, verbose=0)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return {"crossings": len(crossings), "files": len(files),
            "pairs": sorted(f"{a} -> {b}" for a, b in crossings), "file_list": sorted(files)}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--one"]:
        print(json.dumps(count(MODES[argv[1]])))
        return 0
    modes = argv or list(MODES)
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    results = {}
    for mode in modes:
        command = [sys.executable, __file__, "--one", mode]
        if mode in ELASTIC_MODES:
            command = [sys.executable, "-m", "tfdist.cli", "launch", "--workers", "1",
                       "--min-workers", "1", "--max-workers", "2", *command[1:]]
        out = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        lines = [line.split("] ", 1)[-1] for line in out.stdout.splitlines()]
        lines = [line for line in lines if line.startswith("{")]
        if out.returncode or not lines:
            results[mode] = {"error": (out.stderr or out.stdout).strip().splitlines()[-1:]}
        else:
            results[mode] = json.loads(lines[-1])
    for mode, result in results.items():
        if "error" in result:
            print(f"{mode:16s} {result['error']}")
        else:
            print(f"{mode:16s} crossings {result['crossings']:3d}  files {result['files']:3d}")
    if "-v" in os.environ.get("GRADIENT_PATH_FLAGS", ""):
        print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
