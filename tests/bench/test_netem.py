"""Tests for sparsync_bench.netem: parsing everywhere, real namespaces only as root with iproute2."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
from multiprocessing.queues import Queue

import pytest

from sparsync_bench.netem import (
    NetNamespaces,
    NetSpec,
    enter_namespace,
    parse_latency,
    parse_rate,
    require_root,
)

CAN_NETNS = os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None
netns = pytest.mark.netns
needs_netns = pytest.mark.skipif(not CAN_NETNS, reason="needs root and ip/tc to create network namespaces")


@pytest.mark.parametrize(
    ("text", "bits"),
    [
        ("1gbit", 10**9),
        ("100mbit", 10**8),
        ("500kbit", 500_000),
        ("1.5gbit", 1_500_000_000),
        ("64bit", 64),
        (" 2Gbit ", 2 * 10**9),
        (".5mbit", 500_000),
    ],
)
def test_parse_rate_good(text: str, bits: int) -> None:
    assert parse_rate(text) == bits


@pytest.mark.parametrize("text", ["", "1", "1gb", "1gbps", "mbit", "-1mbit", "0mbit", "1.2.3mbit", "1 xbit"])
def test_parse_rate_bad(text: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(text))):
        parse_rate(text)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("1ms", 1e-3), ("200us", 200e-6), ("0.5ms", 0.5e-3), ("2s", 2.0), ("0ms", 0.0), (None, None)],
)
def test_parse_latency_good(text: str | None, seconds: float | None) -> None:
    assert parse_latency(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "1", "1m", "ms", "-1ms", "1 min", "1.5.ms"])
def test_parse_latency_bad(text: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(text))):
        parse_latency(text)


def test_netspec_validates() -> None:
    assert NetSpec("1gbit", "0.5ms").latency == "0.5ms"
    with pytest.raises(ValueError, match="'fast'"):
        NetSpec("fast")
    with pytest.raises(ValueError, match="'soon'"):
        NetSpec("1gbit", "soon")


def test_names_without_creating() -> None:
    net = NetNamespaces(3, NetSpec("1gbit"), prefix="abc")
    assert [net.namespace(i) for i in range(3)] == ["abcns0", "abcns1", "abcns2"]
    assert net.ifname(2) == "abcv2"
    with pytest.raises(IndexError):
        net.ifname(3)
    with pytest.raises(RuntimeError, match="not been entered"):
        _ = net.master_addr
    assert len(NetNamespaces(2, NetSpec("1gbit")).prefix) <= 12
    with pytest.raises(ValueError, match="prefix"):
        NetNamespaces(2, NetSpec("1gbit"), prefix="averyverylongprefix")
    with pytest.raises(ValueError, match="prefix"):
        NetNamespaces(2, NetSpec("1gbit"), prefix="bad-name")
    with pytest.raises(ValueError, match="nprocs"):
        NetNamespaces(0, NetSpec("1gbit"))


def test_require_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(PermissionError, match="--net needs root"):
        require_root()
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/" + tool)
    with pytest.raises(RuntimeError, match="'tc'"):
        require_root()


def test_enter_missing_namespace() -> None:
    # Fails at open(), before setns, so it cannot move the test process anywhere.
    with pytest.raises(OSError, match="no-such-ns-for-sparsync"):
        enter_namespace("no-such-ns-for-sparsync")


# --------------------------------------------------------------------- real namespaces


def _netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _host_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link"], check=True, capture_output=True, text=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


def _assert_gone(net: NetNamespaces) -> None:
    assert not {n for n in _netns_names() if n.startswith(net.prefix)}
    assert not {n for n in _host_links() if n.startswith(net.prefix)}


def _prefix() -> str:
    return "sst" + secrets.token_hex(3)


def _receive(ns: str, addr: str, nbytes: int, q: Queue[object]) -> None:
    """Child: accept one connection in namespace ns and report seconds to receive nbytes."""
    enter_namespace(ns)
    with socket.create_server((addr, 0)) as srv:
        srv.settimeout(10)
        q.put(srv.getsockname()[1])
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(10)
            got, t0 = 0, time.perf_counter()
            while got < nbytes:
                chunk = conn.recv(1 << 20)
                if not chunk:
                    break
                got += len(chunk)
            q.put((got, time.perf_counter() - t0))


def _send(ns: str, addr: str, port: int, nbytes: int) -> None:
    """Child: connect from namespace ns and send nbytes."""
    enter_namespace(ns)
    with socket.create_connection((addr, port), timeout=10) as s:
        s.sendall(b"\0" * nbytes)


@netns
@needs_netns
def test_shaped_namespaces() -> None:
    rate = parse_rate("100mbit")
    with NetNamespaces(2, NetSpec("100mbit"), prefix=_prefix()) as net:
        assert {net.namespace(0), net.namespace(1)} <= _netns_names()
        assert net.bridge in _host_links()
        assert net.master_addr == net.address(0)
        assert re.fullmatch(r"10\.2[0-5]\d\.0\.1", net.master_addr)
        assert net.env(1) == {"GLOO_SOCKET_IFNAME": net.ifname(1), "MASTER_ADDR": net.master_addr}

        if shutil.which("ping") is not None:
            ping = ["ip", "netns", "exec", net.namespace(0), "ping", "-c1", "-W2", net.address(1)]
            subprocess.run(ping, check=True, capture_output=True)

        # A real transfer from rank 0 to rank 1 must run at about the shaped rate.
        nbytes = 5_000_000
        ctx = mp.get_context("fork")
        q: Queue[object] = ctx.Queue()
        rx = ctx.Process(target=_receive, args=(net.namespace(1), net.address(1), nbytes, q))
        rx.start()
        port = q.get(timeout=10)
        assert isinstance(port, int)
        tx = ctx.Process(target=_send, args=(net.namespace(0), net.address(1), port, nbytes))
        tx.start()
        result = q.get(timeout=20)
        assert isinstance(result, tuple)
        got, seconds = result
        tx.join(10)
        rx.join(10)
        assert (rx.exitcode, tx.exitcode) == (0, 0)
        assert got == nbytes
        bits_per_s = nbytes * 8 / float(seconds)
        print(f"shaped transfer: {bits_per_s / 1e6:.1f} Mbit/s ({seconds:.3f} s for {nbytes} B)")
        assert 0.3 * rate < bits_per_s < 1.3 * rate
    _assert_gone(net)
    assert net.address(1) not in subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    net.close()  # idempotent
    net.__exit__(None, None, None)


@netns
@needs_netns
def test_teardown_on_exception() -> None:
    old = signal.getsignal(signal.SIGINT)
    net = NetNamespaces(2, NetSpec("1gbit"), prefix=_prefix())
    with pytest.raises(ValueError, match="boom"), net:
        assert net.namespace(1) in _netns_names()
        raise ValueError("boom")
    _assert_gone(net)
    assert signal.getsignal(signal.SIGINT) is old


@netns
@needs_netns
def test_teardown_on_sigterm() -> None:
    old = signal.getsignal(signal.SIGTERM)
    net = NetNamespaces(1, NetSpec("1gbit"), prefix=_prefix())
    with pytest.raises(SystemExit), net:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends
    _assert_gone(net)
    assert signal.getsignal(signal.SIGTERM) is old


@netns
@needs_netns
def test_failed_setup_removes_only_its_own() -> None:
    net = NetNamespaces(2, NetSpec("1gbit"), prefix=_prefix())
    squatter = net.namespace(1)
    subprocess.run(["ip", "netns", "add", squatter], check=True, capture_output=True)
    try:
        with pytest.raises(RuntimeError, match="ip netns add " + squatter), net:
            pass
        # What it made is gone; the namespace that was already there is left alone.
        assert net.namespace(0) not in _netns_names()
        assert not {n for n in _host_links() if n.startswith(net.prefix)}
        assert squatter in _netns_names()
    finally:
        subprocess.run(["ip", "netns", "del", squatter], capture_output=True)
    _assert_gone(net)


@netns
@needs_netns
def test_latency() -> None:
    if shutil.which("ping") is None:
        pytest.skip("needs ping")
    net = NetNamespaces(2, NetSpec("1gbit", "5ms"), prefix=_prefix())
    try:
        net.__enter__()
    except RuntimeError as e:
        _assert_gone(net)
        if "netem" in str(e) and "unknown" in str(e).lower():
            pytest.skip(f"kernel has no netem qdisc: {e}")
        raise
    try:
        ping = ["ip", "netns", "exec", net.namespace(0), "ping", "-c2", "-W2", net.address(1)]
        out = subprocess.run(ping, check=True, capture_output=True, text=True).stdout
        rtts = [float(t) for t in re.findall(r"time=([\d.]+) ms", out)]
        assert rtts and min(rtts) >= 9.0  # 5 ms each way
    finally:
        net.close()
    _assert_gone(net)
