"""Workers for test_optim.py (module-level: ``launch`` pickles them)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from sparsync.compress import ErrorFeedback, TopK
from sparsync.optim import LAYOUT_KEY, DistributedOptimizer
from sparsync.placement import Compressed
from sparsync.record import CommLog

VOCAB, DIM, STEPS = 500, 6, 4


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(VOCAB, DIM, sparse=True), nn.Flatten(), nn.Linear(3 * DIM, 2))


def _batch(step: int, rank: int, density: float) -> torch.Tensor:
    """Token ids of one rank's batch: ``density`` of the vocabulary reachable (0: the empty gradient)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    top = max(1, round(density * VOCAB))
    return torch.randint(0, top, (5 if density > 0 else 0, 3), generator=g)  # 0: no row read, empty COO


def exact_worker(rank: int, densities: tuple[float, ...]) -> dict[float, dict[str, Any]]:
    """Per density, ``exact_case``."""
    return {d: exact_case(rank, d) for d in densities}


def exact_case(rank: int, density: float) -> dict[str, Any]:
    """DistributedOptimizer against an exact reference: every rank's dense gradient gathered, averaged in
    float64 and applied by hand; and against torch's DDP with sparse gradients."""
    P = dist.get_world_size()
    model = _model(rank)  # different inits: the wrapper broadcasts rank 0's
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.3), model)
    ref = _model(0)
    ddp_model = _model(0)
    ddp = nn.parallel.DistributedDataParallel(ddp_model)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.3)
    for step in range(STEPS):
        x = _batch(step, rank, density)
        for m, o in ((model, opt), (ddp, ddp_opt)):
            o.zero_grad()
            (m(x).square().sum() / 5).backward()
            o.step()
        ref.zero_grad()
        (ref(x).square().sum() / 5).backward()
        with torch.no_grad():
            for p in ref.parameters():
                assert p.grad is not None
                local = p.grad.to_dense().double()
                got = [torch.zeros_like(local) for _ in range(P)]
                dist.all_gather(got, local)
                p -= (0.3 * torch.stack(got).sum(0) / P).to(p.dtype)
    return {
        "ours": [p.detach().numpy().copy() for p in model.parameters()],
        "ref": [p.detach().numpy().copy() for p in ref.parameters()],
        "ddp": [p.detach().numpy().copy() for p in ddp_model.parameters()],
    }


def scheduler_worker(rank: int) -> dict[str, Any]:
    """An LR scheduler on the wrapper; a checkpoint after 2 steps loaded into a fresh wrapper resumes to the
    same parameters as an uninterrupted run; synchronize() + clipping aggregates once."""

    layouts: list[Any] = []

    def run(resume_at: int | None, clip: bool) -> tuple[list[np.ndarray], list[float]]:
        model = _model(0)
        opt = DistributedOptimizer(torch.optim.Adagrad(model.parameters(), lr=0.5), model)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        lrs = []
        for step in range(STEPS):
            if resume_at is not None and step == resume_at:
                state = {"opt": opt.state_dict(), "sched": sched.state_dict(), "model": model.state_dict()}
                model = _model(7)
                model.load_state_dict(state["model"])
                opt = DistributedOptimizer(torch.optim.Adagrad(model.parameters(), lr=0.5), model)
                sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
                opt.load_state_dict(state["opt"])
                sched.load_state_dict(state["sched"])
                # the path, not the values' luck: the saved bucket layout, and the resumed optimizer holding it
                # before its first round (without it that round would reduce the step-time way)
                layouts.append((state["opt"].get(LAYOUT_KEY), opt.state_dict().get(LAYOUT_KEY)))
            opt.zero_grad()
            model(_batch(step, rank, 1.0)).square().mean().backward()
            if clip:
                opt.synchronize()
                dense = [p for p in model.parameters() if p.grad is not None and not p.grad.is_sparse]
                nn.utils.clip_grad_norm_(dense, 1e9)  # a bound never reached: the same update as no clipping
            opt.step()
            sched.step()
            lrs.append(opt.optimizer.param_groups[0]["lr"])
        return [p.detach().numpy().copy() for p in model.parameters()], lrs

    straight, lrs = run(None, False)
    resumed, lrs2 = run(2, False)
    clipped, _ = run(None, True)
    return {"straight": straight, "resumed": resumed, "clipped": clipped, "lrs": lrs, "lrs2": lrs2,
            "layouts": layouts}  # fmt: skip


