"""The placements that aggregate by collectives among the workers (TF-Replicator §3.4's ``wrap_optimizer``
plans, Parallax §3.1's allreduce placements): ``DenseAllreduce`` (one flat allreduce per dtype),
``SparseAllreduce`` (SparCML's ``sparsync.allreduce`` per tensor, COO in, COO out), ``Compressed`` (a
``sparsync.compress`` compressor with error feedback through ``sparsync.compressed_allreduce``: ``Threshold`` +
``ErrorFeedback`` is DCT-DP), ``CustomReduce`` (any ``(grad, name, group) -> sum`` callable), ``Grouped``
(sparse and small dense gradients in one ``grouped_allreduce``) and ``ByLayout`` (the default: sparse gradients
to ``SparseAllreduce``, dense ones to ``DenseAllreduce``, both in one ``Grouped`` call when those two are the
defaults). The sketch is ``placement.sketch``, the parameter server ``sparsync.ps.placement``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from sparsync.collectives.grouped import grouped_allreduce
from sparsync.collectives.tensor import allreduce
from sparsync.compress import Compressor, PowerSGD, compressed_allreduce, powersgd_allreduce
from sparsync.compress.memory import Memory
from sparsync.placement.base import NamedParam, Placement, ReduceEnv

ReduceFn = Callable[[torch.Tensor, str, dist.ProcessGroup], torch.Tensor]


@dataclass(frozen=True)
class DenseAllreduce(Placement):
    """Dense allreduce (gloo ring), all gradients of one dtype in one flat bucket. A sparse gradient is
    densified: this is what plain data parallelism (Horovod, DDP) does with an embedding's gradient."""

    kind = "dense_allreduce"

    def aggregate(self, params: list[NamedParam], env: ReduceEnv) -> None:
        buckets: dict[torch.dtype, list[NamedParam]] = {}
        for p in params:
            buckets.setdefault(_grad(p).dtype, []).append(p)
        for members in buckets.values():
            flat = torch.cat([dense_flat(_grad(p)) for p in members])
            out = allreduce(
                flat, algorithm="dense", group=env.group, log=env.log, timeout=env.timeout,
                name="dense:" + ",".join(p.name for p in members), check_nan=env.check_nan,
            )  # fmt: skip
            assert isinstance(out, torch.Tensor)
            # views of the result's fresh buffer (the allreduce never aliases its input)
            views = flat_views(out, [p.param.shape for p in members])
            for p, view in zip(members, views, strict=True):
                p.param.grad = view


def dense_flat(grad: torch.Tensor) -> torch.Tensor:
    """A gradient as a dense allreduce sends it: densified (a sparse one), flattened."""
    return (grad.to_dense() if grad.is_sparse else grad).reshape(-1)


