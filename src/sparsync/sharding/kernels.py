"""The primitives under a sharded step's stages: a table group's step kernels and the stages' all-to-all rounds.

The kernels: the dedupe's sorted unique (``ids.dedupe_groups``), the rows stage's gather
(``rows.RowExchange``), the pooling's gather and its backward (``rows._pool_rows``), the owner's sum of the
gradient rows (``rows._owner_sum``), and the fused optimizers' row reads and updates (``group.Fused``), in C
where the extension ``_group_c`` is built (``pip install`` compiles it) and in torch otherwise. The two give the
same bits (``tests/sharding/test_kernels.py``): each C kernel computes the expressions of the torch ops it stands
for, in their order and precision, and leaves to torch what it cannot copy (the square roots; a sum of more than
two rows, whose order coalesce chooses).

``kernels``: "auto" (C where built, else torch), "c" (RuntimeError when not built), "torch". The C kernels read
host memory through raw pointers, so they serve contiguous CPU tensors (and float32/float64 values); any other
input runs the torch ops, whatever ``kernels`` says. Rows must lie in [0, R): the C kernels raise IndexError for
any other (``index_put_`` would wrap a negative one).

Beside the kernels, the other primitive the stages run on: their rounds (``Link``), ``dist.all_to_all_single``
with split sizes on the tables' group, what each round put on the wire counted (``Traffic``: bytes per phase,
messages, wait time), each round a ``trace.scope`` (a profiler range and an event on the rank's timeline), and
the rows' optional lower precision on the wire (``WIRE``). The stages (``ids``, ``rows``) call the kernels and
the rounds; neither calls anything of theirs. The rounds run on the caller's group in the caller's thread, as a
model's own collective (DLRM's all-to-all): sparsync's background work (``DistributedOptimizer``'s reductions
during backward) runs on a group of its own and never interleaves with them.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from sparsync.collectives.timeline import tracer
from sparsync.collectives.trace import scope
from sparsync.collectives.traffic import Traffic
from sparsync.record import CommLog, CommRecord

try:  # built by `pip install` (setup.py); optional: the torch ops are the fallback
    from sparsync.sharding import _group_c as _native
except ImportError:  # pragma: no cover - only without a C compiler
    _native = None  # type: ignore[assignment]

KERNELS = ("auto", "c", "torch")
ADD, SQUARES, STEP = 0, 1, 2  # the kinds of the C update
FLOATS = (torch.float32, torch.float64)


def built() -> bool:
    """Whether the C kernels were built ("auto" uses them then)."""
    return _native is not None


def check(owner: str, kernels: str) -> None:
    """ValueError for a ``kernels`` setting not in ``KERNELS``; RuntimeError for "c" when the C kernels are not
    built."""
    if kernels not in KERNELS:
        raise ValueError(f"{owner}: kernels must be 'auto', 'c' or 'torch', got {kernels!r}")
    if kernels == "c" and _native is None:
        raise RuntimeError(f"{owner}(kernels='c'): the C extension sparsync.sharding._group_c is not built")


def _native_for(kernels: str, *tensors: torch.Tensor) -> bool:
    check("sharding.kernels", kernels)
    return kernels != "torch" and _native is not None and all(t.device.type == "cpu" for t in tensors)


def unique(keys: torch.Tensor, kernels: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.unique(keys, sorted=True, return_inverse=True)`` of 1-D int64 ``keys``: the distinct keys
    ascending, and each key's position among them."""
    if keys.dtype != torch.int64 or keys.dim() != 1 or not _native_for(kernels, keys):
        out, inverse = torch.unique(keys, sorted=True, return_inverse=True)
        return out, inverse
    keys = keys.contiguous()
    out, inverse = torch.empty_like(keys), torch.empty_like(keys)
    count = _native.unique(keys.data_ptr(), keys.numel(), out.data_ptr(), inverse.data_ptr())
    return out[:count], inverse


def gather(src: torch.Tensor, rows: torch.Tensor, kernels: str = "auto") -> torch.Tensor:
    """``src.index_select(0, rows)`` of a 2-D ``src`` and int64 ``rows``, outside autograd (IndexError for a row
    out of range)."""
    if (
        src.dim() != 2
        or not src.is_contiguous()
        or rows.dtype != torch.int64
        or not _native_for(kernels, src, rows)
    ):
        return src.index_select(0, rows)  # (a copy of a whole non-contiguous table would cost more than it saves)
    rows = rows.contiguous()
    out = src.new_empty(rows.numel(), src.shape[1])
    row_bytes = src.shape[1] * src.element_size()
    _native.gather(src.data_ptr(), src.shape[0], row_bytes, rows.data_ptr(), rows.numel(), out.data_ptr())
    return out


