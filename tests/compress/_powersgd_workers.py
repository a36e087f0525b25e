"""Module-level rank functions for the PowerSGD tests (``launch`` unpickles workers by qualified name).

Inputs are deterministic functions of (rank, step, name), so the parent rebuilds every rank's input and runs its
own float64 reference of PowerSGD on them (``test_powersgd.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import sparsync
from sparsync.compress import ErrorFeedback, PowerSGD, compressed_allreduce
from sparsync.compress.hooks import compression_hook
from sparsync.record import CommLog
from sparsync_bench.grad_bucket import GradBucket

# name -> (shape, dtype, PowerSGD rank) of the tensors compressed_allreduce reduces one at a time
TENSORS: dict[str, tuple[tuple[int, ...], torch.dtype, int]] = {
    "w": ((12, 5, 3), torch.float64, 2),  # a conv-like 3-D tensor: a 12 x 15 matrix
    "f": ((20, 9), torch.float32, 3),
    "v": ((7,), torch.float64, 2),  # a vector: sent whole
}
# the hand-made bucket's model: two Linear layers (float64), its gradients listed as DDP lists them (reversed)
BUCKET_RANK = 2


def grad_input(rank: int, step: int, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    seed = 7919 * step + 104729 * rank + sum(map(ord, name))
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def bucket_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 4)).double()


def reduce_worker(rank: int, steps: int) -> dict[str, Any]:
    """``steps`` steps of each tensor of ``TENSORS`` through ``compressed_allreduce`` with error feedback (sync,
    and async for "w"), then the hook on a hand-made bucket of matrices and vectors. Returns the results, the
    residuals after every step, the warm-start Qs and the CommLog records."""
    out: dict[str, Any] = {}
    for name, (shape, dtype, r) in TENSORS.items():
        comp, mem, log = PowerSGD(rank=r), ErrorFeedback(), CommLog()
        acomp, amem = PowerSGD(rank=r), ErrorFeedback()
        res, ares, resid = [], [], []
        for step in range(steps):
            g = grad_input(rank, step, name, shape, dtype)
            res.append(compressed_allreduce(g, comp, memory=mem, name=name, log=log).numpy())
            ares.append(compressed_allreduce(g, acomp, memory=amem, name=name, async_op=True).wait().numpy())
            e = mem.error(name)
            assert e is not None
            resid.append(e.numpy().copy())
        q = comp.warm_q(name)
        out[name] = {
            "steps": res, "async": ares, "residuals": resid, "q": None if q is None else q.numpy(),
            "records": [(rec.algorithm, rec.nnz_in, rec.bytes_sent) for rec in log.records],
        }  # fmt: skip
    out["bucket"] = bucket_run(rank, steps)
    return out


def bucket_run(rank: int, steps: int) -> dict[str, Any]:
    """The hook (PowerSGD with error feedback) on a hand-made bucket of ``bucket_model``'s four gradients."""
    model = bucket_model()
    named = list(model.named_parameters())[::-1]  # DDP's order: the last layer first
    log = CommLog()
    mem = ErrorFeedback()
    hook = compression_hook(PowerSGD(rank=BUCKET_RANK), mem, module=model, log=log)
    bufs = []
    for step in range(steps):
        grads = [grad_input(rank, step, n, tuple(p.shape), p.dtype) for n, p in named]
        bufs.append(hook(None, GradBucket([p for _, p in named], grads)).wait().numpy().copy())
    residuals = {n: e.numpy() for n in mem.names() if (e := mem.error(n)) is not None}
    records = [(rec.algorithm, rec.nnz_in, rec.bytes_sent, rec.messages) for rec in log.records]
    return {"buffers": bufs, "residuals": residuals, "records": records, "order": [n for n, _ in named]}


# --- DDP ----------------------------------------------------------------------------------------------------
DDP_STEPS = 6
START = 2  # steps sent uncompressed first (torch's start_powerSGD_iter; it must be >= 2 with error feedback)
DDP_RANK = 2


def ddp_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for a, b in ((24, 32), (32, 32), (32, 20), (20, 4)):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1]).double()


