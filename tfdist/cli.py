"""The ``tfdist`` command: ``launch``, ``train``, ``compare`` and ``bench``."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import sys
from pathlib import Path


def _launch(args: argparse.Namespace) -> int:
    from tfdist.launch import LaunchError, LaunchOptions, RendezvousError
    from tfdist.launch.api import launch_target, restarts_for

    # Every option flag's dest is its LaunchOptions field.
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(LaunchOptions)
              if hasattr(args, f.name)}
    options = LaunchOptions(**fields)
    # With -m, SCRIPT names a module and every positional argument is the module's.
    target, module = (None, args.script) if args.module else (args.script, None)
    try:
        launch_target(target, args.args, {}, options, restarts_for(options.chief, options.ps),
                      module=module)
    except (LaunchError, RendezvousError) as error:
        print(f"tfdist launch: FAILED: {error}", file=sys.stderr, flush=True)
        return 1
    except (ValueError, FileNotFoundError, ImportError, RuntimeError) as error:
        print(f"tfdist launch: error: {error}", file=sys.stderr, flush=True)
        return 2
    return 0


def _train(args: argparse.Namespace) -> int:
    from tfdist.train.main import main as train_main

    return train_main(args)


def _compare(args: argparse.Namespace) -> int:
    from tfdist.train.compare import compare_main

    return compare_main(args)


def _source_checkout() -> Path | None:
    """The tfdist checkout this tfdist is imported from, if it has the benchmarks."""
    import tfdist

    root = Path(tfdist.__file__).resolve().parents[1]
    return root if (root / "benchmarks" / "runner.py").is_file() else None


def _bench(args: argparse.Namespace) -> int:
    # The benchmarks are part of the source checkout, not of the wheel.
    root = _source_checkout()
    if root is None:
        print("tfdist bench: the benchmarks are not in the installed package; run "
              "`python -m benchmarks` from a tfdist source checkout", file=sys.stderr)
        return 2
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from benchmarks.runner import main as bench_main

    return bench_main(args)


def build_parser() -> argparse.ArgumentParser:
    from tfdist.launch.options import DEFAULTS

    parser = argparse.ArgumentParser(prog="tfdist", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    launch = commands.add_parser(
        "launch", help="run SCRIPT (or -m MODULE) once per task of a cluster on "
                       "127.0.0.1, or on several nodes with --nnodes")
    launch.add_argument("--workers", type=int, default=DEFAULTS.workers,
                        help="number of worker tasks")
    launch.add_argument("--chief", action="store_true", help="add a chief task")
    launch.add_argument("--ps", type=int, default=DEFAULTS.ps,
                        help="number of parameter servers")
    launch.add_argument("--evaluator", action="store_true",
                        help="add an evaluator task (side-car evaluation; does not train)")
    launch.add_argument("--evaluator-wait", type=float, default=DEFAULTS.evaluator_wait,
                        metavar="SECONDS",
                        help="how long the evaluator may run on after training ended")
    launch.add_argument("--timeout", type=float, default=DEFAULTS.timeout,
                        help="seconds before every task is killed")
    launch.add_argument("--max-restarts", type=int, default=DEFAULTS.max_restarts,
                        help="restart the whole job up to N times after a failure (with "
                             "--nnodes: on every node, which must all give the same N). In a "
                             "parameter-server job (--chief --ps P) a dead worker is restarted "
                             "alone while restarts are left (one each; with --nnodes: the "
                             "whole job), and with none left the job carries on without it "
                             "(it fails once no worker is left)")
    elastic = launch.add_argument_group(
        "elastic", "lose a worker and train on; a worker joins the running job "
                   "(engine='horovod'; docs/elastic.md)")
    elastic.add_argument("--min-workers", type=int, default=DEFAULTS.min_workers,
                         metavar="N",
                         help="make the job elastic: a dead worker is removed and the others "
                              "train on while N remain; --max-restarts counts replacements, "
                              "which join the running job")
    elastic.add_argument("--max-workers", type=int, default=DEFAULTS.max_workers,
                         metavar="N", help="the most workers the elastic job may have "
                                           "(default: --workers); `kill -USR1` to the "
                                           "launcher adds one to the running job")
    elastic.add_argument("--elastic-timeout", type=float, default=DEFAULTS.elastic_timeout,
                         metavar="SECONDS",
                         help="fail once the job stayed below --min-workers this long "
                              "(default 600)")
    launch.add_argument("--backup-dir", default=DEFAULTS.backup_dir,
                        help="exported as TFDIST_BACKUP_DIR; restarts resume from it "
                             "(with --nnodes: put it on storage every node reads)")
    launch.add_argument("--grace-period", type=float, default=DEFAULTS.grace_period,
                        help="seconds between SIGTERM and SIGKILL when stopping tasks")
    launch.add_argument("--isolate-network", action="store_true",
                        help="run the job in a private network namespace (root): TF's "
                             "servers listen on 0.0.0.0, this keeps them unreachable")
    launch.add_argument("--gpus-per-task", type=int, default=DEFAULTS.gpus_per_task,
                        metavar="G",
                        help="GPUs per task in CUDA_VISIBLE_DEVICES (default: this node's "
                             "GPUs divided by its tasks; nothing without GPUs)")
    nodes = launch.add_argument_group(
        "multi-node", "run the same command on every node; --workers/--ps count this "
                      "node's tasks")
    nodes.add_argument("--nnodes", type=int, default=DEFAULTS.nnodes,
                       help="number of nodes (hosts)")
    nodes.add_argument("--node-rank", type=int, default=DEFAULTS.node_rank,
                       help="this node's rank; node 0 hosts the rendezvous")
    nodes.add_argument("--master", default=DEFAULTS.master, metavar="HOST:PORT",
                       help="node 0's rendezvous address, reachable from every node")
    nodes.add_argument("--node-addr", default=DEFAULTS.node_addr,
                       help="address the other nodes reach this node at (default: as "
                            "node 0 sees it)")
    nodes.add_argument("--token", default=DEFAULTS.token,
                       help="shared rendezvous secret (default: $TFDIST_TOKEN; node 0 "
                            "prints a new one if neither is set)")
    nodes.add_argument("--join-timeout", type=float, default=DEFAULTS.join_timeout,
                       help="seconds for every node to join (default 120)")
    launch.add_argument("-m", "--module", action="store_true",
                        help="SCRIPT is a module name: every task runs `python -m SCRIPT "
                             "ARGS...`, as python -m does")
    launch.add_argument("script", help="Python script every task runs (with -m: a module)")
    launch.add_argument("args", nargs=argparse.REMAINDER,
                        help="arguments of the script or module")
    launch.set_defaults(handler=_launch)

    train = commands.add_parser("train", help="run the main job from a TOML config")
    train.add_argument("config", nargs="?", default=None,
                       help="config file (default: the embedded defaults)")
    train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config value, e.g. --set train.epochs=2")
    train.add_argument("--fresh", action="store_true",
                       help="discard the backup in OUTPUT_DIR/backup or $TFDIST_BACKUP_DIR "
                            "(an interrupted run's, of any config) and start at epoch 1; "
                            "without it, a backup of this config is resumed and one of "
                            "another config is refused. A directory that holds anything "
                            "tfdist did not write is never removed")
    nodes = train.add_argument_group(
        "multi-node", "set cluster.mode = 'nodes' and these keys; run the same command on "
                      "every node with its own --node-rank")
    nodes.add_argument("--nnodes", type=int, default=None, help="cluster.nnodes")
    nodes.add_argument("--node-rank", type=int, default=None, help="cluster.node_rank")
    nodes.add_argument("--master", default=None, metavar="HOST:PORT", help="cluster.master")
    train.set_defaults(handler=_train)

    compare = commands.add_parser("compare", help="run several configs side by side")
    compare.add_argument("configs", nargs="+")
    compare.add_argument("--output", default="runs/compare")
    compare.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    compare.set_defaults(handler=_compare)

    bench = commands.add_parser(
        "bench", help="from a source checkout: python -m benchmarks (docs/benchmarks.md)")
    bench.add_argument("--quick", action="store_true", help="tiny sizes, one repetition")
    bench.add_argument("--output", default=None, metavar="DIR",
                       help="where RESULTS.md goes (default: benchmarks/ of the checkout; "
                            "a temporary directory with --quick)")
    bench.add_argument("--jobs", type=int, default=None,
                       help="sections run at once (default: 1; 3 with --quick)")
    bench.set_defaults(handler=_bench)
    return parser


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    """Entry point of the ``tfdist`` console script."""
    # The user's job, not TensorFlow's C++ start-up log (INFO, WARNING), here and in the
    # tasks it starts; a level the user set wins. TF 2.21 logs its banner before it
    # reads the level: this process drops it as the launcher does for its tasks.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from tfdist.launch.banner import hide_tf_banner
    from tfdist.launch.output import cpp_log_level

    hide_tf_banner(cpp_log_level(os.environ))
    # SIGTERM and SIGHUP (the terminal went away) unwind the launcher like Ctrl-C, so
    # it stops its tasks before exiting.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        with contextlib.suppress(OSError):  # after SIGHUP the terminal may be gone
            print("tfdist: interrupted; tasks stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
