"""DDP communication hooks running any sparsync compressor (``DistributedDataParallel.register_comm_hook``).

A hook is a plain function ``hook(state, bucket) -> Future`` (PyTorch's ``default_hooks.py`` convention); the
one built here ignores ``state`` and carries its settings in a closure. Each gradient of a bucket is compressed
on its own, under its parameter's name (layer-wise, as DCT §2.1 applies its threshold; error-feedback
residuals and DCT thresholds then survive DDP's bucket rebuild after the first iteration, which reorders
buckets). Sparse gradients (``nn.Embedding(sparse=True)``) arrive as their own bucket holding the COO tensor
and are reduced as COO: DDP's own fp16 and PowerSGD hooks crash or hang on them.

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
from typing import Any

import torch
import torch.distributed as dist

from sparsync.collectives.background import background_group
from sparsync.collectives.group import resolve_group
from sparsync.compress.base import Compressor
from sparsync.compress.bucket_allreduce import BucketAllreduce
from sparsync.compress.bucket_sparse import BucketSparse, fusable
from sparsync.compress.hook_future import bucket_future, complete_when_done
from sparsync.compress.identity import Identity
from sparsync.compress.memory import ErrorFeedback
from sparsync.compress.reduce import compressed_allreduce
from sparsync.handle import Work
from sparsync.record import CommLog

# dist.GradBucket is missing from torch's type stubs: buckets are typed Any.
Hook = Callable[[Any, Any], torch.futures.Future[torch.Tensor]]


def compression_hook(
    compressor: Compressor,
    memory: ErrorFeedback | None = None,
    *,
    module: torch.nn.Module | None = None,
    group: dist.ProcessGroup | None = None,
    average: bool = True,
    async_op: bool = True,
    algorithm: str = "auto",
    plan: Mapping[str, Compressor] | None = None,
    sparse: Compressor | None = None,
    log: CommLog | None = None,
) -> Hook:
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
    lossless = Identity()
    own = background_group(group)
    # Uncompressed dense buckets, once their layout is checked: DDP's own allreduce (bucket_allreduce.py)
    plain = BucketAllreduce(own, resolve_group(group), average=average, log=log) if async_op else None
    # Dense buckets of sparsifiers: per-parameter encode, one sparse allreduce per bucket (bucket_sparse.py)
    fused = BucketSparse(own, memory=memory, average=average, async_op=async_op, algorithm=algorithm, log=log)

    def chosen(name: str, grad: torch.Tensor) -> Compressor:
        if name in plan:
            return plan[name]
        if grad.is_sparse:
            return sparse if sparse is not None else lossless
        return compressor

    # Every dense gradient goes by Identity whatever its name: a dense bucket needs no look at its parameters.
    dense_identity = not plan and isinstance(compressor, Identity)

    def per_gradient(bucket: Any, buffer: torch.Tensor) -> tuple[list[tuple[str, torch.Tensor]], list[Compressor]]:
        grads = bucket.gradients() if not buffer.is_sparse else [buffer]
        todo = [
            (names.get(id(p)) or f"bucket{bucket.index()}.{j}", grad)
            for j, (p, grad) in enumerate(zip(bucket.parameters(), grads, strict=True))
        ]
        return todo, [chosen(name, grad) for name, grad in todo]

    def hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        buffer: torch.Tensor = bucket.buffer()
        todo, comps = ([], []) if dense_identity else per_gradient(bucket, buffer)
        if not buffer.is_sparse and all(isinstance(c, Identity) for c in comps):
            if plain is not None and plain.checked(bucket):
                return plain(bucket)
            # Nothing to compress layer by layer: the bucket's flat buffer in one call (one metadata round,
            # as DDP's own hook sends it), not one call per gradient.
            todo, comps = [(f"bucket{bucket.index()}", buffer.view(-1))], [lossless]
        elif not todo:
            todo, comps = per_gradient(bucket, buffer)
        if fusable(buffer, comps):
            return fused(buffer, todo, comps)
        works: list[Work[torch.Tensor]] = []
        for (name, grad), c in zip(todo, comps, strict=True):
            out = compressed_allreduce(
                grad, c, memory=None if isinstance(c, Identity) else memory, name=name, group=own,
                average=average, async_op=async_op, algorithm=algorithm, log=log,
            )  # fmt: skip
            works.append(out if isinstance(out, Work) else Work.done(out))
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

    # DDP inspects the annotations and rejects the string forms that `from __future__ import annotations`
    # leaves there: give it the real classes.
    hook.__annotations__ = {
        "state": object,
        "bucket": dist.GradBucket,  # type: ignore[attr-defined]
        "return": torch.futures.Future[torch.Tensor],
    }
    return hook
