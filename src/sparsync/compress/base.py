"""The compressor axis and the interface that joins it to the wire.

A ``Compressor`` turns a tensor into a typed payload and back; a payload says how many bytes it puts on the wire
(``nbytes``). How the payloads of one ``compressed_allreduce`` are combined across ranks is the compressor's
choice, made per call (``Compressor.aggregator``): an ``Aggregator`` (powersgd's Aggregator, GRACE's communicator)
runs the local half (compress, the error-feedback update: ``aggregate.encode``) and the collective half
(``aggregate``). Payloads that add up linearly (dense casts, sketch tables + bitmaps) go through one dense
allreduce; sparse payloads (top-k, threshold) through ``sparse_allreduce``; quantized ones, which do not add
up, through an allgather followed by a local decode-and-sum (SparCML §5, "Low-Precision Support"), or for QSGD
at P > 2 a quantized reduce-scatter + allgather (``qsgd_allreduce.py``). Error feedback is a separate axis
(``memory.py``); ``reduce.py`` joins the axes in one template method.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

import torch
import torch.distributed as dist

from sparsync.collectives.site import CallSite
from sparsync.collectives.tensor import coo_to_stream, stream_to_coo
from sparsync.compress.memory import Memory
from sparsync.handle import Work
from sparsync.record import CommLog
from sparsync.stream import SparseStream


@dataclass(frozen=True)
class TensorSpec:
    """What a decompressed tensor must look like: shape, dtype, and layout (``sparse_dim`` is None for a
    strided tensor, else the number of sparse dims of a COO tensor)."""

    shape: torch.Size
    dtype: torch.dtype
    sparse_dim: int | None = None

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorSpec:
        return cls(t.shape, t.dtype, t.sparse_dim() if t.is_sparse else None)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_sparse(self) -> bool:
        return self.sparse_dim is not None


@dataclass(frozen=True)
class Context:
    """Where a compress call runs: the memory/state key (parameter name) and this rank's place in the group.
    Randomised compressors draw per-rank streams from it (independent rounding on every rank)."""

    name: str = ""
    rank: int = 0
    world_size: int = 1


NO_CONTEXT = Context()  # frozen: a safe default argument


# --- payloads ---------------------------------------------------------------------------------------------
class Payload(ABC):
    """What one rank puts on the wire for one tensor; its ``Aggregator`` knows how the ranks' payloads combine."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes this payload puts on the wire (what one rank contributes)."""


@dataclass(frozen=True)
class DensePayload(Payload):
    """A dense tensor (identity, fp16/bf16 casts): summed by one dense allreduce
    (``aggregate.DenseSumAggregator``)."""

    values: torch.Tensor
    # values is a fresh tensor no one else holds (a cast's output), so the allreduce may sum into it; False
    # (identity) makes to_buffer copy, leaving the caller's tensor alone
    owned: bool = False

    @property
    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size()

    def to_buffer(self) -> torch.Tensor:
        """The flat buffer the allreduce sums in place: ``values`` itself when owned, else a copy."""
        flat = self.values.reshape(-1)
        return flat if self.owned and flat.data_ptr() == self.values.data_ptr() else flat.clone()

    def from_buffer(self, buf: torch.Tensor) -> DensePayload:
        return DensePayload(buf.reshape(self.values.shape))


@dataclass(frozen=True)
class SparsePayload(Payload):
    """Selected (index, value) pairs of the flattened tensor: summed by ``sparse_allreduce``
    (``aggregate.SparseSumAggregator``)."""

    stream: SparseStream

    @property
    def nbytes(self) -> int:
        return self.stream.nbytes