def flat_views(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """The members of a flat buffer of consecutive ``shapes``, as views (DDP's gradient_as_bucket_view: no copy
    per parameter); what follows the last member (a tail) is left out."""
    out, at = [], 0
    for shape in shapes:
        size = math.prod(shape)
        out.append(flat[at : at + size].view(shape))
        at += size
    return out


@dataclass(frozen=True)
class SparseAllreduce(Placement):
    """SparCML sparse allreduce per gradient (``sparsync.allreduce``): COO gradients of
    ``nn.Embedding(sparse=True)`` stay COO; dense ones travel sparse when "auto" finds that cheaper."""

    algorithm: str = "auto"
    kind = "sparse_allreduce"

    def aggregate(self, params: list[NamedParam], env: ReduceEnv) -> None:
        for p in params:
            g = p.param.grad
            assert g is not None
            p.param.grad = allreduce(  # type: ignore[assignment]
                g.coalesce() if g.is_sparse else g,
                algorithm=self.algorithm,
                group=env.group,
                log=env.log,
                timeout=env.timeout,
                name=p.name,
                check_nan=env.check_nan,
            )


@dataclass(frozen=True)
class CustomReduce(Placement):
    """Any reduction ``fn(grad, name, group) -> sum over the group`` (same kind of tensor as ``grad``): the plug
    point for compressors with error feedback, keyed by the parameter's stable name."""

    fn: ReduceFn
    kind = "custom"

    def aggregate(self, params: list[NamedParam], env: ReduceEnv) -> None:
        for p in params:
            g = p.param.grad
            assert g is not None
            out = self.fn(g, p.name, env.group)
            if not isinstance(out, torch.Tensor) or out.shape != g.shape:
                raise ValueError(
                    f"CustomReduce for {p.name!r} returned {type(out).__name__} "
                    f"{tuple(getattr(out, 'shape', ()))}, expected a tensor of shape {tuple(g.shape)}"
                )
            p.param.grad = out


@dataclass(frozen=True)
class Compressed(Placement):
    """A compressor from ``sparsync.compress`` with optional error feedback, through
    ``sparsync.compressed_allreduce``: e.g. ``Compressed(Threshold(0.01, lifespan=1000), ErrorFeedback())`` is
    DCT-DP (DCT Alg. 1). Residuals and the compressor's per-name state are keyed by the parameter's name."""

    compressor: Compressor
    memory: Memory | None = None
    # One compression and one collective for all the dense gradients of a dtype, flattened in plan order under
    # the name "bucket:<name>,<name>,..." (DCT Alg. 1 thresholds the gradient as one vector; per tensor, a model
    # of many small layers pays a collective per layer). Every member's name is in it, so two same-shape members
    # in another order on one rank raise on every rank. Sparse (COO) gradients are always reduced one by one.
    # PowerSGD's dense gradients are always batched, each factored under its name (``powersgd_allreduce``).
    bucket: bool = False
    kind = "compressed"

    def aggregate(self, params: list[NamedParam], env: ReduceEnv) -> None:
        # PowerSGD factors each matrix on its own; batched, its dense gradients of a dtype cost one exchange of two
        # allreduces in all (PowerSGD Alg. 1, as torch's hook batches a bucket), not two per gradient
        factored = isinstance(self.compressor, PowerSGD)
        buckets: dict[torch.dtype, list[NamedParam]] = {}
        for p in params:
            g = _grad(p)
            if (self.bucket or factored) and not g.is_sparse:
                buckets.setdefault(g.dtype, []).append(p)
            else:
                p.param.grad = self._reduce(g, p.name, env)
        for group in buckets.values():
            grads = [_grad(p) for p in group]
            if isinstance(self.compressor, PowerSGD):
                outs = powersgd_allreduce([(p.name, g) for p, g in zip(group, grads, strict=True)],
                                          self.compressor, self.memory, group=env.group, log=env.log,
                                          timeout=env.timeout, check_nan=env.check_nan)  # fmt: skip
            else:
                name = "bucket:" + ",".join(p.name for p in group)
                out = self._reduce(torch.cat([g.reshape(-1) for g in grads]), name, env)
                outs = list(torch.split(out, [g.numel() for g in grads]))
            for p, g, piece in zip(group, grads, outs, strict=True):
                p.param.grad = piece.view_as(g)

    def _reduce(self, g: torch.Tensor, name: str, env: ReduceEnv) -> torch.Tensor:
        out: torch.Tensor = compressed_allreduce(
            g, self.compressor, memory=self.memory, name=name, group=env.group, average=False, log=env.log,
            timeout=env.timeout, check_nan=env.check_nan,
        )  # fmt: skip
        return out


def _grad(p: NamedParam) -> torch.Tensor:
    g = p.param.grad
    assert g is not None
    return g


@dataclass(frozen=True)
class Grouped(Placement):
    """Sparse and small dense gradients together in one ``grouped_allreduce`` (one metadata round, and one
    allgather in all when the payloads fit the eager protocol): COO gradients grouped by (row width, dtype),
    one call per group, the dense gradients of a group's dtype packed into the first such call while their
    total is at most ``max_dense`` elements. Dense gradients left over go to ``DenseAllreduce``. Why: the
    demo's embedding + MLP paid two calls with a metadata round each, and lost to DDP."""

    algorithm: str = "auto"
    # Above this many dense elements a ring allreduce of the dense part (2(P-1)/P of it per rank) is left to
    # DenseAllreduce: fused, auto may run allgather, which sends it P-1 times.
    max_dense: int = 1 << 16
    kind = "grouped"

    def aggregate(self, params: list[NamedParam], env: ReduceEnv) -> None:
        groups: dict[tuple[int, torch.dtype], list[NamedParam]] = {}
        dense: list[NamedParam] = []
        for p in params:
            g = p.param.grad
            assert g is not None
            if g.is_sparse:
                groups.setdefault((math.prod(g.shape[g.sparse_dim() :]), g.dtype), []).append(p)
            else:
                dense.append(p)
        fused: set[torch.dtype] = set()
        for (_, dtype), members in groups.items():
            extra: list[NamedParam] = []
            if dtype not in fused:
                extra = [p for p in dense if p.param.grad is not None and p.param.grad.dtype == dtype]
                if sum(p.param.numel() for p in extra) > self.max_dense:
                    extra = []
                fused.add(dtype)
            together = members + extra
            out = grouped_sum([_grad(p) for p in together], [p.name for p in together], self.algorithm, env)
            for p, g in zip(together, out, strict=True):
                p.param.grad = g
            done = {id(p) for p in extra}
            dense = [p for p in dense if id(p) not in done]
        if dense:
            DenseAllreduce().aggregate(dense, env)


def grouped_sum(
    tensors: list[torch.Tensor], names: Sequence[str], algorithm: str, env: ReduceEnv, *, check_nan: bool = True
) -> list[torch.Tensor]:
    """One ``grouped_allreduce`` of ``tensors`` (the gradients of the parameters ``names``) over ``env.group``:
    their sums, in order. ``check_nan=False`` lets NaN and ±Inf through even where ``env.check_nan`` refuses."""
    out = grouped_allreduce(
        tensors, algorithm=algorithm, group=env.group, log=env.log, timeout=env.timeout, name=",".join(names),
        check_nan=env.check_nan and check_nan,
    )  # fmt: skip
    assert isinstance(out, list)  # a blocking call
    return out


@dataclass(frozen=True)
class ByLayout(Placement):
    """The default: sparse (COO) gradients by ``sparse``, dense ones by ``dense``. With the default
    placements on both sides and ``fuse`` on, the two go together through ``Grouped`` (one call where there
    were two)."""

    dense: Placement = field(default_factory=DenseAllreduce)
    sparse: Placement = field(default_factory=SparseAllreduce)
    fuse: bool = True
    kind = "by_layout"

    def aggregate(self, params: list[NamedParam], env: ReduceEnv) -> None:
        sp = [p for p in params if p.param.grad is not None and p.param.grad.is_sparse]
        dn = [p for p in params if p.param.grad is not None and not p.param.grad.is_sparse]
        # A gradient's layout comes from its module (nn.Embedding(sparse=True)), so it is the same on every
        # replica and both sides skip an empty half alike.
        if self.fuse and sp and type(self.dense) is DenseAllreduce and type(self.sparse) is SparseAllreduce:
            Grouped(self.sparse.algorithm).aggregate(sp + dn, env)
            return
        if dn:
            self.dense.aggregate(dn, env)
        if sp:
            self.sparse.aggregate(sp, env)
