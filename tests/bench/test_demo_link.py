"""``sparsync demo``'s links: ``--net auto`` emulates 1 Gbit/s where it may (root, ``ip`` and ``tc``) and says
which setting it ran on and why; ``loopback`` and a rate are taken as asked."""

from __future__ import annotations

import pytest

from sparsync_bench import cli


@pytest.mark.parametrize(
    ("uid", "tools", "want"),
    [(0, True, "1gbit"), (1000, True, None), (0, False, None)],
)
def test_auto_emulates_links_only_where_it_can(
    monkeypatch: pytest.MonkeyPatch, uid: int, tools: bool, want: str | None
) -> None:
    monkeypatch.setattr("os.geteuid", lambda: uid)
    monkeypatch.setattr("shutil.which", lambda name: f"/usr/sbin/{name}" if tools else None)
    net, why = cli.demo_link("auto")
    assert net == want
    assert why.startswith("emulated 1gbit links" if want else "loopback: emulated links need root")


def test_an_asked_setting_is_kept() -> None:
    assert cli.demo_link("loopback") == (None, "loopback (asked for)")
    net, why = cli.demo_link("250mbit")
    assert net == "250mbit" and "asked for" in why
