"""Parameter-server probe for docs/reliability.md: memory before authentication, and CURVE throughput.

    .venv/bin/python scripts/ps_probe.py peers                 # 4 and 64 raw TCP peers against a default server
    .venv/bin/python scripts/ps_probe.py throughput --runs 5   # large PUSH and PULL, with and without CURVE

``peers``: each peer greets with CURVE, declares a 200 MiB HELLO and streams into it (48 MiB each for 4 peers,
4 MiB for 64); printed: the bytes the peers got into their sockets before the server dropped them, the
server's peak RSS growth (VmHWM, reset first through /proc/<pid>/clear_refs), and whether an authenticated
client still gets a pull answered afterwards.
``throughput``: one server, one client on loopback; a PUSH of 2,000,000 rows x 16 (144 MB on the wire) and a
PULL of 1,000,000 rows x 16 (72 MB, 64 MB of it in the reply), best and median of ``--runs``.

To measure an older sparsync, put its ``src`` first: ``PYTHONPATH=/tmp/old/src .venv/bin/python ...``.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import struct
import threading
import time
from pathlib import Path

import numpy as np

from sparsync.ps import PSClient, PSTable
from sparsync.ps.process import ServerProcess
from sparsync.ps.server import ServerConfig
from sparsync.ps.wire import split_address

MiB = 2**20


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(f"no {field} in /proc/{pid}/status")


def _peer(endpoint: str, declared: int, stream: int, took: list[int], i: int) -> None:
    """A raw ZMTP 3.0 peer: CURVE greeting, a HELLO command declaring ``declared`` bytes, up to ``stream`` bytes
    of it, then wait until the server closes; ``took[i]``: the bytes sent before that."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    sent = 0
    with socket.create_connection((host, int(port)), timeout=3) as s:
        try:
            s.sendall(b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"CURVE".ljust(20, b"\0") + bytes(32))
            s.sendall(b"\x06" + struct.pack(">Q", declared))
            chunk = bytes(MiB)
            while sent < stream:
                s.sendall(chunk)
                sent += len(chunk)
            s.shutdown(socket.SHUT_WR)  # closing now would reset what the server has not read yet
            while s.recv(65536):
                pass
        except OSError:
            pass  # dropped by the server
    took[i] = sent


def peers(counts: list[int]) -> None:
    for n in counts:
        stream = 48 * MiB if n <= 4 else 4 * MiB
        sp = ServerProcess(ServerConfig())
        address = sp.start()
        try:
            assert sp.pid is not None
            Path(f"/proc/{sp.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
            before = _status_kib(sp.pid, "VmRSS")
            took = [0] * n
            endpoint = split_address(address)[0]
            threads = [
                threading.Thread(target=_peer, args=(endpoint, 200 * MiB, stream, took, i)) for i in range(n)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            time.sleep(0.3)
            grew = _status_kib(sp.pid, "VmHWM") - before
            with PSClient([address], timeout=10) as c:
                t = PSTable(c, "after", 10, 2, partitions=1)
                t.create().wait()
                answered = t.pull(np.arange(10)).wait().shape == (10, 2)
            print(
                f"{n} peers x 200 MiB HELLO declared, {stream // MiB} MiB streamed each: "
                f"{sum(took) / MiB:.0f} MiB sent before the server dropped them, peak RSS +{grew / 1024:.1f} MiB; "
                f"authenticated client answered: {answered}",
                flush=True,
            )
        finally:
            sp.kill()


def throughput(runs: int) -> None:
    dim = 16
    push_rows, pull_rows = 2_000_000, 1_000_000
    for auth in (False, True):
        sp = ServerProcess(ServerConfig(auth=auth))
        address = sp.start()
        try:
            with PSClient([address], timeout=120) as c:
                t = PSTable(c, "b", push_rows, dim, partitions=1, mode="async")
                t.create().wait()
                rows = np.arange(push_rows)
                grads = np.ones((push_rows, dim), np.float32)
                pulled = np.arange(0, push_rows, 2)
                t.push(rows, grads, coalesce=False).wait()  # warm up
                t.pull(pulled).wait()
                for what, nbytes in (("PUSH", push_rows * (8 + 4 * dim)), ("PULL", pull_rows * (8 + 4 * dim))):
                    rates = []
                    for _ in range(runs):
                        t0 = time.perf_counter()
                        if what == "PUSH":
                            t.push(rows, grads, coalesce=False).wait()
                        else:
                            t.pull(pulled).wait()
                        rates.append(nbytes / (time.perf_counter() - t0) / 1e6)
                    kind = "CURVE" if auth else "plain"
                    print(
                        f"{kind} {what} of {nbytes / 1e6:.0f} MB: best {max(rates):.0f} MB/s, "
                        f"median {statistics.median(rates):.0f} MB/s ({runs} runs)",
                        flush=True,
                    )
        finally:
            sp.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("peers", help="unauthenticated raw TCP peers against a default server")
    p.add_argument("--peers", type=int, nargs="+", default=[4, 64])
    q = sub.add_parser("throughput", help="large PUSH and PULL, with and without CURVE")
    q.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    if a.what == "peers":
        peers(a.peers)
    else:
        throughput(a.runs)


if __name__ == "__main__":
    main()
