"""Workers of tests/test_overlap.py (module-level: ``launch`` pickles them)."""

from __future__ import annotations

import math
import tempfile
import threading
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import sparsync
from sparsync.collectives.timeline import set_tracer
from sparsync.collectives.trace import Tracer
from sparsync.compress import ErrorFeedback, Threshold, TopK
from sparsync.optim import jobs
from sparsync.placement import Compressed, NamedParam, Placement, ReduceEnv
from sparsync.record import CommLog

STEPS = 4


class Mixed(nn.Module):
    """A sparse table, an MLP, a layer only even ranks use and one nobody uses."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(200, width, mode="sum", sparse=True)
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)
        self.odd = nn.Linear(width, 1)
        self.unused = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, even: bool) -> torch.Tensor:
        h = torch.relu(self.fc1(self.emb(x)))
        out = self.fc2(h).square().sum()
        return out + self.odd(h).sum() if even else out


def _batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return (torch.rand(8, 3, generator=g) ** 2 * 200).long()


def _plan(kind: str) -> Any:
    """The plans compared: the default; DCT-style TopK with error feedback on one weight; one bucketed
    Threshold (DCT-DP) placement for every parameter. One placement object per run: its residuals persist."""
    if kind == "compressed":
        return {"fc1.weight": Compressed(TopK(0.3), ErrorFeedback())}
    if kind == "bucketed":
        one = Compressed(Threshold(0.2, lifespan=2), ErrorFeedback(), bucket=True)
        return lambda n, p: one
    return None


def train(rank: int, kind: str, overlap: bool, *, micro: int = 1, no_sync: bool = True) -> list[np.ndarray]:
    """STEPS steps of Adagrad-free SGD with momentum on ``Mixed``; ``micro`` backward passes per step, all but the
    last under ``no_sync()`` unless ``no_sync`` is False."""
    torch.manual_seed(0)
    model = Mixed().double()
    opt = sparsync.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), model, plan=_plan(kind), overlap=overlap
    )
    for step in range(STEPS):
        opt.zero_grad()
        for m in range(micro):
            loss = model(_batch(10 * step + m, rank), rank % 2 == 0)
            if m < micro - 1 and no_sync:
                with opt.no_sync():
                    loss.backward()
            else:
                loss.backward()
        opt.step()
    return [p.detach().numpy().copy() for p in model.parameters()]


def reference(P: int, micro: int) -> list[np.ndarray]:
    """One process, float64: every rank's batches through the model, the mean gradient, plain SGD."""
    torch.manual_seed(0)
    model = Mixed().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(STEPS):
        opt.zero_grad()
        for r in range(P):
            for m in range(micro):
                model(_batch(10 * step + m, r), r % 2 == 0).backward()
        for p in model.parameters():
            if p.grad is not None:
                p.grad = (p.grad.to_dense() if p.grad.is_sparse else p.grad) / P
        opt.step()
    return [p.detach().numpy().copy() for p in model.parameters()]


def compressed_reference(P: int) -> list[np.ndarray]:
    """``_plan("compressed")`` in one process, float64: each rank's own gradient, fc1.weight's replaced by the
    TopK(0.3) of it plus that rank's residual (error feedback: the residual keeps what was not sent), the mean
    over the ranks, plain SGD."""
    torch.manual_seed(0)
    model = Mixed().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    residual = [torch.zeros_like(model.fc1.weight) for _ in range(P)]
    for step in range(STEPS):
        sums: dict[str, torch.Tensor] = {}
        for r in range(P):
            model.zero_grad()
            model(_batch(10 * step, r), r % 2 == 0).backward()
            for name, p in model.named_parameters():
                if p.grad is None:
                    continue
                g = p.grad.to_dense() if p.grad.is_sparse else p.grad.clone()
                if name == "fc1.weight":
                    c = (g + residual[r]).reshape(-1)
                    kept = torch.zeros_like(c)
                    top = c.abs().topk(math.ceil(0.3 * c.numel())).indices
                    kept[top] = c[top]
                    residual[r] = (c - kept).view_as(g)
                    g = kept.view_as(g)
                sums[name] = sums[name] + g if name in sums else g
        for name, p in model.named_parameters():
            p.grad = sums[name] / P if name in sums else None
        opt.step()
    return [p.detach().numpy().copy() for p in model.parameters()]


def exact_worker(rank: int) -> dict[str, Any]:
    """Overlap against the float64 references (default plan, with and without ``no_sync``; a compressor on one
    weight), run to run, and, on more than one rank (on one, overlap is off), against reduction in ``step()``
    (compressed plans: the same calls, so the same bits)."""
    P = dist.get_world_size()
    out: dict[str, Any] = {}
    out["default"] = train(rank, "default", True)
    out["default_again"] = train(rank, "default", True)
    out["ref"] = reference(P, 1)
    out["accumulate"] = train(rank, "default", True, micro=2)
    out["accumulate_sync"] = train(rank, "default", True, micro=2, no_sync=False)
    out["ref2"] = reference(P, 2)
    out["compressed"] = train(rank, "compressed", True)
    out["compressed_ref"] = compressed_reference(P)
    if P > 1:
        out["bucketed"] = train(rank, "bucketed", True)
        for kind in ("compressed", "bucketed"):
            out[kind + "_step"] = train(rank, kind, False)
    return out