def packed_bitmap_bytes(blocks: int) -> int:
    """Bytes of a bitmap of ``blocks`` bits sent as int32 words (``collectives.tensor.pack_bits``)."""
    return -(-blocks // 32) * 4


@dataclass(frozen=True)
class SketchPayload(Payload):
    """S2 Reducer §3.1: a bitmap of non-zero blocks and an r x c count sketch of the non-zero values.

    S2 sums both in one dense allreduce of their concatenation (``to_buffer``: the bitmap as counts in the
    table's dtype). ``reduce`` sends the bitmap packed instead, one bit per block OR-ed in a second allreduce
    started beside the table's (``nbytes``): on an embedding gradient the float bitmap was most of the payload
    (4 MB of 5.5 MB per rank for 1M rows at P = 2, λ = 0.5); packed it is 128 KB."""

    bitmap: torch.Tensor  # (n_blocks,), same dtype as the table: non-zero where a block is set
    table: torch.Tensor  # (rows, cols)

    @property
    def nbytes(self) -> int:
        """Bytes ``reduce`` allreduces: the table, and the bitmap as packed int32 words."""
        return packed_bitmap_bytes(self.bitmap.numel()) + self.table.numel() * self.table.element_size()

    def to_buffer(self) -> torch.Tensor:
        return torch.cat([self.bitmap.reshape(-1), self.table.reshape(-1)])

    def from_buffer(self, buf: torch.Tensor) -> SketchPayload:
        nb = self.bitmap.numel()
        return SketchPayload(buf[:nb], buf[nb:].reshape(self.table.shape))


@dataclass(frozen=True)
class QuantizedPayload(Payload):
    """QSGD codes packed ``8 // bits`` to a byte plus one full-precision scale per bucket. Does not add up
    linearly: aggregated by an allgather of the bytes and a local decode-and-sum, or by QSGD's quantized
    reduce-scatter + allgather (``QSGD.aggregation``); ``aggregate.GatherAggregator``, ``qsgd.py``."""

    codes: torch.Tensor  # uint8, packed
    scales: torch.Tensor  # float32, one per bucket

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * 4

    def to_bytes(self) -> torch.Tensor:
        return torch.cat([self.codes, self.scales.to(torch.float32).view(torch.uint8)])

    def from_bytes(self, buf: torch.Tensor) -> QuantizedPayload:
        n = self.codes.numel()
        return QuantizedPayload(buf[:n], buf[n:].clone().view(torch.float32))


# --- compressors ------------------------------------------------------------------------------------------
class Compressor(ABC):
    """Turns a tensor into a payload and back.

    ``accepts_sparse``: ``compress`` takes a sparse COO tensor as it is; for the others ``reduce`` densifies a
    COO input first (O(numel)) and hands back the layout it was given. ``unbiased``: E[decompress(compress(x))]
    = x. Mutable per-name state (DCT's threshold, call counters) is checkpointed by ``state_dict``.
    """

    name: ClassVar[str]
    accepts_sparse: ClassVar[bool] = False
    unbiased: ClassVar[bool] = False

    @abstractmethod
    def compress(self, tensor: torch.Tensor, ctx: Context = NO_CONTEXT) -> Payload:
        """Payload of ``tensor``; does not modify ``tensor`` (may update this compressor's state for ctx.name)."""

    @abstractmethod
    def decompress(self, payload: Any, spec: TensorSpec) -> torch.Tensor:
        """Tensor described by ``spec`` from a payload (a local one, or the sum produced by its aggregation)."""

    def decompress_gathered(self, payloads: list[Any], spec: TensorSpec) -> torch.Tensor:
        """Sum of every rank's payload, for ``allgather`` payloads (decoded one by one, then added)."""
        out = self.decompress(payloads[0], spec)
        for p in payloads[1:]:
            out = out + self.decompress(p, spec)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, got keys {sorted(state)}")

    @abstractmethod
    def aggregator(self, enc: Encoding) -> Aggregator[Any]:
        """How ``compressed_allreduce`` combines this compressor's payloads of ``enc.x`` over ``enc.world_size``
        ranks (``aggregate.py`` has the shared ones). Every rank must choose the same: choose from what the ranks
        agree on (shape, dtype, layout, P, settings, whether a memory is given)."""

    def check_feedback(self) -> None:
        """Raise ValueError when error feedback cannot keep its invariant with this compressor's aggregation:
        checked before any rank communicates, so that every rank raises it."""
        return  # every aggregator here keeps it but QSGD's reduce-scatter

    def check_device(self, device: torch.device) -> None:
        """Raise ValueError when this compressor cannot run on a tensor of ``device`` (``kernels="c"`` off the
        host): checked before any rank communicates, so that every rank raises it."""
        del device  # torch ops only: any device


# --- the aggregation interface ---------------------------------------------------------------------------
PayloadT = TypeVar("PayloadT", bound=Payload)


@dataclass(frozen=True, eq=False)
class Encoding:
    """One tensor on its way to the wire, as an ``Aggregator``'s local steps get it (``aggregate.encode``)."""

    compressor: Compressor
    tensor: torch.Tensor  # the caller's tensor: never modified here
    x: torch.Tensor  # what is compressed: tensor + residual, densified for a compressor that takes dense only
    spec: TensorSpec  # x's
    ctx: Context  # name (the memory's and compressor's key), rank, world size
    async_op: bool = False  # the collective half runs on another thread
    feedback: bool = False  # a memory keeps this rank's residual

    @property
    def values(self) -> torch.Tensor:
        """``x`` without autograd history: what the compressor reads."""
        return self.x.detach()

    @property
    def world_size(self) -> int:
        return self.ctx.world_size


@dataclass(frozen=True, eq=False)
class ReduceCall:
    """One ``compressed_allreduce`` call as ``Aggregator.aggregate`` gets it: the local half's ``enc`` and the
    options of the collective half (see ``compressed_allreduce``)."""

    enc: Encoding
    spec: TensorSpec  # the caller's tensor's: the result's shape, dtype and layout
    group: dist.ProcessGroup  # the caller's group (resolved)
    comm: dist.ProcessGroup  # where the collectives run: ``group``, or sparsync's own one for async calls
    layout: str  # the call's fingerprint text (compressor, layout, dtype, device), agreed across ranks
    average: bool = True
    inplace: bool = False
    algorithm: str = "auto"  # sparse_allreduce's, for sparse payloads
    timeout: float | None = None
    check_nan: bool = True
    log: CommLog | None = None
    site: CallSite | None = None  # where an unnamed call was issued (tells calls apart)
    t0: float = 0.0  # perf_counter at the call, for the CommLog record

    @property
    def name(self) -> str:
        return self.enc.ctx.name

    @property
    def world_size(self) -> int:
        return self.enc.ctx.world_size

    @property
    def async_op(self) -> bool:
        return self.enc.async_op

    def finish(self, total: torch.Tensor, *, divide: bool | None = None) -> torch.Tensor:
        """The result from the decoded sum ``total``: divided by P (``divide``, default ``average``), in the
        caller's dtype and layout, written into the caller's tensor with ``inplace``. ``total`` is divided in
        place when it is a fresh buffer (no second fresh tensor)."""
        out, spec, P = total, self.spec, self.world_size
        if self.average if divide is None else divide:
            out = total.div_(P) if _private(total, self.enc.tensor, self.enc.x) else total / P
        if spec.sparse_dim is not None and not out.is_sparse:
            out = out.to_sparse(spec.sparse_dim)
        out = out.to(spec.dtype)
        if self.inplace:
            self.enc.tensor.copy_(out)
            return self.enc.tensor
        return out


class Aggregator(ABC, Generic[PayloadT]):
    """How one ``compressed_allreduce`` combines its payloads across ranks, with the local steps that go with it
    (powersgd's Aggregator, GRACE's communicator): dense allreduce, sparse allreduce, allgather, quantized
    reduce-scatter, cast pipeline. ``Compressor.aggregator`` picks one per call; the template calls
    ``compress``, ``feedback`` (with a memory) and ``aggregate`` in that order."""

    name: ClassVar[str]  # the collective, as the benchmarks print it ("allreduce", "sparse_allreduce", ...)

    @abstractmethod
    def compress(self, enc: Encoding) -> PayloadT | None:
        """This rank's payload of ``enc.values``, made on the caller's thread; None when ``aggregate`` encodes
        while it sends. Mutates the compressor's state of ``enc.ctx.name`` only."""

    @abstractmethod
    def feedback(self, enc: Encoding, payload: PayloadT | None, memory: Memory) -> torch.Tensor | None:
        """Store in ``memory`` ``enc.x`` minus what ``payload`` stands for on the other ranks (mutates the entry
        of ``enc.ctx.name``). Returns that estimate (``enc.spec``) when it was built, else None."""

    @abstractmethod
    def aggregate(self, call: ReduceCall, payload: PayloadT | None) -> torch.Tensor | Work[torch.Tensor]:
        """Every rank's payload combined over ``call.comm`` and decoded: ``call.finish`` of the sum (a ``Work`` of
        it with ``async_op``). Collective: every rank calls it with the same kind of aggregator, in order."""


def _private(out: torch.Tensor, *inputs: torch.Tensor) -> bool:
    """Whether ``out`` is a dense tensor sharing no storage with ``inputs`` (decompress returned a fresh
    buffer, as every compressor here does; checked, because dividing the caller's tensor would be a bug)."""
    if out.is_sparse:
        return False
    ptr = out.untyped_storage().data_ptr()
    return all(t.is_sparse or t.untyped_storage().data_ptr() != ptr for t in inputs)


# --- helpers shared by the sparsifiers ---------------------------------------------------------------------
def flat_values(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(values, indices) of the entries a sparsifier chooses from: all of a dense tensor (indices None: the
    position is the index), or the stored entries of a COO tensor with their linear indices."""
    if tensor.is_sparse:
        s = coo_to_stream(tensor).elements()
        assert s.indices is not None  # coo_to_stream always builds the sparse format
        return s.values, s.indices
    return tensor.reshape(-1), None


def selected(
    values: torch.Tensor,
    indices: torch.Tensor | None,
    positions: torch.Tensor,
    dim: int,
    *,
    presorted: bool = False,
) -> SparsePayload:
    """SparsePayload of ``values[positions]`` (positions into ``values``; unique; any order unless
    ``presorted``)."""
    pos = positions if presorted else positions.sort().values
    idx = pos if indices is None else indices.to(torch.int64)[pos]
    return SparsePayload(SparseStream(idx, values[pos].contiguous(), dim, validate=False))


def sparse_to_tensor(payload: SparsePayload, spec: TensorSpec) -> torch.Tensor:
    """Decompress a SparsePayload into the layout of ``spec`` (scatter, or COO rows)."""
    s = payload.stream
    if spec.sparse_dim is not None:
        return stream_to_coo(s, spec.shape, spec.sparse_dim).to(spec.dtype)
    return s.to_dense().to(spec.dtype).reshape(spec.shape)


def count_for(ratio: float, n: int) -> int:
    """k = ceil(ratio * n), at least 1 (when n > 0): a compressor never sends nothing for a non-empty input."""
    return min(n, max(1, math.ceil(ratio * n))) if n else 0


def check_ratio(ratio: float, what: str = "ratio") -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0.0 < ratio <= 1.0:
        raise ValueError(f"{what} must lie in (0, 1], got {ratio!r}")


def check_kernels(owner: str, kernels: str, built: bool, extension: str) -> None:
    """A compressor's ``kernels=`` setting: "auto" (C where built, else torch), "c" (the C extension
    ``extension`` must be built) or "torch"."""
    if kernels not in ("auto", "c", "torch"):
        raise ValueError(f"kernels must be 'auto', 'c' or 'torch', got {kernels!r}")
    if kernels == "c" and not built:
        raise RuntimeError(f"{owner}(kernels='c'): the C extension sparsync.compress.{extension} is not built")


def native_for(owner: str, kernels: str, built: bool, device: torch.device) -> bool:
    """Whether a call on a tensor of ``device`` runs the C kernels: they read host memory through raw pointers,
    so they serve CPU tensors only. "auto" runs the torch kernels (the same results) on any other device;
    "c" with such a tensor raises ValueError."""
    if device.type != "cpu":
        if kernels == "c":
            raise ValueError(
                f"{owner}(kernels='c'): the C kernels take CPU tensors only, got a tensor on {device}; "
                "use kernels='auto' or 'torch' for it"
            )
        return False
    return kernels != "torch" and built


def check_positive_int(value: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