def unreached_clip_worker(rank: int) -> dict[str, Any]:
    """``clip_grad_norm_`` with a bound far above the norm: the aggregated gradients (sparse and dense) before
    and after it, the norm it returns, and the norm of the unclipped gradients (torch's definition: the norm of
    the per-tensor norms, a sparse one over its coalesced values)."""
    model = _model(0)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    model(_batch(0, rank, 0.2)).square().mean().backward()
    opt.synchronize()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    before = [(g.coalesce().to_dense() if g.is_sparse else g).clone() for g in grads]
    per = [torch.linalg.vector_norm(g.coalesce().values() if g.is_sparse else g) for g in grads]
    unclipped = torch.linalg.vector_norm(torch.stack(per))
    norm = opt.clip_grad_norm_(1e6)
    after = [g.coalesce().to_dense() if g.is_sparse else g for g in (p.grad for p in model.parameters())]
    return {
        "sparse": [g.is_sparse for g in grads],
        "before": [g.numpy().copy() for g in before],
        "after": [g.detach().numpy().copy() for g in after if g is not None],
        "norm": norm.item(),
        "unclipped": unclipped.item(),
    }


def plan_worker(rank: int) -> dict[str, Any]:
    """A per-parameter plan: the dense weight by TopK with error feedback, the rest by default; the log
    records bytes per collective."""
    model = _model(0)
    log = CommLog()
    plan = {"2.weight": Compressed(TopK(0.5), ErrorFeedback())}
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, plan=plan, log=log)
    twin = _model(0)  # this rank's own gradient (the wrapper's backward leaves the reduced one in .grad)
    twin(_batch(0, rank, 1.0)).square().mean().backward()
    before = {n: (p.detach().numpy().copy(), p.grad.to_dense().numpy().copy()) for n, p in twin.named_parameters()}
    opt.zero_grad()
    model(_batch(0, rank, 1.0)).square().mean().backward()
    opt.step()
    calls = [(r.op, r.dim, r.nnz_in) for r in log.records]
    return {"calls": calls, "bytes": sum(r.bytes_sent for r in log.records),
            "params": [p.detach().numpy().copy() for p in model.parameters()], "before": before}  # fmt: skip


def errors_worker(rank: int) -> list[str]:
    """Misuse inside a process group: each must raise with a message, never wrap silently."""
    model = _model(0)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    out = []
    for bad in (
        lambda: DistributedOptimizer(opt, model),
        lambda: opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]}),
        lambda: DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, op="avg"),
        lambda: DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model, plan={"nope": Compressed(TopK(0.5))}
        ),
    ):
        try:
            bad()
            out.append("no error")
        except (TypeError, ValueError, KeyError) as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


def hook_worker(rank: int) -> dict[str, Any]:
    """DDP with sparsync's hook: TopK + error feedback for dense gradients; the sparse embedding by the
    lossless row-sparse allreduce unless a plan names it; every reduction in the log."""
    from sparsync.compress.hooks import compression_hook

    out: dict[str, Any] = {}
    for case in ("default", "plan"):
        model = _model(0)
        ddp = nn.parallel.DistributedDataParallel(model)
        log = CommLog()
        plan = {"module.0.weight": TopK(0.1)} if case == "plan" else None
        ddp.register_comm_hook(None, compression_hook(TopK(0.5), ErrorFeedback(), module=ddp, log=log, plan=plan))
        x = _batch(0, rank, 1.0)
        (ddp(x).square().sum() / 5).backward()
        emb = model[0].weight.grad
        assert emb is not None and emb.is_sparse
        out[case] = {"emb": emb.to_dense().numpy().copy(), "records": len(log.records),
                     "bytes": sum(r.bytes_sent for r in log.records)}  # fmt: skip
    # the exact mean of the embedding gradient, for comparison
    ref = _model(0)
    (ref(_batch(0, rank, 1.0)).square().sum() / 5).backward()
    assert ref[0].weight.grad is not None
    g = ref[0].weight.grad.to_dense()
    dist.all_reduce(g)
    out["exact"] = (g / dist.get_world_size()).numpy()
    errors = []
    for bad in (
        lambda: compression_hook(TopK(0.5), plan={"x": TopK(0.1)}),
        lambda: compression_hook(TopK(0.5), module=ddp, plan={"nope": TopK(0.1)}),
    ):
        try:
            bad()
            errors.append("no error")
        except (ValueError, KeyError) as e:
            errors.append(str(e))
    out["errors"] = errors
    return out


