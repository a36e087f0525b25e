"""The communication axis of compressed reduction (GRACE's communicator): the aggregators the payload kinds
share, the local half of the template (``encode``), and what every aggregator uses: the metadata round
(``agree``, run by ``collective``), the CommLog record (``record``), a pipelined collective (``pipelined``) and the
decode (``decoded``). An aggregator from outside the package uses them the same way.

A compressor names its aggregator beside itself (``Compressor.aggregator``): the ones here
(``DenseSumAggregator``, ``SparseSumAggregator``, ``GatherAggregator``, ``LOCAL_SUM``; named apart from the
placements ``placement.DenseAllreduce``/``SparseAllreduce``), S2's sketch allreduce in ``sketch.py``, the cast
pipeline in ``cast_allreduce.py``, QSGD's scaled allgather and quantized reduce-scatter in ``qsgd.py``.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch
import torch.distributed as dist

from sparsync.collectives import trace
from sparsync.collectives.allreduce import CallOptions, start_allreduce
from sparsync.collectives.comm import Comm, ring_allreduce_bytes
from sparsync.collectives.fifo import submit
from sparsync.collectives.group import next_call
from sparsync.collectives.meta import (
    CHECK_NAN,
    NAME_KEY,
    allgather_rows,
    first_nonfinite,
    name_key,
    nonfinite_at,
    shape_fingerprint,
)
from sparsync.collectives.row import Agree, Column, Disagreement, Facts, meta_row, register_row
from sparsync.collectives.timeline import tracer
from sparsync.compress import base
from sparsync.compress.memory import Memory
from sparsync.handle import Work
from sparsync.stream import SparseStream


def _reduce_mismatch(d: Disagreement) -> BaseException:
    return ValueError(
        f"reduce: {d.column.what} mismatch across ranks: rank {d.rank} differs from rank 0 (seen on rank "
        f"{d.facts.me}){d.facts.detail()}; every rank must reduce the same shape with the same compressor settings"
    )


# The row of compressed_allreduce's own metadata rounds (the dense, allgather and quantized paths), checked in this
# order after the frame's refusal, op and call number; its sparse payloads go through sparse_allreduce's round.
REDUCE_ROW = meta_row(
    Column("shape_key", Agree.SAME, "shape, layout, dtype or compressor", doc="shape_fingerprint(layout, shape)"),
    Column("nbytes", Agree.SAME, "payload size (compressor settings)", doc="payload bytes per rank"),
    NAME_KEY,
    CHECK_NAN,
    Column("nonfinite", Agree.UNSET, describe=nonfinite_at("at index", "check_nan=False to let it through"),
           default=-1, doc="flat index of the first NaN or ±Inf (-1: none, or unchecked)"),
    mismatch=_reduce_mismatch,
)  # fmt: skip
REDUCE_OP = register_row("reduce", REDUCE_ROW)  # the op column's code of these rounds (collectives/ops.py)

PayloadT = TypeVar("PayloadT", bound=base.Payload)
T = TypeVar("T")
Result = torch.Tensor | Work[torch.Tensor]


@dataclass(frozen=True)
class Encoded:
    """``encode``'s result: the encoding, its aggregator, this rank's payload (None: encoded while sent) and
    what the payload stands for (``local``) where the memory update built it."""

    enc: base.Encoding
    aggregator: base.Aggregator[Any]
    payload: base.Payload | None
    local: torch.Tensor | None


def encode(
    compressor: base.Compressor,
    tensor: torch.Tensor,
    ctx: base.Context,
    memory: Memory | None = None,
    *,
    async_op: bool = False,
    aggregator: base.Aggregator[Any] | None = None,
) -> Encoded:
    """The local half of GRACE's template (DCT Alg. 1 lines 2-11): ``x = memory.compensate(ctx.name, tensor)``
    (densified for a compressor that takes dense tensors only), the aggregator (``aggregator``, else the
    compressor's choice for ``x``), this rank's payload, ``memory.update`` with what the payload stands for.

    Mutates: ``memory``'s residual of ``ctx.name`` and the compressor's state of it; never ``tensor``."""
    x = memory.compensate(ctx.name, tensor) if memory is not None else tensor
    if x.is_sparse and not compressor.accepts_sparse:
        x = x.to_dense()  # documented O(numel) fallback; the result gets the input's layout back
    enc = base.Encoding(
        compressor, tensor, x, base.TensorSpec.of(x), ctx, async_op=async_op, feedback=memory is not None
    )
    agg = compressor.aggregator(enc) if aggregator is None else aggregator
    payload = agg.compress(enc)
    local = agg.feedback(enc, payload, memory) if memory is not None else None
    return Encoded(enc, agg, payload, local)


def expect(payload: base.Payload | None, kind: type[PayloadT], agg: base.Aggregator[Any]) -> PayloadT:
    """``payload``, checked to be what ``agg`` combines: a compressor whose ``compress`` and ``aggregator``
    disagree raises TypeError naming both."""
    if not isinstance(payload, kind):
        raise TypeError(
            f"{type(agg).__name__} combines {kind.__name__}s, got {type(payload).__name__}: the compressor's "
            "aggregator() does not match what its compress() returns"
        )
    return payload


# --- what the aggregators share ---------------------------------------------------------------------------
class PayloadAggregator(base.Aggregator[PayloadT]):
    """The local steps of an aggregator that sends what ``Compressor.compress`` returns: compress on the caller's
    thread, and the residual from the decompressed payload. Both traced (``sparsync:reduce:compress``, ...)."""

    def compress(self, enc: base.Encoding) -> PayloadT | None:
        c = enc.compressor
        with trace.scope(tracer(), "reduce", "compress", compressor=type(c).__name__, numel=enc.spec.numel):
            return self.check(c.compress(enc.values, enc.ctx))

    @abstractmethod
    def check(self, payload: base.Payload) -> PayloadT:
        """``payload`` as this aggregator's kind (``expect``)."""

    def feedback(self, enc: base.Encoding, payload: PayloadT | None, memory: Memory) -> torch.Tensor | None:
        with trace.scope(tracer(), "reduce", "error_feedback"):
            local = enc.compressor.decompress(payload, enc.spec)
            memory.update(enc.ctx.name, enc.x, local)
        return local


def decoded(call: base.ReduceCall, res: Any, decode: Callable[[Any], torch.Tensor]) -> Result:
    """``decode`` applied to a collective's result (or to its ``Work``'s), traced as the call's decompress."""

    def traced(r: Any) -> torch.Tensor:
        with trace.scope(tracer(), "reduce", "decompress", compressor=type(call.enc.compressor).__name__):
            return decode(r)

    return res.then(traced) if isinstance(res, Work) else traced(res)


def facts(call: base.ReduceCall) -> Callable[[], dict[str, object]]:
    """What a queued call tells the flight recorder about itself."""
    return lambda: {"compressor": type(call.enc.compressor).__name__, "numel": call.enc.spec.numel,
                    "P": call.world_size}  # fmt: skip


def collective(call: base.ReduceCall, alg: str, nbytes: int, body: Callable[[], T]) -> T | Work[T]:
    """Run ``body`` (the payload's collective on ``call.comm``) behind the metadata round (``agree``: ``nbytes``
    per rank): now, or queued on sparsync's own thread with ``async_op`` (a ``Work``). The call's number is
    taken here, on the caller's thread."""
    seq = next_call(call.comm)

    def run() -> T:
        agree(call, seq, nbytes)
        return body()

    out: T | Work[T] = submit(call.group, run, call.async_op, label=f"reduce:{alg}", facts=facts(call))
    return out


def pipelined(
    call: base.ReduceCall,
    nbytes: int,
    elements: int,
    alg: str,
    msgs: int,
    body: Callable[[], tuple[torch.Tensor, int]],
) -> Result:
    """A pipelined collective (QSGD's reduce-scatter + allgather, the casts' chunked allreduce): the metadata
    round, ``body`` (the flat float32 result, already scaled, and the bytes sent), the record (``elements``:
    the payload's, as the other paths count them), the result."""
    xspec = call.enc.spec

    def run() -> torch.Tensor:
        total, sent = body()
        record(call, alg, elements, sent, msgs, device=call.enc.x.device)
        return call.finish(total.view(xspec.shape).to(xspec.dtype), divide=False)

    return collective(call, alg, nbytes, run)


def agree(call: base.ReduceCall, seq: int, nbytes: int) -> None:
    """The metadata round of the dense, allgather and quantized paths (``REDUCE_ROW``): raise the same ValueError
    on every rank unless all passed the same shape, layout, dtype, compressor, ``name`` and ``check_nan`` and will
    send payloads of one size, and (``check_nan``) none holds NaN or ±Inf; a rank whose input was refused is
    reported here too. The name tells apart calls of one shape (two layers' gradients swapped on one rank were
    summed with each other), and check_nan is agreed because a rank that skips the check would hand its NaN to
    the ranks that asked for it. The row is host metadata (one scalar read of ``x``'s sum on a device), on the
    group's CPU side (``Comm.meta``) for a payload on ``x``'s device."""
    x, spec, layout, check_nan = call.enc.x, call.spec, call.layout, call.check_nan
    nonfinite = first_nonfinite(x) if check_nan and not x.is_sparse else -1
    words = REDUCE_ROW.pack(seq=seq, op=REDUCE_OP, shape_key=shape_fingerprint(layout, tuple(spec.shape)),
                            nbytes=nbytes, name_key=name_key(call.name, call.site), check_nan=int(check_nan),
                            nonfinite=nonfinite)  # fmt: skip
    comm = Comm(call.comm, call.timeout, x.device)
    comm.op = "reduce"
    table, blocks = allgather_rows(comm, words)

    def detail() -> str:
        return f" (this rank: {layout}, shape {tuple(spec.shape)}, {nbytes} payload bytes)"

    REDUCE_ROW.check(table, Facts(comm.rank, op="reduce", name=call.name or None, site=call.site, blocks=blocks,
                                  detail=detail))  # fmt: skip


def record(call: base.ReduceCall, alg: str, n: int, nbytes: int, msgs: int, *, device: torch.device) -> None:
    """Count the bytes and messages of a torch collective run on ``call.comm`` (gloo: ring) for a traced call,
    and append the call's CommRecord to ``call.log``."""
    log = call.log
    if log is None and trace.CURRENT.get() is None:
        return
    comm = Comm(call.comm, device=device)
    comm.count_collective(nbytes, nbytes, msgs)
    if log is not None:
        log.append(comm.record("reduce", alg, call.t0, dim=call.enc.spec.numel, nnz_in=n, nnz_out=n))


# --- the aggregators ----------------------------------------------------------------------------------------
class DenseSumAggregator(PayloadAggregator[base.DensePayload]):
    """A linear dense payload (identity, a cast of a small tensor): one dense allreduce of its flat buffer."""

    name: ClassVar[str] = "allreduce"

    def check(self, payload: base.Payload) -> base.DensePayload:
        return expect(payload, base.DensePayload, self)

    def aggregate(self, call: base.ReduceCall, payload: base.DensePayload | None) -> Result:
        p = expect(payload, base.DensePayload, self)

        def run() -> base.DensePayload:
            buf = p.to_buffer()
            dist.all_reduce(buf, group=call.comm)
            P = call.world_size
            nb = ring_allreduce_bytes(buf.numel() * buf.element_size(), P)
            record(call, "allreduce", buf.numel(), nb, 2 * (P - 1), device=buf.device)
            return p.from_buffer(buf)

        work = collective(call, "allreduce", p.nbytes, run)
        return decoded(call, work, lambda s: call.finish(call.enc.compressor.decompress(s, call.enc.spec)))


class SparseSumAggregator(PayloadAggregator[base.SparsePayload]):
    """Selected (index, value) pairs: ``sparse_allreduce`` with the call's ``algorithm`` (SparCML §4), whose own
    metadata round checks the fingerprint, name and NaN on every rank. A sparsifier's residual is ``x`` with the
    sent entries taken out (``Memory.update_selected``): no dense decompress, no ``x - t``."""

    name: ClassVar[str] = "sparse_allreduce"

    def check(self, payload: base.Payload) -> base.SparsePayload:
        return expect(payload, base.SparsePayload, self)

    def feedback(
        self, enc: base.Encoding, payload: base.SparsePayload | None, memory: Memory
    ) -> torch.Tensor | None:
        st = expect(payload, base.SparsePayload, self).stream
        if st.indices is None or st.row != 1 or enc.x.is_sparse:
            return super().feedback(enc, payload, memory)
        with trace.scope(tracer(), "reduce", "error_feedback"):
            memory.update_selected(enc.ctx.name, enc.x, st.indices, st.values, owned=enc.x is not enc.tensor)
        return None

    def aggregate(self, call: base.ReduceCall, payload: base.SparsePayload | None) -> Result:
        p = expect(payload, base.SparsePayload, self)
        opts = CallOptions(algorithm=call.algorithm, timeout=call.timeout, check_nan=call.check_nan,
                           name=call.name or None)  # fmt: skip
        res = start_allreduce(p.stream, lambda c, s: s, opts, group=call.group, async_op=call.async_op,
                              log=call.log, shape=(call.layout, tuple(call.spec.shape)))  # fmt: skip
        compressor, xspec = call.enc.compressor, call.enc.spec

        def decode(s: SparseStream) -> torch.Tensor:
            return call.finish(compressor.decompress(base.SparsePayload(s), xspec))

        return decoded(call, res, decode)


class GatherAggregator(PayloadAggregator[base.QuantizedPayload]):
    """A payload that does not add up (quantized codes): everyone's bytes to everyone, in one buffer on the
    payload's device, decoded and summed on every rank (SparCML §5). Equal sizes, as NCCL needs: the metadata
    round refused payloads of different sizes on every rank."""

    name: ClassVar[str] = "allgather"

    def check(self, payload: base.Payload) -> base.QuantizedPayload:
        return expect(payload, base.QuantizedPayload, self)

    def aggregate(self, call: base.ReduceCall, payload: base.QuantizedPayload | None) -> Result:
        p = expect(payload, base.QuantizedPayload, self)
        scale = self.scale(call)
        divide = call.average if scale is None else False

        def run() -> list[base.QuantizedPayload]:
            buf = p.to_bytes()
            P = call.world_size
            comm = Comm(call.comm, device=buf.device)
            out = comm.empty(P * buf.numel())
            comm.all_gather_into("allgather of quantized payloads", out, buf)  # gloo + CUDA: through the host
            record(call, "allgather", buf.numel(), (P - 1) * buf.numel(), P - 1, device=buf.device)
            return [scaled(p.from_bytes(b), 1.0 if scale is None else scale) for b in out.view(P, -1)]

        work = collective(call, "allgather", p.nbytes, run)
        compressor, xspec = call.enc.compressor, call.enc.spec
        return decoded(
            call, work, lambda ps: call.finish(compressor.decompress_gathered(ps, xspec), divide=divide)
        )

    def scale(self, call: base.ReduceCall) -> float | None:
        """What the gathered payloads' scales are multiplied by before they are decoded, the result then not
        divided (a decoder linear in its scales: QSGD's, ``qsgd.ScaledAllgather``); None: not scaled, the sum
        divided by P after decoding when the call averages."""
        del call
        return None


def scaled(p: base.QuantizedPayload, scale: float) -> base.QuantizedPayload:
    """``p`` with its scales times ``scale`` (a decoder linear in them decodes ``scale`` times the values)."""
    return p if scale == 1.0 else base.QuantizedPayload(p.codes, p.scales * scale)


class LocalAggregator(PayloadAggregator[base.Payload]):
    """No collective: what a parameter-server push compresses (``ps.feedback``); ``aggregate`` is the payload's
    own decode, the sum over a group of one."""

    name: ClassVar[str] = "local"

    def check(self, payload: base.Payload) -> base.Payload:
        return payload

    def aggregate(self, call: base.ReduceCall, payload: base.Payload | None) -> Result:
        return call.finish(call.enc.compressor.decompress(payload, call.enc.spec))


# stateless: one of each serves every call
DENSE_SUM = DenseSumAggregator()
SPARSE_SUM = SparseSumAggregator()
GATHER = GatherAggregator()
LOCAL_SUM = LocalAggregator()
