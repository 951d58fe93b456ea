"""What the command line accepts: its error type and the argparse types of its options.

Every command (``notify``, ``status``, ``bench`` ...) and the project's harnesses
(``python -m benchmarks``) check their arguments with these, so a mistake is one line saying
what was wrong and what is allowed - never a traceback, and never after a benchmark ran.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from typing import Any

EXIT_USAGE, EXIT_NO_CLUSTER, EXIT_NO_COORDINATOR, EXIT_REJECTED = 2, 3, 4, 5


class CliError(Exception):
    def __init__(self, message: str, status: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.status = status


def group_rank(text: str) -> tuple[str, int]:
    group, sep, rank = text.rpartition("/")
    if not sep or not group or not rank.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: give GROUP/RANK, e.g. policy/3")
    return group, int(rank)


MAX_TIMEOUT_S = 86_400.0  # --timeout: a day; more overflows the clients' timers
MAX_SECONDS = 1e10  # any number of seconds or Unix time (the year 2286)


def _seconds_within(
    text: str, minimum: float, allow_equal: bool, maximum: float = MAX_SECONDS
) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{cut(text)} is not a number of seconds") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{cut(text)}: give a finite number of seconds")
    if value < minimum or (value == minimum and not allow_equal):
        raise argparse.ArgumentTypeError(
            f"{cut(text)}: seconds must be {'>=' if allow_equal else '>'} {minimum:g}"
        )
    if value > maximum:
        raise argparse.ArgumentTypeError(f"{cut(text)}: at most {maximum:g} seconds")
    return value


def non_negative_seconds(text: str) -> float:
    return _seconds_within(text, 0.0, allow_equal=True)


def timeout_seconds(text: str) -> float:
    return _seconds_within(text, 0.0, allow_equal=True, maximum=MAX_TIMEOUT_S)


def deadline_in(text: str) -> float:
    from ..notices import MAX_DEADLINE_AHEAD_S

    value = non_negative_seconds(text)
    if value > MAX_DEADLINE_AHEAD_S:
        raise argparse.ArgumentTypeError(
            f"{cut(text)}: a deadline at most 7 days ({MAX_DEADLINE_AHEAD_S:.0f} s) ahead"
        )
    return value


def positive_seconds(text: str) -> float:
    """argparse type: a finite number of seconds > 0."""
    return _seconds_within(text, 0.0, allow_equal=False, maximum=1e6)


def cut(text: str, limit: int = 60) -> str:
    """An argument as an error shows it: quoted, and cut short."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def utf8_text(text: str) -> str:
    """argparse type: text that is valid UTF-8 (argv bytes that are not decode to surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(
            f"{cut(text.encode('utf-8', 'backslashreplace').decode())} is not valid UTF-8 text"
        ) from None
    return text


def comma_choices(*allowed: str) -> Any:
    """argparse type: a comma-separated subset of ``allowed``, e.g. 'sigterm,drain'."""

    def parse(text: str) -> str:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        wrong = [p for p in parts if p not in allowed]
        if not parts or wrong:
            shown = f"{cut(wrong[0])} is not one of them; " if wrong else ""
            raise argparse.ArgumentTypeError(
                f"{shown}give one or more of {', '.join(allowed)}, separated by commas"
            )
        return ",".join(parts)

    return parse


def _nearest_existing(path: str) -> str:
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def writable_dir(text: str) -> str:
    """argparse type: a directory that exists and is writable, or can be made."""
    path = os.path.abspath(utf8_text(text))
    base = _nearest_existing(path)
    if not os.path.isdir(base):
        what = "is not a directory" if base == path else f"cannot be made: {base} is not one"
        raise argparse.ArgumentTypeError(f"{cut(text)} {what}")
    if not os.access(base, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{cut(text)}: {base} is not writable")
    return text


def writable_file(text: str) -> str:
    """argparse type: a file path whose directory is (or can be made) writable."""
    path = os.path.abspath(utf8_text(text))
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{cut(text)} is a directory: give a file path")
    try:
        writable_dir(os.path.dirname(path))
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{cut(text)}: its directory {exc}") from None
    return text


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"{text!r}: give an integer >= {low}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int_at_least(text, 1)


def count(text: str) -> int:
    """argparse type: an integer >= 0 (how many of something; 0: none)."""
    return _int_at_least(text, 0)


def positive_ints(text: str) -> list[int]:
    """argparse type: a comma-separated list of integers >= 1, e.g. '2,4,8'."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"{text!r}: give integers >= 1 separated by commas")
    try:
        return [positive_int(p) for p in parts]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give integers >= 1 separated by commas, e.g. 2,4,8"
        ) from None


def non_empty(text: str) -> str:
    if not utf8_text(text).strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def unix_time(text: str) -> float:
    value = non_negative_seconds(text)
    if value <= time.time():
        raise argparse.ArgumentTypeError(
            f"{text!r} is a Unix time in the past ({time.time() - value:.0f}s ago); for seconds "
            "from now use --deadline-in"
        )
    return value