def bucket_worker(rank: int) -> dict[str, Any]:
    """``Compressed(..., bucket=True)``: every parameter (sparse embedding + dense Linear weight and bias) by
    the placement. Lossless: the exact sum of the ranks' gradients. Lossy (Threshold + error feedback, two
    steps): the same bits as compressing the flattened dense gradients by hand under the bucket's name, and the
    embedding's COO gradient reduced on its own."""
    from sparsync.compress import Identity, Threshold, compressed_allreduce

    out: dict[str, Any] = {}
    model = _model(0)
    grads = []
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, op="sum",
                               plan=lambda n, p: Compressed(Identity(), bucket=True))  # fmt: skip
    twin = _model(0)  # this rank's own gradient (the wrapper's backward leaves the sum in .grad)
    twin(_batch(0, rank, 1.0)).square().mean().backward()
    for p in twin.parameters():
        assert p.grad is not None
        ref = p.grad.to_dense().double()
        dist.all_reduce(ref)
        grads.append(ref)
    opt.zero_grad()
    model(_batch(0, rank, 1.0)).square().mean().backward()
    opt.synchronize()
    out["lossless"] = [
        float((p.grad.to_dense().double() - r).abs().max()) for p, r in zip(model.parameters(), grads, strict=True)
    ]  # type: ignore[union-attr]

    model, twin = _model(1), _model(1)
    lossy = Compressed(Threshold(0.3, lifespan=1), ErrorFeedback(), bucket=True)
    opt = DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model, op="sum", plan=lambda n, p: lossy
    )
    by_hand, memory = Threshold(0.3, lifespan=1), ErrorFeedback()
    same = []
    for step in range(2):
        for m in (model, twin):
            m.zero_grad()
            m(_batch(step, rank, 0.5)).square().mean().backward()
        opt.synchronize()
        dense = [p for n, p in twin.named_parameters() if n != "0.weight"]
        flat = torch.cat([p.grad.reshape(-1) for p in dense])  # type: ignore[union-attr]
        want = compressed_allreduce(flat, by_hand, memory=memory, name="bucket:2.weight", average=False)
        emb = compressed_allreduce(twin[0].weight.grad, by_hand, memory=memory, name="0.weight", average=False)
        got = torch.cat([p.grad.reshape(-1) for n, p in model.named_parameters() if n != "0.weight"])  # type: ignore[union-attr]
        same.append(bool(torch.equal(got, want)))
        same.append(bool(torch.equal(model[0].weight.grad.to_dense(), emb.to_dense())))  # type: ignore[union-attr]
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            p.grad = None
            q.grad = None
    out["lossy_same"] = same
    return out


def dlrm_worker_nominal_link(rank: int, cfg: Any, data: Any) -> Any:
    """``bench.dlrm_train.worker`` with auto priced on the nominal reference link instead of one measured on a
    loaded machine: measured under a full test run's load, the merge costs made auto densify DLRM's small
    tables once (the same sums, dense bytes), which is a timing choice, not what the test checks."""
    from sparsync.collectives.group import set_link
    from sparsync.costmodel import REFERENCE_LINK
    from sparsync_bench.dlrm_train import worker

    set_link(REFERENCE_LINK)
    return worker(rank, cfg, data)
