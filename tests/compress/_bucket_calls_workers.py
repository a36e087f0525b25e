"""Module-level rank functions for ``test_bucket_calls.py``: how many collectives one bucket costs (a counter
wrapped around ``torch.distributed``'s collective functions), and the flat route's results against references.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

import sparsync
from sparsync.compress import ErrorFeedback, from_spec
from sparsync.compress.hook_future import bucket_name
from sparsync.compress.hooks import compression_hook
from sparsync.placement import Compressed

# every torch.distributed function that communicates (sparsync calls them as dist.<name> at call time)
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "broadcast",
    "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv", "gather", "scatter",
    "barrier",
)  # fmt: skip
STEPS = 4
COUNTED = (2, 3)  # steps counted: after DDP's bucket rebuild (step 0) and the hook's first layout check (step 1)


class CallCounter:
    """Counts calls of ``COLLECTIVES`` while ``on``, by function name, from any thread of this process."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.on = False
        self._real: dict[str, Callable[..., Any]] = {}

    def _wrap(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.on:
                self.counts[name] += 1
            return real(*args, **kwargs)

        return counted

    @contextmanager
    def installed(self) -> Iterator[CallCounter]:
        for name in COLLECTIVES:
            real = getattr(dist, name, None)
            if real is not None:
                self._real[name] = real
                setattr(dist, name, self._wrap(name, real))
        try:
            yield self
        finally:
            for name, real in self._real.items():
                setattr(dist, name, real)


def model(layers: int) -> torch.nn.Module:
    """``layers`` Linear layers (2 parameters each), small enough for one DDP bucket."""
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(12, 12), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods[:-1])


def _train(net: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, counter: CallCounter) -> None:
    gen = torch.Generator().manual_seed(rank)
    for step in range(STEPS):
        counter.on = step in COUNTED
        opt.zero_grad()
        net(torch.randn(8, 12, generator=gen)).pow(2).mean().backward()
        opt.step()  # DistributedOptimizer: waits for its buckets here
        if step in COUNTED:
            dist.barrier()  # counted steps end when every rank's hook futures are done (DDP waits on them)
    counter.on = False


def calls_worker(rank: int, runs: tuple[str, ...], layers: tuple[int, ...]) -> dict[str, dict[int, Any]]:
    """For each run ("hook:<spec>": DDP with the hook of ``spec``, error feedback where the compressor keeps it;
    "opt:<spec>": ``DistributedOptimizer`` with ``Compressed(spec, ErrorFeedback())``; "opt-bucket:<spec>": with
    ``bucket=True``) and each model size of
    ``layers``, the collective calls of the steps ``COUNTED`` per function name, and the buckets the hook saw
    per step. Errors come back as text."""
    from torch.nn.parallel import DistributedDataParallel

    out: dict[str, dict[int, Any]] = {}
    for run in runs:
        kind, _, spec = run.partition(":")
        out[run] = {}
        for n in layers:
            net = model(n)
            comp = from_spec(spec)
            mem = None if comp.name in ("qsgd",) else ErrorFeedback()  # QSGD's reduce-scatter keeps no residual
            buckets: list[int] = []
            with CallCounter().installed() as counter:
                if kind == "hook":
                    ddp = DistributedDataParallel(net)
                    real = compression_hook(comp, mem, module=ddp)

                    def hook(state: Any, bucket: Any, real: Any = real, seen: list[int] = buckets) -> Any:
                        seen.append(int(bucket.index()))
                        return real(state, bucket)

                    hook.__annotations__ = real.__annotations__  # DDP reads them
                    ddp.register_comm_hook(None, hook)
                    _train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.01), rank, counter)
                else:
                    sgd = torch.optim.SGD(net.parameters(), lr=0.01)
                    placement = Compressed(comp, mem, bucket=kind == "opt-bucket")
                    opt = sparsync.DistributedOptimizer(sgd, net, default=placement)
                    _train(net, opt, rank, counter)
            calls = dict(counter.counts)
            calls["barrier"] = calls.get("barrier", 0) - len(COUNTED)  # the test's own
            out[run][n] = {"calls": calls, "hook_calls": len(buckets) // STEPS}
    return out


def flat_worker(rank: int, spec: str, feedback: bool) -> dict[str, Any]:
    """DDP with the hook of ``spec`` (``feedback``: with ``ErrorFeedback``) on a 3-layer model in one bucket:
    each call's members, gradients and result; then, from the same gradients, the reference of one
    ``compressed_allreduce`` of the bucket's flat buffer per call (a fresh compressor, the call named after the
    bucket, residuals per parameter kept here by hand) and the per-parameter path (one call per gradient)."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model(3))
    names = {id(p): n for n, p in ddp.named_parameters()}
    mem = ErrorFeedback() if feedback else None
    real = compression_hook(from_spec(spec), mem, module=ddp)
    calls: list[dict[str, Any]] = []

    def hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        row: dict[str, Any] = {
            "names": [names[id(p)] for p in bucket.parameters()],
            "grads": [g.clone() for g in bucket.gradients()],
        }
        calls.append(row)

        def reduced(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            row["out"] = f.value().clone()
            return f.value()

        return real(state, bucket).then(reduced)

    hook.__annotations__ = real.__annotations__
    ddp.register_comm_hook(None, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        opt.zero_grad()
        ddp(torch.randn(8, 12, generator=gen)).pow(2).mean().backward()
        opt.step()
    flat_comp, residual = from_spec(spec), {n: torch.zeros_like(p) for n, p in ddp.named_parameters()}
    per_comp, per_mem = from_spec(spec), ErrorFeedback() if feedback else None
    flat_ref, per_param = [], []
    for row in calls:
        xs = [g + residual[n] if feedback else g for n, g in zip(row["names"], row["grads"], strict=True)]
        x = torch.cat([t.reshape(-1) for t in xs])
        flat_ref.append(sparsync.compressed_allreduce(x, flat_comp, name=bucket_name(row["names"])).numpy())
        if feedback:  # what this rank's payload stood for: the cast of x (a deterministic compressor)
            local = flat_comp.decompress(flat_comp.compress(x), sparsync.compress.TensorSpec.of(x))
            for n, t, sent in zip(row["names"], xs, torch.split(local, [t.numel() for t in xs]), strict=True):
                residual[n] = t - sent.view_as(t)
        res = [
            sparsync.compressed_allreduce(g, per_comp, memory=per_mem, name=n).reshape(-1)
            for n, g in zip(row["names"], row["grads"], strict=True)
        ]
        per_param.append(torch.cat(res).numpy())
    residuals = {n: mem.error(n).numpy() for n in mem.names()} if mem is not None else {}  # type: ignore[union-attr]
    return {
        "outs": [c["out"].numpy() for c in calls],
        "flat_ref": flat_ref,
        "per_param": per_param,
        "residuals": residuals,
        "ref_residuals": {n: e.numpy() for n, e in residual.items()} if feedback else {},
        "per_param_residuals": {n: e.numpy() for n in per_mem.names() if (e := per_mem.error(n)) is not None}
        if per_mem is not None
        else {},
    }
