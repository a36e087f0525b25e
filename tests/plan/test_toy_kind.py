"""A placement kind added from outside the package with one entry: a ``PlacementKind`` (name, estimate, how to
make it) registered in ``KINDS``, which the planner then chooses, ``sparsync plan`` accepts, and ``objects``,
``resolve`` and ``Plan.placements`` make, as the built-in kinds; and gone again when unregistered."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparsync.compress.sketch import SparseSketch
from sparsync.placement import DenseAllreduce, Placement
from sparsync.plan import (
    KINDS,
    Cluster,
    Estimate,
    MakeOptions,
    ParamStats,
    PlacementKind,
    make_plan,
    objects,
    resolve,
)
from sparsync_bench.cli import main


class Pigeon(DenseAllreduce):
    """The placement object: the pigeons carry a dense allreduce."""

    kind = "pigeon"


class PigeonKind(PlacementKind):
    """The one entry: any sparse parameter for one byte and no time."""

    name = "pigeon"

    def estimate(self, s: ParamStats, c: Cluster, *, sketch: SparseSketch) -> Estimate | None:
        return Estimate(1.0, 0.0, "by air") if s.sparse else None

    def make(self, options: MakeOptions) -> Placement:
        return Pigeon()


STATS = [ParamStats("emb", (10_000, 16), 0.01, True), ParamStats("fc", (64, 64), 1.0, False)]


def test_a_registered_kind_is_planned_and_made() -> None:
    with KINDS.registered(PigeonKind()):
        plan = make_plan(STATS, Cluster(4, 1, 1.25e8, 1e-4))  # no kinds=: the registry's
        assert plan.kinds == {"emb": "pigeon", "fc": "dense_allreduce"}
        assert plan.entries[0].detail == "by air"
        made = plan.placements()
        assert isinstance(made["emb"], Pigeon) and {n: o.kind for n, o in made.items()} == plan.kinds
        two = objects({"a": "pigeon", "b": "pigeon", "c": "sketch"})
        assert two["a"] is two["b"] and isinstance(two["a"], Pigeon)  # one object per kind, as the built-ins
        assert resolve(["emb", "fc"], {"emb": "ps", "fc": "dense_allreduce"}, {"emb": "pigeon"})["emb"] == "pigeon"
        with pytest.raises(ValueError, match="'pigeon' is empty or taken"):
            KINDS.register(PigeonKind())
    assert "pigeon" not in KINDS and "pigeon" not in make_plan(STATS, Cluster(4)).kinds.values()
    with pytest.raises(KeyError, match="unknown placement kind 'pigeon'; valid: dense_allreduce, sketch"):
        objects({"a": "pigeon"})
    with pytest.raises(KeyError, match="'pigeon'"):
        resolve(["emb"], {"emb": "ps"}, {"emb": "pigeon"})
    with pytest.raises(KeyError, match="unknown placement 'pigeon'"):
        make_plan(STATS, Cluster(4), overrides={"emb": "pigeon"})


def test_the_plan_cli_accepts_a_registered_kind(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps([{"name": "t", "shape": [50_000, 32], "row_fraction": 0.001, "sparse": True}]))
    out = tmp_path / "plans.json"
    argv = ["plan", "--stats", str(stats), "--machines", "16", "--override", "t=pigeon", "--json", str(out)]
    with KINDS.registered(PigeonKind()):
        assert main(argv) == 0
    assert "pigeon" in capsys.readouterr().out
    entry = json.loads(out.read_text())[0]["entries"][0]
    assert entry["placement"] == "pigeon" and entry["overridden"] and entry["detail"] == "by air"
    with pytest.raises(SystemExit):
        main(argv)
    assert "PLACEMENT in dense_allreduce, sketch, sparse_allreduce, ps," in capsys.readouterr().err
