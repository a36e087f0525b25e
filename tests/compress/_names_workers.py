"""Module-level rank functions for test_names.py: ``name=`` and ``check_nan`` agreed across ranks by every
reduction (compressed_allreduce on each of its paths, the placements that call it, the Replicator's primitives).

Each case is a function of (rank, group) run on a fresh group (``dist.new_group``) with a short call timeout, so
a case that leaves its group broken cannot spoil the next; its outcome is recorded per rank as ("ok", value) or
(exception type, message).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _bad_input_workers import ctx as bad_inputs_ctx
from torch import nn

import sparsync
from sparsync.compress import BF16, FP16, QSGD, Identity, TopK, from_spec
from sparsync.compress.cast_allreduce import MIN_VALUES
from sparsync.placement import Compressed
from sparsync.replicator import ReplicaContext

WORLD = 3
TIMEOUT = 10.0  # a hang becomes a PeerError, not a stuck test
NAN = float("nan")


def _ab(rank: int, shape: tuple[int, ...] = (4,), coo: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Two gradients of one shape: "a" is rank + 1 everywhere, "b" is 10 * (rank + 1)."""
    a, b = torch.full(shape, rank + 1.0), torch.full(shape, 10.0 * (rank + 1))
    if coo:
        return a.to_sparse(1), b.to_sparse(1)
    return a, b


def swapped_reduce(spec: str, *, coo: bool = False, async_op: bool = False, n: int = 64) -> Callable[..., Any]:
    """compressed_allreduce of two same-shape named tensors, issued a, b on every rank but rank 1 (b, a)."""

    def run(rank: int, g: dist.ProcessGroup) -> Any:
        a, b = _ab(rank, (n, 2) if coo else (n,), coo)
        order = [("b", b), ("a", a)] if rank == 1 else [("a", a), ("b", b)]
        out = []
        for name, t in order:
            r = sparsync.compressed_allreduce(
                t, from_spec(spec), name=name, group=g, average=False, async_op=async_op, timeout=TIMEOUT
            )
            out.append(r.wait() if async_op else r)
        return [o.to_dense().sum().item() for o in out]

    return run


def nan_reduce(compressor: Callable[[], Any], n: int = 64) -> Callable[..., Any]:
    """NaN on rank 1, which passes check_nan=False; the others ask for the check."""

    def run(rank: int, g: dist.ProcessGroup) -> Any:
        x = torch.ones(n)
        if rank == 1:
            x[3] = NAN
        out = sparsync.compressed_allreduce(
            x, compressor(), name="w", group=g, average=False, check_nan=rank != 1, timeout=TIMEOUT
        )
        return out.tolist()

    return run


def check_nan_differs_reduce(rank: int, g: dist.ProcessGroup) -> Any:
    """Finite input everywhere, check_nan=False on rank 2 only: the ranks disagree about the call's options."""
    out = sparsync.compressed_allreduce(
        torch.ones(8), Identity(), group=g, average=False, check_nan=rank != 2, timeout=TIMEOUT
    )
    return out.tolist()


class TwoLayers(nn.Module):
    """A layer "z", then two layers of one shape, registered in the order ``first`` then the other: on a rank
    that registers them in the other order, the optimizer reduces them in the other order ("z" first
    everywhere, so that a bucket's first name is the same on every rank)."""

    def __init__(self, first: str) -> None:
        super().__init__()
        self.z = nn.Linear(3, 2, bias=False)
        for name in (first, "b" if first == "a" else "a"):
            self.add_module(name, nn.Linear(3, 3, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.z(x).sum() + 2 * self.a(x).sum() + 3 * self.b(x).sum()


def swapped_optimizer(plan_kind: str) -> Callable[..., Any]:
    """DistributedOptimizer over a model whose two same-shape layers are registered in another order on rank 1,
    each layer's gradient a different constant: named reductions must refuse the swap."""

    def run(rank: int, g: dist.ProcessGroup) -> Any:
        model = TwoLayers("b" if rank == 1 else "a")
        for name, p in model.named_parameters():
            p.grad = torch.full_like(p, (rank + 1.0) * (1.0 if name.startswith("a") else 10.0))
        placement = Compressed(Identity(), bucket=plan_kind == "bucket")  # one placement: one bucket
        plan = {n: placement for n, _ in model.named_parameters()}
        opt = sparsync.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.0),
            model,
            plan=plan,
            op="sum",
            group=g,
            timeout=TIMEOUT,
            sync_parameters=False,
        )
        opt.synchronize()
        return {n: p.grad[0, 0].item() for n, p in sorted(model.named_parameters()) if p.grad is not None}

    return run


def swapped_hook(rank: int, g: dist.ProcessGroup) -> Any:
    """DDP with sparsync's compression hook (FP16: reduced per parameter, under its name) over a model whose two
    same-shape layers are registered in another order on rank 1: the hook must refuse the swap. DDP surfaces
    the hook's error from backward() as a RuntimeError carrying its message."""
    from torch.nn.parallel import DistributedDataParallel

    from sparsync.compress.hooks import compression_hook

    torch.manual_seed(0)
    model = TwoLayers("b" if rank == 1 else "a")
    ddp = DistributedDataParallel(model, process_group=g)
    ddp.register_comm_hook(None, compression_hook(FP16(), module=ddp, group=g))
    ddp(torch.ones(2, 3) * (rank + 1)).backward()
    return {n: p.grad.sum().item() for n, p in sorted(model.named_parameters()) if p.grad is not None}


