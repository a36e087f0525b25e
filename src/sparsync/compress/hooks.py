"""DDP communication hooks running any sparsync compressor (``DistributedDataParallel.register_comm_hook``).

A hook is a callable ``hook(state, bucket) -> Future`` (PyTorch's ``default_hooks.py`` convention); the
one built here (``CompressionHook``) ignores ``state``, carries its settings, and sends each bucket by the first
of its ordered routes that accepts it: DDP's own allreduce, one fused sparse allreduce, PowerSGD's two
allreduces, the flat buffer in one call (compressed or not), or one call per gradient. Error-feedback residuals
are kept per parameter name on every route (they then survive DDP's bucket rebuild after the first iteration,
which reorders buckets), and so is the per-layer state of the compressors that have one (DCT's threshold,
§2.1; PowerSGD's warm start). Sparse gradients (``nn.Embedding(sparse=True)``) arrive as their own bucket
holding the COO tensor and are reduced as COO: DDP's own fp16 and PowerSGD hooks crash or hang on them.

Per parameter: ``plan`` maps parameter names to the compressor that reduces them; a sparse gradient
no plan names goes by ``sparse`` (default ``Identity()``: the lossless row-sparse allreduce), since a lossy
compressor with error feedback turns an embedding's row-sparse gradient dense (TopK + error feedback sent 1.5x
the bytes of no compression on DLRM); dense ones by ``compressor``. Error feedback applies to lossy
compressors only. ``log`` receives one CommRecord per reduction, so the DDP route reports its bytes too.

A dense bucket with nothing to compress costs what DDP's own allreduce costs: after its layout was checked once
(its first step, through ``compressed_allreduce`` and its metadata round), it goes as one
``dist.all_reduce(bucket.buffer(), async_op=True)`` issued in the hook, no queue, no copies
(``bucket_allreduce.py``).

A dense bucket whose gradients all go by sparsifiers (``Threshold`` = DCT-DP, ``TopK``, ``RandomK``, ``BlockTopK``)
is sent as one sparse allreduce (``bucket_sparse.py``): compensation, compression and the error-feedback update
stay per parameter and under its name (DCT §2.1's layer-wise threshold, the same selection and residuals as one
call per gradient), and the payloads, shifted to their gradients' offsets in the bucket, travel as one stream over
the bucket's flat buffer, named after the bucket's members. One metadata round and one allreduce per bucket
instead of one of each per gradient. A bucket mixing sparsifiers with other compressors (or with ``Identity``,
e.g. by ``plan=``) is reduced one gradient at a time.

A dense bucket whose gradients all go by one other compressor object (``QSGD``, the casts, ``SparseSketch``, or
``TopK(scope="bucket")``: no per-layer selection) is compressed as its flat buffer, in one
``compressed_allreduce`` named after the bucket's members, as torch's fp16 hook casts the whole buffer: one
metadata round and one collective per bucket instead of one of each per gradient. The residuals stay per
parameter name (``memory.SlicedMemory``); QSGD's scale buckets then span parameter boundaries.

A dense bucket whose gradients all go by ``PowerSGD`` is sent with two allreduces in all, one of the bucket's Ps
(and its vectors, sent whole), one of its Qs (``bucket_powersgd.py``), residuals and warm-start Qs per parameter
name; unlike torch's ``powerSGD_hook``, with any number of buckets in flight on gloo.

The reductions run on sparsync's own process group over the same ranks
(``sparsync.collectives.background.background_group``), made when the hook is built: a model whose backward issues
collectives of its own on the user's group (DLRM's alltoall) cannot interleave them with the hook's in a
different order per rank.

Example::

    >>> ddp = DistributedDataParallel(model)
    >>> ddp.register_comm_hook(None, compression_hook(TopK(0.01), memory=ErrorFeedback(), module=ddp))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sparsync.collectives.background import background_group
from sparsync.collectives.group import resolve_group
from sparsync.compress.base import Compressor
from sparsync.compress.bucket_allreduce import BucketAllreduce
from sparsync.compress.bucket_powersgd import BucketPowerSGD, low_rank
from sparsync.compress.bucket_sparse import BucketSparse, fusable
from sparsync.compress.hook_future import bucket_future, bucket_name, complete_when_done
from sparsync.compress.identity import Identity
from sparsync.compress.memory import Memory, SlicedMemory
from sparsync.compress.reduce import compressed_allreduce
from sparsync.handle import Work
from sparsync.record import CommLog

# dist.GradBucket is missing from torch's type stubs: buckets are typed Any.
Hook = Callable[[Any, Any], torch.futures.Future[torch.Tensor]]
Route = Callable[["CompressionHook", "_Bucket"], torch.futures.Future[torch.Tensor]]


def compression_hook(
    compressor: Compressor,
    memory: Memory | None = None,
    *,
    module: torch.nn.Module | None = None,
    group: dist.ProcessGroup | None = None,
    average: bool = True,
    async_op: bool = True,
    algorithm: str = "auto",
    plan: Mapping[str, Compressor] | None = None,
    sparse: Compressor | None = None,
    log: CommLog | None = None,
) -> CompressionHook:
    """A DDP comm hook reducing every gradient through
    ``sparsync.compressed_allreduce(grad, compressor, memory=...)``.

    ``module``: the model (or the DDP wrapper) whose ``named_parameters()`` name the gradients; required with
    ``memory`` or a compressor with per-name state, since bucket positions change when DDP rebuilds its
    buckets. ``group``: the ranks to reduce over (DDP's ``process_group``; default the world). ``average``:
    divide by the world size, as DDP's default hook does. ``async_op``: the hook returns before its bucket is
    reduced, so autograd computes the next buckets meanwhile (DDP's overlap): uncompressed dense buckets as
    DDP's allreduce, the others on sparsync's queue; ``False`` reduces before returning (a diagnostic).
    ``plan``: parameter name -> compressor (needs ``module``); ``sparse``: the compressor of sparse gradients
    no plan names (default ``Identity()``, lossless); ``log``: a CommLog receiving one record per reduction.

    Collective: every rank of ``group`` builds the hook (the first hook for a group creates sparsync's own
    group over its ranks, where the reductions run; later hooks reuse it).
    """
    if not isinstance(compressor, Compressor):
        raise TypeError(f"compressor must be a sparsync Compressor, got {type(compressor).__name__}")
    if memory is not None and module is None:
        raise ValueError("memory= needs module=: residuals are kept per parameter name")
    plan = dict(plan or {})
    if plan and module is None:
        raise ValueError("plan= needs module=: it names parameters")
    for c in [*plan.values(), sparse]:
        if c is not None and not isinstance(c, Compressor):
            raise TypeError(f"plan and sparse take sparsync Compressors, got {type(c).__name__}")
    names: dict[int, str] = {}
    if module is not None:
        names = {id(p): n for n, p in module.named_parameters()}
        unknown = sorted(set(plan) - set(names.values()))
        if unknown:
            raise KeyError(f"plan names unknown parameters {unknown}; valid names: {sorted(names.values())}")
    return CompressionHook(
        compressor, memory, names=names, plan=plan, sparse=sparse, group=group, average=average,
        async_op=async_op, algorithm=algorithm, log=log,
    )  # fmt: skip


# One bucket as the hook sees it: the buffer, each gradient's name and tensor (empty until a route needs them),
# the compressor of each, and the memory of the flat route (None: the hook's own).
@dataclass
class _Bucket:
    raw: Any  # dist.GradBucket
    buffer: torch.Tensor
    todo: list[tuple[str, torch.Tensor]]
    comps: list[Compressor]
    memory: Memory | None = None


class CompressionHook:
    """The hook ``compression_hook`` builds: ``hook(state, bucket) -> Future`` (DDP's convention; ``state`` is
    not used, the settings are the object's). A bucket takes the first route of ``ROUTES`` that accepts it."""

    def __init__(
        self,
        compressor: Compressor,
        memory: Memory | None,
        *,
        names: dict[int, str],
        plan: dict[str, Compressor],
        sparse: Compressor | None,
        group: dist.ProcessGroup | None,
        average: bool,
        async_op: bool,
        algorithm: str,
        log: CommLog | None,
    ) -> None:
        # DDP reads a hook's __name__ and __qualname__ (its logger, its bf16-hook check), as a function has them
        self.__name__ = self.__qualname__ = "compression_hook"
        self.compressor, self.memory, self.names, self.plan = compressor, memory, names, plan
        self.sparse = sparse if sparse is not None else Identity()
        self.average, self.async_op, self.algorithm, self.log = average, async_op, algorithm, log
        self.lossless = Identity()
        self.own = background_group(group)
        # Uncompressed dense buckets, once their layout is checked: DDP's own allreduce (bucket_allreduce.py)
        self.plain = (
            BucketAllreduce(self.own, resolve_group(group), average=average, log=log) if async_op else None
        )
        # Dense buckets of sparsifiers: per-parameter encode, one sparse allreduce per bucket (bucket_sparse.py)
        self.fused = BucketSparse(
            self.own, memory=memory, average=average, async_op=async_op, algorithm=algorithm, log=log
        )
        # Dense buckets of PowerSGD gradients: per-parameter plan, two allreduces per bucket (bucket_powersgd.py)
        self.factored = BucketPowerSGD(self.own, memory=memory, average=average, async_op=async_op, log=log)
        # Every dense gradient goes by Identity whatever its name: a dense bucket needs no look at its parameters.
        self.dense_identity = not plan and isinstance(compressor, Identity)

    def __call__(self, state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        del state
        buffer: torch.Tensor = bucket.buffer()
        b = _Bucket(bucket, buffer, [], [])
        if not self.dense_identity or buffer.is_sparse:
            self._per_gradient(b)
        for _name, accepts, send in self.ROUTES:
            if accepts(self, b):
                return send(self, b)
        raise AssertionError("the last route accepts every bucket")  # pragma: no cover

    def _chosen(self, name: str, grad: torch.Tensor) -> Compressor:
        if name in self.plan:
            return self.plan[name]
        return self.sparse if grad.is_sparse else self.compressor

    def _per_gradient(self, b: _Bucket) -> None:
        grads = b.raw.gradients() if not b.buffer.is_sparse else [b.buffer]
        b.todo = [
            (self.names.get(id(p)) or f"bucket{b.raw.index()}.{j}", grad)
            for j, (p, grad) in enumerate(zip(b.raw.parameters(), grads, strict=True))
        ]
        b.comps = [self._chosen(name, grad) for name, grad in b.todo]

    # --- the routes, in order: (name, accepts, send) ----------------------------------------------------------
    def _uncompressed(self, b: _Bucket) -> bool:
        return not b.buffer.is_sparse and all(isinstance(c, Identity) for c in b.comps)

    def _plain_accepts(self, b: _Bucket) -> bool:
        """An uncompressed dense bucket whose layout was checked: DDP's own allreduce."""
        return self._uncompressed(b) and self.plain is not None and self.plain.checked(b.raw)

    def _plain(self, b: _Bucket) -> torch.futures.Future[torch.Tensor]:
        assert self.plain is not None
        return self.plain(b.raw)

    def _flat_accepts(self, b: _Bucket) -> bool:
        """A dense bucket whose gradients all go by one compressor with no per-layer selection (an uncompressed
        one not checked yet, or without async_op; QSGD, the casts, the sketch): the flat buffer in one call, its
        residuals kept per parameter name."""
        if b.buffer.is_sparse:
            return False
        if self._uncompressed(b):
            b.todo, b.comps = [(f"bucket{b.raw.index()}", b.buffer.view(-1))], [self.lossless]
            return True
        first = b.comps[0]
        if any(c is not first for c in b.comps):
            return False
        if self.memory is not None:
            b.memory = SlicedMemory(self.memory, [(n, g.shape) for n, g in b.todo])
        b.todo, b.comps = [(bucket_name([n for n, _ in b.todo]), b.buffer.view(-1))], [first]
        return True

    def _fused_accepts(self, b: _Bucket) -> bool:
        """A dense bucket of sparsifiers: one sparse allreduce (bucket_sparse.py)."""
        return fusable(b.buffer, b.comps)

    def _fused(self, b: _Bucket) -> torch.futures.Future[torch.Tensor]:
        return self.fused(b.buffer, b.todo, b.comps)

    def _low_rank_accepts(self, b: _Bucket) -> bool:
        """A dense bucket of PowerSGD gradients: its Ps in one allreduce, its Qs in another (bucket_powersgd)."""
        return low_rank(b.buffer, b.comps)

    def _low_rank(self, b: _Bucket) -> torch.futures.Future[torch.Tensor]:
        return self.factored(b.buffer, b.todo, b.comps)

    def _each(self, b: _Bucket) -> torch.futures.Future[torch.Tensor]:
        """Anything else: one ``compressed_allreduce`` per gradient (for the flat route, one for the buffer)."""
        works: list[Work[torch.Tensor]] = []
        for (name, grad), c in zip(b.todo, b.comps, strict=True):
            out = compressed_allreduce(
                grad, c, memory=None if isinstance(c, Identity) else b.memory or self.memory, name=name,
                group=self.own,
                average=self.average, async_op=self.async_op, algorithm=self.algorithm, log=self.log,
            )  # fmt: skip
            works.append(out if isinstance(out, Work) else Work.done(out))
        buffer = b.buffer
        fut: torch.futures.Future[torch.Tensor] = bucket_future(buffer)

        def assemble() -> torch.Tensor:
            results: list[torch.Tensor] = [w.wait() for w in works]
            if buffer.is_sparse:
                return results[0]
            offset = 0
            flat = buffer.view(-1)
            for r in results:
                flat[offset : offset + r.numel()].copy_(r.reshape(-1))
                offset += r.numel()
            return buffer

        # The group's queue runs reductions in issue order: the last one done means all are.
        complete_when_done(works[-1], fut, assemble)
        return fut

    ROUTES: tuple[tuple[str, Callable[[CompressionHook, _Bucket], bool], Route], ...] = (
        ("plain", _plain_accepts, _plain),
        ("fused", _fused_accepts, _fused),
        ("low_rank", _low_rank_accepts, _low_rank),
        ("flat", _flat_accepts, _each),
        ("each", lambda self, b: True, _each),
    )


# DDP inspects the hook's signature and rejects the string annotations that `from __future__ import annotations`
# leaves: give it the real classes.
CompressionHook.__call__.__annotations__ = {
    "state": object,
    "bucket": dist.GradBucket,  # type: ignore[attr-defined]
    "return": torch.futures.Future[torch.Tensor],
}