def scatter_add(src: torch.Tensor, index: torch.Tensor, size: int, kernels: str = "auto") -> torch.Tensor:
    """``zeros(size, D).index_add_(0, index, src)`` of a 2-D float ``src`` (index_select's backward): each row
    the sum of its sources in their order."""
    if (
        src.dim() != 2
        or src.dtype not in FLOATS
        or index.dtype != torch.int64
        or index.numel() != src.shape[0]
        or not _native_for(kernels, src, index)
    ):  # (torch's op then names a mismatch)
        return src.new_zeros(size, src.shape[1]).index_add_(0, index, src)
    src, index = src.contiguous(), index.contiguous()
    out = src.new_empty(size, src.shape[1])
    dbl = int(src.dtype == torch.float64)
    _native.scatter_add(src.data_ptr(), index.data_ptr(), index.numel(), src.shape[1], out.data_ptr(), size, dbl)
    return out


def sum_rows(
    rows: torch.Tensor, values: torch.Tensor, size: int, kernels: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of the sparse ``[size, D]`` tensor (int64 ``rows``, ``values`` ``[n, D]``) summed per row, as
    ``coalesce()`` gives them: (the distinct rows ascending, their sums). In C where no row occurs more than
    twice (a sum of two is the same bits in either order, so coalesce's order needs no copying); else
    coalesce."""
    if (
        rows.dtype == torch.int64
        and values.dim() == 2
        and rows.numel() == values.shape[0]
        and _updatable(kernels, values)
    ):
        rows = rows.contiguous()
        out_rows, out = torch.empty_like(rows), torch.empty_like(values)
        dbl = int(values.dtype == torch.float64)
        count = _native.sum_rows(rows.data_ptr(), rows.numel(), values.data_ptr(), values.shape[1],
                                 out_rows.data_ptr(), out.data_ptr(), dbl)  # fmt: skip
        if count >= 0:
            return out_rows[:count], out[:count]
    shape = (size, values.shape[1])
    coo = torch.sparse_coo_tensor(rows.unsqueeze(0), values, shape, check_invariants=False).coalesce()
    return coo.indices()[0], coo.values()


class _Pick(torch.autograd.Function):
    """``index_select(0, rows)`` whose forward and backward run the C kernels."""

    @staticmethod
    def forward(ctx: Any, src: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows)
        ctx.size = src.shape[0]
        return gather(src, rows, "c")

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (rows,) = ctx.saved_tensors
        return scatter_add(grad, rows, ctx.size, "c"), None


def pick_rows(src: torch.Tensor, rows: torch.Tensor, kernels: str = "auto") -> torch.Tensor:
    """``src.index_select(0, rows)`` of a 2-D float ``src``, differentiable in ``src`` (its gradient: each row's
    gradients summed in order, as index_select's backward sums them)."""
    if src.dim() != 2 or src.dtype not in FLOATS or rows.dtype != torch.int64 or not _native_for(kernels, src):
        return src.index_select(0, rows)
    out: torch.Tensor = _Pick.apply(src, rows)  # type: ignore[no-untyped-call]
    return out


def _updatable(kernels: str, *tensors: torch.Tensor | None) -> bool:
    """Whether the C update serves these tensors: built, CPU, contiguous, one float dtype."""
    given = [t for t in tensors if t is not None]
    return _native_for(kernels, *given) and given[0].dtype in FLOATS and all(
        t.is_contiguous() and t.dtype == given[0].dtype for t in given
    )  # fmt: skip


def _update(kind: int, t: torch.Tensor, rows: torch.Tensor, v: torch.Tensor, std: torch.Tensor | None,
            lr: float) -> None:  # fmt: skip
    rows = rows.contiguous()
    D = t.shape[1] if t.dim() == 2 else 1
    n = rows.numel()
    if v.numel() != n * D or (std is not None and std.numel() not in (n, n * D)):
        got = (v.numel(), None if std is None else std.numel())
        raise ValueError(f"sharding.kernels: {n} rows of {D} take {n * D} values (and std), got {got}")
    dbl = int(t.dtype == torch.float64)
    std_ptr, stride = (0, 0) if std is None else (std.data_ptr(), 1 if std.dim() == 1 else D)
    _native.update(kind, t.data_ptr(), t.shape[0], D, rows.data_ptr(), rows.numel(), v.data_ptr(), std_ptr,
                   stride, lr, dbl)  # fmt: skip
    torch.autograd.graph.increment_version(t)  # written through a pointer: what index_put_ would count


def add_rows(
    target: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, kernels: str = "auto", squares: bool = False
) -> None:
    """``target[rows] += values`` (``values.pow(2)`` with ``squares``) for distinct int64 ``rows`` of a 1-D or
    2-D ``target``: each element ``t + v``, as ``index_put_``'s accumulate computes it. Mutates ``target``;
    IndexError for a row out of range (nothing changed then)."""
    if rows.dtype != torch.int64 or not _updatable(kernels, target, values):
        target.index_put_((rows,), values.pow(2) if squares else values, accumulate=True)
        return
    _update(SQUARES if squares else ADD, target, rows, values, None, 0.0)


def step_rows(
    w: torch.Tensor, rows: torch.Tensor, g: torch.Tensor, lr: float, std: torch.Tensor | None = None,
    kernels: str = "auto",
) -> None:  # fmt: skip
    """``w[rows] += g * -lr`` (SGD), or ``w[rows] += (g / std) * -lr`` with ``std`` per element (``[n, D]``) or
    per row (``[n]``), for distinct int64 ``rows`` of a 2-D ``w``: the expressions of ``group.Fused``'s torch ops.
    Mutates ``w``; IndexError for a row out of range (nothing changed then)."""
    if rows.dtype != torch.int64 or not _updatable(kernels, w, g, std):
        step = g if std is None else g / (std if std.dim() == 2 else std.unsqueeze(1))
        w.index_put_((rows,), step * -lr, accumulate=True)
        return
    _update(STEP, w, rows, g, std, lr)


# ``sparsync.shard(rows=...)``: the lower precisions rows and gradient rows may travel in
WIRE: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class Rider:
    """A round's blocks that can travel inside a later gradient rows round instead of a round of their own
    (``Link.rows(rider=...)``; the ids round of a batch looked ahead, ``ids.prepare``): one block of ``width``
    int64 words per peer, in peer order. ``taken``: sent, in a rows round or in a round of its own (``take``);
    ``got``: the blocks received, once they came in a rows round."""

    send: torch.Tensor  # [P·width] int64
    width: int  # words per peer
    split: dict[str, int] = field(default_factory=dict)  # bytes sent to the other ranks, per phase
    taken: bool = False
    got: torch.Tensor | None = None

    def take(self) -> torch.Tensor:
        """The blocks, marked sent (a later rows round then leaves them out). RuntimeError when already sent."""
        if self.taken:
            raise RuntimeError("sharding.kernels.Rider: these blocks were sent already")
        self.taken = True
        return self.send


def alive(ref: weakref.ReferenceType[dist.ProcessGroup]) -> dist.ProcessGroup:
    """The group ``ref`` holds, or a RuntimeError saying it was destroyed. The sharded and replicated tables hold
    their group weakly, so that ``dist.destroy_process_group()`` frees it while the model lives on: a group freed
    only at the interpreter's exit can make gloo abort the process there (docs/sharding.md, "Ending a torchrun
    script")."""
    group = ref()
    if group is None:
        raise RuntimeError(
            "the process group of these sharded or replicated tables was destroyed (dist.destroy_process_group); "
            "they cannot exchange rows any more: shard the model again on a live group"
        )
    return group


class Link:
    """The all-to-all rounds of one ``sparsync.shard`` call's tables (module doc). ``wire``: the dtype rows and
    gradient rows travel in (``WIRE``; None: the tables' own), each value rounded once on the way. ``log``
    receives a ``CommRecord`` per exchange and direction."""

    def __init__(
        self, group: dist.ProcessGroup, log: CommLog | None = None, wire: torch.dtype | None = None
    ) -> None:
        self._group = weakref.ref(group)  # the tables do not keep their group alive (``alive``)
        self.wire = wire
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.log = log

    @property
    def group(self) -> dist.ProcessGroup:
        """The tables' process group; a RuntimeError once it is gone (``alive``)."""
        return alive(self._group)

    def start(
        self,
        send: torch.Tensor,
        send_sizes: list[int],
        recv_sizes: list[int],
        phase: str,
        tally: Traffic,
        split: dict[str, int] | None = None,
        wait: bool = False,
    ) -> tuple[torch.Tensor, Any]:
        """One round (split sizes in elements), started: the tensor it fills and the work to wait for (None once
        waited, with ``wait``, or with no peer). Counts what crossed to other ranks under ``phase`` or, given
        ``split``, under its phases (bytes sent each, adding up to the round's), and with ``wait`` the time under
        ``phase`` (else the waiter counts it). Traced as ``shard:<phase>`` (``shard:<phase> start`` when not
        waited for here)."""
        w = send.element_size()
        sent = w * (sum(send_sizes) - send_sizes[self.rank])
        t0 = time.perf_counter()
        work = None
        with scope(tracer(), "shard", f"shard:{phase}" if wait else f"shard:{phase} start", bytes=sent):
            if self.size == 1:
                out = send
            else:
                out = send.new_empty(sum(recv_sizes))
                work = dist.all_to_all_single(
                    out, send.contiguous(), recv_sizes, send_sizes, group=self.group, async_op=True
                )
                if wait:
                    work.wait()
                    work = None
        tally.add(sent, w * (sum(recv_sizes) - recv_sizes[self.rank]), self.size - 1)
        for name, n in (split or {phase: sent}).items():
            tally.phase_bytes[name] = tally.phase_bytes.get(name, 0) + n
        if wait:
            tally.phases[phase] = tally.phases.get(phase, 0.0) + time.perf_counter() - t0
        return out, work

    def rows(
        self,
        send: torch.Tensor,
        sizes: tuple[list[int], list[int]],
        phase: str,
        tally: Traffic,
        verdicts: bool = False,
        rider: Rider | None = None,
    ) -> torch.Tensor:
        """A round of row values (``sizes``: the split sizes sent and received), waited for, in ``wire`` precision
        when set, back in ``send``'s dtype. ``verdicts``: each block opens with one word that is no row
        (``rows.with_verdicts``), counted as ``header``. ``rider``: blocks not taken yet (``Rider``) that every
        rank sends in this round (``carry``); the rows alone when it is None or taken."""
        send_sizes, recv_sizes = sizes
        wire = send.dtype if self.wire is None else self.wire
        if rider is not None and not rider.taken:
            return self.carry(send.to(wire), sizes, phase, tally, rider).to(send.dtype)
        split = None
        if verdicts:
            header_bytes = wire.itemsize * (self.size - 1)
            rows_bytes = wire.itemsize * (sum(send_sizes) - send_sizes[self.rank]) - header_bytes
            split = {phase: rows_bytes, "header": header_bytes}
        got, _ = self.start(send.to(wire), send_sizes, recv_sizes, phase, tally, split, wait=True)
        return got.to(send.dtype)

    def carry(
        self, send: torch.Tensor, sizes: tuple[list[int], list[int]], phase: str, tally: Traffic, rider: Rider
    ) -> torch.Tensor:
        """One round of row values (``send``, ``sizes`` as ``rows``'s) with ``rider``'s blocks: each peer's block
        its rows' bytes then its rider block's, all in one ``all_to_all_single`` of bytes (split sizes in bytes);
        the rows received, and the blocks received in ``rider.got`` (taken). Counted once: the rows' bytes under
        ``phase``, the blocks' under the rider's phases. Every rank must carry a rider of the same width."""
        send_sizes, recv_sizes = sizes
        w, block = send.element_size(), 8 * rider.width
        theirs = torch.split(rider.take().view(torch.uint8), block)  # both as bytes: one view each, not per peer
        mine = torch.split(send.contiguous().view(torch.uint8), [w * n for n in send_sizes])
        packed = torch.cat([t for pair in zip(mine, theirs, strict=True) for t in pair])
        out_bytes, in_bytes = [w * n + block for n in send_sizes], [w * n + block for n in recv_sizes]
        split = {phase: w * (sum(send_sizes) - send_sizes[self.rank]), **rider.split}
        got, _ = self.start(packed, out_bytes, in_bytes, phase, tally, split, wait=True)
        parts = torch.split(got, [b for n in recv_sizes for b in (w * n, block)])  # rows, block, rows, block, ...
        rider.got = torch.cat(parts[1::2]).view(torch.int64)
        return torch.cat(parts[0::2]).view(send.dtype)

    def record(self, op: str, tally: Traffic, t0: float, *, nnz_in: int, nnz_out: int) -> None:
        """One ``CommRecord`` of an exchange's direction in ``log``, when a log is attached."""
        if self.log is None:
            return
        self.log.append(
            CommRecord(
                op, "alltoall", self.rank, self.size, 0, nnz_in, nnz_out, tally.bytes_sent, tally.bytes_recv,
                tally.messages, time.perf_counter() - t0, dict(tally.phases), None, dict(tally.phase_bytes),
            )
        )  # fmt: skip
