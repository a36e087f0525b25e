"""What CURVE authentication costs the parameter server (docs/reliability.md, docs/reliability.md#what-curve-authentication-costs-the-parameter-server): one server
on loopback with and without CURVE, a 1M x 16 float32 table; the throughput of a pull of 500,000 rows (36 MB on
the wire with the ids) and the latency of a pull of 1,000 rows, each repeated.

    .venv/bin/python scripts/ps_auth_cost.py            # prints a markdown table
    .venv/bin/python scripts/ps_auth_cost.py --repeats 10
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from sparsync.ps import PSClient, PSTable, start_servers


def measure(auth: bool, repeats: int) -> tuple[list[float], list[float]]:
    """MB/s of each big pull and microseconds of each small pull."""
    sv = start_servers(1, auth=auth)
    try:
        with PSClient([sv[0].address], timeout=60) as c:
            t = PSTable(c, "b", 1_000_000, 16, partitions=1)
            t.create().wait()
            big, small = np.arange(0, 1_000_000, 2), np.arange(0, 1_000_000, 1000)
            t.pull(big).wait()  # warm-up: the connection, the table's pages
            rates, lat = [], []
            for _ in range(repeats):
                t0 = time.perf_counter()
                t.pull(big).wait()
                rates.append(big.size * (16 * 4 + 8) / (time.perf_counter() - t0) / 1e6)
            for _ in range(20 * repeats):
                t0 = time.perf_counter()
                t.pull(small).wait()
                lat.append((time.perf_counter() - t0) * 1e6)
            return rates, lat
    finally:
        sv[0].kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print("| server | pull of 500,000 rows, MB/s (median, min-max) | pull of 1,000 rows, us (median, min-max) |")
    print("|---|---|---|")
    for auth in (False, True):
        rates, lat = measure(auth, args.repeats)
        print(
            f"| {'CURVE' if auth else 'no auth'} | {np.median(rates):.0f} ({min(rates):.0f}-{max(rates):.0f}) | "
            f"{np.median(lat):.0f} ({min(lat):.0f}-{max(lat):.0f}) |"
        )


if __name__ == "__main__":
    main()
