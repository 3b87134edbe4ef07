"""The main job: ``tfdist train CONFIG`` and ``tfdist compare CONFIG...``.

``tfdist train`` reads a TOML config (`tfdist.config`), and either runs the job in this
process (no strategy, mirrored, or a task of a cluster that the environment describes)
or launches one local process per task through `tfdist.launch`. Every task runs
`run_task`; the chief prints the per-epoch progress and a final table, and writes
``report.json``, ``report.png`` and ``model.keras`` into the output directory.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tfdist.config import ConfigError, is_multi_process, load_config

REPORT_FIELDS = ("config", "strategy", "num_replicas", "epochs", "history", "final",
                 "wall_time_seconds", "bytes_communicated")


def build_strategy(config: dict[str, Any]):
    """The strategy a config names, built with its options. Call before other TF work."""
    import tensorflow as tf

    import tfdist

    name, options = config["strategy"]["name"], dict(config["strategy"]["options"])
    if isinstance(options.get("outer_optimizer"), dict):
        options["outer_optimizer"] = _optimizer_from_table(options["outer_optimizer"])
    try:
        if name == "none":
            return tf.distribute.get_strategy()
        if name == "mirrored":
            tfdist.devices.use_logical_cpus(config["cluster"]["logical_cpus"])
            return tfdist.MirroredStrategy(**options)
        classes = {"multi_worker": "MultiWorkerMirroredStrategy",
                   "parameter_server": "ParameterServerStrategy",
                   "model_average": "ModelAverageStrategy", "horovod": "HorovodStrategy"}
        return getattr(tfdist, classes[name])(**options)
    except TypeError as error:
        raise ConfigError(f"strategy.options do not fit strategy {name!r}: {error}") from None


def _optimizer_from_table(table: dict[str, Any]):
    """``{name = "sgd", learning_rate = 0.7, ...}`` -> a function making that Keras
    optimizer (multi-worker strategies must exist before the optimizer is created)."""
    import keras

    table = dict(table)
    name = table.pop("name", "sgd")
    cls = {"sgd": keras.optimizers.SGD, "adam": keras.optimizers.Adam}.get(name.lower())
    if cls is None:
        raise ConfigError(f"strategy.options.outer_optimizer.name must be 'sgd' or 'adam'. "
                          f"Received: {name!r}")
    try:
        inspect.signature(cls).bind(**table)
    except TypeError as error:
        raise ConfigError(f"strategy.options.outer_optimizer: {error}") from None
    return lambda: cls(**table)


def export_slurm_cluster(config: dict[str, Any]) -> None:
    """In a Slurm job step without TF_CONFIG, writes the TF_CONFIG Slurm implies."""
    if config["cluster"]["mode"] != "env" or os.environ.get("TF_CONFIG"):
        return
    if "SLURM_PROCID" in os.environ and config["strategy"]["name"] != "horovod":
        from tfdist.cluster import from_slurm

        spec = from_slurm(chief=config["cluster"]["chief"], ps=config["cluster"]["ps"])
        os.environ["TF_CONFIG"] = spec.to_tf_config()


def is_chief_task(config: dict[str, Any]) -> bool:
    """True on the task that reports and writes the model."""
    if config["strategy"]["name"] == "horovod":
        from tfdist.comm import horovod

        return horovod.rank() == 0
    if os.environ.get("TF_CONFIG"):
        from tfdist.cluster import ClusterSpec

        return ClusterSpec.from_env().is_chief()
    return True


def run_task(config: dict[str, Any]) -> dict[str, Any] | None:
    """Trains as one task of the job. Returns the report on the chief, else None."""
    export_slurm_cluster(config)
    strategy = build_strategy(config)  # first: multi-worker TF must start before any op
    import keras

    from tfdist.data import load_dataset
    from tfdist.models import build_model, build_optimizer

    train_cfg = config["train"]
    chief = is_chief_task(config)
    keras.utils.set_random_seed(train_cfg["seed"])
    x, y, x_val, y_val = load_dataset(config["data"], seed=train_cfg["seed"])
    num_classes = int(max(y.max(), y_val.max() if len(y_val) else 0)) + 1
    with strategy.scope():
        model = build_model(config["model"], x.shape[1:], num_classes)
        model.compile(build_optimizer(train_cfg),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    from tfdist.keras.guards import StopOnNaN

    fit_kwargs: dict[str, Any] = dict(
        batch_size=train_cfg["global_batch_size"], epochs=train_cfg["epochs"],
        verbose=train_cfg["verbose"] if chief else 0, callbacks=[StopOnNaN()])
    if train_cfg["steps_per_epoch"]:
        fit_kwargs["steps_per_epoch"] = train_cfg["steps_per_epoch"]
    if len(x_val):
        fit_kwargs["validation_data"] = (x_val, y_val)
    started = time.monotonic()
    history = model.fit(x, y, **fit_kwargs)
    wall = time.monotonic() - started
    final = {}
    if len(x_val):
        values = model.evaluate(x_val, y_val, batch_size=train_cfg["global_batch_size"],
                                verbose=0, return_dict=True)
        final = {f"val_{k}": float(v) for k, v in values.items()}
    final.update({k: float(v[-1]) for k, v in history.history.items()
                  if not k.startswith("val_")})
    if not chief:
        return None
    report = {
        "config": config,
        "strategy": type(strategy).__name__,
        "num_replicas": int(strategy.num_replicas_in_sync),
        "epochs": len(history.history.get("loss", [])),
        "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
        "final": final,
        "wall_time_seconds": wall,
        "bytes_communicated": int(getattr(strategy, "bytes_communicated", 0) or 0),
    }
    out = Path(train_cfg["output_dir"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=_jsonable))
    plot_history(report, out / "report.png")
    model.save(out / "model.keras")
    print(format_table([("metric", "value")] +
                       [(k, f"{v:.4f}") for k, v in sorted(final.items())] +
                       [("wall time (s)", f"{wall:.1f}"),
                        ("bytes all-reduced", f"{report['bytes_communicated']:,}")]),
          flush=True)
    return report


def _jsonable(value):
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def format_table(rows: list[tuple]) -> str:
    """A plain text table, first row the header."""
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot_history(report: dict[str, Any], path: Path) -> None:
    """Loss and accuracy per epoch, training and validation, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = report["history"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, metric in zip(axes, ("loss", "accuracy")):
        for key, style in ((metric, "-"), (f"val_{metric}", "--")):
            if key in history:
                ax.plot(range(1, len(history[key]) + 1), history[key], style, label=key)
        ax.set_xlabel("epoch")
        ax.set_title(metric)
        ax.legend()
    fig.suptitle(f"{report['strategy']} ({report['num_replicas']} replicas)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def launch_job(config: dict[str, Any], config_path: Path) -> int:
    """Starts one local process per task, each running `run_task` on the same config."""
    from tfdist.launch import LaunchError, run

    cluster = config["cluster"]
    argv = [sys.executable, "-m", "tfdist.train", "--task", str(config_path)]
    if config["strategy"]["name"] == "horovod":
        return _horovodrun(cluster, argv)
    try:
        run(argv, workers=cluster["workers"], chief=cluster["chief"],
               ps=cluster["ps"], timeout=cluster["timeout"],
               max_restarts=cluster["max_restarts"],
               backup_dir=str(Path(config["train"]["output_dir"]) / "backup"))
    except LaunchError as error:
        print(f"tfdist train: FAILED: {error}", file=sys.stderr, flush=True)
        return 1
    return 0


def _horovodrun(cluster: dict[str, Any], argv: list[str]) -> int:
    n = cluster["workers"] + int(cluster["chief"])
    horovodrun = shutil.which("horovodrun") or str(Path(sys.executable).with_name("horovodrun"))
    command = [horovodrun, "-np", str(n), "-H", f"localhost:{n}", "--gloo", *argv]
    try:
        return subprocess.run(command, timeout=cluster["timeout"],
                              start_new_session=True).returncode
    except subprocess.TimeoutExpired:
        print(f"tfdist train: horovodrun timed out after {cluster['timeout']}s",
              file=sys.stderr)
        return 1


def main(args) -> int:
    """``tfdist train``: load, validate, then run here or launch the tasks."""
    try:
        config = load_config(args.config, args.set)
    except ConfigError as error:
        print(f"tfdist train: error: {error}", file=sys.stderr)
        return 2
    out = Path(config["train"]["output_dir"])
    out.mkdir(parents=True, exist_ok=True)
    if is_multi_process(config) and config["cluster"]["mode"] == "local":
        config_path = out / "config.resolved.json"
        config_path.write_text(json.dumps(config, indent=2))
        code = launch_job(config, config_path)
    else:
        try:
            run_task(config)
        except ConfigError as error:
            print(f"tfdist train: error: {error}", file=sys.stderr)
            return 2
        code = 0
    if code == 0:
        print(f"tfdist train: wrote {out / 'report.json'}, {out / 'report.png'} and "
              f"{out / 'model.keras'}", flush=True)
    return code


def compare_main(args) -> int:
    """``tfdist compare``: runs each config, then one table and one plot side by side."""
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    reports = []
    for index, config_file in enumerate(args.configs):
        run_dir = out / f"{index}-{Path(config_file).stem}"
        command = [sys.executable, "-m", "tfdist.cli", "train", config_file,
                   "--set", f"train.output_dir={json.dumps(str(run_dir))}",
                   *sum((["--set", s] for s in args.set), [])]
        print(f"tfdist compare: [{index + 1}/{len(args.configs)}] {config_file}", flush=True)
        if subprocess.run(command).returncode:
            print(f"tfdist compare: {config_file} failed", file=sys.stderr)
            return 1
        report = json.loads((run_dir / "report.json").read_text())
        report["name"] = Path(config_file).stem
        reports.append(report)
    rows = [("config", "strategy", "replicas", "val_accuracy", "loss", "time (s)",
             "bytes all-reduced")]
    for r in reports:
        rows.append((r["name"], r["strategy"], r["num_replicas"],
                     f"{r['final'].get('val_accuracy', float('nan')):.4f}",
                     f"{r['final'].get('loss', float('nan')):.4f}",
                     f"{r['wall_time_seconds']:.1f}", f"{r['bytes_communicated']:,}"))
    table = format_table(rows)
    print(table)
    summary = [{k: r[k] for k in ("name", "strategy", "num_replicas", "final",
                                  "wall_time_seconds", "bytes_communicated", "history")}
               for r in reports]
    (out / "compare.json").write_text(json.dumps(summary, indent=2))
    (out / "compare.md").write_text("```\n" + table + "\n```\n")
    plot_compare(summary, out / "compare.png")
    print(f"tfdist compare: wrote {out / 'compare.json'}, {out / 'compare.md'} and "
          f"{out / 'compare.png'}")
    return 0


def plot_compare(summary: list[dict], path: Path) -> None:
    """Validation accuracy per epoch, and final accuracy against bytes and time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for r in summary:
        curve = r["history"].get("val_accuracy") or r["history"].get("accuracy", [])
        axes[0].plot(range(1, len(curve) + 1), curve, marker="o", label=r["name"])
        accuracy = r["final"].get("val_accuracy", r["final"].get("accuracy", 0.0))
        axes[1].scatter(max(r["bytes_communicated"], 1), accuracy, label=r["name"])
        axes[2].scatter(r["wall_time_seconds"], accuracy, label=r["name"])
    axes[0].set(xlabel="epoch", ylabel="accuracy", title="accuracy per epoch")
    axes[1].set(xlabel="bytes all-reduced (log)", ylabel="final accuracy", xscale="log",
                title="accuracy vs bytes")
    axes[2].set(xlabel="wall time (s)", ylabel="final accuracy", title="accuracy vs time")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _task_entry(argv: list[str]) -> int:
    """``python -m tfdist.train --task CONFIG_JSON``: one task of a launched job."""
    config = json.loads(Path(argv[1]).read_text())
    run_task(config)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--task":
        sys.exit(_task_entry(sys.argv[1:]))
    sys.exit("usage: python -m tfdist.train --task CONFIG_JSON")