class SummedInBackward(Placement):
    """A placement whose gradients their module's backward already summed over the ranks (as a sharded table's
    are): ``DistributedOptimizer`` sends nothing for them and only divides by P."""

    kind = "summed_in_backward"
    communicates = False

    def aggregate(self, params: list[NamedParam], env: ReduceEnv) -> None:
        del params, env


class Summed(nn.Module):
    """An MLP beside a layer whose gradient a tensor hook sums over ``group`` during backward (None: no hook,
    the reference's); ``use`` False: no rank uses that layer in the step."""

    def __init__(self, group: dist.ProcessGroup | None, width: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.summed = nn.Linear(width, width)
        if group is not None:
            for p in self.summed.parameters():
                p.register_hook(lambda g: _summed(g, group))

    def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        return h.square().sum() + self.summed(h).square().sum() if use else h.square().sum()


def _summed(grad: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    out = grad.clone()
    dist.all_reduce(out, group=group)
    return out


SKIPPED = 2  # the step in which no rank uses ``Summed.summed``


def _summed_batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank), dtype=torch.float64)


def summed_worker(rank: int) -> dict[str, Any]:
    """A non-communicating bucket (``SummedInBackward``'s two parameters): after the first step, SGD with
    momentum on ``Summed`` under overlap; in step ``SKIPPED`` no rank has a gradient for that bucket, which
    must leave them None (momentum skips them, as in one process). Our parameters, the float64 single
    process's, and the buckets (members' names, local or not)."""
    P = dist.get_world_size()
    group = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    model = Summed(group).double()
    summed = SummedInBackward()
    opt = sparsync.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model,
        plan={"summed.weight": summed, "summed.bias": summed},
    )  # fmt: skip
    none_at_skip = []
    for step in range(STEPS):
        opt.zero_grad()
        model(_summed_batch(step, rank), step != SKIPPED).backward()
        none_at_skip.append(model.summed.weight.grad is None)
        opt.step()
    reducer = opt._reducer
    assert reducer is not None and reducer.buckets is not None
    names = [p.name for p in reducer.params]
    buckets = [([names[i] for i in b.members], b.local) for b in reducer.buckets]
    torch.manual_seed(0)
    ref = Summed(None).double()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        ref_opt.zero_grad()
        for r in range(P):
            ref(_summed_batch(step, r), step != SKIPPED).backward()
        for p in ref.parameters():
            if p.grad is not None:
                p.grad = p.grad / P
        ref_opt.step()
    return {
        "ours": [p.detach().numpy().copy() for p in model.parameters()],
        "ref": [p.detach().numpy().copy() for p in ref.parameters()],
        "buckets": buckets,
        "none": none_at_skip,
    }


def timeline_worker(rank: int) -> dict[str, Any]:
    """A deep MLP whose first bucket (1 MiB) fills early in backward: at the first layer's post-accumulate hook
    (late in backward), has bucket 0 been launched, and does its allreduce (issued on backward's thread,
    ``jobs.Issued``) complete while backward waits in that hook (up to 60 s: gloo's threads run it, and on a
    loaded host they may be scheduled late)? Also when, on the timeline, bucket 0 started and backward ended."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(6)])
    opt = sparsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model)
    reducer = opt._reducer
    assert reducer is not None
    directory = tempfile.mkdtemp()
    tracer = Tracer(directory, rank, dist.get_world_size())
    set_tracer(tracer)
    seen: list[tuple[int, bool]] = []  # (buckets launched, bucket 0 running or done) at the first layer's hook

    def first_layer(_: torch.Tensor) -> None:
        works = [w.work for b, w in reducer.works if b.index == 0 and isinstance(w, jobs.Issued)]

        def started() -> bool:
            return bool(works) and works[0].is_completed()

        deadline = time.monotonic() + 60
        while works and not started() and time.monotonic() < deadline:
            time.sleep(0.001)
        seen.append((reducer.launched, started()))

    model[0].weight.register_post_accumulate_grad_hook(first_layer)
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(64, 512)).square().mean().backward()
        opt.step()
    set_tracer(None)
    events = tracer.to_json()["traceEvents"]
    buckets = [e for e in events if e.get("name", "").startswith("bucket:") and e.get("ph") == "X"]
    backward = [e for e in events if e.get("name") == "backward" and e.get("ph") == "X"]
    return {
        "bucket0_starts": [e["ts"] for e in buckets if e["name"] == "bucket:0"],
        "backward_ends": [e["ts"] + e["dur"] for e in backward],
        "seen": seen,
        "buckets": len(reducer.buckets or []),
    }


def log_worker(rank: int) -> dict[str, Any]:
    """A dense model after its first step: only the buckets' allreduces, no metadata round (the log's records),
    and no sparsync queue thread (the names of those alive at the end)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 300), nn.Linear(300, 300))
    log = CommLog()
    opt = sparsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model, log=log)
    counts = []
    for _ in range(3):
        before = len(log.records)
        opt.zero_grad()
        model(torch.randn(4, 300)).sum().backward()
        opt.step()
        counts.append([(r.op, r.dim, r.bytes_sent) for r in log.records[before:]])
    threads = sorted(
        t.name for t in threading.enumerate() if t.name.startswith("sparsync_")
    )  # a queue thread (fifo)
    return {"steps": counts, "buckets": len(opt._reducer.buckets or []), "queues": threads}  # type: ignore[union-attr]


