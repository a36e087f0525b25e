"""Each compressor's kernels on one device against a copy of the same bytes on that device.

``python -m sparsync_bench.gpu_kernels --device cuda`` (scripts/gpu_check.sh runs it): for every compressor of
``bench compress``, compress + decompress of N float32 values (25M by default) on the device, median of
``--repeats`` after one warm-up, beside ``dst.copy_(src)`` of the same 4N bytes (a device memcpy), and whether
the result stayed on the device. Target (the GPU issue): compress + decompress within 10x of the memcpy.
One process, no group. ``--device cpu`` runs the same on the host (the C kernels), for comparison and tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from sparsync.compress import Context, TensorSpec, from_spec
from sparsync_bench.compress import DEFAULT_COMPRESSORS

TARGET_RATIO = 10.0  # compress + decompress / memcpy of the same bytes, at most


def _timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    def once() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    once()  # warm-up (Threshold with a lifespan computes τ here, as one step in L does)
    return statistics.median(once() for _ in range(repeats))


def measure(spec: str, x: torch.Tensor, repeats: int) -> dict[str, Any]:
    """One compressor's row: compress and decompress seconds, the memcpy's, their ratio, the error."""
    comp = from_spec(spec)
    ctx, xs = Context("x", 0, 1), TensorSpec.of(x)
    row: dict[str, Any] = {"compressor": spec, "n": x.numel(), "device": str(x.device)}
    try:
        payload = comp.compress(x, ctx)
        y = comp.decompress(payload, xs)
        row["result_device"] = str(y.device)
        row["rel_error"] = float((x - y).norm() / x.norm())
        row["compress_s"] = _timed(lambda: comp.compress(x, ctx), x.device, repeats)
        row["decompress_s"] = _timed(lambda: comp.decompress(payload, xs), x.device, repeats)
    except Exception as e:  # a row per compressor: one failing must not hide the others
        row["error"] = f"{type(e).__name__}: {e}"
    return row


def run(device: torch.device, n: int, specs: tuple[str, ...], repeats: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g).to(device)
    dst = torch.empty_like(x)
    memcpy = _timed(lambda: dst.copy_(x), device, repeats)
    rows = [measure(spec, x, repeats) for spec in specs]
    for r in rows:
        if "error" not in r:
            r["cd_s"] = r["compress_s"] + r["decompress_s"]
            r["x_memcpy"] = r["cd_s"] / memcpy
            r["target_met"] = r["x_memcpy"] <= TARGET_RATIO and r["result_device"] == str(x.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": str(device), "device_name": name, "n": n, "memcpy_s": memcpy, "rows": rows}


def profile(device: torch.device, n: int, specs: tuple[str, ...], top: int = 6) -> str:
    """Each compressor's ``top`` ops by self time on the device (compress + decompress, after a warm-up):
    where a compressor's time goes, for the rows that miss the target."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    out = []
    for spec in specs:
        comp, ctx, xs = from_spec(spec), Context("x", 0, 1), TensorSpec.of(x)
        comp.decompress(comp.compress(x, ctx), xs)
        with torch_profile(activities=acts) as prof:
            comp.decompress(comp.compress(x, ctx), xs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        table = prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=40)
        out.append(f"--- {spec}\n{table}")
    return "\n".join(out)


def render(res: dict[str, Any]) -> str:
    lines = [
        f"{res['device_name']} ({res['device']}), N = {res['n']:,} float32, memcpy {res['memcpy_s'] * 1e3:.3f} ms",
        f"{'compressor':46} {'compress ms':>12} {'decompress ms':>14} {'x memcpy':>9}  target",
    ]
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"{r['compressor']:46} ERROR {r['error']}")
            continue
        ok = "met" if r["target_met"] else "MISSED"
        lines.append(
            f"{r['compressor']:46} {r['compress_s'] * 1e3:12.3f} {r['decompress_s'] * 1e3:14.3f} "
            f"{r['x_memcpy']:9.1f}  {ok}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sparsync_bench.gpu_kernels", description=__doc__)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--n", type=int, default=25_000_000, help="float32 values per tensor (default 25,000,000)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs after one warm-up (default 5)")
    ap.add_argument("--compressors", nargs="*", default=list(DEFAULT_COMPRESSORS), help="registry specs")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    ap.add_argument("--profile", action="store_true", help="also print each compressor's slowest ops")
    a = ap.parse_args(argv)
    res = run(torch.device(a.device), a.n, tuple(a.compressors), a.repeats)
    print(render(res), flush=True)
    if a.profile:
        print(profile(torch.device(a.device), a.n, tuple(a.compressors)), flush=True)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1))
    return 0 if all("error" not in r for r in res["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
