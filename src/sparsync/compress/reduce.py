"""``compressed_allreduce``: the template method joining the three axes (GRACE's
compensate -> compress -> memory.update -> send_receive): compensate -> compress -> update memory (``encode``) ->
aggregate -> decompress (the compressor's ``Aggregator``). Nothing here depends on which compressor it is."""

from __future__ import annotations

import time
from typing import Any, Literal, TypedDict, Unpack, overload

import torch
import torch.distributed as dist

from sparsync.collectives.allreduce import comm_group, refuse
from sparsync.collectives.group import resolve_group
from sparsync.collectives.site import call_site
from sparsync.compress import base
from sparsync.compress.aggregate import encode
from sparsync.compress.memory import Memory
from sparsync.handle import Work
from sparsync.record import CommLog


class ReduceOptions(TypedDict, total=False):
    """``compressed_allreduce``'s keyword options but ``async_op`` (its docstring says what each does)."""

    memory: Memory | None
    name: str
    group: dist.ProcessGroup | None
    average: bool
    inplace: bool
    algorithm: str
    log: CommLog | None
    timeout: float | None
    check_nan: bool


@overload
def compressed_allreduce(
    tensor: torch.Tensor,
    compressor: base.Compressor,
    *,
    async_op: Literal[False] = ...,
    **opts: Unpack[ReduceOptions],
) -> torch.Tensor: ...
@overload
def compressed_allreduce(
    tensor: torch.Tensor, compressor: base.Compressor, *, async_op: Literal[True], **opts: Unpack[ReduceOptions]
) -> Work[torch.Tensor]: ...
@overload
def compressed_allreduce(
    tensor: torch.Tensor, compressor: base.Compressor, *, async_op: bool = ..., **opts: Unpack[ReduceOptions]
) -> torch.Tensor | Work[torch.Tensor]: ...
def compressed_allreduce(
    tensor: torch.Tensor,
    compressor: base.Compressor,
    *,
    memory: Memory | None = None,
    name: str = "",
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    average: bool = True,
    inplace: bool = False,
    algorithm: str = "auto",
    log: CommLog | None = None,
    timeout: float | None = None,
    check_nan: bool = True,
) -> torch.Tensor | Work[torch.Tensor]:
    """Average (``average=True``) or sum over ``group`` of ``tensor`` sent through ``compressor``.

    Steps: ``x = memory.compensate(name, tensor)``; ``payload = compressor.compress(x)``;
    ``memory.update(name, x, decompress(payload))`` (``aggregate.encode``); aggregate the payloads and decompress
    the aggregate with the ``Aggregator`` that ``compressor.aggregator`` picks (dense allreduce,
    ``sparse_allreduce`` with ``algorithm``, allgather, QSGD's quantized reduce-scatter + allgather when
    ``QSGD.uses_reduce_scatter(P)``, the 16-bit casts' chunked allreduce).
    Returns a tensor of ``tensor``'s shape, dtype and layout (dense or sparse COO), the same on every rank.

    Mutates: ``memory`` (the residual of ``name``) and the compressor's per-name state, on the caller's thread
    before this returns, also with ``async_op=True``; ``tensor`` only with ``inplace=True`` (dense only: the
    result is written into it, e.g. back into a gradient). Collective: every rank of ``group`` calls it with
    the same compressor settings and shape, in the same order; a rank whose shape, dtype, compressor, payload
    size, ``name`` or ``check_nan`` differs, or whose input holds NaN or ±Inf (unless ``check_nan=False`` on
    every rank), makes every rank raise the same ValueError. ``name`` also tells apart calls of one shape: two
    same-shape gradients reduced in another order on one rank raise instead of being summed with each other.
    ``log`` collects a CommRecord per call.

    Example::

        >>> memory = ErrorFeedback()
        >>> for name, p in model.named_parameters():
        ...     p.grad = sparsync.compressed_allreduce(p.grad, TopK(0.01), memory=memory, name=name)
    """
    try:
        check_input(tensor, compressor, memory, name, inplace)
    except (TypeError, ValueError) as e:  # every rank raises it, not only this one
        refuse(group, "reduce", e, timeout, async_op)
    user = resolve_group(group)
    g = comm_group(user, async_op)  # async work on sparsync's own group
    P = dist.get_world_size(g)
    site = None if name else call_site()  # an unnamed call is told apart by where it was issued
    t0 = time.perf_counter()
    spec = base.TensorSpec.of(tensor)
    layout = _call_layout(compressor, spec, tensor.device)
    # compensate -> compress -> memory update, on the caller's thread (also with async_op) ...
    local = encode(compressor, tensor, base.Context(name, dist.get_rank(g), P), memory, async_op=async_op)
    call = base.ReduceCall(
        local.enc, spec, user, g, layout, average=average, inplace=inplace, algorithm=algorithm, timeout=timeout,
        check_nan=check_nan, log=log, site=site, t0=t0,
    )  # fmt: skip
    # ... then aggregate -> decompress, as the compressor's aggregator does it
    return local.aggregator.aggregate(call, local.payload)


def _call_layout(compressor: base.Compressor, spec: base.TensorSpec, device: torch.device) -> str:
    """The call's fingerprint, checked across ranks by the metadata round (shapes (2, 5) and (5, 2),
    FP16 against BF16 bits, or payloads of other sizes were summed, or made gloo abort the process).
    The device type too: a CPU rank and a CUDA rank cannot meet in one payload collective."""
    kind = "coo" if spec.is_sparse else "strided"
    return f"reduce/{type(compressor).__name__}/{kind}/{spec.dtype}/{device.type}"


def check_input(tensor: Any, compressor: Any, memory: Memory | None, name: str, inplace: bool) -> None:
    """The checks of reduce's arguments that need no other rank."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"reduce takes a torch.Tensor, got {type(tensor).__name__}")
    if not isinstance(compressor, base.Compressor):
        raise TypeError(f"compressor must be a sparsync Compressor, got {type(compressor).__name__}")
    if tensor.layout not in (torch.strided, torch.sparse_coo):
        raise ValueError(f"reduce supports strided and sparse COO tensors, got layout {tensor.layout}")
    if not tensor.dtype.is_floating_point:
        raise ValueError(f"reduce needs a floating tensor, got {tensor.dtype}")
    if tensor.numel() == 0:
        raise ValueError(f"reduce of an empty tensor (shape {tuple(tensor.shape)})")
    if memory is not None and not name:
        raise ValueError("memory= needs name=: error-feedback residuals are kept per name")
    if memory is not None:
        compressor.check_feedback()
    if inplace and tensor.is_sparse:
        raise ValueError("inplace=True needs a dense tensor (a sparse COO result has its own storage)")
    compressor.check_device(tensor.device)
