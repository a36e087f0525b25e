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

What a rank's part stands for (``Exchanged.local``, the error-feedback residual's subtrahend, Algorithm 2's
``DECOMPRESS(C(Δ_w))``) is ``P̂ Q_i^T``: linear in Q_i, so the ranks' parts add up to the result exactly, and
``x = local + residual`` holds on every rank. (torch's hook keeps ``x - P̂ Q^T / W`` instead; the residuals
differ per rank but have the same sum, and the output depends on the ranks' inputs only through their sum, so
the two give the same results up to rounding.)

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
    """One tensor's outcome: ``total`` (the sum over ranks, ``x``'s shape), ``local`` (what this rank's part
    stands for, ``x``'s shape; None unless asked for) and, for factors, ``p`` (P̂, n x r) and ``q`` (Σ Q_i,
    m x r: the next warm start)."""

    total: torch.Tensor
    local: torch.Tensor | None
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


def exchange(items: Sequence[Factor], group: dist.ProcessGroup | None, *, local: bool = False) -> list[Exchanged]:
    """Algorithm 1 for every tensor of ``items`` at once, summed over ``group`` (None: this rank alone, no
    collective). ``local``: also return what each rank's part stands for (``P̂ Q_i^T``; ``x`` for a tensor sent
    whole), for error feedback. Reads ``items``; writes nothing of theirs.

    Collective: every rank of ``group`` calls it with items of the same shapes, ranks and dtype, in the same
    order (the two allreduces are issued on this thread, in this order)."""
    if not items:
        return []
    pbuf = torch.cat([(f.x if f.q is None else f.matrix() @ f.q).reshape(-1) for f in items])
    _sum(pbuf, group)
    ps, wholes = _split_ps(items, pbuf)
    orthogonalize_([p for p in ps if p is not None])
    qs = [None if p is None else f.matrix().T @ p for f, p in zip(items, ps, strict=True)]
    mine = [_local(f, p, q) if local else None for f, p, q in zip(items, ps, qs, strict=True)]
    sent = [q for q in qs if q is not None]
    qbuf = torch.cat([q.reshape(-1) for q in sent]) if sent else None
    if qbuf is not None:
        _sum(qbuf, group)
    out: list[Exchanged] = []
    offset = 0
    for f, p, w, m in zip(items, ps, wholes, mine, strict=True):
        if p is None:
            assert w is not None
            out.append(Exchanged(w.view(f.x.shape), m))
            continue
        assert qbuf is not None and f.q is not None
        q = qbuf[offset : offset + f.q.numel()].view(f.q.shape)
        offset += f.q.numel()
        out.append(Exchanged((p @ q.T).view(f.x.shape), m, p, q))
    return out


def _sum(buf: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(buf, group=group)


def _split_ps(
    items: Sequence[Factor], pbuf: torch.Tensor
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """The summed Ps (n x r views of ``pbuf``) and whole tensors (flat views), in ``items``' order."""
    ps: list[torch.Tensor | None] = []
    wholes: list[torch.Tensor | None] = []
    offset = 0
    for f in items:
        k = f.p_numel
        piece = pbuf[offset : offset + k]
        offset += k
        if f.q is None:
            ps.append(None)
            wholes.append(piece)
        else:
            ps.append(piece.view(f.x.shape[0], f.q.shape[1]))
            wholes.append(None)
    return ps, wholes


def _local(f: Factor, p: torch.Tensor | None, q: torch.Tensor | None) -> torch.Tensor:
    """This rank's part: ``P̂ Q_i^T`` for factors (before Q's allreduce), ``x`` itself for a tensor sent whole."""
    if p is None or q is None:
        return f.x
    return (p @ q.T).view(f.x.shape)


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
    groups: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for p in ps:
        groups.setdefault(tuple(p.shape), []).append(p)
    for members in groups.values():
        if len(members) == 1:
            gram_schmidt_(members[0].unsqueeze(0))
            continue
        batch = torch.stack(members)
        gram_schmidt_(batch)
        for p, done in zip(members, batch, strict=True):
            p.copy_(done)


def gram_schmidt_(batch: torch.Tensor) -> None:
    """Gram-Schmidt with re-orthogonalization over the columns of each b x n x r matrix of ``batch``, in place;
    numerically dependent columns become zero (``orthogonalize_``)."""
    finfo = torch.finfo(batch.dtype)
    drop = finfo.eps**0.5
    for i in range(batch.shape[2]):
        col = batch[:, :, i : i + 1]
        before = col.norm(dim=1, keepdim=True)
        if i:
            done = batch[:, :, :i]
            for _ in range(2):
                col.sub_(done @ (done.transpose(1, 2) @ col))
        norm = col.norm(dim=1, keepdim=True)
        keep = norm > drop * before  # False for a zero column too (0 > 0)
        col.copy_(torch.where(keep, col / norm.clamp_min(finfo.tiny), torch.zeros_like(col)))
