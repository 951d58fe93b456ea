"""The ``ray-graceful`` command line.

Commands:
  notify     tell the coordinator a node or rank is going away (Kubernetes preStop, SLURM)
  status     the coordinator's view: ranks, health, the last outcome
  plan       a planning dry run on a scenario file (JSON or YAML)
  demo       the main job: an eviction handled end to end on a local cluster
  anyscale   switch the plugin on in an Anyscale job YAML
  bench      measure release and save on this machine, against their baselines
  config     the effective configuration, or its reference table
  dashboard  the Grafana dashboard of ray_graceful's metrics, beside Ray's own

Exit statuses: 0 done; 2 bad arguments or configuration; 3 no Ray cluster reachable; 4 no
coordinator running; 5 the coordinator rejected the notice.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from ..config import ConfigError, GracefulConfig, config_reference_markdown, is_rays_own
from .arguments import (
    EXIT_NO_COORDINATOR,
    EXIT_REJECTED,
    EXIT_USAGE,
    CliError,
    cut,
    deadline_in,
    group_rank,
    non_empty,
    non_negative_seconds,
    positive_int,
    timeout_seconds,
    unix_time,
    utf8_text,
    writable_dir,
    writable_file,
)
from .connection import connect_coordinator, connect_every_coordinator, job_config

# --- commands ------------------------------------------------------------------------------


def _cmd_notify(args: argparse.Namespace) -> int:
    import ray

    config = job_config(args)
    node_id = args.node_id
    every_job = args.rank is None and args.job is None and not config.coordinator_name
    coordinators = (
        connect_every_coordinator(args, config)
        if every_job
        else [connect_coordinator(args, config)]
    )
    if args.this_node:
        node_id = ray.get_runtime_context().get_node_id()
    deadline = 0.0
    if args.deadline_in is not None:
        deadline = time.time() + args.deadline_in
    elif args.deadline is not None:
        deadline = args.deadline
    target = f"node {node_id}" if node_id else f"rank {args.rank[0]}/{args.rank[1]}"
    accepted, refused, silent = [], [], []
    for coordinator in coordinators:
        who = coordinator.name if len(coordinators) > 1 else ""
        try:
            answer = coordinator.notify(
                node_id=node_id,
                rank=args.rank,
                reason=args.reason,
                deadline=deadline,
                source="cli",
                timeout=args.timeout,
            )
        except Exception as exc:
            silent.append(f"{who or 'the coordinator'} did not answer: {exc}")
            continue
        if answer.accepted:
            accepted.append(f"{coordinator.name} (cycle {answer.cycle})")
        else:
            refused.append(f"{who}: {answer.reason}" if who else answer.reason)
    if not accepted:
        if silent and not refused:
            raise CliError("; ".join(silent), EXIT_NO_COORDINATOR)
        print(
            f"ray-graceful notify: rejected ({target}): {'; '.join(refused + silent)}",
            file=sys.stderr,
        )
        return EXIT_REJECTED
    for line in refused + silent:  # other jobs: the node holds none of their ranks
        print(f"ray-graceful notify: not for {line}", file=sys.stderr)
    print(f"ray-graceful notify: accepted ({target}) by {', '.join(accepted)}")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    coordinator = connect_coordinator(args, job_config(args))
    try:
        status = coordinator.status(timeout=args.timeout)
    except Exception as exc:
        raise CliError(f"the coordinator did not answer: {exc}", EXIT_NO_COORDINATOR) from exc
    if args.json:
        print(json.dumps(status, indent=2, sort_keys=True))
        return 0
    print(
        f"cycle {status['cycle']}  job {status['job_state']}"
        f"{'  (tearing down)' if status['tearing_down'] else ''}"
    )
    rows = [("rank", "node", "pid", "shard", "step", "health", "seen")]
    for r in status["ranks"]:
        rows.append(
            (
                f"{r['group']}/{r['rank']}",
                r["node_id"][:12],
                str(r["pid"]),
                r["shard"],
                str(r["last_step"]),
                r["health"],
                f"{r['seen_s_ago']}s ago",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    for spare in status["spares"]:
        print(f"{spare['role']} {spare['id']} on {spare['node_id'][:12]} (pid {spare['pid']})")
    for group, why in sorted(status.get("incomplete_groups", {}).items()):
        print(f"group {group} is incomplete, so never saved: {why}")
    durable = status.get("durable")
    if durable and durable.get("says"):
        print(f"DURABLE: {durable['says']}")
    elif durable and durable.get("step") is not None:
        print(f"durable: step {durable['step']} at {durable['path']}")
    if status["plan_table"]:
        print("\ncurrent plan:\n" + status["plan_table"])
    if status["last_outcome"]:
        from ..outcome import TerminationOutcome

        print("\nlast outcome: " + TerminationOutcome.from_dict(status["last_outcome"]).summary())
    for rejected in status["rejected"]:
        print(f"rejected: {rejected['reason']}")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from ..plan import TopologyError
    from .dry_run import ScenarioError, plan_file

    now = time.time() if args.now is None else args.now
    try:
        plan = plan_file(args.scenario, now=now)
    except (ScenarioError, ConfigError, TopologyError) as exc:
        raise CliError(f"{args.scenario}: {exc}") from exc
    except OSError as exc:
        raise CliError(f"{args.scenario}: cannot read it: {exc.strerror or exc}") from exc
    if args.json:
        print(json.dumps({"now": now, **plan.to_dict()}, indent=2, sort_keys=True))
    else:
        print(f"now = {now:.3f} (Unix seconds); deadlines below are relative to it")
        print(plan.table(now=now))
    return 0


def _cmd_anyscale(args: argparse.Namespace) -> int:
    from ..anyscale import DEFAULT_PACKAGE, AnyscaleConfigError, enable_yaml

    overrides = {}
    fields = GracefulConfig.field_names()
    for item in args.set or []:
        name, sep, value = item.partition("=")
        if not sep:
            raise CliError(f"--set {cut(item)}: give FIELD=VALUE, e.g. checkpoint_dir=/mnt/ckpt")
        field, variable = name.strip().lower(), f"RAY_GRACEFUL_{name.strip().upper()}"
        if field not in fields:
            import difflib

            close = difflib.get_close_matches(field, fields, n=1)
            hint = f" Did you mean {close[0]}?" if close else ""
            if is_rays_own(variable):
                hint = f" {variable} is Ray's own variable: set it in the job's env_vars yourself."
            raise CliError(
                f"--set {cut(name)}: not a ray_graceful setting.{hint} Allowed: "
                f"{', '.join(fields)}."
            )
        overrides[variable] = value
    if args.checkpoint_dir:
        overrides["RAY_GRACEFUL_CHECKPOINT_DIR"] = args.checkpoint_dir
    config = GracefulConfig.from_env(overrides)
    target = args.output or args.job
    try:
        enable_yaml(
            args.job,
            target,
            config=config,
            package=None if args.no_package else (args.package or DEFAULT_PACKAGE),
            train_callback=not args.no_train_callback,
            setup_hook=not args.no_setup_hook,
        )
    except AnyscaleConfigError as exc:
        raise CliError(f"{args.job}: {exc}") from exc
    except OSError as exc:  # the file it names: the job read, or the output written
        raise CliError(f"{exc.filename or args.job}: {exc.strerror or exc}") from exc
    print(f"ray-graceful anyscale: wrote {target}")
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    if args.markdown:
        sys.stdout.write(config_reference_markdown())
        return 0
    config = GracefulConfig.from_env()
    config.check_checkpoint_dir()
    print(json.dumps(config.model_dump(mode="json"), indent=2, sort_keys=True))
    return 0


def _cmd_dashboard(args: argparse.Namespace) -> int:
    from .dashboard import dashboard_json

    if args.output is None:
        sys.stdout.write(dashboard_json())
        return 0
    try:
        with open(args.output, "w") as f:
            f.write(dashboard_json())
    except OSError as exc:
        raise CliError(f"{args.output}: {exc.strerror or exc}") from exc
    print(f"ray-graceful dashboard: wrote {args.output}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    scene = "host-loss" if args.host_loss else "drain"
    return run_demo(output=args.output, steps_before=args.steps, scene=scene)


# --- parser --------------------------------------------------------------------------------


def _connection_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--address",
        type=utf8_text,
        default="auto",
        help="Ray cluster address (default: auto, the cluster on this node)",
    )
    p.add_argument(
        "--coordinator",
        type=non_empty,
        help="coordinator name, where the jobs set RAY_GRACEFUL_COORDINATOR_NAME (default: the "
        "job's own coordinator)",
    )
    p.add_argument(
        "--namespace", type=non_empty, help="coordinator namespace (default: ray_graceful)"
    )
    p.add_argument(
        "--job",
        type=non_empty,
        help="the Ray job whose coordinator to talk to (default: the only one running)",
    )
    p.add_argument(
        "--timeout",
        type=timeout_seconds,
        default=10.0,
        help="seconds to wait for the coordinator (default 10)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ray-graceful",
        description="Bounded, clean, reported endings for distributed PyTorch training on Ray.",
        epilog="Exit statuses: 0 done; 2 bad arguments or configuration; 3 no Ray cluster; "
        "4 no coordinator; 5 notice rejected.",
    )
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"ray-graceful {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    notify = sub.add_parser(
        "notify",
        help="tell the coordinator a node or rank is going away",
        description="Tell the running job's coordinator that a node or a rank is going away. "
        "Use it as a Kubernetes preStop hook (ray-graceful notify --this-node --deadline-in 25 "
        "--reason 'pod terminating') or from a SLURM --signal handler.",
    )
    target = notify.add_mutually_exclusive_group(required=True)
    target.add_argument("--this-node", action="store_true", help="the Ray node this runs on")
    target.add_argument("--node-id", type=non_empty, help="a Ray node id (hex)")
    target.add_argument("--rank", type=group_rank, help="one rank, as GROUP/RANK")
    notify.add_argument(
        "--reason", required=True, type=utf8_text, help="why (shown in the plan and outcome)"
    )
    when = notify.add_mutually_exclusive_group()
    when.add_argument(
        "--deadline-in",
        type=deadline_in,
        metavar="SECONDS",
        help="the node or rank is gone this many seconds from now",
    )
    when.add_argument(
        "--deadline",
        type=unix_time,
        metavar="UNIX_SECONDS",
        help="the node or rank is gone at this time (Unix seconds, in the future)",
    )
    _connection_options(notify)
    notify.set_defaults(func=_cmd_notify)

    status = sub.add_parser(
        "status",
        help="the coordinator's view: ranks, health, outcome",
        description="Show the running coordinator's ranks, their health "
        "and last step, and the last termination outcome.",
    )
    status.add_argument("--json", action="store_true", help="print the raw status as JSON")
    _connection_options(status)
    status.set_defaults(func=_cmd_status)

    plan = sub.add_parser(
        "plan",
        help="a planning dry run on a scenario file",
        description="Plan who saves and who leaves for the scenario in FILE "
        "(JSON or YAML: ranks, notices, health, config) and print the table. "
        "Deadlines print relative to now (printed first; --now sets it).",
    )
    plan.add_argument("scenario", metavar="FILE")
    plan.add_argument(
        "--now",
        type=non_negative_seconds,
        metavar="UNIX_SECONDS",
        help="the time to plan at (default: the current time); deadline_in_s counts from it",
    )
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(func=_cmd_plan)

    demo = sub.add_parser(
        "demo",
        help="the main job: an eviction handled end to end",
        description="Start a local multi-node Ray cluster, train a small "
        "model on CPU ranks, drain one node and fault another, and show the "
        "plan, the teardown, the committed checkpoint and the resume.",
    )
    demo.add_argument(
        "--output",
        type=writable_dir,
        default="demo-output",
        help="directory for the outcome JSON and the timeline PNG",
    )
    demo.add_argument(
        "--steps",
        type=positive_int,
        default=6,
        help="training steps before the eviction (default 6)",
    )
    demo.add_argument(
        "--host-loss",
        action="store_true",
        help="instead of a drain and a fault: node B crashes without a notice (every process "
        "SIGKILLed); the host watch declares it lost and the group comes back from the replicas",
    )
    demo.set_defaults(func=_cmd_demo)

    anyscale = sub.add_parser(
        "anyscale",
        help="switch the plugin on in an Anyscale job YAML",
        description="Read an Anyscale job YAML and write it back with "
        "ray_graceful on: its settings, the Ray Train callback and the "
        "worker setup hook in env_vars, the package in requirements. The "
        "job's own env_vars are kept; a conflicting one is an error.",
    )
    anyscale.add_argument("job", metavar="JOB_YAML")
    anyscale.add_argument(
        "-o", "--output", type=writable_file, help="where to write (default: in place)"
    )
    anyscale.add_argument("--checkpoint-dir", help="emergency checkpoint directory")
    anyscale.add_argument(
        "--set",
        action="append",
        metavar="FIELD=VALUE",
        help="any GracefulConfig field, e.g. --set save_budget_s=12",
    )
    anyscale.add_argument(
        "--package", help="requirement to install (default: ray-graceful==this version)"
    )
    anyscale.add_argument(
        "--no-package",
        action="store_true",
        help="do not add the package (it is in the image already)",
    )
    anyscale.add_argument(
        "--no-train-callback",
        action="store_true",
        help="do not set RAY_TRAIN_CALLBACKS (not a Ray Train job)",
    )
    anyscale.add_argument(
        "--no-setup-hook",
        action="store_true",
        help="do not set the worker setup hook (no async actors)",
    )
    anyscale.set_defaults(func=_cmd_anyscale)

    from .bench import add_bench_parser

    add_bench_parser(sub)

    config = sub.add_parser(
        "config",
        help="the effective configuration, or its reference",
        description="Print the configuration read from RAY_GRACEFUL_* "
        "variables as JSON, or (--markdown) the reference table.",
    )
    config.add_argument("--markdown", action="store_true", help="print the reference table")
    config.set_defaults(func=_cmd_config)

    dashboard = sub.add_parser(
        "dashboard",
        help="the Grafana dashboard of ray_graceful's metrics",
        description="Print (or write, -o) the Grafana dashboard for ray_graceful's metrics, in "
        "the shape of Ray's own: load it beside them (docs/metrics.md).",
    )
    dashboard.add_argument(
        "-o", "--output", type=writable_file, help="the file to write (default: standard output)"
    )
    dashboard.set_defaults(func=_cmd_dashboard)
    return parser


def _chosen(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost subcommand's parser ``args`` went through (``bench release``'s for
    ``ray-graceful bench release``): its usage is the one that helps with a wrong flag."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(args, action.dest, None) or "")
            if chosen is not None:
                return _chosen(chosen, args)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the subcommand, with its own usage, not the top level's
        _chosen(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return int(args.func(args))
    except CliError as exc:
        print(f"ray-graceful {args.command}: {exc}", file=sys.stderr)
        return exc.status
    except ConfigError as exc:
        print(f"ray-graceful {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
