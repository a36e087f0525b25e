"""The error-feedback axis: residuals keyed by parameter name.

``Memory`` is its interface, ``ErrorFeedback`` the implementation. ``compressed_allreduce`` uses it as
``x = compensate(name, g)`` before compressing and ``update(name, x, local)`` after, where
``local = decompress(compress(x))`` on this rank, so that the invariant
``g + e_old == decompress(compress(g + e_old)) + e_new`` holds exactly (Stich et al. 2018; DCT Alg. 1 lines 2
and 11). Checkpoint it with ``state_dict()`` / ``load_state_dict()`` like an optimizer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class Memory(ABC):
    """The error-feedback interface (GRACE's memory): what ``compressed_allreduce`` and the parameter server's
    pushes call around a compression (``aggregate.encode``). ``ErrorFeedback`` is the one implementation here."""

    @abstractmethod
    def compensate(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` plus what the memory holds for ``name``: what gets compressed. Does not modify ``tensor``."""

    @abstractmethod
    def update(self, name: str, compensated: torch.Tensor, transmitted: torch.Tensor) -> None:
        """Remember what was not sent: ``compensated`` minus ``transmitted`` (what this rank's payload stands for).
        Mutates the memory of ``name``."""

    def update_residual(self, name: str, compensated: torch.Tensor, residual: torch.Tensor) -> None:
        """``update`` for a caller that has the residual ``compensated - transmitted`` already (PowerSGD's, taken
        in one pass); ``residual`` (dense) is the memory's from then on. This default rebuilds the transmitted
        tensor."""
        self.update(name, compensated, compensated - residual)

    def update_selected(
        self, name: str, compensated: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, *, owned: bool
    ) -> None:
        """``update`` for a transmitted tensor that is zero but ``values`` at the flat ``indices`` (a sparsifier's
        payload). This default builds that tensor; ``owned``: ``compensated`` is no one else's (a hint)."""
        del owned
        flat = torch.zeros(compensated.numel(), dtype=compensated.dtype, device=compensated.device)
        flat[indices.to(torch.int64)] = values.to(flat.dtype)
        self.update(name, compensated, flat.view(compensated.shape))


def difference(compensated: torch.Tensor, transmitted: torch.Tensor) -> torch.Tensor:
    """``compensated - transmitted``, dense and detached: a residual."""
    c = compensated.to_dense() if compensated.is_sparse else compensated
    t = transmitted.to_dense() if transmitted.is_sparse else transmitted
    return (c - t).detach()


def without_selected(
    compensated: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, *, owned: bool
) -> torch.Tensor:
    """``compensated`` with ``values`` taken out at the flat ``indices`` (unique), bit for bit
    ``difference(compensated, t)`` for the t that is zero elsewhere (c - 0 is c). ``owned``: ``compensated`` is
    no one else's and is written in place (if contiguous); otherwise it is copied first. Dense only."""
    c = compensated.detach()
    e = c if owned and c.is_contiguous() else c.clone(memory_format=torch.contiguous_format)
    flat = e.view(-1)
    idx = indices.to(torch.int64)
    flat[idx] = flat[idx] - values.to(e.dtype)
    return e


class SlicedMemory(Memory):
    """``memory`` seen through a flat concatenation: the one tensor it is given (a DDP bucket's buffer, whatever
    its name) is ``parts`` (name, shape) laid end to end, and each part's residual is kept in ``memory`` under
    its own name and shape, as a call per tensor keeps it (so the residuals outlive a change of the buckets)."""

    def __init__(self, memory: Memory, parts: list[tuple[str, torch.Size]]) -> None:
        self.memory = memory
        self.parts = parts

    def _split(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        flat = (tensor.to_dense() if tensor.is_sparse else tensor).reshape(-1)
        pieces = torch.split(flat, [s.numel() for _, s in self.parts])
        return [p.view(s) for p, (_, s) in zip(pieces, self.parts, strict=True)]

    def compensate(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The concatenation of each part compensated under its name (a new tensor, ``tensor``'s flat shape)."""
        del name
        pieces = self._split(tensor)
        return torch.cat(
            [self.memory.compensate(n, p).reshape(-1) for (n, _), p in zip(self.parts, pieces, strict=True)]
        )

    def update(self, name: str, compensated: torch.Tensor, transmitted: torch.Tensor) -> None:
        """Each part's ``update`` under its name. Mutates ``memory``."""
        del name
        for (n, _), c, t in zip(self.parts, self._split(compensated), self._split(transmitted), strict=True):
            self.memory.update(n, c, t)


class ErrorFeedback(Memory):
    """Per-name residual memory. ``decay`` scales the residual before it is added back (1.0: plain EF)."""

    def __init__(self, decay: float = 1.0) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"decay must lie in [0, 1], got {decay!r}")
        self.decay = decay
        self._errors: dict[str, torch.Tensor] = {}

    def compensate(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor + decay·e[name]`` (a new tensor; ``tensor`` is not modified). A sparse ``tensor`` with a
        stored residual comes back dense, since the residual is dense."""
        e = self._errors.get(name)
        if e is None:
            return tensor
        if e.shape != tensor.shape:
            raise ValueError(
                f"error-feedback residual for {name!r} has shape {tuple(e.shape)}, the tensor has "
                f"{tuple(tensor.shape)}: one name per tensor"
            )
        base = tensor.to_dense() if tensor.is_sparse else tensor
        return base + e if self.decay == 1.0 else base + self.decay * e

    def update(self, name: str, compensated: torch.Tensor, transmitted: torch.Tensor) -> None:
        """Store ``e[name] = compensated - transmitted`` (dense)."""
        self._errors[name] = difference(compensated, transmitted)

    def update_residual(self, name: str, compensated: torch.Tensor, residual: torch.Tensor) -> None:
        """Store ``e[name] = residual``, the given ``compensated - transmitted``."""
        del compensated
        self._errors[name] = residual.detach()

    def update_selected(
        self, name: str, compensated: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, *, owned: bool
    ) -> None:
        """``update(name, compensated, t)`` for a ``t`` that is zero but ``values`` at the flat ``indices``
        (unique; a sparsifier's payload), without building t: e = compensated, then e[indices] -= values,
        bit for bit the residual ``update`` stores (c - 0 is c). ``owned``: ``compensated`` is a tensor no one
        else holds, which becomes the residual, written in place (if contiguous); otherwise it is copied first.
        Dense ``compensated`` only."""
        if compensated.is_sparse:
            raise ValueError("update_selected needs a dense compensated tensor; use update")
        self._errors[name] = without_selected(compensated, indices, values, owned=owned)

    def error(self, name: str) -> torch.Tensor | None:
        return self._errors.get(name)

    def reset(self, name: str | None = None) -> None:
        """Forget one name's residual, or all."""
        if name is None:
            self._errors.clear()
        else:
            self._errors.pop(name, None)

    def names(self) -> list[str]:
        return sorted(self._errors)

    def state_dict(self) -> dict[str, object]:
        return {"decay": self.decay, "errors": _cloned(self._errors)}

    def load_state_dict(self, state: dict[str, object]) -> None:
        errors = _tensors(state, "errors")
        self.decay = _number(state, "decay", 1.0)
        self._errors = errors


class MomentumCorrection(Memory):
    """Deep Gradient Compression's local accumulation (Lin et al., ICLR 2018, §3.2 and Alg. 1 lines 11-17):
    momentum correction and momentum factor masking, for a sparsifier.

    Per name, a velocity u and an accumulator v: ``compensate`` computes u = m·u + g and returns v + u, what
    the sparsifier selects from; ``update`` keeps the unsent part as v and zeroes u where something was sent
    (the masking: a stale momentum would keep pushing a coordinate already applied). Sparsifying the
    accumulated velocity instead of the gradient is what makes top-k behave like momentum SGD; the optimizer
    must then step without momentum of its own (plain SGD on the aggregated velocities). With ``momentum=0``
    this is ``ErrorFeedback``.
    """

    def __init__(self, momentum: float = 0.9) -> None:
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must lie in [0, 1), got {momentum!r}")
        self.momentum = momentum
        self._velocity: dict[str, torch.Tensor] = {}
        self._errors: dict[str, torch.Tensor] = {}

    def compensate(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Mutates the velocity of ``name`` (u = m·u + g); returns v + u, a new tensor."""
        g = (tensor.to_dense() if tensor.is_sparse else tensor).detach()
        u = self._velocity.get(name)
        if u is not None and u.shape != g.shape:
            raise ValueError(
                f"momentum-correction velocity for {name!r} has shape {tuple(u.shape)}, the tensor has "
                f"{tuple(g.shape)}: one name per tensor"
            )
        u = g.clone(memory_format=torch.contiguous_format) if u is None else u.mul_(self.momentum).add_(g)
        self._velocity[name] = u
        v = self._errors.get(name)
        return u.clone() if v is None else v + u

    def update(self, name: str, compensated: torch.Tensor, transmitted: torch.Tensor) -> None:
        """v = compensated - transmitted; u = 0 where ``transmitted`` is non-zero."""
        self._errors[name] = difference(compensated, transmitted)
        u = self._velocity.get(name)
        if u is not None:
            u.masked_fill_((transmitted.to_dense() if transmitted.is_sparse else transmitted) != 0, 0.0)

    def update_selected(
        self, name: str, compensated: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, *, owned: bool
    ) -> None:
        """``update`` for a payload of ``values`` at the flat ``indices``: v = compensated, v[indices] -= values
        (in place when ``owned``), u[indices] = 0."""
        self._errors[name] = without_selected(compensated, indices, values, owned=owned)
        u = self._velocity.get(name)
        if u is not None:
            u.view(-1)[indices.to(torch.int64)] = 0.0

    def error(self, name: str) -> torch.Tensor | None:
        return self._errors.get(name)

    def velocity(self, name: str) -> torch.Tensor | None:
        return self._velocity.get(name)

    def state_dict(self) -> dict[str, object]:
        return {
            "momentum": self.momentum,
            "errors": _cloned(self._errors),
            "velocity": _cloned(self._velocity),
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        errors, velocity = _tensors(state, "errors"), _tensors(state, "velocity")
        self.momentum = _number(state, "momentum", 0.9)
        self._errors, self._velocity = errors, velocity


def _cloned(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {str(k): v.clone() for k, v in tensors.items()}


def _tensors(state: dict[str, object], key: str) -> dict[str, torch.Tensor]:
    """A copy of the name -> tensor dict ``state[key]``; ValueError naming the keys when there is none."""
    got = state.get(key)
    if not isinstance(got, dict):
        raise ValueError(f"state has no {key!r} dict (keys: {sorted(state)})")
    return _cloned(got)


def _number(state: dict[str, object], key: str, default: float) -> float:
    got = state.get(key, default)
    if isinstance(got, bool) or not isinstance(got, float | int):
        raise ValueError(f"bad {key} in state: {got!r}")
    return float(got)
