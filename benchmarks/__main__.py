"""``python -m benchmarks NAME``: the command line of the project's harnesses (see
``benchmarks/__init__.py``). Arguments are checked before anything runs; a mistake is one line
and exit status 2."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ray_graceful.tools.arguments import (
    EXIT_USAGE,
    CliError,
    comma_choices,
    count,
    positive_int,
    positive_ints,
    positive_seconds,
)
from ray_graceful.tools.bench import (
    DIAGNOSTICS,
    add_json_argument,
    add_release_arguments,
    add_save_arguments,
    diagnostic,
)
from ray_graceful.tools.bench.kit import run_and_write

from .fanout import add_fanout_parser
from .host_loss import add_host_loss_parser
from .host_watch_load import add_host_watch_load_parser
from .host_watch_scale import add_host_watch_scale_parser
from .keeper_memory import add_keeper_memory_parser
from .replies import add_replies_parser
from .restart import add_restart_parser
from .soak import add_soak_parser
from .watcher import add_watcher_parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__import__("benchmarks").__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    names = parser.add_subparsers(dest="bench", required=True, metavar="NAME")

    release = names.add_parser("release", help="eviction to every rank out, vs the baseline")
    add_release_arguments(release)

    save = names.add_parser("save", help="emergency-save MB/s; --tier memory, --format dcp")
    add_save_arguments(save)
    save.add_argument(
        "--tier",
        choices=("disk", "memory"),
        default="disk",
        help="disk: today's durable save vs raw writes; memory: the memory tier (a keeper on "
        "this node and on a second one) vs the durable disk save vs torch.save, and the loads",
    )
    save.add_argument(
        "--format",
        choices=("torch", "dcp"),
        default="torch",
        help="torch: the default saver (torch.save); dcp: the emergency DCP save (dcp_saver + "
        "the commit's metadata assembly) vs an ordinary collective dcp.save vs the default "
        "saver, and a dcp.load at another world size checked bitwise",
    )
    save.add_argument(
        "--ranks", type=positive_int, default=2, help="--format dcp: saving ranks (default 2)"
    )
    save.add_argument(
        "--load-ranks",
        type=positive_int,
        default=3,
        help="--format dcp: ranks that load the emergency checkpoint (default 3)",
    )
    save.add_argument(
        "--preallocate",
        action="store_true",
        help="--tier memory: start the object stores pre-populated "
        "(RAY_preallocate_plasma_memory=1), so the first hand-off pays no page faults",
    )

    plan = names.add_parser("plan", help="planning time for many ranks")
    plan.add_argument("--sizes", type=positive_ints, default="1000,10000,100000")
    plan.add_argument("--reps", type=positive_int, default=7)

    overhead = names.add_parser("overhead", help="step time with the plugin idle, vs without")
    overhead.add_argument(
        "--steps", type=positive_int, default=100, help="steps per round (default 100)"
    )
    overhead.add_argument(
        "--rounds", type=positive_int, default=12, help="alternating rounds (default 12)"
    )

    recovery = names.add_parser("recovery", help="Ray Train: preemption to resumed training")
    recovery.add_argument(
        "--total", type=positive_int, default=80, help="steps in the run (default 80)"
    )
    recovery.add_argument(
        "--every", type=positive_int, default=10, help="periodic checkpoint interval (default 10)"
    )
    recovery.add_argument("--step-s", type=positive_seconds, default=0.3, help="seconds per step")
    recovery.add_argument(
        "--evict-after", type=positive_int, default=16, help="steps before the node is drained"
    )
    recovery.add_argument(
        "--deadline",
        type=positive_seconds,
        default=10.0,
        help="drain deadline in seconds (default 10)",
    )
    recovery.add_argument(
        "--tier",
        choices=("memory",),
        help="memory: a hand-built group's restart from the memory tier against the same "
        "checkpoint on disk, same run (see --sizes, --reps, --ranks)",
    )
    recovery.add_argument(
        "--sizes",
        type=positive_ints,
        default="64,256,1024",
        help="--tier memory: MB per shard (default 64,256,1024)",
    )
    recovery.add_argument(
        "--reps", type=positive_int, default=3, help="--tier memory: repetitions (default 3)"
    )
    recovery.add_argument(
        "--ranks", type=positive_int, default=2, help="--tier memory: ranks, one shard each"
    )
    recovery.add_argument(
        "--peers",
        action="store_true",
        help="the race: no handling, Ray Train's own preemption handling (documented, and its "
        "best), and ray_graceful, through each scenario (see --scenarios)",
    )
    recovery.add_argument(
        "--scenarios",
        type=comma_choices("drain", "sigterm", "stuck", "faulty"),
        default="drain,sigterm,stuck,faulty",
        help="with --peers: drain, sigterm, stuck, faulty (default: all)",
    )
    recovery.add_argument(
        "--ways",
        type=comma_choices("none", "ray-documented", "ray-best", "graceful", "graceful-warm"),
        default="none,ray-documented,ray-best,graceful,graceful-warm",
        help="with --peers: none, ray-documented, ray-best, graceful, graceful-warm (Ray Train's "
        "warm path: GracefulTorchConfig) (default: all)",
    )
    recovery.add_argument(
        "--free-nodes",
        type=count,
        default=2,
        help="with --peers: free worker nodes already in the cluster (spare capacity); 0: a "
        "fresh node is started once the old one is gone",
    )

    fanout = add_fanout_parser(names)
    replies = add_replies_parser(names)
    restart = add_restart_parser(names)
    soak = add_soak_parser(names)
    watcher = add_watcher_parser(names)
    host_loss = add_host_loss_parser(names)
    keeper_memory = add_keeper_memory_parser(names)
    host_watch_scale = add_host_watch_scale_parser(names)
    host_watch_load = add_host_watch_load_parser(names)
    harnesses = (
        release, save, plan, overhead, recovery, fanout, replies, restart, soak, watcher,
        host_loss, keeper_memory, host_watch_scale, host_watch_load,
    )  # fmt: skip
    for p in harnesses:
        add_json_argument(p)
    return parser


def _runner(args: argparse.Namespace) -> Callable[[argparse.Namespace], dict[str, Any]]:
    """The function that runs ``args.bench``, imported only when it runs."""
    if args.bench == "save" and args.format == "dcp":
        if args.tier != "disk":
            raise CliError(
                "save --format dcp measures the disk save (emergency DCP vs dcp.save); "
                "use --tier disk (the default) with it"
            )
        from .dcp import bench_save_dcp

        return bench_save_dcp
    if args.bench == "save" and args.tier == "memory":
        from .memory import bench_save_memory

        return bench_save_memory
    if args.bench == "soak" and args.warm and args.train:
        raise CliError("soak: --warm and --train are two harnesses; give one")
    if args.bench == "soak" and args.train:
        from .soak_train import bench_soak_train

        return bench_soak_train
    if args.bench == "soak" and args.warm:
        from .soak_warm import bench_soak_warm

        return bench_soak_warm
    if args.bench in DIAGNOSTICS:
        return diagnostic(args.bench)
    module = args.bench.replace("-", "_")
    return getattr(importlib.import_module(f".{module}", __package__), f"bench_{module}")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run_and_write(_runner(args), args, args.bench, "python -m benchmarks")
    except CliError as exc:
        print(f"python -m benchmarks {args.bench}: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
