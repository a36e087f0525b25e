"""``PowerSGD(rank=2)``: rank-r power iteration with warm start and error feedback (Vogels, Karimireddy, Jaggi,
"PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization", NeurIPS 2019, arXiv
1905.13727; Algorithm 1 "Rank-r PowerSGD compression", Algorithm 2 for the error feedback).

A gradient of two or more dimensions is viewed as an n x m matrix M (``x.reshape(x.shape[0], -1)``, as the
paper's code does for convolutions) and sent as two factors, P (n x r) and Q (m x r): two allreduces, P then Q,
and between them P is orthogonalized (``lowrank.exchange``). Q starts from the previous step's Q for the same
name (the paper's warm start: one power-iteration step per training step, reusing the last approximation, so
that over the steps it tracks the best rank-r approximation of the slowly changing gradient). A vector (one
dimension, such as a bias) is sent whole, as in the paper, and so is a matrix whose factors would not be
``min_compression_rate`` times smaller than it. Error feedback is the ``memory=`` axis, as for every compressor
here: the residual is ``x - P̂ Q_i^T``, what this rank's part of the approximation did not carry (the paper's
error feedback, Algorithm 2).

Choices where the paper is vague:

- **First Q.** Algorithm 1 draws Q from a standard normal distribution, the same on every rank (the Ps of the
  ranks must add up in one basis). Here it is drawn from a generator seeded by (``seed``, the tensor's name),
  so every rank draws the same Q with no communication, and DDP's bucket rebuild (which reorders buckets)
  changes nothing; ``initial_q`` gives it. Without ``warm_start`` a fresh Q is drawn at every call, seeded by
  the call's number too.
- **What is stored for the warm start**: the sum of the ranks' Q_i (torch's hook keeps the mean; the two only
  differ by a factor that the next orthogonalization removes), not orthogonalized.
- **Orthogonalization**: Gram-Schmidt with re-orthogonalization, on every rank on the same summed P (the same
  bits everywhere); a column numerically dependent on the earlier ones (a rank-1 gradient at r = 2, a zero
  gradient) becomes zero instead of normalized noise (``lowrank.orthogonalize_``).
- **Precision**: float64 tensors are factored in float64, all others (float32, float16, bfloat16) in float32,
  which is also what goes on the wire.
- **Warm-up** (``start_iter``, torch's ``start_powerSGD_iter``; not in the paper): the first ``start_iter`` calls
  of a name send the tensor whole (an exact mean), and leave a zero residual.

One ``compressed_allreduce`` of a matrix costs two allreduces behind one metadata round; the DDP hook sends a
bucket of PowerSGD gradients with two allreduces in all (``bucket_powersgd.py``). With ``async_op=True`` the
residual and the warm-start Q are stored when the call's ``Work`` completes (they need the summed P), not
before the call returns as for the other compressors: wait before the next call of the same name.
State: per name the call count and the warm-start Q, checkpointed by ``state_dict()`` (the residuals are the
memory's, checkpointed by ``ErrorFeedback.state_dict()``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from sparsync.compress import base
from sparsync.compress.aggregate import Result, collective, record
from sparsync.compress.lowrank import Exchanged, Factor, exchange, payload_nbytes, traffic
from sparsync.compress.memory import Memory


@dataclass(frozen=True)
class LowRankPayload(base.Payload):
    """A matrix as its two factors, ``p @ q.T`` (``p``: n x r with orthonormal columns, ``q``: m x r)."""

    p: torch.Tensor
    q: torch.Tensor

    @property
    def nbytes(self) -> int:
        return (self.p.numel() + self.q.numel()) * self.p.element_size()


@dataclass
class _Named:
    """One name's state: calls made, and the warm-start Q (None before its first factored call)."""

    calls: int = 0
    q: torch.Tensor | None = None


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor of ``dtype`` is factored and sent in: float64 stays, every other float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True, eq=False)
class PowerSGD(base.Compressor):
    """Rank-``rank`` PowerSGD (module doc)."""

    name: ClassVar[str] = "powersgd"

    rank: int = 1  # r: columns of P and Q (the paper uses 1 to 4; capped at min(n, m) per matrix)
    # a matrix goes as factors only if (n + m)·r·min_compression_rate < n·m (torch's hook: 2); else whole
    min_compression_rate: float = 1.0
    start_iter: int = 0  # the first start_iter calls of each name send it whole (torch's start_powerSGD_iter)
    warm_start: bool = True  # reuse each name's last Q (the paper's warm start); False: a fresh Q every call
    seed: int = 0  # seeds the first Q of each name (the same on every rank)
    _state: dict[str, _Named] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        base.check_positive_int(self.rank, "rank")
        rate = self.min_compression_rate
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not rate >= 0:
            raise ValueError(f"min_compression_rate must be a number >= 0, got {rate!r}")
        if isinstance(self.start_iter, bool) or not isinstance(self.start_iter, int) or self.start_iter < 0:
            raise ValueError(f"start_iter must be an int >= 0, got {self.start_iter!r}")
        if not isinstance(self.warm_start, bool):
            raise ValueError(f"warm_start must be True or False, got {self.warm_start!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")

    # --- the plan of one call ---------------------------------------------------------------------------------
    def factor_rank(self, shape: torch.Size | tuple[int, ...]) -> int | None:
        """The rank a tensor of ``shape`` is sent at, min(``rank``, n, m); None: sent whole (a vector, or too
        small to gain ``min_compression_rate`` from factors)."""
        if len(shape) < 2 or shape[0] == 0:
            return None
        n = shape[0]
        m = torch.Size(shape).numel() // n
        r = min(self.rank, n, m)
        return r if (n + m) * r * self.min_compression_rate < n * m else None

    def initial_q(self, name: str, m: int, r: int, *, draw: int = 0) -> torch.Tensor:
        """The first Q (m x r, float64, host) of ``name``: standard normal from a generator seeded by (``seed``,
        ``name``, ``draw``), the same on every rank, whatever the tensor's dtype (cast to it when used).
        ``draw``: the call's number without ``warm_start``, else 0."""
        key = hashlib.blake2b(f"{self.seed}/{name}/{draw}".encode(), digest_size=8).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)
        return torch.randn(m, r, generator=gen, dtype=torch.float64)

    def factor(self, name: str, x: torch.Tensor) -> Factor:
        """``x`` (dense) as this call sends it, with its Q; counts the call of ``name``. Reads ``x`` (converted to
        the work dtype, a view when it is already in it); mutates the state of ``name``."""
        st = self._state.setdefault(name, _Named())
        call = st.calls
        st.calls += 1
        xw = x.detach().to(work_dtype(x.dtype))
        r = self.factor_rank(x.shape) if call >= self.start_iter else None
        if r is None:
            return Factor(xw, None)
        m = x.numel() // x.shape[0]
        q = st.q if self.warm_start else None
        if q is None:
            q = self.initial_q(name, m, r, draw=0 if self.warm_start else call)
        elif tuple(q.shape) != (m, r):
            raise ValueError(
                f"PowerSGD: the warm-start Q of {name!r} is {tuple(q.shape)}, a tensor of shape {tuple(x.shape)} "
                f"needs ({m}, {r}): one name per tensor (pass name=)"
            )
        return Factor(xw, q.to(dtype=xw.dtype, device=xw.device))

    def settle(self, name: str, out: Exchanged) -> None:
        """Keep ``out``'s summed Q as the warm start of ``name`` (with ``warm_start``)."""
        if self.warm_start and out.q is not None:
            self._state[name].q = out.q

    def warm_q(self, name: str) -> torch.Tensor | None:
        """The Q the next factored call of ``name`` starts from (None: it draws ``initial_q``)."""
        st = self._state.get(name)
        return None if st is None else st.q

    # --- the Compressor interface ---------------------------------------------------------------------------
    def compress(self, tensor: torch.Tensor, ctx: base.Context = base.NO_CONTEXT) -> base.Payload:
        """This rank alone (Algorithm 1 at one worker): the factors of ``tensor``'s rank-r approximation, or the
        tensor whole. Advances the warm start of ``ctx.name``; does not modify ``tensor``."""
        f = self.factor(ctx.name, tensor)
        (out,) = exchange([f], None)
        self.settle(ctx.name, out)
        if out.p is None or out.q is None:
            return base.DensePayload(f.x)
        return LowRankPayload(out.p, out.q)

    def decompress(self, payload: Any, spec: base.TensorSpec) -> torch.Tensor:
        if isinstance(payload, LowRankPayload):
            return (payload.p @ payload.q.T).reshape(spec.shape).to(spec.dtype)
        if isinstance(payload, base.DensePayload):
            return payload.values.reshape(spec.shape).to(spec.dtype, copy=True)
        raise TypeError(f"PowerSGD decompresses LowRankPayload or DensePayload, got {type(payload).__name__}")

    def aggregator(self, enc: base.Encoding) -> base.Aggregator[Any]:
        """A fresh ``PowerSGDReduce`` per call: it carries the call's memory to the collective half."""
        del enc
        return PowerSGDReduce(self)

    def state_dict(self) -> dict[str, Any]:
        return {
            n: {"calls": st.calls, "q": None if st.q is None else st.q.clone()} for n, st in self._state.items()
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        loaded: dict[str, _Named] = {}
        for name, st in state.items():
            if not isinstance(st, dict) or not isinstance(st.get("calls"), int):
                raise ValueError(f"PowerSGD state of {name!r} must be a dict with an int 'calls', got {st!r}")
            q = st.get("q")
            if q is not None and not (isinstance(q, torch.Tensor) and q.dim() == 2):
                raise ValueError(f"PowerSGD state of {name!r}: 'q' must be None or a 2-D tensor, got {q!r}")
            loaded[str(name)] = _Named(st["calls"], None if q is None else q.clone())
        self._state.clear()
        self._state.update(loaded)


@dataclass(eq=False)
class PowerSGDReduce(base.Aggregator[LowRankPayload]):
    """One ``compressed_allreduce`` through PowerSGD: the metadata round, then ``lowrank.exchange`` of the one
    tensor (two allreduces), the residual and the warm start stored, the sum decoded (``call.finish``).

    Nothing is sent from the local half: the payload depends on the summed P, so ``compress`` returns None and
    ``feedback`` only keeps the memory for ``aggregate``, which updates it once P̂ is known."""

    name: ClassVar[str] = "powersgd"
    comp: PowerSGD
    memory: Memory | None = None

    def compress(self, enc: base.Encoding) -> LowRankPayload | None:
        del enc
        return None

    def feedback(self, enc: base.Encoding, payload: LowRankPayload | None, memory: Memory) -> torch.Tensor | None:
        del enc, payload
        self.memory = memory
        return None

    def aggregate(self, call: base.ReduceCall, payload: LowRankPayload | None) -> Result:
        del payload
        enc, memory, name = call.enc, self.memory, call.name
        x = enc.values
        if call.async_op and enc.x is enc.tensor:
            x = x.clone()  # the caller may reuse its tensor once the call returns
        f = self.comp.factor(name, x)
        P = call.world_size

        def run() -> torch.Tensor:
            (out,) = exchange([f], call.comm, residual=memory is not None)
            self.comp.settle(name, out)
            if memory is not None and out.residual is not None:
                memory.update_residual(name, x, out.residual.to(x.dtype))
            record(call, "powersgd", *traffic([f], P), device=x.device)
            return call.finish(out.total)

        return collective(call, "powersgd", payload_nbytes([f]), run)
