"""Placement kinds: the names a plan uses (``sparsync.plan``, Parallax §3.1) and the objects they stand for.
What each costs, the planner asks the kind itself (``sparsync.plan.kinds``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sparsync.compress.sketch import SparseSketch
from sparsync.placement.base import Placement
from sparsync.placement.collective import DenseAllreduce, SparseAllreduce
from sparsync.placement.sketch import Sketch

# dense allreduce, sparse allreduce (SparCML), sketch (S2), parameter server (Parallax)
KINDS = ("dense_allreduce", "sparse_allreduce", "sketch", "ps")


def resolve(
    params: Sequence[str],
    default: Mapping[str, str],
    given: Mapping[str, str | Placement] | None,
) -> dict[str, str | Placement]:
    """Every parameter's placement: ``default`` (a kind per parameter) overridden by ``given`` (a kind or a
    ``Placement`` object per parameter, naming any subset of ``params``).

    Raises KeyError naming unknown parameters or unknown kinds."""
    out: dict[str, str | Placement] = {n: default[n] for n in params}
    if not given:
        return out
    unknown = sorted(set(given) - set(params))
    if unknown:
        raise KeyError(f"placements name unknown parameters {unknown}; the model has {list(params)}")
    bad = {n: pl for n, pl in given.items() if not isinstance(pl, Placement) and pl not in KINDS}
    if bad:
        raise KeyError(f"unknown placements {bad}; valid: {', '.join(KINDS)} or a Placement object")
    out.update(given)
    return out


def kind_of(placement: str | Placement) -> str:
    return placement.kind if isinstance(placement, Placement) else placement


def objects(
    placed: Mapping[str, str | Placement],
    *,
    sketch: SparseSketch | None = None,
    sketch_error_feedback: bool = False,
    servers: Placement | None = None,
) -> dict[str, Placement]:
    """Placement objects for ``placed`` (a kind or an object per parameter): one shared object per kind (the
    sketch keeps one hash counter and one residual store for all its parameters), ``servers`` for ``ps``
    (parameters placed ``ps`` are left out when it is None), objects given as they are."""
    shared: dict[str, Placement] = {
        "dense_allreduce": DenseAllreduce(),
        "sparse_allreduce": SparseAllreduce(),
        "sketch": Sketch(sketch, error_feedback=sketch_error_feedback),
    }
    if servers is not None:
        shared["ps"] = servers
    given = {n: shared.get(pl) if isinstance(pl, str) else pl for n, pl in placed.items()}
    return {n: pl for n, pl in given.items() if pl is not None}
