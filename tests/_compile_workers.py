"""Workers for test_compile.py (module-level: ``launch`` pickles them). Each case trains the same model twice on
the same batches, once as it is and once through ``torch.compile``, and returns both runs' parameters, the
collectives each run logged, and how many graphs dynamo compiled (a compiled run that compiled nothing proves
nothing)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo
from torch import nn

import sparsync
from sparsync.compress import ErrorFeedback, Identity, TopK
from sparsync.compress.hooks import compression_hook
from sparsync.optim import DistributedOptimizer
from sparsync.record import CommLog
from sparsync.sharding import plan_of

STEPS = 3


class Net(nn.Module):
    """A sparse-gradient table, a dense-gradient table, a sparse-gradient bag and a dense layer over the three.
    The forward looks every table up before it uses any output, so sharded tables share one exchange."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.sp = nn.Embedding(40, 4, sparse=True)
        self.de = nn.Embedding(30, 4)
        self.bag = nn.EmbeddingBag(24, 4, mode="sum", sparse=True)
        self.fc = nn.Linear(12, 2)

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        looked = [self.sp(a), self.de(b), self.bag(c)]
        return self.fc(torch.cat([looked[0].sum(1), looked[1].sum(1), looked[2]], 1)).tanh()


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return (
        torch.randint(0, 40, (4, 3), generator=g),
        torch.randint(0, 30, (4, 3), generator=g),
        torch.randint(0, 24, (4, 2), generator=g),
    )


# What a case builds: (the model whose parameters are compared, the module to call, the optimizer to step)
Setup = Callable[[CommLog], tuple[nn.Module, nn.Module, torch.optim.Optimizer]]


def _optimizer_setup(overlap: bool) -> Setup:
    """``overlap``: reduce during backward, in buckets filled in the order autograd hands over the gradients
    (which a compiled backward changes); else every gradient in ``step()``, in the parameters' order."""

    def setup(log: CommLog) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
        model = Net()
        opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
        return model, model, DistributedOptimizer(opt, model, log=log, overlap=overlap)

    return setup


def _hook_setup(compressor: str) -> Setup:
    def setup(log: CommLog) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
        model = Net()
        ddp = nn.parallel.DistributedDataParallel(model)
        if compressor == "identity":
            hook = compression_hook(Identity(), module=ddp, log=log)
        else:  # dense gradients by TopK with error feedback (one fused sparse call per bucket), sparse lossless
            hook = compression_hook(TopK(0.5), ErrorFeedback(), module=ddp, log=log)
        ddp.register_comm_hook(None, hook)
        return model, ddp, torch.optim.SGD(model.parameters(), lr=0.1)

    return setup


def _shard_setup(log: CommLog) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    model = sparsync.shard(Net(), plan={"sp": "sharded", "bag": "sharded", "de": "replicated"}, log=log)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, plan=plan_of(model),
                               sync_parameters=False, log=log)  # fmt: skip
    return model, model, opt


SETUPS: dict[str, Setup] = {
    "optimizer": _optimizer_setup(overlap=True),
    "optimizer_in_step": _optimizer_setup(overlap=False),
    "hook_identity": _hook_setup("identity"),
    "hook_topk": _hook_setup("topk"),
    "shard": _shard_setup,
}


def _train(setup: Setup, rank: int, backend: str | None) -> dict[str, Any]:
    """``STEPS`` steps of the case's model, through ``torch.compile(backend=backend)`` unless None."""
    torch._dynamo.reset()  # each run compiles afresh: no graph or recompile budget left over from another case
    torch._dynamo.utils.counters.clear()
    log = CommLog()
    model, module, opt = setup(log)
    call = torch.compile(module, backend=backend) if backend is not None else module
    before = [p.detach().clone() for p in model.parameters()]
    for step in range(STEPS):
        opt.zero_grad()
        call(*_batch(step, rank)).square().sum().backward()
        opt.step()
    return {
        "params": {n: p.detach().numpy().copy() for n, p in model.named_parameters()},
        # the collectives' order may differ (a compiled backward hands autograd the gradients in another order)
        "ops": sorted((r.op, r.nnz_in) for r in log.records),
        "moved": all(not torch.equal(p0, p) for p0, p in zip(before, model.parameters(), strict=True)),
        "graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"]),
    }


def compare_worker(rank: int, cases: tuple[str, ...], backend: str) -> dict[str, dict[str, Any]]:
    """Per case of ``SETUPS``: the eager run and the compiled one. ``auto`` chooses its algorithms from the
    reference link (``set_deterministic``): a link measured by timing could choose another summation order in
    the second run, which would differ in the last bits for reasons that have nothing to do with compiling."""
    sparsync.set_deterministic()
    return {case: {"eager": _train(SETUPS[case], rank, None), "compiled": _train(SETUPS[case], rank, backend)}
            for case in cases}  # fmt: skip


def fullgraph_worker(rank: int) -> str:
    """A sharded model compiled with ``fullgraph=True``: the error torch raises at its first call (its lookups
    must run their exchange eagerly), or "no error"."""
    _, module, _ = _shard_setup(CommLog())
    try:
        torch.compile(module, backend="aot_eager", fullgraph=True)(*_batch(0, rank))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"
