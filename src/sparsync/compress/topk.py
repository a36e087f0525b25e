"""``TopK(ratio)``: the k = ceil(ratio·n) entries of largest magnitude; ``TopK(ratio, bucket=512)``: the
ceil(ratio·bucket) largest of every bucket of consecutive entries (SparCML §6.1, which selects "the biggest
elements in magnitude" per bucket of 512 so the selection parallelises; we select exactly, not randomised).

``TopK(ratio, warmup=W)``: Deep Gradient Compression's warm-up (Lin et al. 2018, §3.4): the fraction kept
starts at 25% and falls exponentially, 25%, 6.25%, 1.5625%, 0.39%, one stage per quarter of the first W calls
of each name, to ``ratio`` (never below it); the call count is kept per name and checkpointed.

``TopK(ratio, dense_below=N)``: a tensor of fewer than N entries (a bias, a norm's scale, a small head) is sent
whole, every entry kept, with nothing left to its residual; larger ones keep their top ``ratio``. Selection is
per tensor, so a small tensor would otherwise get as small a share of its entries as the largest one.

``TopK(ratio, scope="bucket")``: in ``compression_hook``, the top ``ratio`` of a DDP bucket's gradients at once,
as one vector (the hook's flat route; residuals still per parameter name), instead of per parameter; elsewhere
(``compressed_allreduce`` of one tensor) the same as ``scope="tensor"``.

A contraction in the sense of Stich et al. (2018) Def. 2.1, the property DCT §2.1 relies on:
‖x - topk(x)‖² ≤ (1 - k/n)‖x‖². Biased: use it with error feedback (or ``MomentumCorrection``, DGC).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from sparsync.compress import base
from sparsync.compress.sparsifier import Sparsifier


@dataclass(frozen=True, eq=False)
class TopK(Sparsifier):
    """Keep the largest-magnitude entries (of the stored entries, for a sparse COO input)."""

    name: ClassVar[str] = "topk"
    accepts_sparse: ClassVar[bool] = True

    bucket: int | None = None  # None: exact top-k over the whole tensor; else top ceil(ratio·bucket) per bucket
    warmup: int = 0  # DGC's warm-up: calls per name over which the kept fraction falls from 25% to ratio
    dense_below: int = 0  # tensors of fewer entries than this are sent whole (0: none)
    scope: str = "tensor"  # "tensor": the DDP hook selects per parameter; "bucket": over each bucket at once
    _calls: dict[str, int] = field(default_factory=dict, init=False, repr=False)  # name -> calls (warm-up)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bucket is not None:
            base.check_positive_int(self.bucket, "bucket")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be a non-negative int (calls), got {self.warmup!r}")
        if isinstance(self.dense_below, bool) or not isinstance(self.dense_below, int) or self.dense_below < 0:
            raise ValueError(f"dense_below must be a non-negative int (entries), got {self.dense_below!r}")
        if self.scope not in ("tensor", "bucket"):
            raise ValueError(f"scope must be 'tensor' or 'bucket', got {self.scope!r}")

    @property
    def per_tensor(self) -> bool:
        return self.scope == "tensor"

    def ratio_at(self, call: int) -> float:
        """The fraction kept at a name's ``call``-th call (from 0): DGC's exponential warm-up, then ``ratio``."""
        if call >= self.warmup:
            return self.ratio
        return max(self.ratio, 0.25 ** (1 + 4 * call // self.warmup))

    def compress(self, tensor: torch.Tensor, ctx: base.Context = base.NO_CONTEXT) -> base.SparsePayload:
        values, indices = base.flat_values(tensor)
        n = values.numel()
        if tensor.numel() < self.dense_below:  # sent whole: every stored entry
            return base.selected(values, indices, torch.arange(n, device=values.device), tensor.numel(),
                                 presorted=True)  # fmt: skip
        ratio = self.ratio
        if self.warmup:
            call = self._calls.get(ctx.name, 0)
            self._calls[ctx.name] = call + 1
            ratio = self.ratio_at(call)
        if self.bucket is None or n <= self.bucket:
            pos = largest(values.abs(), base.count_for(ratio, n))
        else:
            pos = _bucket_topk(values.abs(), self.bucket, base.count_for(ratio, self.bucket))
        return base.selected(values, indices, pos, tensor.numel())

    def state_dict(self) -> dict[str, Any]:
        return {name: {"calls": c} for name, c in self._calls.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state and not self.warmup:
            raise ValueError(f"TopK without warmup keeps no state, got keys {sorted(state)}")
        self._calls.clear()
        self._calls.update({name: int(st["calls"]) for name, st in state.items()})


SAMPLE = 1 << 16  # magnitudes sampled to pick the candidates' threshold (``largest``)


def largest(mag: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the k largest of ``mag`` (≥ 0, 1-D), unsorted: ``torch.topk``'s, found among candidates.

    ``torch.topk`` of a large k is slow on CPU (a heap over every value; docs/results_design.md). Instead: a
    threshold τ from a strided sample of SAMPLE magnitudes, at the sample's 1 - 2k/n quantile; the candidates
    |x| ≥ τ (one vectorized pass, about 2k of them); ``torch.topk`` of the candidates. Exact whenever there
    are at least k candidates, since then the k-th largest value is ≥ τ and every value above it is a
    candidate. A mostly-zero input (a dense embedding gradient: only the batch's rows are non-zero) puts τ at
    0: the candidates are then the non-zero values, and with fewer than k of them the answer is all of them
    and the first zeros (ties, which topk may pick in any order). Otherwise (an unlucky sample, or NaN, which
    compares false and which topk ranks first) the full ``torch.topk``."""
    n = mag.numel()
    if n < 4 * SAMPLE or 8 * k > n:  # small, or a large k: the heap is cheap enough
        return torch.topk(mag, k, sorted=False).indices
    sample = mag[:: n // SAMPLE]
    rank = max(1, int(sample.numel() * (1 - 2 * k / n)))  # kthvalue's k-th smallest: about 2k of n above it
    tau = kth_smallest(sample, rank)
    zero = bool(tau <= 0)
    cand = torch.nonzero(mag > 0 if zero else mag >= tau, as_tuple=True)[0]
    if not bool(torch.isfinite(mag.sum())):  # NaN: topk's order
        return torch.topk(mag, k, sorted=False).indices
    if zero and cand.numel() < k:
        need = k - cand.numel()  # zeros: the first ``need`` of them lie among the first need + nnz positions
        head = mag[: need + cand.numel()]
        return torch.cat([cand, torch.nonzero(head == 0, as_tuple=True)[0][:need]])
    if cand.numel() < k or cand.numel() > n // 4:
        return torch.topk(mag, k, sorted=False).indices
    return cand[torch.topk(mag[cand], k, sorted=False).indices]


def kth_smallest(t: torch.Tensor, rank: int, by_topk: bool | None = None) -> torch.Tensor:
    """The ``rank``-th smallest of ``t`` (1-D), a 0-d tensor on its device: ``kthvalue`` on the host, the
    smallest of ``topk`` elsewhere (``by_topk``; CUDA's ``kthvalue`` sorts; measured: docs/gpu.md)."""
    if not (t.device.type != "cpu" if by_topk is None else by_topk):
        return t.kthvalue(rank).values
    return torch.topk(t, t.numel() - rank + 1, sorted=False).values.min()


def _bucket_topk(mag: torch.Tensor, bucket: int, k: int) -> torch.Tensor:
    """Positions of the k largest of every bucket; the short last bucket is padded with -1 (never chosen
    before a real entry, since magnitudes are >= 0) and its padding positions dropped."""
    n = mag.numel()
    nb = -(-n // bucket)
    pad = nb * bucket - n
    m = torch.nn.functional.pad(mag, (0, pad), value=-1.0) if pad else mag
    top = torch.topk(m.reshape(nb, bucket), k, dim=1, sorted=False).indices
    pos = (top + torch.arange(nb, device=mag.device).unsqueeze(1) * bucket).reshape(-1)
    return pos[pos < n] if pad else pos
