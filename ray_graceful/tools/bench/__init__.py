"""``ray-graceful bench``: measure what the plugin costs and saves on your own cluster, as
``ray microbenchmark`` measures Ray.

- ``release``  from an eviction (SIGTERM to a rank, or its node drained) to every rank out,
               against the same job without the plugin, in the same run (``release.py``).
- ``save``     the emergency save's MB/s on a directory of yours, against raw sequential writes
               and a plain ``torch.save`` (``save.py``).

Each prints a Markdown table and writes JSON (``--json``, default ``bench-output/<name>.json``).
``release`` starts a private local cluster in a temp directory.

The project's own harnesses - the race against Ray Train, the fan-out simulation, the memory
tier, restart, DCP and soak studies - are not part of the installed package: they live in the
repository's ``benchmarks/`` and run as ``python -m benchmarks NAME`` from a checkout.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

from ...config import GracefulConfig
from ..arguments import (
    CliError,
    comma_choices,
    positive_int,
    positive_ints,
    positive_seconds,
    writable_dir,
    writable_file,
)

DIAGNOSTICS = ("release", "save")
HARNESSES = ("plan", "overhead", "recovery", "fanout", "restart", "soak")


def add_release_arguments(release: argparse.ArgumentParser) -> None:
    release.add_argument(
        "--sizes", type=positive_ints, default="2,4,8,16", help="ranks per run (default 2,4,8,16)"
    )
    release.add_argument(
        "--reps", type=positive_int, default=5, help="repetitions per size (default 5)"
    )
    release.add_argument(
        "--how",
        type=comma_choices("sigterm", "drain"),
        default="sigterm,drain",
        help="sigterm, drain or sigterm,drain (default)",
    )
    release.add_argument(
        "--timeout",
        type=positive_seconds,
        default=60.0,
        help="collective timeout; the baseline waits this long (default 60)",
    )
    release.add_argument(
        "--no-baseline",
        dest="baseline",
        action="store_false",
        help="skip the runs without the plugin",
    )
    release.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default="gloo",
        help="nccl needs a GPU: a whole one per rank where there are enough, else a share",
    )
    release.add_argument(
        "--groups",
        type=positive_int,
        default=1,
        help="process groups per rank, each all-reduced every step (2: a training and a "
        "weight-sync group, as verl and OpenRLHF have); all are released (default 1)",
    )
    release.add_argument(
        "--drain-poll",
        type=positive_seconds,
        default=GracefulConfig.model_fields["drain_poll_interval_s"].default,
        help="the coordinator's drain_poll_interval_s in these runs (default: the library's, "
        f"{GracefulConfig.model_fields['drain_poll_interval_s'].default}); --how drain "
        "also measures what one poll costs the GCS",
    )
    release.add_argument(
        "--node-agent",
        type=comma_choices("off", "on"),
        default="off",
        help="ranks polling the coordinator themselves (off), through their node's agent (on), "
        "or off,on to compare both in one run (rows 'sigterm+agent')",
    )
    release.add_argument(
        "--imports",
        default="",
        help="modules every rank imports first, e.g. transformers (a real import graph: "
        "what the interpreter's exit has to go through)",
    )


def add_save_arguments(save: argparse.ArgumentParser) -> None:
    save.add_argument(
        "--sizes", type=positive_ints, default="64,256,1024", help="state dict sizes in MB"
    )
    save.add_argument("--reps", type=positive_int, default=3)
    save.add_argument(
        "--dir", type=writable_dir, help="directory to write to (default: a temp directory)"
    )


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json",
        type=writable_file,
        help="where to write the results (default bench-output/<name>.json)",
    )


def add_bench_parser(sub: Any) -> None:
    bench = sub.add_parser(
        "bench",
        help="measure release and save on this machine, against their baselines",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    names = bench.add_subparsers(dest="bench", required=True, metavar="NAME")
    release = names.add_parser("release", help="eviction to every rank out, vs the baseline")
    add_release_arguments(release)
    save = names.add_parser("save", help="emergency-save MB/s vs raw writes and torch.save")
    add_save_arguments(save)
    for parser in (release, save):
        add_json_argument(parser)
    for name in HARNESSES:  # moved out of the package: say where to, not "invalid choice"
        moved = names.add_parser(name, add_help=False, prefix_chars="\0")  # takes any option
        moved.add_argument("rest", nargs="*")
    bench.set_defaults(func=run_benchmark)


def run_benchmark(args: argparse.Namespace) -> int:
    from .kit import run_and_write

    if args.bench not in DIAGNOSTICS:
        raise CliError(
            f"`bench {args.bench}` is one of the project's harnesses, not part of the installed "
            f"package: from a checkout of the repository run `python -m benchmarks {args.bench} "
            f"...` (the package measures {' and '.join(DIAGNOSTICS)})"
        )
    return run_and_write(diagnostic(args.bench), args, args.bench, "ray-graceful")


def diagnostic(name: str) -> Any:
    """The function that runs the diagnostic ``name`` (release, save), imported when asked."""
    return getattr(importlib.import_module(f".{name}", __package__), f"bench_{name}")
