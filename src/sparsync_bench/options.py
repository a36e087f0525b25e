"""The ``sparsync`` command's option types and shared options: sizes (``16M``), comma lists, choices, the option
groups several subcommands take (``--net``/``--latency``, ``--hosts``/``--procs-per-host``, ``--no-progress``),
and ``HelpFormatter``, which ends every option's help with its default. argparse only: the command imports it
before it knows the bench extra is there."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import Any

_SIZE = re.compile(r"^(\d+)([kKmMgG]?)$")


def parse_size(text: str) -> int:
    """'16M' -> 16*2**20, '1000' -> 1000."""
    m = _SIZE.match(text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: expected e.g. 16M, 1M, 500k, 1000")
    return int(m.group(1)) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[m.group(2).lower()]


def ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def sizes(text: str) -> tuple[int, ...]:
    return tuple(parse_size(x) for x in text.split(","))


def choices(valid: tuple[str, ...], what: str) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        out = tuple(text.split(","))
        bad = [m for m in out if m not in valid]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {what} {bad}; valid: {', '.join(valid)}")
        return out

    return parse


def shown_default(default: Any) -> str:
    """An option's default as ``--help`` shows it: a tuple as the comma list the option takes, a list as the
    separate values, 0 as 0, and nothing given (None, an empty list) as "none"."""
    if default is None or (isinstance(default, tuple | list) and not default):
        return "none"
    if isinstance(default, tuple):
        return ",".join(map(str, default))
    if isinstance(default, list):
        return " ".join(map(str, default))
    return '""' if default == "" else str(default)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default (``shown_default``), unless the help already names it. A flag
    (an option that takes no value, e.g. ``store_true``) has none to show: it is on when given, off otherwise."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            not action.option_strings
            or action.nargs == 0
            or action.default is argparse.SUPPRESS
            or "default" in text
        ):
            return text
        return f"{text} (default: {shown_default(action.default).replace('%', '%%')})"


def points(p: argparse.ArgumentParser, *dests: str) -> int:
    """The size of the grid that ``p``'s defaults for these list options span."""
    n = 1
    for d in dests:
        n *= len(p.get_default(d))
    return n


def shared_options() -> dict[str, argparse.ArgumentParser]:
    """Option groups shared by several subcommands."""
    net = argparse.ArgumentParser(add_help=False)
    net.add_argument("--net", default=None, help="shape each rank's link, e.g. 1gbit, 100mbit (needs root)")
    net.add_argument("--latency", default=None, help="extra one-way delay per link with --net, e.g. 0.5ms")
    progress = argparse.ArgumentParser(add_help=False)
    progress.add_argument("--no-progress", action="store_true", help="no progress bar")
    hosts = argparse.ArgumentParser(add_help=False)
    hosts.add_argument("--hosts", type=int, default=None, help="emulated hosts (with --procs-per-host)")
    hosts.add_argument("--procs-per-host", type=int, default=None, help="ranks per emulated host (shared link)")
    return {"net": net, "progress": progress, "hosts": hosts}


def hosts(args: argparse.Namespace, procs: tuple[int, ...]) -> tuple[tuple[int, ...], int | None]:
    """(world sizes, ranks per host) from ``--procs`` or ``--hosts`` with ``--procs-per-host``."""
    if args.hosts is None and args.procs_per_host is None:
        return procs, None
    if args.hosts is None or args.procs_per_host is None or min(args.hosts, args.procs_per_host) < 1:
        raise ValueError("give both --hosts and --procs-per-host (each >= 1)")
    return (args.hosts * args.procs_per_host,), args.procs_per_host


def hosts_and_methods(
    args: argparse.Namespace, defaults: tuple[str, ...], on_hosts: tuple[str, ...]
) -> tuple[tuple[int, ...], int | None, tuple[str, ...]]:
    """``hosts``, and the methods: ``on_hosts`` instead of the default list when hosts are emulated."""
    procs, per_host = hosts(args, args.procs)
    methods = on_hosts if per_host is not None and args.methods == defaults else args.methods
    return procs, per_host, methods