def bad_worker(rank: int, case: str) -> str:
    """A fault through DistributedOptimizer after the layout is agreed: NaN on the last rank (in a dense or in
    the sparse gradient), a second backward outside no_sync() on rank 1, a whole step skipped by rank 1, or
    models that differ across ranks. Returns the error."""
    P = dist.get_world_size()
    torch.manual_seed(0)
    try:
        model = Mixed(16 if case != "shape" or rank == 0 else 8)
        timeout = 10 if case == "skip_step" else 60
        opt = sparsync.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05), model, timeout=timeout, overlap=case != "nan_in_step"
        )
        for step in range(STEPS):
            if case == "skip_step" and rank == 1 and step == 2:
                continue
            opt.zero_grad()
            hook = None
            if step == 2 and rank == P - 1 and case in ("nan_dense", "nan_sparse", "nan_in_step"):
                param = model.emb.weight if case == "nan_sparse" else model.fc2.bias
                hook = param.register_hook(lambda g: g * float("nan"))
            model(_batch(step, rank), True).backward()
            if case == "extra_round" and rank == 1 and step == 2:
                model(_batch(step, rank), True).backward()  # accumulation without no_sync() on one rank
            if hook is not None:
                hook.remove()
            opt.step()
        return "no error"
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"


class Dropped(nn.Module):
    """An MLP with a head every rank uses at step 0 and none uses after (``first`` True only then)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(200, width, mode="sum")  # dense gradients: Adam takes no sparse ones
        self.fc = nn.Linear(width, width)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, first: bool) -> torch.Tensor:
        h = torch.tanh(self.fc(self.emb(x)))
        return h.square().sum() + self.head(h).sum() if first else h.square().sum()


DROPPED_OPTIMIZERS = {
    "momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
}


def dropped_layer_worker(rank: int) -> dict[str, Any]:
    """A layer with a gradient on every rank in the first round and on none later: after each later step its
    ``.grad`` must stay None (as under DDP and a single process), so momentum and Adam leave it where step 0
    put it. Per optimizer: our parameters, the float64 single-process reference's, and whether the head's
    ``.grad`` was None after each step."""
    P = dist.get_world_size()
    out: dict[str, Any] = {}
    for name, make in DROPPED_OPTIMIZERS.items():
        torch.manual_seed(0)
        model = Dropped().double()
        opt = sparsync.DistributedOptimizer(make(model.parameters()), model)
        grads = []
        for step in range(STEPS):
            opt.zero_grad()
            model(_batch(step, rank), step == 0).backward()
            opt.step()
            grads.append(model.head.weight.grad is None)
        out[name] = {"ours": [p.detach().numpy().copy() for p in model.parameters()], "head_grad_none": grads}
        out[name]["ref"] = _dropped_reference(P, name)
    return out


def _dropped_reference(P: int, name: str) -> list[np.ndarray]:
    torch.manual_seed(0)
    model = Dropped().double()
    opt = DROPPED_OPTIMIZERS[name](model.parameters())
    for step in range(STEPS):
        opt.zero_grad()
        for r in range(P):
            model(_batch(step, r), step == 0).backward()
        for p in model.parameters():
            if p.grad is not None:
                p.grad = p.grad / P
        opt.step()
    return [p.detach().numpy().copy() for p in model.parameters()]


def accumulate_worker(rank: int) -> dict[str, Any]:
    """Steps of two backward passes inside ``no_sync()`` and one outside, ``zero_grad()`` before each: whether
    the local sparse gradient was coalesced as it accumulated (``DistributedOptimizer._accumulated``, called from
    the reducer's hook), and the storage each step's reduced dense gradients live in (every step's gradients
    held, so a buffer made anew could not land where the last one was)."""
    torch.manual_seed(0)
    model = Mixed()
    opt = sparsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4), model)
    dense = [model.fc1.weight, model.fc1.bias, model.fc2.weight, model.fc2.bias, model.odd.weight]
    coalesced, storages, held = [], [], []
    for step in range(STEPS):
        opt.zero_grad()
        with opt.no_sync():
            for m in range(2):
                model(_batch(10 * step + m, rank), True).backward()
        g = model.emb.weight.grad
        assert g is not None
        coalesced.append(bool(g.is_coalesced()))
        model(_batch(10 * step + 2, rank), True).backward()
        grads = [p.grad for p in dense]
        held.append(grads)
        storages.append({g.untyped_storage().data_ptr() for g in grads if g is not None})
        opt.step()
    return {"coalesced": coalesced, "storages": storages}
