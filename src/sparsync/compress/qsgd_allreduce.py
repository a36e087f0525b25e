"""Quantized reduce-scatter + allgather for QSGD (SparCML §5's low-precision dense phase, the
"reduce-scatter, then re-quantize" design of THC-style quantized allreduce).

Allgather aggregation (``base.Compressor.decompress_gathered``) sends every rank's payload to every rank, and
every rank decodes all P of them: (P - 1)·q bytes in and P·n decoded values per rank, for a payload of q bytes
of n values. Here the n values are cut into segments of about ``SEGMENT`` values (``segments``), each split
into P partitions of whole buckets (``partitions``), and for every segment:

1. ``all_to_all_single``: rank j receives partition j of every other rank's payload ((P - 1)/P·q bytes per
   rank). A rank never quantizes its own partition: it does not leave the rank (``encode_remote``);
2. rank j adds its own exact values and the P - 1 decoded slices, and re-quantizes the sum with its own noise
   (``QSGD.sum_requantize``): about n decoded values per rank in all, instead of P·n;
3. ``all_gather_into_tensor`` of the quantized partitions ((P - 1)/P·q bytes per rank), which every rank
   decodes into the result, straight from the gathered buffers: bitwise the same everywhere.

The three steps are a software pipeline over the segments (``quantized_allreduce``): while segment i is
encoded, i - 1's all-to-all and i - 2's allgather are on the wire, so the encode, re-quantization and decode
overlap the transfers instead of adding to them.

Bytes per rank: 2(P - 1)/P·q instead of (P - 1)·q (at P = 4: 1.5q vs 3q); at P = 2 both move q, so ``auto``
keeps the allgather there (see ``QSGD.aggregation``).

Variance. Let x_r be rank r's input and Q(·) one stochastic quantization (unbiased: E[Q(v) | v] = v). Partition
j's result is Q₂(Y) with Y = x_j + Σ_{r≠j} Q₁(x_r) and Q₂ drawn independently of Q₁ (its own generator stream,
``qsgd.REQUANTIZE_STREAM``), so by the tower rule E[Q₂(Y)] = E[Y] = Σ_r x_r: unbiased, and

    Var[Q₂(Y)_i] = Σ_{r≠j} Var[Q₁(x_r)_i] + E[Var[Q₂(Y)_i | Y]].

The first term is the allgather path's minus the owner's own rounding. The second is the added variance: with
``scale="max"`` the bucket of Y has scale ‖Y_b‖∞ ≤ Σ_r ‖x_{r,b}‖∞ (every decoded value lies within its bucket's
scale), so per value it is at most (‖Y_b‖∞ / s)²/4 ≤ (Σ_r M_{r,b})² / (4s²), with M_{r,b} = ‖x_{r,b}‖∞ and
s = 2^(bits-1) - 1 levels; summed over a bucket of B values, at most B·(Σ_r M_{r,b})²/(4s²). With equal M
that is P² times one rank's bound B·M²/(4s²) (ranks whose values align); for independent ranks
‖Y_b‖∞ ≈ √P·M, so the added variance is about P times one rank's, about as large as the first term. For the
average (``reduce``'s default) divide by P²: the re-quantization adds at most the noise of one single-rank
quantization of the mean, (mean_r M_{r,b})²/(4s²) per value, while the first term shrinks as 1/P. With
``scale="l2"``, QSGD Lemma 3.1 bounds the second term by min(B/s², √B/s)·E‖Y_b‖₂² per bucket.
Error feedback (``reduce(memory=...)``) compensates a rank's own Q₁ only, as with the allgather: its residual
is x - ``local_estimate`` (zero on the rank's own partitions, which travel exactly).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sparsync.buffers import fresh
from sparsync.collectives.comm import Comm
from sparsync.compress.base import Context, QuantizedPayload
from sparsync.compress.qsgd_codec import REQUANTIZE_STREAM, QSGDCodec, Workspace

# values per pipeline segment (whole kernel chunks): 2 MB of 4-bit codes (2M was slower: docs/results_design.md)
SEGMENT = 1 << 22


def partitions(q: QSGDCodec, n: int, world_size: int) -> list[tuple[int, int]]:
    """[lo, hi) value ranges of the P partitions: K whole buckets each, K = ⌈buckets / P⌉ rounded up to an
    aligned unit (so every partition's packed codes start on a byte), the last ones clipped to n (some may be
    empty). Equal partitions make the allgathered partitions the result's payload as it lies: no copy."""
    K = _partition_buckets(q, n, world_size)
    return [(min(n, j * K * q.bucket), min(n, (j + 1) * K * q.bucket)) for j in range(world_size)]


