"""Every subcommand's help: each option explained, with its default; no issue numbers in user-facing text."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sparsync_bench.cli import build_parser, shown_default

Parsers = list[tuple[str, argparse.ArgumentParser]]


def _subparsers(p: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Parsers:
    out = [(" ".join(path), p)]
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sp in a.choices.items():
                out += _subparsers(sp, (*path, name))
    return out


PARSERS = _subparsers(build_parser())


def test_every_subcommand_is_listed() -> None:
    names = {n for n, _ in PARSERS}
    want = {"demo", "plan", "cluster", "reproduce", "bench"}
    want |= {f"bench {b}" for b in ("allreduce", "compress", "embedding", "dlrm", "hybrid")}
    assert want <= names


def _rendered(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The action's entry in ``parser``'s --help as printed, without its whitespace (argparse breaks a long comma
    list inside a word)."""
    formatter = parser._get_formatter()
    formatter.add_argument(action)
    return "".join(formatter.format_help().split())


@pytest.mark.parametrize("name,parser", PARSERS, ids=[n or "sparsync" for n, _ in PARSERS])
def test_options_have_help_with_defaults(name: str, parser: argparse.ArgumentParser) -> None:
    """Every option that takes a value shows its default, 0, 0.0, empty and None ("none") included, or its help
    says the default in words ("default: generate one"). Flags (no value: store_true and the like) are left
    out: a flag is on when given and off otherwise, and "(default: False)" would name a Python value."""
    text = parser.format_help()
    assert not re.search(r"\(issue \d+\)|issue \d+", text, re.I), f"{name}: an issue number in its help"
    for a in parser._actions:
        if isinstance(a, argparse._HelpAction | argparse._SubParsersAction | argparse._VersionAction):
            continue
        assert a.help, f"sparsync {name} {a.option_strings or a.dest}: no help text"
        if not a.option_strings or a.nargs == 0 or a.default is argparse.SUPPRESS:
            continue
        shown = _rendered(parser, a)
        if "default" in a.help:  # the help says it in words, and the formatter adds nothing
            assert shown.count("default") == a.help.count("default"), f"sparsync {name} {a.option_strings}"
            continue
        # shown_default's values themselves are checked by their literals below
        want = "".join(f"(default: {shown_default(a.default)})".split())
        assert shown.endswith(want), f"sparsync {name} {a.option_strings}: {shown!r} does not end with {want!r}"


@pytest.mark.parametrize(
    "argv,option,default",
    [(["cluster"], "--max-restarts", "0"), (["trace", "merge"], "--from-step", "0"),
     (["bench", "hybrid"], "--text", "none"), (["plan"], "--override", "none")],
)  # fmt: skip
def test_zero_and_empty_defaults_are_printed(
    argv: list[str], option: str, default: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``sparsync <command> --help`` as a user runs it: a default of 0 or nothing is printed like any other."""
    from sparsync_bench.cli import main

    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0
    options = capsys.readouterr().out.split("options:", 1)[1]  # past the usage line
    entry = options[options.index(f"\n  {option} ") + 1 :]
    end = re.search(r"\n  -", entry)  # the next option's entry
    entry = " ".join(entry[: end.start() if end else None].split())
    assert entry.endswith(f"(default: {default})"), entry


def test_defaults_show_as_the_option_takes_them() -> None:
    text = dict(PARSERS)["bench allreduce"].format_help()
    assert re.search(r"\(default:\s+2,4,8\)", text)  # a tuple as its comma list


def test_every_subcommand_dispatches_to_a_function() -> None:
    for name, parser in PARSERS:
        leaf = not any(isinstance(a, argparse._SubParsersAction) for a in parser._actions)
        if leaf:
            assert callable(parser.get_default("func")), name


def test_without_the_bench_extra_the_command_says_what_to_install() -> None:
    """The library needs neither rich nor matplotlib; the command names the extra that brings them instead of
    failing with a traceback (here rich is made unimportable)."""
    code = "import sys; sys.modules['rich'] = None; from sparsync_bench.cli import main; sys.exit(main(['-h']))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert "pip install -e '.[bench]'" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("name,parser", PARSERS[1:], ids=[n for n, _ in PARSERS[1:]])
def test_every_subcommand_has_a_description(name: str, parser: argparse.ArgumentParser) -> None:
    assert parser.description and parser.description.strip(), f"sparsync {name}: no description"
    assert parser.description.strip() in parser.format_help().replace("\n", " ") or parser.description.split()[
        0
    ] in (parser.format_help())


def test_grid_commands_say_the_size_of_their_default_grid() -> None:
    helps = {n: p.format_help() for n, p in PARSERS}
    assert re.search(r"default grid: 21 points", helps["bench allreduce"]), helps["bench allreduce"]
    assert re.search(r"default grid: 54 points", helps["bench embedding"]), helps["bench embedding"]
    assert "default grid: 2 sizes" in helps["bench compress"]
    assert "5 min 26 s" in helps["reproduce"]


def test_version_prints_the_package_version() -> None:
    import sparsync

    done = subprocess.run(
        [sys.executable, "-m", "sparsync_bench.cli", "--version"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"sparsync {sparsync.__version__}"


def test_results_are_not_overwritten_silently(tmp_path: Path) -> None:
    import io

    from rich.console import Console

    from sparsync_bench.cli import warn_overwrite

    out = tmp_path / "allreduce"
    args = build_parser().parse_args(["bench", "allreduce", "--out", str(out)])
    buf = io.StringIO()
    assert warn_overwrite(args, Console(file=buf, width=200)) == [] and buf.getvalue() == ""
    for suffix in (".json", ".md"):
        Path(f"{out}{suffix}").write_text("{}")
    found = warn_overwrite(args, Console(file=buf, width=200))
    assert found == [Path(f"{out}.json"), Path(f"{out}.md")]
    assert buf.getvalue().strip() == f"overwriting {out}.json, {out}.md"
    rdir = tmp_path / "reproduce"
    rdir.mkdir()
    (rdir / "report.md").write_text("x")
    args = build_parser().parse_args(["reproduce", "--out", str(rdir)])
    assert warn_overwrite(args, Console(file=io.StringIO())) == [rdir]
