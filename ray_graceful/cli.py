"""The ``ray-graceful`` command line.

Commands: ``config`` (show or document the configuration).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict

from .config import ConfigError, GracefulConfig, config_reference_markdown


def _cmd_config(args: argparse.Namespace) -> int:
    if args.markdown:
        sys.stdout.write(config_reference_markdown())
        return 0
    config = GracefulConfig.from_env()
    print(json.dumps(asdict(config), indent=2, sort_keys=True))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ray-graceful",
        description="Bounded, clean, reported endings for distributed PyTorch training on Ray.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    config = sub.add_parser(
        "config",
        help="print the configuration read from RAY_GRACEFUL_* variables",
        description="Print the effective configuration (from RAY_GRACEFUL_* variables) as "
        "JSON, or the reference table of every setting as Markdown.",
    )
    config.add_argument("--markdown", action="store_true", help="print the reference table")
    config.set_defaults(func=_cmd_config)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"ray-graceful: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