def slice_payload(q: QSGDCodec, p: QuantizedPayload, lo: int, hi: int) -> QuantizedPayload:
    """The payload of values [lo, hi) of ``p`` (``lo`` on a partition boundary): views, no copy."""
    a, b = _extent(q, lo, hi)
    return QuantizedPayload(p.codes[a[0] : a[1]], p.scales[b[0] : b[1]])


def _extent(q: QSGDCodec, lo: int, hi: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """([first, end) byte of the codes, [first, end) scale) of values [lo, hi); lo a partition boundary."""
    if lo == hi:  # an empty partition (at the end: lo = n need not be a boundary)
        return (0, 0), (0, 0)
    return (lo * q.bits // 8, q.code_bytes(hi)), (lo // q.bucket, -(-hi // q.bucket))


def concat_payloads(parts: list[QuantizedPayload]) -> QuantizedPayload:
    """Inverse of slicing at partition boundaries."""
    return QuantizedPayload(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]))


def segments(q: QSGDCodec, n: int) -> list[tuple[int, int]]:
    """[a, b) value ranges of the pipeline's segments: about ``SEGMENT`` values each, whole kernel chunks (the
    last one shorter). A tensor of at most one segment runs the three steps once, unpipelined."""
    step = max(1, SEGMENT // q.chunk_step()) * q.chunk_step()
    return [(a, min(n, a + step)) for a in range(0, n, step)]


def encode_remote(q: QSGDCodec, values: torch.Tensor, n: int, ctx: Context, world_size: int) -> QuantizedPayload:
    """This rank's payload for ``quantized_allreduce``: every segment's partitions encoded but the rank's own
    (ctx.rank's; zero codes and scales there: they are summed exactly where they are). Advances ``q``'s
    rounding generator of (ctx.name, ctx.rank) as the pipelined encode inside ``quantized_allreduce`` does."""
    payload, ws, gen = q.empty_payload(n, values.device), q.workspace(n, values.device), q.generator(ctx)
    for a, b in segments(q, n):
        _encode_segment(q, values.reshape(-1), a, b, world_size, ctx.rank, payload, ws, gen)
    return payload


def local_estimate(
    q: QSGDCodec, payload: QuantizedPayload, values: torch.Tensor, world_size: int, rank: int
) -> torch.Tensor:
    """What the other ranks receive of this rank's ``values`` (float32, flat): the decoded payload, and the
    exact values on the rank's own partitions. Error feedback keeps values - this."""
    flat = values.reshape(-1)
    n = flat.numel()
    out = q.decode_sum([payload], n)
    for a, b in segments(q, n):
        lo, hi = partitions(q, b - a, world_size)[rank]
        out[a + lo : a + hi] = flat[a + lo : a + hi]
    return out


def simulate(
    q: QSGDCodec,
    payloads: list[QuantizedPayload],
    xs: list[torch.Tensor],
    ctxs: list[Context],
    requantizers: list[QSGDCodec] | None = None,
) -> torch.Tensor:
    """What ``quantized_allreduce`` returns (scale 1) when rank r holds ``xs[r]`` and sent ``payloads[r]``
    (``encode_remote``'s), computed in one process: partition j of every segment summed from ``xs[j]`` and the
    others' slices and re-quantized, segment after segment, with the noise of ``ctxs[j]`` drawn from
    ``requantizers[j]`` (each rank's own compressor, default ``q``). For tests."""
    n = xs[0].numel()
    if len(payloads) == 1:
        return xs[0].reshape(-1).to(torch.float32)
    qs = requantizers or [q] * len(payloads)
    parts = []
    for a, b in segments(q, n):
        for j, (lo, hi) in enumerate(partitions(q, b - a, len(payloads))):
            others = [slice_payload(q, p, a + lo, a + hi) for r, p in enumerate(payloads) if r != j]
            gen = qs[j].generator(ctxs[j], REQUANTIZE_STREAM)
            parts.append(q.sum_requantize(others, hi - lo, gen, xs[j].reshape(-1)[a + lo : a + hi]))
    return q.decode_sum([concat_payloads(parts)], n)


def quantized_allreduce(
    q: QSGDCodec,
    values: torch.Tensor,
    n: int,
    ctx: Context,
    group: dist.ProcessGroup,
    scale: float = 1.0,
    payload: QuantizedPayload | None = None,
) -> Reduced:
    """Sum over ``group`` (times ``scale``) of every rank's ``values`` (n of them, any float dtype), quantized
    where they travel, decoded: float32, bitwise the same on every rank (``simulate``).

    ``payload``: this rank's ``encode_remote`` payload if already encoded; otherwise the values are encoded here
    segment by segment (the same bits) while the previous segment is on the wire. The result and every buffer
    live on ``values``' device (gloo's all-to-all and gathers take CPU tensors only: there a device segment goes
    through host memory, collectives/transport.py). Collective: every rank of ``group`` calls it with the same
    settings and n, in the same order. Advances ``q``'s generators of
    (ctx.name, ctx.rank): the rounding one when encoding, the re-quantization one.

    Example::

        >>> q = QSGD(bits=4)
        >>> r = quantized_allreduce(q, grad, grad.numel(), Context("w", rank, P), group)
        >>> r.total.view_as(grad)  # Σ_r grad_r, unbiased
    """
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    flat = values.reshape(-1)
    device = flat.device
    if P == 1:  # nothing travels: the sum is the values themselves
        total = flat.to(torch.float32, copy=True)
        codes = torch.zeros(q.code_bytes(n), dtype=torch.uint8, device=device)
        zero = QuantizedPayload(codes, torch.zeros(-(-n // q.bucket), device=device))
        return Reduced(total.mul_(scale) if scale != 1.0 else total, zero, 0)  # encode_remote's payload at P = 1
    stage = Comm(group, device=device).stage
    encode = payload is None
    own = q.empty_payload(n, device) if payload is None else payload
    out = fresh(n, device=device)
    ws = q.workspace(n, device)
    segs = [_Segment(q, a, b, P, rank, device, stage) for a, b in segments(q, n)]
    gen, regen = q.generator(ctx), q.generator(ctx, REQUANTIZE_STREAM)
    # Software pipeline, one step per segment i: encode i and start its all-to-all; finish i - 1's all-to-all,
    # sum and re-quantize its partition and start its allgather; finish i - 2's allgather and decode it. The
    # collectives start in the same order on every rank (gloo pairs them by that order).
    for i in range(len(segs) + 2):
        if i < len(segs):
            seg = segs[i]
            if encode:
                _encode_segment(q, flat, seg.a, seg.b, P, rank, own, ws, gen)
            seg.start_all_to_all(own, group)
        if 0 <= i - 1 < len(segs):
            segs[i - 1].requantize_and_gather(flat, regen, group)
        if 0 <= i - 2 < len(segs):
            segs[i - 2].decode(out, scale, ws)
    return Reduced(out, own, sum(seg.sent for seg in segs))


def _encode_segment(
    q: QSGDCodec,
    flat: torch.Tensor,
    a: int,
    b: int,
    P: int,
    rank: int,
    payload: QuantizedPayload,
    ws: Workspace,
    gen: torch.Generator,
) -> None:
    """Encode segment [a, b) of ``flat`` into ``payload`` around this rank's own partition, which is zeroed."""
    lo, hi = partitions(q, b - a, P)[rank]
    for u, v in ((a, a + lo), (a + hi, b)):
        if v > u:
            q.encode_range(flat, u, v, payload, ws, gen)
    (c0, c1), (s0, s1) = _extent(q, a + lo, a + hi)
    payload.codes[c0:c1] = 0
    payload.scales[s0:s1] = 0


@dataclass
class Reduced:
    """``quantized_allreduce``'s result: the decoded sum, this rank's ``encode_remote`` payload (for error
    feedback: ``local_estimate``), and the bytes this rank sent."""

    total: torch.Tensor  # float32, n values
    payload: QuantizedPayload
    sent: int


class _Segment:
    """One segment's three steps (module doc), its buffers alive only between them. A block (what one rank
    sends another) is a partition's codes, padded to 4 bytes, then its scales. Buffers on ``device``; with
    ``stage`` the transfers go through host memory (gloo with a device tensor)."""

    def __init__(self, q: QSGDCodec, a: int, b: int, P: int, rank: int, device: torch.device, stage: bool) -> None:
        self.q, self.a, self.b, self.P, self.rank = q, a, b, P, rank
        self.device, self.stage = device, stage
        self.parts = partitions(q, b - a, P)
        self.extents = [_extent(q, a + lo, a + hi) for lo, hi in self.parts]  # within the whole payload
        self.blocks = [_pad4(c1 - c0) + 4 * (s1 - s0) for (c0, c1), (s0, s1) in self.extents]
        K = _partition_buckets(q, b - a, P)
        self.gather_codes = _pad4(K * q.bucket * q.bits // 8)  # every rank's gathered block: the largest
        self.gather_block = self.gather_codes + 4 * K
        self.sent = sum(self.blocks) - self.blocks[rank] + (P - 1) * self.gather_block
        self.work: dist.Work | None = None
        # kept alive until the collective is done
        self.send = self.buf = torch.empty(0, dtype=torch.uint8, device=device)

    def start_all_to_all(self, payload: QuantizedPayload, group: dist.ProcessGroup) -> None:
        """Step 1: partition j of this segment (codes, scales) to rank j; none to this rank itself."""
        sizes = [0 if j == self.rank else blk for j, blk in enumerate(self.blocks)]
        send = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
        at = 0
        for ((c0, c1), (s0, s1)), blk in zip(self.extents, sizes, strict=True):
            if blk:
                _put(send[at : at + blk], payload.codes[c0:c1], payload.scales[s0:s1])
                at += blk
        mine = [0 if r == self.rank else self.blocks[self.rank] for r in range(self.P)]
        # all_to_all_single with splits: NCCL has it (unequal blocks need no padding)
        self._start(lambda out, inp: dist.all_to_all_single(out, inp, mine, sizes, group=group, async_op=True),
                    send, sum(mine))  # fmt: skip

    def requantize_and_gather(self, flat: torch.Tensor, gen: torch.Generator, group: dist.ProcessGroup) -> None:
        """Step 2: this rank's exact values plus the decoded P - 1 slices of its partition, re-quantized; start
        the allgather."""
        self._wait()
        q, blk = self.q, self.blocks[self.rank]
        (c0, c1), (s0, s1) = self.extents[self.rank]
        lo, hi = self.parts[self.rank]
        slices = [_get(self.buf[r * blk : (r + 1) * blk], c1 - c0, s1 - s0) for r in range(self.P - 1)]
        mine = q.sum_requantize(slices, hi - lo, gen, flat[self.a + lo : self.a + hi])
        send = torch.zeros(self.gather_block, dtype=torch.uint8, device=self.device)
        _put(send, mine.codes, mine.scales, codes_room=self.gather_codes)
        # every rank's block padded to the largest partition's (gather_block): the equal sizes NCCL gathers
        self._start(lambda out, inp: _all_gather_into_tensor(out, inp, group), send, self.P * self.gather_block)

    def decode(self, out: torch.Tensor, scale: float, ws: Workspace) -> None:
        """Step 3: decode every rank's re-quantized partition into ``out``, scales times ``scale``."""
        self._wait()
        blk = self.gather_block
        for j, ((lo, hi), ((c0, c1), (s0, s1))) in enumerate(zip(self.parts, self.extents, strict=True)):
            if hi > lo:
                part = _get(self.buf[j * blk : (j + 1) * blk], c1 - c0, s1 - s0, codes_room=self.gather_codes)
                self.q.decode_into(_scaled(part, scale), out[self.a + lo : self.a + hi], ws)
        self.send = self.buf = torch.empty(0, dtype=torch.uint8, device=self.device)

    def _start(
        self, collective: Callable[[torch.Tensor, torch.Tensor], dist.Work], send: torch.Tensor, n: int
    ) -> None:
        """Start ``collective(receive buffer of n bytes, send)``; with ``stage`` both on the host."""
        where = _HOST if self.stage else self.device
        self.send = send.to(where)  # staged: one copy to the host of what this rank sends
        self.buf = torch.empty(n, dtype=torch.uint8, device=where)
        self.work = collective(self.buf, self.send)

    def _wait(self) -> None:
        assert self.work is not None
        self.work.wait()
        self.work = None
        if self.stage:  # staged: what arrived goes to the device once
            self.buf = self.buf.to(self.device)


def _put(dst: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, codes_room: int | None = None) -> None:
    """Write a block: ``codes``, then from ``codes_room`` (default: the codes padded to 4 bytes) the scales."""
    room = _pad4(codes.numel()) if codes_room is None else codes_room
    dst[: codes.numel()].copy_(codes)
    dst[room : room + 4 * scales.numel()].view(torch.float32).copy_(scales)


def _get(block: torch.Tensor, ncodes: int, nscales: int, codes_room: int | None = None) -> QuantizedPayload:
    """The payload of a block written by ``_put`` (views)."""
    room = _pad4(ncodes) if codes_room is None else codes_room
    return QuantizedPayload(block[:ncodes], block[room : room + 4 * nscales].view(torch.float32))


_HOST = torch.device("cpu")


def _pad4(nbytes: int) -> int:
    return -(-nbytes // 4) * 4


def _scaled(p: QuantizedPayload, scale: float) -> QuantizedPayload:
    return p if scale == 1.0 else QuantizedPayload(p.codes, p.scales * scale)


def _partition_buckets(q: QSGDCodec, n: int, world_size: int) -> int:
    """K: buckets per partition, ⌈buckets / P⌉ rounded up to whole aligned units."""
    buckets, step = -(-n // q.bucket), world_size * q.unit()
    return -(-buckets // step) * q.unit()


def _all_gather_into_tensor(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> dist.Work:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    work: dist.Work = gather(out, inp, group=group, async_op=True)
    return work
