"""Which parameters are sparse, and how sparse (Parallax §2.2, §5).

Sparse parameters are the weights of sparsely read embeddings (``placement.embeddings``: Parallax's
IndexedSlices are PyTorch's sparse COO gradients) plus any parameter whose gradient is sparse.

α of a variable (§2.2) is the average, over steps, of the fraction of its elements one worker uses in a step;
for an embedding that is (unique rows in the step's input) / rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from sparsync.placement.embeddings import embedding_modules, rows_of_input


def sparse_param_names(model: nn.Module) -> list[str]:
    """Names of parameters with sparse gradients: sparse embeddings and embedding bags, plus any parameter
    whose current ``.grad`` is a sparse tensor (run a backward first to catch custom sparse ops)."""
    names = [n for n, _ in embedding_modules(model)]
    for n, p in model.named_parameters():
        if p.grad is not None and p.grad.is_sparse and n not in names:
            names.append(n)
    return names


@dataclass
class ParamStats:
    """What the plan needs about one parameter (recorded, or described for ``sparsync plan``)."""

    name: str
    shape: tuple[int, ...]
    row_fraction: float  # α (Parallax): fraction of the rows one worker touches per step (1 for dense)
    sparse: bool
    row_fraction_machine: float | None = None  # fraction touched by the union of one machine's workers
    itemsize: int = 4

    def __post_init__(self) -> None:
        if not 0.0 <= self.row_fraction <= 1.0:
            raise ValueError(f"row_fraction of {self.name!r} must lie in [0, 1], got {self.row_fraction}")
        if not self.shape or any(d < 1 for d in self.shape):
            raise ValueError(f"shape of {self.name!r} must be non-empty positive, got {self.shape}")

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


class RowFractionMeter:
    """Measures α (the fraction of rows touched per step) of each sparse parameter over warm-up steps: attach,
    run forward passes, read ``stats()``.

    Forward pre-hooks record the unique rows each embedding reads; call ``end_step()`` after each step.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._seen: dict[str, set[int]] = {}
        self._fractions: dict[str, list[float]] = {}
        self._handles = []
        for name, m in embedding_modules(model):
            self._seen[name] = set()
            self._fractions[name] = []
            self._handles.append(m.register_forward_pre_hook(self._hook(name)))

    def _hook(self, name: str):  # type: ignore[no-untyped-def]
        def hook(m: nn.Module, args: tuple[object, ...]) -> None:
            self._seen[name].update(rows_of_input(m, args).tolist())

        return hook

    def end_step(self) -> None:
        params = dict(self.model.named_parameters())
        for name, seen in self._seen.items():
            self._fractions[name].append(len(seen) / params[name].shape[0])
            seen.clear()

    def stats(self) -> list[ParamStats]:
        """One ParamStats per parameter: sparse ones with their mean α, dense ones with α = 1."""
        out = []
        for n, p in self.model.named_parameters():
            fr = self._fractions.get(n)
            if fr is not None:
                if not fr:
                    raise ValueError("RowFractionMeter saw no step: run forward passes and call end_step() first")
                out.append(ParamStats(n, tuple(p.shape), sum(fr) / len(fr), True))
            else:
                out.append(ParamStats(n, tuple(p.shape), 1.0, False))
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
