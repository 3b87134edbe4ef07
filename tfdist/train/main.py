"""``tfdist train CONFIG``: load and check the config, lock the output directory, then
dispatch the job.

The job runs in this process (no strategy, mirrored, or a task of a cluster that the
environment describes, `tfdist.train.task`), or as one local process per task through
`tfdist.launch` (also this host's tasks of a multi-node job), on Spark or Ray
(`tfdist.runners`), or under ``horovodrun`` when the strategy's ranks are Horovod's.
Every task resumes from the backup of an interrupted run of the same config; the chief
writes ``report.json``, ``report.png`` and ``model.keras`` into the output directory.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from tfdist import env
from tfdist.config import ConfigError, is_multi_process, load_config
from tfdist.files import describe_disk_full, is_disk_full
from tfdist.strategies import registry
from tfdist.train.checks import check_job
from tfdist.train.outdir import (backup_dir, create_output_dir, holds_lock, lock_output_dir,
                                 prepare_backup, write_atomic)
from tfdist.train.task import run_task, snapshot_task


def launch_job(config: dict[str, Any], config_path: Path) -> int:
    """Starts one local process per task, each running `run_task` on the same config.

    With ``cluster.mode = "nodes"`` these are this host's tasks of a multi-node job:
    the launcher meets the other hosts at ``cluster.master`` (`tfdist.launch.rendezvous`).
    """
    from tfdist.launch import LaunchError, RendezvousError, run
    from tfdist.launch.api import restarts_for

    cluster = config["cluster"]
    if cluster["mode"] in ("spark", "ray"):
        return _engine_job(cluster, json.loads(config_path.read_text()))
    argv = [sys.executable, "-m", "tfdist.train", "--task", str(config_path)]
    if registry.get(config["strategy"]["name"]).horovodrun:
        return _horovodrun(cluster, argv)
    nodes = {}
    if cluster["mode"] == "nodes":
        nodes = dict(nnodes=cluster["nnodes"], node_rank=cluster["node_rank"],
                     master=cluster["master"])
    try:
        run(argv, workers=cluster["workers"], chief=cluster["chief"],
            ps=cluster["ps"], timeout=cluster["timeout"],
            max_restarts=cluster["max_restarts"],
            backup_dir=str(Path(config["train"]["output_dir"]) / "backup"),
            restarts=restarts_for(cluster["chief"], cluster["ps"]),
            min_workers=cluster["min_workers"] or None,
            max_workers=cluster["max_workers"] or None,
            elastic_timeout=cluster["elastic_timeout"], **nodes)
    except (LaunchError, RendezvousError) as error:
        print(f"tfdist train: FAILED: {error}", file=sys.stderr, flush=True)
        return 1
    return 0


def _engine_job(cluster: dict[str, Any], snapshot: dict[str, Any]) -> int:
    """``cluster.mode = "spark"`` / ``"ray"``: every task runs `run_task` on that engine,
    on ``cluster.master`` (default: ``local[workers]``, or a local Ray instance)."""
    from tfdist.launch import LaunchError

    # The tasks run in the engine's working directory: give them absolute paths.
    config = snapshot["config"]
    for section, key in (("train", "output_dir"), ("data", "path")):
        if config[section][key]:
            config[section][key] = os.path.abspath(config[section][key])
    options = dict(workers=cluster["workers"], timeout=cluster["timeout"])
    try:
        if cluster["mode"] == "spark":
            from tfdist import spark

            master = cluster["master"] or f"local[{cluster['workers']}]"
            with spark.session(master, "tfdist train") as session:
                spark.run(snapshot_task, snapshot, spark=session, **options)
        else:
            from tfdist import ray

            with ray.connect(cluster["master"] or None):
                ray.run(snapshot_task, snapshot, **options)
    except LaunchError as error:
        print(f"tfdist train: FAILED: {error}", file=sys.stderr, flush=True)
        return 1
    except ConnectionError as error:  # nothing started: a bad or unreachable master
        print(f"tfdist train: error: cluster.master: {error}", file=sys.stderr, flush=True)
        return 2
    return 0



def _horovodrun(cluster: dict[str, Any], argv: list[str]) -> int:
    from tfdist.launch import LaunchError, run_command, split_horovod_prefix

    n = cluster["workers"] + int(cluster["chief"])
    horovodrun = shutil.which("horovodrun") or str(Path(sys.executable).with_name("horovodrun"))
    command = [horovodrun, "-np", str(n), "-H", f"localhost:{n}", "--gloo", *argv]
    # Run and relayed as `tfdist launch` runs a task: it dies with this process, and its
    # output comes live with the launcher's prefix ("[1]<stdout>:..." -> "[worker-1] ...").
    try:
        return run_command(command, timeout=cluster["timeout"], stream=sys.stdout,
                           route=split_horovod_prefix)
    except LaunchError as error:
        print(f"tfdist train: {error}", file=sys.stderr)
        return 1


def config_name(path: str | os.PathLike | None) -> str:
    """The name a report gives a config: its file name without ``.toml``."""
    return Path(path).stem if path is not None else "defaults"


def node_overrides(args) -> list[str]:
    """``--nnodes/--node-rank/--master`` as ``--set`` overrides (with
    ``cluster.mode="nodes"`` when any is given)."""
    flags = {"nnodes": getattr(args, "nnodes", None),
             "node_rank": getattr(args, "node_rank", None),
             "master": getattr(args, "master", None)}
    given = [f"cluster.{key}={json.dumps(value)}" for key, value in flags.items()
             if value is not None]
    return ['cluster.mode="nodes"', *given] if given else []


def main(args) -> int:
    """``tfdist train``: load and check, lock the output directory, then run here or
    launch the tasks."""
    source = str(args.config) if args.config is not None else "<defaults>"
    try:
        config = load_config(args.config, [*args.set, *node_overrides(args)])
        check_job(config, source)
        out = Path(config["train"]["output_dir"])
        create_output_dir(out, source)
        lock = lock_output_dir(out) if holds_lock(config) else None
    except ConfigError as error:
        print(f"tfdist train: error: {error}", file=sys.stderr)
        return 2
    name = config_name(args.config)
    try:
        launched = is_multi_process(config) and config["cluster"]["mode"] in (
            "local", "nodes", "spark", "ray")
        if lock is not None:  # the launcher points its tasks at OUTPUT_DIR/backup
            from_env = not launched and bool(os.environ.get(env.BACKUP_DIR))
            try:
                prepare_backup(config, out / "backup" if launched else backup_dir(config),
                               fresh=getattr(args, "fresh", False),
                               setting=env.BACKUP_DIR if from_env else "train.output_dir")
            except ConfigError as error:
                print(f"tfdist train: error: {error}", file=sys.stderr)
                return 2
        entry = registry.get(config["strategy"]["name"])
        if launched and entry.horovodrun and config["cluster"]["max_restarts"]:
            print(f"tfdist train: cluster.max_restarts does not apply to {entry.name} "
                  "(horovodrun does not restart ranks); run the same command again to "
                  f"resume from {out / 'backup'}", file=sys.stderr, flush=True)
        if launched:
            if lock is not None:  # not on the other nodes of a multi-node job
                text = json.dumps(config, indent=2)
                write_atomic(out / "config.resolved.json", lambda tmp: tmp.write_text(text))
            # The tasks (and their restarts) read this job's own snapshot.
            with tempfile.TemporaryDirectory(prefix="tfdist-job-") as job_dir:
                snapshot = Path(job_dir) / "config.json"
                snapshot.write_text(json.dumps({"name": name, "config": config}))
                code = launch_job(config, snapshot)
        else:
            try:
                run_task(config, name)
            except ConfigError as error:
                print(f"tfdist train: error: {source}: {error}", file=sys.stderr)
                return 2
            except OSError as error:
                if not is_disk_full(error):
                    raise
                print(f"tfdist train: FAILED: {describe_disk_full(error)}", file=sys.stderr,
                      flush=True)
                return 1
            code = 0
    finally:
        if lock is not None:
            os.close(lock)
    if code == 0 and lock is None:  # not the chief's process: it writes nothing
        print("tfdist train: this node's tasks finished; node 0 writes the report" if launched
              else "tfdist train: this task finished; the chief writes the report", flush=True)
    elif code == 0:
        print(f"tfdist train: wrote {out / 'report.json'}, {out / 'report.png'} and "
              f"{out / 'model.keras'}", flush=True)
    return code