def ddp_worker(rank: int) -> dict[str, Any]:
    """Four DDP runs of ``ddp_model`` (float64) at the world size of the launch, ``DDP_STEPS`` SGD steps each:
    torch's ``powerSGD_hook`` and ours with one bucket for the whole model (ours starting from torch's first Qs),
    ours with its own first Qs with one bucket and with 4 KB buckets. Returns per run the averaged
    gradients after every step and the bucket indices the hook saw."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

    out: dict[str, Any] = {}
    order: list[str] = []

    def torch_hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        if state.iter == START and not order:  # the first compressed step: the bucket's parameter order
            names = {id(p): n for n, p in ddp.named_parameters()}
            order.extend(names[id(p)] for p in bucket.parameters())
        return torch_psgd.powerSGD_hook(state, bucket)

    _real_annotations(torch_hook)
    ddp = _ddp(100.0)
    state = torch_psgd.PowerSGDState(
        process_group=None, matrix_approximation_rank=DDP_RANK, start_powerSGD_iter=START, min_compression_rate=1,
        use_error_feedback=True, warm_start=True, random_seed=0,
    )  # fmt: skip
    ddp.register_comm_hook(state, torch_hook)
    out["torch"] = _train(ddp, rank)
    out["torch_order"] = list(order)
    first_qs = torch_first_qs(ddp, order)
    for run, cap, qs in (("ours_torch_q", 100.0, first_qs), ("ours_one", 100.0, None), ("ours_many", 0.004, None)):
        ddp = _ddp(cap)
        comp = PowerSGD(rank=DDP_RANK, start_iter=START)
        if qs is not None:
            comp.load_state_dict({n: {"calls": 0, "q": q} for n, q in qs.items()})
        seen: list[int] = []
        hook = compression_hook(comp, ErrorFeedback(), module=ddp)

        def ours(state: Any, bucket: Any, hook: Any = hook, seen: list[int] = seen) -> Any:
            seen.append(int(bucket.index()))
            return hook(state, bucket)

        ddp.register_comm_hook(None, _real_annotations(ours))
        out[run] = _train(ddp, rank)
        out[run + "_buckets"] = sorted(set(seen))
    return out


def _real_annotations(fn: Any) -> Any:
    """``fn`` with the classes DDP checks a hook's annotations against (this module's are strings)."""
    fn.__annotations__ = {"state": object, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
    return fn


def torch_first_qs(ddp: Any, order: list[str]) -> dict[str, torch.Tensor]:
    """The Qs torch's hook starts from in its first compressed step (powerSGD_hook.py: a seed drawn from
    ``np.random.RandomState(random_seed)``, then one ``torch.randn`` per compressed matrix, matrices grouped by
    shape in the bucket's order, each orthogonalized), by parameter name."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

    params = dict(ddp.named_parameters())
    groups: dict[tuple[int, int], list[str]] = {}
    for n in order:
        shape = params[n].shape
        if len(shape) == 2:
            groups.setdefault((shape[0], shape[1]), []).append(n)
    seed = np.random.RandomState(0).randint(1_000_000_000)
    qs: dict[str, torch.Tensor] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for (n_rows, m), names in groups.items():
            r = min(n_rows, m, DDP_RANK)
            for n in names:
                q = torch.randn(1, m, r, dtype=torch.float64)
                torch_psgd._orthogonalize(q)
                qs[n] = q[0]
    return qs


def _ddp(bucket_cap_mb: float) -> Any:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(ddp_model(), bucket_cap_mb=bucket_cap_mb)


def _train(ddp: Any, rank: int) -> list[list[np.ndarray]]:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    grads = []
    for _ in range(DDP_STEPS):
        xb = torch.randn(16, 24, generator=gen, dtype=torch.float64)
        yb = torch.randn(16, 4, generator=gen, dtype=torch.float64)
        opt.zero_grad()
        (ddp(xb) - yb).pow(2).mean().backward()
        grads.append([p.grad.numpy().copy() for p in ddp.parameters()])
        opt.step()
    return grads


# --- DistributedOptimizer -------------------------------------------------------------------------------------
OPT_STEPS = 4


def optimizer_worker(rank: int, overlap: bool) -> dict[str, Any]:
    """``DistributedOptimizer`` with every parameter by ``Compressed(PowerSGD(rank=2), ErrorFeedback())``,
    ``OPT_STEPS`` SGD steps on ``bucket_model``. Without overlap each step's local gradients (before ``step()``)
    and averaged ones (after) are returned; with it, only the final parameters."""
    from sparsync.placement import Compressed

    model = bucket_model()
    place = Compressed(PowerSGD(rank=BUCKET_RANK), ErrorFeedback())
    opt = sparsync.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model, plan=lambda n, p: place, overlap=overlap
    )
    gen = torch.Generator().manual_seed(rank)
    local, averaged = [], []
    for _ in range(OPT_STEPS):
        xb = torch.randn(5, 8, generator=gen, dtype=torch.float64)
        opt.zero_grad()
        model(xb).pow(2).sum().backward()
        if not overlap:
            local.append({n: p.grad.numpy().copy() for n, p in model.named_parameters()})
        opt.step()
        if not overlap:
            averaged.append({n: p.grad.numpy().copy() for n, p in model.named_parameters()})
    params = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    return {"local": local, "averaged": averaged, "params": params, "P": dist.get_world_size()}


def ddp_and_optimizer_worker(rank: int) -> dict[str, Any]:
    out = ddp_worker(rank)
    out["optimizer"] = optimizer_worker(rank, False)
    out["optimizer_overlap"] = optimizer_worker(rank, True)
    return out
