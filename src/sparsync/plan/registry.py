"""The one registry of placement kinds (Parallax §3.1): the planner chooses among its kinds, ``sparsync plan``
accepts their names, and ``resolve`` and ``objects`` turn a kind per parameter into the placement objects that
``HybridTrainer`` and ``Plan.placements`` run. Each kind's record (``plan.kinds.PlacementKind``: name, lossy,
estimate, how to make it) sits in ``plan.kinds``; this module only collects. A kind from outside the package is
one ``KINDS.register`` (or, for a scope such as a test, ``with KINDS.registered(kind):``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sparsync.compress.sketch import SparseSketch
from sparsync.placement.base import Placement
from sparsync.plan.kinds import (
    DenseAllreduceKind,
    MakeOptions,
    ParameterServerKind,
    PlacementKind,
    ShardedKind,
    SketchKind,
    SparseAllreduceKind,
)
from sparsync.registry import Registry


class KindRegistry(Registry[PlacementKind]):
    """Placement kinds by name, in registration order: the order in which the planner breaks exact ties (the
    first wins) and lists an entry's candidates. ``register`` raises ValueError when a name is empty or taken;
    ``entry`` and ``unregister`` raise ``KeyError`` listing the valid names."""

    noun = "placement kind"


# Every placement kind of this process: dense allreduce (Table 3's ring), S2's sketch, SparCML's sparse
# allreduce, Parallax's parameter server, rows sharded over the ranks (chosen only where modules are swapped),
# in the planner's tie order; plus any a user registers.
KINDS = KindRegistry(
    (DenseAllreduceKind(), SketchKind(), SparseAllreduceKind(), ParameterServerKind(), ShardedKind())
)


def resolve(
    params: Sequence[str],
    default: Mapping[str, str],
    given: Mapping[str, str | Placement] | None,
) -> dict[str, str | Placement]:
    """Every parameter's placement: ``default`` (a kind per parameter) overridden by ``given`` (a kind of
    ``KINDS`` or a ``Placement`` object per parameter, naming any subset of ``params``).

    Raises KeyError naming unknown parameters or unknown kinds."""
    out: dict[str, str | Placement] = {n: default[n] for n in params}
    if not given:
        return out
    unknown = sorted(set(given) - set(params))
    if unknown:
        raise KeyError(f"placements name unknown parameters {unknown}; the model has {list(params)}")
    bad = {n: pl for n, pl in given.items() if not isinstance(pl, Placement) and pl not in KINDS}
    if bad:
        raise KeyError(f"unknown placements {bad}; valid: {', '.join(KINDS.names)} or a Placement object")
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
    """Placement objects for ``placed`` (a kind of ``KINDS`` or an object per parameter): one object per kind,
    shared by its parameters (``PlacementKind.make``), ``servers`` for ``ps`` (parameters placed ``ps`` are left
    out when it is None), objects given as they are.

    Raises KeyError naming a kind that is not registered."""
    options = MakeOptions(sketch, sketch_error_feedback, servers)
    made: dict[str, Placement | None] = {}
    out: dict[str, Placement] = {}
    for n, pl in placed.items():
        if isinstance(pl, str):
            if pl not in made:
                made[pl] = KINDS.entry(pl).make(options)
            obj = made[pl]
        else:
            obj = pl
        if obj is not None:
            out[n] = obj
    return out
