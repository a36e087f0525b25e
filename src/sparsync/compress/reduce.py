"""``compressed_allreduce`` (formerly ``reduce``): the template method joining the three axes (GRACE's
compensate -> compress -> memory.update -> send_receive): compensate -> compress -> update memory -> aggregate ->
decompress."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any, Literal, overload

import torch
import torch.distributed as dist

from sparsync.collectives import trace
from sparsync.collectives.allreduce import CallOptions, comm_group, refuse, start_allreduce
from sparsync.collectives.comm import Comm
from sparsync.collectives.group import next_call, resolve_group, submit, tracer
from sparsync.collectives.meta import (
    allgather_rows,
    first_differing,
    first_nonfinite,
    name_key,
    raise_check_nan_mismatch,
    raise_name_mismatch,
    raise_nonfinite,
    raise_refusals,
    shape_fingerprint,
)
from sparsync.collectives.ops import register_op
from sparsync.collectives.site import CallSite, call_site
from sparsync.collectives.tensor import pack_bits, unpack_bits
from sparsync.compress import base
from sparsync.compress import cast_allreduce as cast_pipeline
from sparsync.compress.cast import BF16, FP16
from sparsync.compress.memory import ErrorFeedback
from sparsync.compress.qsgd import QSGD
from sparsync.compress.qsgd_allreduce import encode_remote, local_estimate, quantized_allreduce, segments
from sparsync.handle import Work
from sparsync.record import CommLog
from sparsync.stream import SparseStream

# The metadata row's "op" code of compressed_allreduce's own rounds (collectives/ops.py); its sparse payloads go
# through sparse_allreduce, whose rounds carry that op.
REDUCE_OP = register_op("reduce")


@overload
def compressed_allreduce(
    tensor: torch.Tensor,
    compressor: base.Compressor,
    *,
    memory: ErrorFeedback | None = ...,
    name: str = ...,
    group: dist.ProcessGroup | None = ...,
    async_op: Literal[False] = ...,
    average: bool = ...,
    inplace: bool = ...,
    algorithm: str = ...,
    log: CommLog | None = ...,
    timeout: float | None = ...,
    check_nan: bool = ...,
) -> torch.Tensor: ...
@overload
def compressed_allreduce(
    tensor: torch.Tensor,
    compressor: base.Compressor,
    *,
    memory: ErrorFeedback | None = ...,
    name: str = ...,
    group: dist.ProcessGroup | None = ...,
    async_op: Literal[True],
    average: bool = ...,
    inplace: bool = ...,
    algorithm: str = ...,
    log: CommLog | None = ...,
    timeout: float | None = ...,
    check_nan: bool = ...,
) -> Work[torch.Tensor]: ...
@overload
def compressed_allreduce(
    tensor: torch.Tensor,
    compressor: base.Compressor,
    *,
    memory: ErrorFeedback | None = ...,
    name: str = ...,
    group: dist.ProcessGroup | None = ...,
    async_op: bool = ...,
    average: bool = ...,
    inplace: bool = ...,
    algorithm: str = ...,
    log: CommLog | None = ...,
    timeout: float | None = ...,
    check_nan: bool = ...,
) -> torch.Tensor | Work[torch.Tensor]: ...
def compressed_allreduce(
    tensor: torch.Tensor,
    compressor: base.Compressor,
    *,
    memory: ErrorFeedback | None = None,
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
    ``memory.update(name, x, decompress(payload))``; aggregate the payloads with the collective the payload
    names (dense allreduce, ``sparse_allreduce`` with ``algorithm``, or allgather; QSGD by quantized
    reduce-scatter + allgather when ``QSGD.uses_reduce_scatter(P)``); decompress the aggregate.
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
        _check_input(tensor, compressor, memory, name, inplace)
    except (TypeError, ValueError) as e:  # every rank raises it, not only this one
        refuse(group, "reduce", e, timeout, async_op)
    user = resolve_group(group)
    g = comm_group(user, async_op)  # async work on sparsync's own group
    P = dist.get_world_size(g)
    site = None if name else call_site()  # an unnamed call is told apart by where it was issued
    t0 = time.perf_counter()
    spec = base.TensorSpec.of(tensor)
    x = memory.compensate(name, tensor) if memory is not None else tensor
    if x.is_sparse and not compressor.accepts_sparse:
        x = x.to_dense()  # documented O(numel) fallback; the result gets the input's layout back
    xspec = base.TensorSpec.of(x)
    ctx = base.Context(name, dist.get_rank(g), P)

    def finish(total: torch.Tensor, divide: bool = average) -> torch.Tensor:
        out = total
        if divide:  # in place when the decoded aggregate is our own buffer: no second fresh tensor
            out = total.div_(P) if _private(total, tensor, x) else total / P
        if spec.sparse_dim is not None and not out.is_sparse:
            out = out.to_sparse(spec.sparse_dim)
        out = out.to(spec.dtype)
        if inplace:
            tensor.copy_(out)
            return tensor
        return out

    # The call's fingerprint, checked across ranks by the metadata round (shapes (2, 5) and (5, 2),
    # FP16 against BF16 bits, or payloads of other sizes were summed, or made gloo abort the process).
    # The device type too: a CPU rank and a CUDA rank cannot meet in one payload collective.
    kind = "coo" if spec.is_sparse else "strided"
    layout = f"reduce/{type(compressor).__name__}/{kind}/{spec.dtype}/{tensor.device.type}"
    n, values = xspec.numel, x.detach()
    scale = 1.0 / P if average else 1.0  # the pipelines scale while they decode: no pass to divide

    def facts() -> dict[str, object]:
        return {"compressor": type(compressor).__name__, "numel": n, "P": P}

    def pipelined(
        nbytes: int, elements: int, alg: str, msgs: int, body: Callable[[], tuple[torch.Tensor, int]]
    ) -> torch.Tensor | Work[torch.Tensor]:
        """Submit a pipelined collective (QSGD's reduce-scatter + allgather, the casts' chunked allreduce): the
        metadata round, ``body`` (the flat float32 result and the bytes sent; it may update a synchronous call's
        residual), the record (``elements``: the payload's, as the other paths count them), the result."""
        seq_p = next_call(g)

        def run() -> torch.Tensor:
            _agree(g, seq_p, layout, spec, nbytes, x, check_nan, name, timeout, site, device=x.device)
            total, sent = body()
            _record(log, alg, g, spec, elements, sent, msgs, t0, device=x.device)
            return finish(total.view(xspec.shape).to(xspec.dtype), divide=False)

        out: torch.Tensor | Work[torch.Tensor] = submit(user, run, async_op, label=f"reduce:{alg}", facts=facts)
        return out

    if isinstance(compressor, QSGD) and compressor.uses_reduce_scatter(P) and memory is None:
        # qsgd_allreduce: a synchronous call encodes while it sends and updates the residual from the payload
        # it returns; an asynchronous one encodes here, so that the residual is updated on the caller's thread
        q = compressor
        sent = None if not async_op else encode_remote(q, values, n, ctx, P)
        if memory is not None and sent is not None:
            memory.update(name, x, q.finish(local_estimate(q, sent, values, P, ctx.rank), xspec))

        def quantized() -> tuple[torch.Tensor, int]:
            r = quantized_allreduce(q, values, n, ctx, g, scale, payload=sent)
            if memory is not None and sent is None:
                memory.update(name, x, q.finish(local_estimate(q, r.payload, values, P, ctx.rank), xspec))
            return r.total, r.sent

        msgs = 2 * (P - 1) * len(segments(q, n))
        nb = q.payload_nbytes(n)
        return pipelined(nb, nb, "quantized_reduce_scatter", msgs, quantized)  # a byte payload
    big = x.dtype == torch.float32 and not x.is_sparse and P > 1 and n >= cast_pipeline.MIN_VALUES
    if isinstance(compressor, FP16 | BF16) and big:
        # cast_allreduce: cast, allreduced and widened chunk by chunk, overlapped. With error feedback the
        # residual (x - the 16-bit round trip) needs the whole cast here, on the caller's thread: the pipeline
        # then sends that cast instead of casting again.
        wire, cast = compressor.wire_dtype, None
        if memory is not None:
            cp = compressor.compress(values, ctx)
            assert isinstance(cp, base.DensePayload)  # a dense float32 tensor's cast
            memory.update(name, x, compressor.decompress(cp, xspec))
            cast = cp.values
        msgs = 2 * (P - 1) * len(cast_pipeline.chunks(n))
        divisor = P if average else 1

        def casts() -> tuple[torch.Tensor, int]:
            return cast_pipeline.cast_allreduce(values, wire, g, divisor, cast=cast)

        return pipelined(n * wire.itemsize, n, "allreduce", msgs, casts)
    tr = tracer()
    with trace.scope(tr, "reduce", "compress", compressor=type(compressor).__name__, numel=n):
        payload = compressor.compress(x.detach(), ctx)
    if memory is not None:
        st = payload.stream if isinstance(payload, base.SparsePayload) else None
        with trace.scope(tr, "reduce", "error_feedback"):
            if st is not None and st.indices is not None and st.row == 1 and not x.is_sparse:
                # a sparsifier's residual is x with the sent entries taken out: no dense decompress, no x - t
                memory.update_selected(name, x, st.indices, st.values, owned=x is not tensor)
            else:
                memory.update(name, x, compressor.decompress(payload, xspec))
    if isinstance(payload, base.SparsePayload):
        # sparse_allreduce's own metadata round checks the fingerprint, name and NaN on every rank
        opts = CallOptions(algorithm=algorithm, timeout=timeout, check_nan=check_nan, name=name or None)
        res = start_allreduce(payload.stream, lambda c, s: s, opts, group=user, async_op=async_op, log=log,
                              shape=(layout, tuple(spec.shape)))  # fmt: skip

        def decode_sparse(s: SparseStream) -> torch.Tensor:
            with trace.scope(tracer(), "reduce", "decompress", compressor=type(compressor).__name__):
                return finish(compressor.decompress(base.SparsePayload(s), xspec))

        return res.then(decode_sparse) if isinstance(res, Work) else decode_sparse(res)
    seq = next_call(g)

    def agree(nbytes: int) -> None:
        _agree(g, seq, layout, spec, nbytes, x, check_nan, name, timeout, site, device=x.device)

    if isinstance(payload, base.DensePayload | base.SketchPayload):

        def dense() -> base.Payload:
            agree(payload.nbytes)
            return _allreduce(payload, g, log, xspec, t0)

        return _then(
            submit(user, dense, async_op, label="reduce:allreduce", facts=facts), compressor, xspec, finish
        )
    if isinstance(payload, base.QuantizedPayload) and isinstance(compressor, QSGD):
        # QSGD decodes linearly in its scales: the average is decoded from scales / P (n / bucket divisions,
        # not a pass over the n decoded values)
        qp, inv = payload, 1.0 / P if average else 1.0

        def run() -> list[base.QuantizedPayload]:
            agree(qp.nbytes)
            return [_scaled(p, inv) for p in _allgather(qp, g, log, xspec, t0)]

        work = submit(user, run, async_op, label="reduce:allgather", facts=facts)
        return _then(work, compressor, xspec, lambda t: finish(t, divide=False))
    if isinstance(payload, base.QuantizedPayload):
        qpay = payload

        def gather() -> list[base.QuantizedPayload]:
            agree(qpay.nbytes)
            return _allgather(qpay, g, log, xspec, t0)

        return _then(
            submit(user, gather, async_op, label="reduce:allgather", facts=facts), compressor, xspec, finish
        )
    raise TypeError(f"{type(compressor).__name__}.compress returned {type(payload).__name__}, not a Payload")


def reduce(tensor: torch.Tensor, compressor: base.Compressor, **kwargs: Any) -> Any:
    """Deprecated: the old name of ``compressed_allreduce`` (every rank gets the result: an allreduce, not a
    reduce to one rank). Same arguments and result; warns ``DeprecationWarning``."""
    warnings.warn(
        "sparsync.reduce is deprecated; use sparsync.compressed_allreduce (same arguments)",
        DeprecationWarning,
        stacklevel=2,
    )
    return compressed_allreduce(tensor, compressor, **kwargs)


def _check_input(tensor: Any, compressor: Any, memory: ErrorFeedback | None, name: str, inplace: bool) -> None:
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
    if memory is not None and isinstance(compressor, QSGD) and compressor.aggregation == "reduce_scatter":
        # The owners re-quantize their partial sums (qsgd_allreduce.py): that error would be in no memory, and
        # Σ(results) + Σ(residuals) would drift from Σ(gradients) (by 69% over 20 steps at 2 bits).
        raise ValueError(
            "QSGD(aggregation='reduce_scatter') with error feedback: the re-quantized partial sums' error is kept "
            "in no memory; use aggregation='auto' (which gathers every rank's quantized gradient when a memory "
            "is given) or 'allgather'"
        )
    if inplace and tensor.is_sparse:
        raise ValueError("inplace=True needs a dense tensor (a sparse COO result has its own storage)")
    compressor.check_device(tensor.device)


def _agree(
    g: dist.ProcessGroup,
    seq: int,
    layout: str,
    spec: base.TensorSpec,
    nbytes: int,
    x: torch.Tensor,
    check_nan: bool,
    name: str,
    timeout: float | None,
    site: CallSite | None = None,
    *,
    device: torch.device,
) -> None:
    """The metadata round of the dense, allgather and quantized paths: raise the same ValueError on every rank
    unless all passed the same shape, layout, dtype, compressor, ``name`` and ``check_nan`` and will send
    payloads of one size, and (``check_nan``) none holds NaN or ±Inf; a rank whose input was refused is
    reported here too. The name tells apart calls of one shape (two layers' gradients swapped on one rank were
    summed with each other), and check_nan is agreed because a rank that skips the check would hand its NaN to
    the ranks that asked for it. The row is host metadata (one scalar read of ``x``'s sum on a device), on the
    group's CPU side (``Comm.meta``) for a payload on ``device``."""
    nonfinite = first_nonfinite(x) if check_nan and not x.is_sparse else -1
    row = torch.tensor(
        [seq, REDUCE_OP, shape_fingerprint(layout, tuple(spec.shape)), nbytes, nonfinite, int(check_nan),
         name_key(name, site)],
        dtype=torch.int64,
    )  # fmt: skip
    comm = Comm(g, timeout, device)
    comm.op = "reduce"
    table, blocks = allgather_rows(comm, row)
    raise_refusals(table, blocks, comm.rank)
    for col, what in ((1, "collective"), (0, "call number"), (2, "shape, layout, dtype or compressor"),
                      (3, "payload size (compressor settings)")):  # fmt: skip
        r = first_differing(table, col)
        if r is not None:
            detail = f" (this rank: {layout}, shape {tuple(spec.shape)}, {nbytes} payload bytes)"
            raise ValueError(
                f"reduce: {what} mismatch across ranks: rank {r} differs from rank 0 (seen on rank {comm.rank})"
                f"{detail}; every rank must reduce the same shape with the same compressor settings"
            )
    raise_name_mismatch(table[:, 6], comm.rank, name or None, site=site)
    raise_check_nan_mismatch(table[:, 5], comm.rank)
    raise_nonfinite("reduce", table[:, 4], comm.rank, who="rank", where="at index",
                    hint="check_nan=False to let it through")  # fmt: skip


def _then(
    res: Any,
    compressor: base.Compressor,
    spec: base.TensorSpec,
    finish: Any,
) -> torch.Tensor | Work[torch.Tensor]:
    def decode(p: base.Payload | list[base.Payload]) -> torch.Tensor:
        with trace.scope(tracer(), "reduce", "decompress", compressor=type(compressor).__name__):
            total = (
                compressor.decompress_gathered(p, spec) if isinstance(p, list) else compressor.decompress(p, spec)
            )
            out: torch.Tensor = finish(total)
        return out

    if isinstance(res, Work):
        return res.then(decode)
    return decode(res)


def _allreduce(
    payload: base.DensePayload | base.SketchPayload,
    g: dist.ProcessGroup,
    log: CommLog | None,
    spec: base.TensorSpec,
    t0: float,
) -> base.Payload:
    """Linear payloads: one dense allreduce of the payload's flat buffer; a sketch's table, and its bitmap
    packed and OR-ed in a second allreduce started beside it (``SketchPayload``)."""
    if isinstance(payload, base.SketchPayload):
        return _sketch_allreduce(payload, g, log, spec, t0)
    buf = payload.to_buffer()
    dist.all_reduce(buf, group=g)
    P = dist.get_world_size(g)
    nb = 2 * (P - 1) * buf.numel() * buf.element_size() // P  # ring allreduce, per rank
    _record(log, "allreduce", g, spec, buf.numel(), nb, 2 * (P - 1), t0, device=buf.device)
    return payload.from_buffer(buf)


def _sketch_allreduce(
    payload: base.SketchPayload, g: dist.ProcessGroup, log: CommLog | None, spec: base.TensorSpec, t0: float
) -> base.SketchPayload:
    table, device = payload.table.clone(), payload.table.device
    exact = Comm(g, device=device).exact
    if exact:
        # NCCL has no BOR (collectives/transport.py): one byte per block reduced with MAX, on the device (8x the
        # bitmap's packed bytes, no host round trip)
        words, op = (payload.bitmap != 0).to(torch.uint8), dist.ReduceOp.MAX
    else:
        # gloo: packed 32 to an int32 word on the host (a device bitmap comes over once, n_blocks bytes) and
        # OR-ed there; gloo reduces host and device tensors on one group
        words, op = pack_bits((payload.bitmap != 0).cpu()), dist.ReduceOp.BOR
    works = [
        dist.all_reduce(table, group=g, async_op=True),
        dist.all_reduce(words, op=op, group=g, async_op=True),
    ]
    for w in works:
        w.wait()
    P = dist.get_world_size(g)
    sent = table.numel() * table.element_size() + words.numel() * words.element_size()  # gloo: payload.nbytes
    nb = 2 * (P - 1) * sent // P  # two ring allreduces, per rank
    _record(log, "allreduce", g, spec, table.numel() + words.numel(), nb, 4 * (P - 1), t0, device=device)
    flags = words if exact else unpack_bits(words, payload.bitmap.numel()).to(device)
    return base.SketchPayload(flags.to(table.dtype), table)


def _allgather(
    payload: base.QuantizedPayload, g: dist.ProcessGroup, log: CommLog | None, spec: base.TensorSpec, t0: float
) -> list[base.QuantizedPayload]:
    """Non-linear payloads: everyone's bytes to everyone, in one buffer on the payload's device. Equal sizes, as
    NCCL needs: the metadata round (``_agree``) refused payloads of different sizes on every rank."""
    buf = payload.to_bytes()
    P = dist.get_world_size(g)
    comm = Comm(g, device=buf.device)
    out = comm.empty(P * buf.numel())
    comm.all_gather_into("allgather of quantized payloads", out, buf)  # gloo + CUDA: through the host
    _record(log, "allgather", g, spec, buf.numel(), (P - 1) * buf.numel(), P - 1, t0, device=buf.device)
    return [payload.from_bytes(b) for b in out.view(P, -1)]


def _scaled(p: base.QuantizedPayload, scale: float) -> base.QuantizedPayload:
    return p if scale == 1.0 else base.QuantizedPayload(p.codes, p.scales * scale)


def _private(out: torch.Tensor, *inputs: torch.Tensor) -> bool:
    """Whether ``out`` is a dense tensor sharing no storage with ``inputs`` (decompress returned a fresh
    buffer, as every compressor here does; checked, because dividing the caller's tensor would be a bug)."""
    if out.is_sparse:
        return False
    ptr = out.untyped_storage().data_ptr()
    return all(t.is_sparse or t.untyped_storage().data_ptr() != ptr for t in inputs)


def _record(
    log: CommLog | None,
    alg: str,
    g: dist.ProcessGroup,
    spec: base.TensorSpec,
    n: int,
    nbytes: int,
    msgs: int,
    t0: float,
    *,
    device: torch.device,
) -> None:
    if log is None and trace.CURRENT.get() is None:
        return
    # the counts of a torch collective run on ``g`` (gloo: ring); a traced call's bytes too
    comm = Comm(g, device=device)
    if log is None:
        comm.count_collective(nbytes, nbytes, msgs)
        return
    comm.count_collective(nbytes, nbytes, msgs)
    log.append(comm.record("reduce", alg, t0, dim=spec.numel, nnz_in=n, nnz_out=n))
