"""PowerSGD's exchange for a batch of tensors (Vogels, Karimireddy, Jaggi, NeurIPS 2019, arXiv 1905.13727,
Algorithm 1 "Rank-r PowerSGD compression"): two allreduces for the whole batch, one of every P, one of every Q.

For each matrix M (a tensor viewed as ``M = x.reshape(x.shape[0], -1)``, n x m) with its warm-start Q (m x r),
on every rank i (Algorithm 1):

1. ``P_i = M_i Q``; ``P = Σ_i P_i`` (the first allreduce: all the batch's Ps in one flat buffer);
2. ``P̂ = orthogonalize(P)`` (Gram-Schmidt, the same bits on every rank: every rank holds the same sum);
3. ``Q_i = M_i^T P̂``; ``Q = Σ_i Q_i`` (the second allreduce: all the batch's Qs in one flat buffer);
4. the sum over ranks is ``P̂ Q^T``, and ``Q`` is the next step's warm start.

A tensor sent whole (a vector, or a matrix too small to gain from factors) travels in the first allreduce beside
the Ps: two allreduces per batch in all, where torch's hook spends a third one on them.

What a rank's part stands for (Algorithm 2's ``DECOMPRESS(C(Δ_w))``) is ``P̂ Q_i^T``: linear in Q_i, so the
ranks' parts add up to the result exactly. Its error-feedback residual (``Exchanged.residual``) is
``x - P̂ Q_i^T``, taken in one pass over ``x`` (``addmm``) before the second allreduce sums the Q_i. (torch's hook
keeps ``x - P̂ Q^T / W`` instead; the residuals differ per rank but have the same sum, and the output depends on
the ranks' inputs only through their sum, so the two give the same results up to rounding.)

Nothing here reads or writes a compressor's state: ``powersgd.PowerSGD`` chooses Q and stores the new one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sparsync.collectives.comm import ring_allreduce_bytes


@dataclass(frozen=True, eq=False)
class Factor:
    """One tensor of a batch: ``x`` (dense, floating, in the work dtype) and, for a matrix sent as factors, its
    warm-start ``q`` (m x r, where m = x.numel() / x.shape[0]); ``q`` None: ``x`` is sent whole."""

    x: torch.Tensor
    q: torch.Tensor | None

    def matrix(self) -> torch.Tensor:
        return self.x.reshape(self.x.shape[0], -1)

    @property
    def q_numel(self) -> int:
        """Values this tensor adds to the second allreduce: m·r as factors, none whole."""
        return 0 if self.q is None else self.q.numel()

    @property
    def p_numel(self) -> int:
        """Values this tensor adds to the first allreduce: n·r as factors, numel whole."""
        return self.x.numel() if self.q is None else self.x.shape[0] * self.q.shape[1]

    @property
    def wire_numel(self) -> int:
        """Values this tensor adds to the two allreduces."""
        return self.p_numel + self.q_numel


@dataclass(frozen=True, eq=False)
class Exchanged:
    """One tensor's outcome: ``total`` (the sum over ranks divided by ``exchange``'s ``divisor``, ``x``'s shape),
    ``residual`` (``x`` minus what this rank's part stands for, ``x``'s shape; None unless asked for) and, for
    factors, ``p`` (P̂, n x r) and ``q`` (Σ Q_i, m x r: the next warm start)."""

    total: torch.Tensor
    residual: torch.Tensor | None
    p: torch.Tensor | None = None
    q: torch.Tensor | None = None


def payload_nbytes(items: Sequence[Factor]) -> int:
    """Bytes one rank puts into the two allreduces (the payload, as every compressor reports it)."""
    return sum(f.wire_numel * f.x.element_size() for f in items)


def traffic(items: Sequence[Factor], world_size: int) -> tuple[int, int, int]:
    """(values, bytes, messages) one rank puts on the wire in ``exchange`` of ``items``: the two ring allreduces
    (gloo's), the second only when some tensor goes as factors."""
    if not items:
        return 0, 0, 0
    esize = items[0].x.element_size()
    p, q = sum(f.p_numel for f in items), sum(f.q_numel for f in items)
    nbytes = sum(ring_allreduce_bytes(k * esize, world_size) for k in (p, q) if k)
    return p + q, nbytes, 2 * (world_size - 1) * (1 + (q > 0))


def exchange(
    items: Sequence[Factor],
    group: dist.ProcessGroup | None,
    *,
    residual: bool = False,
    divisor: int = 1,
    into: Sequence[torch.Tensor] | None = None,
) -> list[Exchanged]:
    """Algorithm 1 for every tensor of ``items`` at once, summed over ``group`` (None: this rank alone, no
    collective). ``residual``: also return each rank's error-feedback residual, ``x - P̂ Q_i^T`` (zero for a tensor
    sent whole). ``divisor``: each total is the sum divided by it (a factored one's Σ Q_i, m x r, is divided
    before its product with P̂, as torch's hook divides it). ``into``: one contiguous tensor per item, of its
    ``x``'s numel and dtype, that receives its total (it may share ``x``'s storage: ``x`` is last read before the
    totals are written); without it the totals are new tensors. Reads ``items``; writes only ``into``.

    Collective: every rank of ``group`` calls it with items of the same shapes, ranks and dtype, in the same
    order (the two allreduces are issued on this thread, in this order)."""
    if not items:
        return []
    pbuf = _ps(items)
    _sum(pbuf, group)
    pts = _split_ps(items, pbuf)
    orthogonalize_rows_([pt for f, pt in zip(items, pts, strict=True) if f.q is not None])
    qbuf, qts = _qs(items, pts)
    residuals = [_residual(f, pt, qt) if residual else None for f, pt, qt in zip(items, pts, qts, strict=True)]
    if qbuf is not None:
        _sum(qbuf, group)
    out: list[Exchanged] = []
    for i, (f, pt, qt, e) in enumerate(zip(items, pts, qts, residuals, strict=True)):
        target = None if into is None else into[i]
        if qt is None:
            out.append(Exchanged(_whole(pt, divisor, target).view(f.x.shape), e))
        else:
            out.append(Exchanged(_product(pt, qt, divisor, target).view(f.x.shape), e, pt.T, qt.T))
    return out


def _sum(buf: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(buf, group=group)


# Up to this rank, P̂ Q^T (and the residual's x - P̂ Q_i^T) is taken as r broadcast multiply-adds of column i of
# P̂ by row i of Q^T, one pass over the n x m output each: MKL's gemm with an inner dimension of 1 is no faster,
# with 2 several times slower on a wide output (docs/results_tta.md); above it, one gemm.
OUTER_RANK = 2


# The products take the tall matrix M (n x m, n >> r), or M^T, as their right operand and the r-row factor as
# their left, and P and Q travel transposed (r x n, r x m): P_i^T = Q^T M^T and Q_i^T = P̂^T M are then products
# that BLAS runs in one pass over M, where M^T P̂ with M^T as the left operand takes a slow path for a small r.
def _ps(items: Sequence[Factor]) -> torch.Tensor:
    """One flat buffer of every factored tensor's P_i^T = Q^T M^T (r x n) and every whole tensor's values, in
    ``items``' order (the first allreduce's)."""
    x0 = items[0].x
    pbuf = torch.empty(sum(f.p_numel for f in items), dtype=x0.dtype, device=x0.device)
    offset = 0
    for f in items:
        piece = pbuf[offset : offset + f.p_numel]
        offset += f.p_numel
        if f.q is None:
            piece.copy_(f.x.reshape(-1))
        else:
            torch.mm(f.q.T, f.matrix().T, out=piece.view(f.q.shape[1], f.x.shape[0]))
    return pbuf


def _split_ps(items: Sequence[Factor], pbuf: torch.Tensor) -> list[torch.Tensor]:
    """The summed P^Ts (r x n views of ``pbuf``) and whole tensors (flat views), in ``items``' order."""
    out: list[torch.Tensor] = []
    offset = 0
    for f in items:
        piece = pbuf[offset : offset + f.p_numel]
        offset += f.p_numel
        out.append(piece if f.q is None else piece.view(f.q.shape[1], f.x.shape[0]))
    return out


def _qs(
    items: Sequence[Factor], pts: Sequence[torch.Tensor]
) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """One flat buffer of every factored tensor's Q_i^T = P̂^T M (r x m; the second allreduce's), and its views
    (None for a tensor sent whole)."""
    total = sum(f.q_numel for f in items)
    if not total:
        return None, [None] * len(items)
    x0 = items[0].x
    qbuf = torch.empty(total, dtype=x0.dtype, device=x0.device)
    qts: list[torch.Tensor | None] = []
    offset = 0
    for f, pt in zip(items, pts, strict=True):
        if f.q is None:
            qts.append(None)
            continue
        qt = qbuf[offset : offset + f.q_numel].view(f.q.shape[1], f.q.shape[0])
        offset += f.q_numel
        qts.append(torch.mm(pt, f.matrix(), out=qt))
    return qbuf, qts


def _residual(f: Factor, pt: torch.Tensor, qt: torch.Tensor | None) -> torch.Tensor:
    """This rank's residual, a new tensor: ``x - P̂ Q_i^T`` (taken before Q's allreduce overwrites Q_i), zero for
    a tensor sent whole."""
    if qt is None:
        return torch.zeros_like(f.x)
    m = f.matrix()
    if pt.shape[0] > OUTER_RANK:
        e = m.clone(memory_format=torch.contiguous_format).addmm_(pt.T, qt, alpha=-1)
    else:
        e = torch.addcmul(m, pt[0, :, None], qt[0, None, :], value=-1)
        for i in range(1, pt.shape[0]):
            e.addcmul_(pt[i, :, None], qt[i, None, :], value=-1)
    return e.view(f.x.shape)


def _whole(summed: torch.Tensor, divisor: int, target: torch.Tensor | None) -> torch.Tensor:
    """A whole tensor's total: its sum (a view of the first allreduce's buffer) divided by ``divisor``."""
    if target is None:
        return summed if divisor == 1 else summed / divisor
    return target.copy_(summed) if divisor == 1 else torch.div(summed, divisor, out=target)


def _product(pt: torch.Tensor, qt: torch.Tensor, divisor: int, target: torch.Tensor | None) -> torch.Tensor:
    """A factored tensor's total, P̂ (Σ Q_i / divisor)^T (n x m)."""
    q = qt if divisor == 1 else qt / divisor
    n, m = pt.shape[1], qt.shape[1]
    out = torch.empty(n, m, dtype=qt.dtype, device=qt.device) if target is None else target.view(n, m)
    if pt.shape[0] > OUTER_RANK:
        return torch.mm(pt.T, q, out=out)
    torch.mul(pt[0, :, None], q[0, None, :], out=out)
    for i in range(1, pt.shape[0]):
        out.addcmul_(pt[i, :, None], q[i, None, :])
    return out


def orthogonalize_(ps: Sequence[torch.Tensor]) -> None:
    """Orthonormalize the columns of each n x r matrix of ``ps`` in place (Algorithm 1's orthogonalization, by
    Gram-Schmidt), matrices of one shape as one batch.

    Where the paper is silent: each column is projected out of the earlier ones twice ("twice is enough",
    Giraud et al. 2005), so that it comes out orthogonal to them to rounding even when it was nearly dependent on
    them; and a column left with at most sqrt(eps) of its norm (numerically in their span: a rank-1 gradient at
    r = 2, or a zero gradient) becomes zero. torch's hook normalizes whatever is left, rounding noise included
    (NaN for a zero column unless given an epsilon): such a column can point anywhere, even along an earlier
    one, and P̂ P̂^T M then overshoots M. Zero columns leave an approximation of fewer directions, and P̂ P̂^T
    a projection."""
    orthogonalize_rows_([p.T for p in ps])


def orthogonalize_rows_(pts: Sequence[torch.Tensor]) -> None:
    """``orthogonalize_`` of the transposes: the rows of each r x n matrix of ``pts``, in place."""
    groups: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for pt in pts:
        groups.setdefault(tuple(pt.shape), []).append(pt)
    for members in groups.values():
        if len(members) == 1:
            gram_schmidt_(members[0].unsqueeze(0))
            continue
        batch = torch.stack(members)
        gram_schmidt_(batch)
        for pt, done in zip(members, batch, strict=True):
            pt.copy_(done)


def gram_schmidt_(batch: torch.Tensor) -> None:
    """Gram-Schmidt with re-orthogonalization over the rows of each b x r x n matrix of ``batch``, in place;
    numerically dependent rows become zero (``orthogonalize_``)."""
    finfo = torch.finfo(batch.dtype)
    drop = finfo.eps**0.5
    for i in range(batch.shape[1]):
        row = batch[:, i : i + 1, :]
        before = row.norm(dim=2, keepdim=True)
        if i:
            done = batch[:, :i, :]
            for _ in range(2):
                row.sub_((row @ done.transpose(1, 2)) @ done)
        norm = row.norm(dim=2, keepdim=True)
        keep = norm > drop * before  # False for a zero row too (0 > 0)
        row.copy_(torch.where(keep, row / norm.clamp_min(finfo.tiny), torch.zeros_like(row)))
