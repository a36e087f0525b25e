"""Quantized reduce-scatter + allgather of QSGD payloads (issue 15, item 2; SparCML §5's low-precision dense
phase, the "reduce-scatter, then re-quantize" design of THC-style quantized allreduce).

Allgather aggregation (``base.Compressor.decompress_gathered``) sends every rank's payload to every rank, and
every rank decodes all P of them: (P - 1)·q bytes in and P·n decoded values per rank, for a payload of q bytes
of n values. Here the n values are split into P partitions of whole buckets (``partitions``):

1. ``all_to_all_single`` (codes, then scales): rank j receives partition j of every rank's payload
   ((P - 1)/P·q bytes per rank);
2. rank j decodes and sums its P slices and re-quantizes the sum with its own noise (``QSGD.sum_requantize``):
   n decoded values per rank in all, instead of P·n;
3. ``all_gather_into_tensor`` of the quantized partitions ((P - 1)/P·q bytes per rank), which every rank
   decodes once into the result, straight from the gathered buffers: bitwise the same everywhere.

Bytes per rank: 2(P - 1)/P·q instead of (P - 1)·q (at P = 4: 1.5q vs 3q); at P = 2 both move q, so ``auto``
keeps the allgather there (see ``QSGD.aggregation``).

Variance. Let x_r be rank r's input and Q(·) one stochastic quantization (unbiased: E[Q(v) | v] = v). A
partition's result is Q₂(Y) with Y = Σ_r Q₁(x_r) and Q₂ drawn independently of Q₁ (its own generator stream,
``qsgd.REQUANTIZE_STREAM``), so by the tower rule E[Q₂(Y)] = E[Y] = Σ_r x_r: unbiased, and

    Var[Q₂(Y)_i] = Σ_r Var[Q₁(x_r)_i] + E[Var[Q₂(Y)_i | Y]].

The first term is what the allgather path has. The second is the added variance: with ``scale="max"`` the
bucket of Y has scale ‖Y_b‖∞ ≤ Σ_r ‖x_{r,b}‖∞ (every decoded value lies within its bucket's scale), so per
value it is at most (‖Y_b‖∞ / s)²/4 ≤ (Σ_r M_{r,b})² / (4s²), with M_{r,b} = ‖x_{r,b}‖∞ and s = 2^(bits-1) - 1
levels; summed over a bucket of B values, at most B·(Σ_r M_{r,b})²/(4s²). With equal M that is P² times one
rank's bound B·M²/(4s²) (ranks whose values align); for independent ranks ‖Y_b‖∞ ≈ √P·M, so the added
variance is about P times one rank's, about as large as the first term. For
the average (``reduce``'s default) divide by P²: the re-quantization adds at most the noise of one
single-rank quantization of the mean, (mean_r M_{r,b})²/(4s²) per value, while the first term shrinks as 1/P.
With ``scale="l2"``, QSGD Lemma 3.1 bounds the second term by min(B/s², √B/s)·E‖Y_b‖₂² per bucket.
Error feedback (``reduce(memory=...)``) compensates a rank's own Q₁ only, as with the allgather.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sparsync.compress.base import Context, QuantizedPayload
from sparsync.compress.qsgd import QSGD, REQUANTIZE_STREAM


def partitions(q: QSGD, n: int, world_size: int) -> list[tuple[int, int]]:
    """[lo, hi) value ranges of the P partitions: K whole buckets each, K = ⌈buckets / P⌉ rounded up to an
    aligned unit (so every partition's packed codes start on a byte), the last ones clipped to n (some may be
    empty). Equal partitions make the allgathered partitions the result's payload as it lies: no copy."""
    K = _partition_buckets(q, n, world_size)
    return [(min(n, j * K * q.bucket), min(n, (j + 1) * K * q.bucket)) for j in range(world_size)]


def slice_payload(q: QSGD, p: QuantizedPayload, lo: int, hi: int) -> QuantizedPayload:
    """The payload of values [lo, hi) of ``p`` (``lo`` on a partition boundary): views, no copy."""
    a, b = _extent(q, lo, hi)
    return QuantizedPayload(p.codes[a[0] : a[1]], p.scales[b[0] : b[1]])


def _extent(q: QSGD, lo: int, hi: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """([first, end) byte of the codes, [first, end) scale) of values [lo, hi); lo a partition boundary."""
    if lo == hi:  # an empty partition (at the end: lo = n need not be a boundary)
        return (0, 0), (0, 0)
    return (lo * q.bits // 8, q.code_bytes(hi)), (lo // q.bucket, -(-hi // q.bucket))


def concat_payloads(parts: list[QuantizedPayload]) -> QuantizedPayload:
    """Inverse of slicing at partition boundaries."""
    return QuantizedPayload(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]))