def ctx(group: dist.ProcessGroup) -> ReplicaContext:
    return bad_inputs_ctx(group, TIMEOUT)


def swapped_primitive(kind: str) -> Callable[..., Any]:
    """Two named primitives on one shape, in another order on replica 1."""

    def run(rank: int, g: dist.ProcessGroup) -> Any:
        c = ctx(g)
        vals = {"x": torch.tensor([1.0 + rank, 2.0]), "y": torch.tensor([2.0, 1.0 + rank])}
        order = ["y", "x"] if rank == 1 else ["x", "y"]
        out = []
        for name in order:
            if kind == "all_sum":
                out.append(c.all_sum(vals[name], name=name).tolist())
            elif kind == "all_reduce_autograd":  # the differentiable path
                t = vals[name].clone().requires_grad_()
                c.all_reduce(t, "sum", name=name).sum().backward()
                out.append(t.grad.tolist() if t.grad is not None else None)
            elif kind == "all_gather":
                out.append(c.all_gather(vals[name], name=name).tolist())
            elif kind == "map_reduce":
                out.append(c.map_reduce(lambda v: 2 * v, vals[name], name=name).tolist())
            elif kind == "map_gather":
                out.append(c.map_gather(lambda v: 2 * v, vals[name], name=name).tolist())
            else:
                out.append(c.broadcast(vals[name], 0, name=name).tolist())
        return out

    return run


def primitive_nan(rank: int, g: dist.ProcessGroup) -> Any:
    """NaN on replica 1, which passes check_nan=False; the others ask for the check."""
    x = torch.tensor([1.0, NAN if rank == 1 else 2.0])
    return ctx(g).all_reduce(x, "sum", check_nan=rank != 1).tolist()


def primitive_check_nan_differs(rank: int, g: dist.ProcessGroup) -> Any:
    return ctx(g).all_reduce(torch.ones(2), "sum", check_nan=rank != 2).tolist()


# Every case: (its function, what every rank must raise: a regex, or None for "the exact value of ``want``").
CASES: dict[str, Callable[..., Any]] = {
    # compressed_allreduce, one case per path: dense allreduce (Identity, small casts), sparse_allreduce
    # (TopK, COO Identity), quantized allgather / reduce-scatter (QSGD), chunked casts (FP16 at >= MIN_VALUES).
    "reduce_identity": swapped_reduce("identity"),
    "reduce_identity_async": swapped_reduce("identity", async_op=True),
    "reduce_identity_coo": swapped_reduce("identity", coo=True),
    "reduce_topk": swapped_reduce("topk:ratio=0.5"),
    "reduce_qsgd": swapped_reduce("qsgd:bits=8,bucket=16"),
    "reduce_sketch": swapped_reduce("sketch:rows=3,cols=64,block=8"),
    "reduce_fp16_chunked": swapped_reduce("fp16", n=MIN_VALUES),
    "optimizer_compressed": swapped_optimizer("compressed"),
    "optimizer_compressed_bucket": swapped_optimizer("bucket"),
    "hook_fp16": swapped_hook,
    "primitive_all_sum": swapped_primitive("all_sum"),
    "primitive_all_reduce_autograd": swapped_primitive("all_reduce_autograd"),
    "primitive_all_gather": swapped_primitive("all_gather"),
    "primitive_broadcast": swapped_primitive("broadcast"),
    "primitive_map_reduce": swapped_primitive("map_reduce"),
    "primitive_map_gather": swapped_primitive("map_gather"),
    "nan_reduce_identity": nan_reduce(Identity),
    "nan_reduce_fp16": nan_reduce(FP16),
    "nan_reduce_bf16_chunked": nan_reduce(BF16, n=MIN_VALUES),
    "nan_reduce_qsgd": nan_reduce(lambda: QSGD(bits=8, bucket=16)),
    "nan_reduce_topk": nan_reduce(lambda: TopK(0.5)),
    "check_nan_differs_reduce": check_nan_differs_reduce,
    "nan_primitive": primitive_nan,
    "check_nan_differs_primitive": primitive_check_nan_differs,
}


def worker(rank: int, names: list[str]) -> dict[str, tuple[str, Any]]:
    torch.set_num_threads(1)
    out: dict[str, tuple[str, Any]] = {}
    for name in names:
        g = dist.new_group()
        try:
            out[name] = ("ok", CASES[name](rank, g))
        except Exception as e:
            out[name] = (type(e).__name__, str(e))
    return out


def bad_stream(rank: int) -> tuple[str, str]:
    """Rank 1 builds a SparseStream with an out-of-range index; the others go on to the allreduce."""
    try:
        idx = torch.tensor([1, 99 if rank == 1 else 4])
        s = sparsync.SparseStream(idx, torch.ones(2), dim=10)
        sparsync.sparse_allreduce(s, timeout=3.0)
        return ("ok", "")
    except Exception as e:
        return (type(e).__name__, str(e))
