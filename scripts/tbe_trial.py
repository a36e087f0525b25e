"""fbgemm's table-batched embedding (TBE) against sparsync's pure-torch table group, as the kernel of a group
(issue: try fbgemm's TBE as a group's kernel, side by side).

One process, DLRM's tables as ``bench dlrm`` builds them (26 tables of the generated Criteo file, capped at
``--max-rows`` rows, dim 16, ``--batch`` samples of its Zipf ids a step), each variant's CPU time of a step's
table work: the lookup of every table, the backward from the sum of the pooled outputs, and an SGD update of
the rows looked up. Variants, in interleaved rounds over the same batches:

- ``torch_tables``: 26 ``nn.EmbeddingBag(sparse=True)`` and ``torch.optim.SGD`` (what a plain user runs);
- ``sparsync_group``: the 26 tables through ``sparsync.shard(model, optimizer=SGD(lr))`` on a one-rank gloo group
  (the group's real step at P = 1: one dedupe, one ``index_select`` of the distinct rows, one of the lookups'
  rows (bags of one id), its backward's sum per row and the update, for all tables; no peer, so no round goes on
  a wire), with the group's C kernels (``sparsync.sharding.kernels``, when built);
- ``sparsync_group_torch``: the same with the torch ops the group runs when the C extension is not built (the
  same results);
- ``fbgemm_tbe``: fbgemm_gpu's ``SplitTableBatchedEmbeddingBagsCodegen`` on the CPU with ``EXACT_SGD`` (its
  backward fused with the update), the ids in its table-major layout.

With ``--kernels``, a second table: each of the group's C kernels (``sparsync.sharding.kernels``) against the
torch ops it stands for, on one step's data (the batch's 26 id columns as the group's rows), time per call
(median of ``--calls``), in interleaved rounds; the kernels that touch the group's flat tensor with its caches
emptied first (``cold``), as a step finds its rows.

It needs fbgemm_gpu, so it runs in torchrec's environment (``scripts/torchrec_env.sh``; torch 2.13 there too)
with this checkout's ``src``:

    PYTHONPATH=src .venv-torchrec/bin/python scripts/tbe_trial.py --rounds 5 --out docs/data/tbe_trial.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

import sparsync
from sparsync.sharding import SGD, kernels
from sparsync_bench.criteo import read_criteo, table_rows

DATA = Path("results/criteo_synthetic.txt")
EVICT = 64 << 20  # bytes written between the calls of a cold kernel case (more than the host's caches)


class Tables(nn.Module):
    """DLRM's tables alone: table j looked up with column j of the ids, the pooled outputs summed."""

    def __init__(self, rows: list[int], dim: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tables = nn.ModuleList(nn.EmbeddingBag(r, dim, mode="sum", sparse=True) for r in rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outs = [t(ids[:, j : j + 1]) for j, t in enumerate(self.tables)]
        return torch.cat([o if isinstance(o, torch.Tensor) else o.wait() for o in outs], 1)


def torch_tables(rows: list[int], dim: int, lr: float) -> Callable[[torch.Tensor], None]:
    model = Tables(rows, dim)
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def step(ids: torch.Tensor) -> None:
        opt.zero_grad()
        model(ids).sum().backward()
        opt.step()

    return step


def sparsync_group(rows: list[int], dim: int, lr: float) -> Callable[[torch.Tensor], None]:
    model = sparsync.shard(Tables(rows, dim), optimizer=SGD(lr=lr))

    def step(ids: torch.Tensor) -> None:
        model(ids).sum().backward()

    return step


def sparsync_group_torch(rows: list[int], dim: int, lr: float) -> Callable[[torch.Tensor], None]:
    step = sparsync_group(rows, dim, lr)

    def torch_step(ids: torch.Tensor) -> None:
        with mock.patch.object(kernels, "_native", None):  # as without the C extension: the torch ops
            step(ids)

    return torch_step


def fbgemm_tbe(rows: list[int], dim: int, lr: float) -> Callable[[torch.Tensor], None]:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    specs = [(r, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for r in rows]
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        specs, optimizer=EmbOptimType.EXACT_SGD, learning_rate=lr, pooling_mode=PoolingMode.SUM
    )

    def step(ids: torch.Tensor) -> None:
        B, T = ids.shape
        indices = ids.t().reshape(-1).contiguous()  # table-major: table 0's B ids, then table 1's ...
        offsets = torch.arange(T * B + 1, dtype=torch.int64)  # one id per bag
        tbe(indices, offsets).sum().backward()

    return step


VARIANTS: dict[str, Callable[[list[int], int, float], Callable[[torch.Tensor], None]]] = {
    "torch_tables": torch_tables,
    "sparsync_group": sparsync_group,
    "sparsync_group_torch": sparsync_group_torch,
    "fbgemm_tbe": fbgemm_tbe,
}


Case = tuple[Callable[[], Any], Callable[[], Any], bool]


def kernel_cases(ids: torch.Tensor, rows: list[int]) -> dict[str, Case]:
    """Per kernel, (torch, C, cold) on one step's data (``ids`` [B, 26] as the group's flat rows); cold: the
    flat tensor's rows are out of cache at each call, as in a step (its rows were last read a step ago)."""
    firsts = torch.tensor([0, *rows[:-1]]).cumsum(0)
    keys = (ids + firsts).reshape(-1)
    distinct, inverse = torch.unique(keys, return_inverse=True)
    flat = torch.randn(sum(rows), 16)
    part = torch.randn(distinct.numel(), 16, requires_grad=True)
    grads, g = torch.randn(keys.numel(), 16), torch.randn(distinct.numel(), 16)
    two = torch.cat([distinct, distinct[::2]])  # two requesters' rows: every other row asked twice
    two_g = torch.randn(two.numel(), 16)

    def pick(setting: str) -> Callable[[], None]:
        return lambda: kernels.pick_rows(part, inverse, setting).backward(grads)

    def sparse_sum(setting: str) -> Callable[[], Any]:
        return lambda: kernels.sum_rows(two, two_g, flat.shape[0], setting)

    return {
        "unique (dedupe)": (
            lambda: torch.unique(keys, sorted=True, return_inverse=True),
            lambda: kernels.unique(keys, "c"),
            False,
        ),
        "pick_rows + backward (pooling)": (pick("torch"), pick("c"), False),
        "sum_rows, 2 requesters (owner sum)": (sparse_sum("torch"), sparse_sum("c"), False),
        "gather from the flat tensor, cold (rows stage)": (
            lambda: flat.index_select(0, distinct),
            lambda: kernels.gather(flat, distinct, "c"),
            True,
        ),
        "step_rows SGD, cold (update)": (
            lambda: kernels.step_rows(flat, distinct, g, 0.1, kernels="torch"),
            lambda: kernels.step_rows(flat, distinct, g, 0.1, kernels="c"),
            True,
        ),
    }


def kernel_table(ids: torch.Tensor, rows: list[int], rounds: int, calls: int) -> list[str]:
    """The second table (module doc)."""
    cases = kernel_cases(ids, rows)
    times: dict[str, list[list[float]]] = {name: [[], []] for name in cases}
    spill = torch.zeros(EVICT // 4)
    for _ in range(rounds):
        for name, (*pair, cold) in cases.items():
            for k, f in enumerate(pair):
                f()
                per = []
                for _ in range(calls):
                    if cold:
                        spill.add_(1.0)  # the caches filled with other data
                    t0 = time.perf_counter()
                    f()
                    per.append(time.perf_counter() - t0)
                times[name][k].append(statistics.median(per) * 1e6)
    head = f"Kernels on one step's data, us per call (median of {calls} calls, median of {rounds} rounds)"
    lines = ["", head, "", "| kernel | torch | C | torch / C |", "|---|---|---|---|"]
    for name, (t, c) in times.items():
        tm, cm = statistics.median(t), statistics.median(c)
        lines.append(f"| {name} | {tm:.0f} | {cm:.0f} | {tm / cm:.1f}x |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-rows", type=int, default=100_000)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--kernels", action="store_true", help="also time each C kernel against its torch ops")
    ap.add_argument("--calls", type=int, default=50)
    a = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29631")
    dist.init_process_group("gloo", rank=0, world_size=1)
    data = read_criteo(DATA, max_rows=a.max_rows, limit=a.batch * a.steps)
    rows = table_rows(a.max_rows)
    ids = data.sparse
    batches = [ids[s * a.batch : (s + 1) * a.batch] for s in range(a.steps)]
    steps = {name: make(rows, 16, 0.1) for name, make in VARIANTS.items()}
    per_round: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for r in range(a.rounds):
        for name, step in steps.items():
            cpu = []
            for b in batches:
                c0 = time.process_time()
                step(b)
                cpu.append(time.process_time() - c0)
            per_round[name].append(statistics.median(cpu[5:]) * 1e3)
            print(f"round {r + 1}/{a.rounds} {name}: {per_round[name][-1]:.2f} ms CPU/step", flush=True)
    dist.destroy_process_group()
    lines = [
        f"DLRM's 26 tables (rows capped at {a.max_rows}, dim 16), {a.batch} samples a step, one process, "
        f"one thread, {a.rounds} interleaved rounds (`PYTHONPATH=src .venv-torchrec/bin/python "
        f"scripts/tbe_trial.py --batch {a.batch} --rounds {a.rounds}{' --kernels' if a.kernels else ''}`)",
        "",
        "| variant | CPU ms/step (median of rounds) | range | vs sparsync_group |",
        "|---|---|---|---|",
    ]
    ours = statistics.median(per_round["sparsync_group"])
    for name, xs in per_round.items():
        med = statistics.median(xs)
        lines.append(f"| {name} | {med:.2f} | {min(xs):.2f}-{max(xs):.2f} | {med / ours:.2f}x |")
    if a.kernels:
        lines += kernel_table(batches[0], rows, a.rounds, a.calls)
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.write_text(text)


if __name__ == "__main__":
    main()