def simulate(
    q: QSGD, payloads: list[QuantizedPayload], n: int, ctxs: list[Context], requantizers: list[QSGD] | None = None
) -> QuantizedPayload:
    """What ``quantized_allreduce`` returns for these payloads (rank r's is ``payloads[r]``), computed in one
    process: partition j re-quantized with the noise of ``ctxs[j]`` drawn from ``requantizers[j]`` (each
    rank's own compressor, default ``q``). For tests and models."""
    if len(payloads) == 1:
        return payloads[0]
    qs = requantizers or [q] * len(payloads)
    parts = []
    for j, (lo, hi) in enumerate(partitions(q, n, len(payloads))):
        mine = [slice_payload(q, p, lo, hi) for p in payloads]
        parts.append(q.sum_requantize(mine, hi - lo, qs[j].generator(ctxs[j], REQUANTIZE_STREAM)))
    return concat_payloads(parts)


def quantized_allreduce(
    q: QSGD, payload: QuantizedPayload, n: int, ctx: Context, group: dist.ProcessGroup
) -> tuple[QuantizedPayload, int]:
    """Quantized payload of the sum of every rank's ``payload`` (n values each), and the bytes this rank sent.

    Collective: every rank of ``group`` calls it with the same settings and n. The result is bitwise the same
    on every rank; it advances ``q``'s re-quantization generator of (ctx.name, ctx.rank).

    Example::

        >>> q = QSGD(bits=4)
        >>> p = q.compress(grad, Context("w", rank, P))
        >>> total, sent = quantized_allreduce(q, p, grad.numel(), Context("w", rank, P), group)
        >>> q.decompress(total, TensorSpec.of(grad))  # Σ_r grad_r, unbiased
    """
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    if P == 1:
        return payload, 0
    parts = partitions(q, n, P)
    # 1. partition j of this rank's codes and scales to rank j: the payload's own buffers, split in place
    extents = [_extent(q, lo, hi) for lo, hi in parts]
    code_split = [b - a for (a, b), _ in extents]
    scale_split = [b - a for _, (a, b) in extents]
    lo, hi = parts[rank]
    codes = torch.empty(P * code_split[rank], dtype=torch.uint8)
    scales = torch.empty(P * scale_split[rank], dtype=torch.float32)
    dist.all_to_all_single(codes, payload.codes, [code_split[rank]] * P, code_split, group=group)
    dist.all_to_all_single(scales, payload.scales, [scale_split[rank]] * P, scale_split, group=group)
    # 2. decode, sum and re-quantize this rank's partition
    c, s = code_split[rank], scale_split[rank]
    slices = [QuantizedPayload(codes[r * c : (r + 1) * c], scales[r * s : (r + 1) * s]) for r in range(P)]
    mine = q.sum_requantize(slices, hi - lo, q.generator(ctx, REQUANTIZE_STREAM))
    # 3. allgather the quantized partitions, each padded to the full K buckets: the gathered buffers are then
    #    the result's codes and scales, in order, followed by the padding
    K = _partition_buckets(q, n, P)
    out_codes = torch.zeros(K * q.bucket * q.bits // 8, dtype=torch.uint8)
    out_codes[:c].copy_(mine.codes)
    out_scales = torch.zeros(K, dtype=torch.float32)
    out_scales[:s].copy_(mine.scales)
    all_codes = torch.empty(P * out_codes.numel(), dtype=torch.uint8)
    all_scales = torch.empty(P * K, dtype=torch.float32)
    _all_gather_into_tensor(all_codes, out_codes, group)
    _all_gather_into_tensor(all_scales, out_scales, group)
    total = QuantizedPayload(all_codes[: q.code_bytes(n)], all_scales[: -(-n // q.bucket)])
    sent = payload.nbytes - c - 4 * s + (P - 1) * (out_codes.numel() + 4 * K)
    return total, sent


def _partition_buckets(q: QSGD, n: int, world_size: int) -> int:
    """K: buckets per partition, ⌈buckets / P⌉ rounded up to whole aligned units."""
    buckets, step = -(-n // q.bucket), world_size * q.unit()
    return -(-buckets // step) * q.unit()


def _all_gather_into_tensor(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    gather(out, inp, group=group)
