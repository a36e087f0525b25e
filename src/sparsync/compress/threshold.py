"""``Threshold(ratio, lifespan=L)``: DCT-DP (DCT §2.1, Algorithm 1).

Every L-th call for a given name, τ is recomputed as the ceil(ratio·n)-th largest |g| (``kthvalue``: a
selection, O(n), instead of the paper's full sort); the calls in between reuse it, so they cost one comparison
pass. Mask |g| ≥ τ. Applied layer-wise: τ is kept per name (per parameter). With error feedback (memory),
g already includes the error, as in Alg. 1 line 2.

A reused τ is also recomputed, on the call itself, when it keeps more than ``slack``·k entries or fewer than
k/``slack`` (k = ceil(ratio·n)): the reuse assumes |g| is distributed alike from one call to the next, which error
feedback breaks. The residual grows after τ is set (at the first call it is zero), so the compensated
g + e grows too and a τ set at call 0 keeps ever more entries, until the sparse allreduce is denser, and
slower, than a dense one. ``slack=None`` reuses τ for the whole lifespan, as Alg. 1 does.

Choices the paper leaves open: the call counter starts at 0, so the first call always computes τ (Alg. 1
line 3, "L divides k"); τ = 0 (an all-zero tensor at a recompute) would select everything, so a zero τ selects
the non-zero entries only. Any τ > 0 gives a contraction (DCT §2.1, citing Stich et al. Def. 2.1) with
δ = (entries kept)/n.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from sparsync.compress import base
from sparsync.compress.sparsifier import Sparsifier
from sparsync.compress.topk import kth_smallest, largest

try:  # built by `pip install` (setup.py); optional: the torch pass is the fallback
    from sparsync.compress import _threshold_c as _native
except ImportError:  # pragma: no cover - only without a C compiler
    _native = None  # type: ignore[assignment]


@dataclass(frozen=True, eq=False)
class Threshold(Sparsifier):
    """Hard threshold with a threshold recomputed every ``lifespan`` calls per name."""

    name: ClassVar[str] = "threshold"
    accepts_sparse: ClassVar[bool] = True

    lifespan: int = 1000  # L: calls between recomputations of τ (per name); 1 = every call
    # a reused τ keeping more than slack·k or fewer than k/slack entries is recomputed (None: never, Alg. 1)
    slack: float | None = 2.0
    # the mask pass: "auto" (C where built, else torch), "c" (raise if not built), "torch"; the same positions
    kernels: str = "auto"
    # name -> [calls, τ, recomputations]
    _state: dict[str, list[Any]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()  # ratio: the paper's sparsity factor η, the fraction kept when τ is recomputed
        base.check_positive_int(self.lifespan, "lifespan")
        if self.slack is not None and (
            isinstance(self.slack, bool) or not isinstance(self.slack, int | float) or not self.slack >= 1.0
        ):
            raise ValueError(f"slack must be a number >= 1 or None, got {self.slack!r}")
        base.check_kernels("Threshold", self.kernels, _native is not None, "_threshold_c")

    def check_device(self, device: torch.device) -> None:
        base.native_for("Threshold", self.kernels, _native is not None, device)

    def threshold(self, name: str = "") -> float | None:
        """Current τ for ``name`` (None before its first call)."""
        st = self._state.get(name)
        return None if st is None else float(st[1])

    def recomputations(self, name: str = "") -> int:
        """How many times τ of ``name`` was computed (every L calls, and where ``slack`` asked)."""
        st = self._state.get(name)
        return 0 if st is None else int(st[2])

    def compress(self, tensor: torch.Tensor, ctx: base.Context = base.NO_CONTEXT) -> base.SparsePayload:
        values, indices = base.flat_values(tensor)
        native = base.native_for(
            "Threshold", self.kernels, _native is not None, values.device
        )  # raises before the state moves
        st = self._state.setdefault(ctx.name, [0, 0.0, 0])
        n = values.numel()
        k = base.count_for(self.ratio, n)
        fresh = st[0] % self.lifespan == 0 and n > 0
        if fresh:
            st[1], st[2] = kth_largest(values.abs(), k), st[2] + 1
        st[0] += 1
        pos = _mask_positions(values, st[1], native=native)
        if not fresh and self.slack is not None and n and not k / self.slack <= pos.numel() <= self.slack * k:
            st[1], st[2] = kth_largest(values.abs(), k), st[2] + 1
            pos = _mask_positions(values, st[1], native=native)
        return base.selected(values, indices, pos, tensor.numel(), presorted=True)

    def state_dict(self) -> dict[str, Any]:
        return {name: {"calls": st[0], "tau": st[1], "recomputations": st[2]} for name, st in self._state.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._state.clear()
        for name, st in state.items():
            self._state[name] = [int(st["calls"]), float(st["tau"]), int(st.get("recomputations", 0))]


def kth_largest(mag: torch.Tensor, k: int, by_topk: bool | None = None) -> float:
    """τ: the k-th largest of ``mag`` (1-D, ≥ 0), state of the host (checkpointed, compared), so one scalar
    read from the device per recompute. By default the smallest of topk's ``largest`` (a sampled threshold,
    then ``torch.topk`` of about 2k candidates), several times faster than ``kthvalue`` on the host
    (docs/results_tta.md) and on a GPU (docs/gpu.md); ``by_topk=False``: ``kthvalue``. The same value."""
    if by_topk is False:
        return float(kth_smallest(mag, mag.numel() - k + 1))
    return float(mag[largest(mag, k)].min())


CHUNK = 1 << 20  # entries per pass of the mask: |g|, the mask and its positions stay in cache


def _mask_positions(
    values: torch.Tensor, tau: float, native: bool = True, one_pass: bool | None = None
) -> torch.Tensor:
    """Sorted positions of |v| >= τ (|v| > 0 when τ = 0), one cache-sized chunk at a time: the calls between
    recomputations are this pass only, and on a large layer a whole-tensor |v| costs a 4-byte-per-entry
    temporary plus a second trip through memory (DCT §2.1: the compression overhead must stay small). In C
    (``_threshold_c.c``: one pass writing only the positions) where built, for float32 and float64 CPU tensors;
    off the host (``one_pass``) one whole-tensor pass, since each chunk's ``nonzero`` waits for a GPU;
    positions on ``values``' device."""
    n, device = values.numel(), values.device
    if (
        native
        and _native is not None
        and device.type == "cpu"
        and values.dtype in (torch.float32, torch.float64)
        and values.is_contiguous()
    ):
        return _native_positions(values, tau)
    if (device.type != "cpu") if one_pass is None else one_pass:
        mag = values.abs()
        return torch.nonzero(mag >= tau if tau > 0 else mag > 0, as_tuple=True)[0]
    buf = torch.empty(min(CHUNK, n), dtype=values.dtype, device=device)
    mask = torch.empty(min(CHUNK, n), dtype=torch.bool, device=device)
    parts = []
    for start in range(0, n, CHUNK):
        v = values[start : start + CHUNK]
        m = v.numel()
        torch.abs(v, out=buf[:m])
        if tau > 0:
            torch.ge(buf[:m], tau, out=mask[:m])
        else:
            torch.gt(buf[:m], 0, out=mask[:m])
        parts.append(torch.nonzero(mask[:m], as_tuple=True)[0] + start)
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64, device=device)


def _native_positions(values: torch.Tensor, tau: float) -> torch.Tensor:
    n = values.numel()
    assert _native is not None
    host = torch.device("cpu")  # the C pass writes host memory
    buf = torch.empty(min(CHUNK, n), dtype=torch.int64, device=host)
    parts = []
    dbl = int(values.dtype == torch.float64)
    item = values.element_size()
    for start in range(0, n, CHUNK):
        m = min(CHUNK, n - start)
        k = _native.select(values.data_ptr() + start * item, m, tau, start, buf.data_ptr(), dbl)
        parts.append(buf[:k].clone())
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64, device=host)
