"""The one schema of metadata rows (collectives/row.py): a row is named columns, each saying how the ranks must
agree on it and how a disagreement on it is described, and every reader (the sparse collectives' round,
compressed_allreduce's, the replicator's primitives', the sharded lookup's header rows, the flight recorder's
labels) goes through it. Unit tests on hand-made tables, then two ranks of a real gloo group that disagree on a
column and get an error naming it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import _row_schema_workers as rw
import pytest
import torch

from sparsync import launch
from sparsync.collectives import row
from sparsync.collectives.meta import SPARSE_ROW, NonFiniteError
from sparsync.collectives.ops import op_name, register_op
from sparsync.collectives.row import Agree, Column, Facts, Schema
from sparsync.compress.aggregate import REDUCE_ROW
from sparsync.replicator.primitives import PRIMITIVE_ROW
from sparsync.sharding.ids import HEADER

COLORS = ("red", "green", "blue")


def _hole(d: row.Disagreement) -> BaseException:
    return ValueError(f"rank {d.rank} has a hole at {d.value()}")


TOY = row.meta_row(
    Column("color", Agree.SAME, "paint", show=COLORS.__getitem__),
    Column("size", Agree.OWN),
    Column(
        "hole", Agree.UNSET, default=-1, describe=lambda d: ValueError(f"rank {d.rank} has a hole at {d.value()}")
    ),
)
TOY_OP = row.register_row("test_row_schema.toy", TOY)


def table(*rows: torch.Tensor) -> torch.Tensor:
    """A round's table as allgather_rows returns it: every row WIDTH words, zero-padded."""
    out = torch.zeros(len(rows), row.WIDTH, dtype=torch.int64)
    for r, words in enumerate(rows):
        out[r, : words.numel()] = words
    return out


def toy(**values: int) -> torch.Tensor:
    return TOY.pack(**{"seq": 1, "op": TOY_OP, **values})


def test_a_disagreement_is_described_by_the_column_name() -> None:
    t = table(toy(color=0, size=3), toy(color=0, size=5), toy(color=2, size=3))
    with pytest.raises(ValueError, match=r"^paint mismatch across ranks: rank 0 has color=red, rank 2 has "
                       r"color=blue \(seen on rank 1\)$"):  # fmt: skip
        TOY.check(t, Facts(me=1))
    assert TOY.check(table(toy(color=1, size=3), toy(color=1, size=9)), Facts(me=0)) == [
        toy(color=1, size=3).tolist(),
        toy(color=1, size=9).tolist(),
    ]  # OWN columns differ freely; the rows come back as lists


def test_columns_are_checked_in_order_frame_first() -> None:
    # op before call number before the layout's own columns; a refusal before everything
    t = table(toy(color=0, seq=1), TOY.pack(seq=2, op=register_op("test_row_schema.other"), color=1))
    with pytest.raises(ValueError, match=r"^collective mismatch across ranks: rank 0 has op=test_row_schema.toy, "
                       r"rank 1 has op=test_row_schema.other"):  # fmt: skip
        TOY.check(t, Facts(me=0))
    t = table(toy(color=0, seq=1), toy(color=1, seq=2, hole=4))
    with pytest.raises(ValueError, match=r"^call number mismatch .* has seq=1, .* has seq=2"):
        TOY.check(t, Facts(me=0))
    with pytest.raises(ValueError, match=r"^rank 1 has a hole at 4$"):
        TOY.check(table(toy(color=0), toy(color=0, hole=4)), Facts(me=0))
    refusal = row.HEAD.pack(seq=1, op=TOY_OP, refused=1)
    blocks = [torch.empty(0, dtype=torch.uint8), torch.frombuffer(bytearray(b"TypeError: no"), dtype=torch.uint8)]
    with pytest.raises(TypeError, match=r"^rank 1 refused its input: TypeError: no \(seen on rank 0\)$"):
        TOY.check(table(toy(color=0), refusal), Facts(me=0, blocks=blocks))


def test_pack_names_every_column_and_rejects_unknown_ones() -> None:
    words = toy(color=2)
    assert words.dtype == torch.int64 and words.numel() == len(TOY) == len(row.FRAME) + 3
    assert words[TOY.index("color")] == 2 and words[TOY.index("hole")] == -1 and words[row.INLINE] == -1
    with pytest.raises(KeyError, match=r"no column \['colour'\] in this row; its columns: refused, op, seq"):
        TOY.pack(colour=1)
    with pytest.raises(KeyError, match=r"no column 'weight'"):
        TOY.index("weight")
    with pytest.raises(ValueError, match="names a column twice"):
        Schema((Column("a", Agree.SAME), Column("a", Agree.OWN)))
    with pytest.raises(ValueError, match=f"at most {row.WIDTH} columns"):
        row.meta_row(*(Column(f"c{i}", Agree.OWN) for i in range(row.WIDTH)))


def test_every_layout_starts_with_the_frame_and_fits_the_wire() -> None:
    """A rank reads another op's row through its own layout: the frame's columns sit at the same positions in
    every layout, so a mismatch of ops is reported before any column of the op's own is read."""
    for schema in (SPARSE_ROW, REDUCE_ROW, PRIMITIVE_ROW, TOY):
        assert schema.columns[: len(row.FRAME)] == row.FRAME
        assert len(schema) <= row.WIDTH
    assert len(SPARSE_ROW) == row.WIDTH  # the widest layout fills the row: nothing added to the wire
    sparse = SPARSE_ROW.pack(seq=3, op=register_op("sparse_allreduce"), dim=8)
    reduce = REDUCE_ROW.pack(seq=3, op=register_op("reduce"), nbytes=8)
    with pytest.raises(ValueError, match=r"^reduce: collective mismatch across ranks: rank 1 differs from rank 0"):
        REDUCE_ROW.check(table(reduce, sparse), Facts(me=0))
    with pytest.raises(ValueError, match=r"^collective mismatch across ranks: rank 0 has op=sparse_allreduce, "
                       r"rank 1 has op=reduce"):  # fmt: skip
        SPARSE_ROW.check(table(sparse, reduce), Facts(me=1))


def test_the_sparse_row_describes_its_columns() -> None:
    base = {"seq": 1, "op": register_op("sparse_allreduce"), "dim": 8, "row": 1, "nan": -1, "bad": -1}
    f32, f64 = (SPARSE_ROW.pack(**base, dtype=i) for i in (0, 1))
    want = r"^dtype mismatch across ranks: rank 0 has dtype=torch\.\w+, rank 1 has dtype=torch\.\w+ \(seen on "
    with pytest.raises(ValueError, match=want + r"rank 0\); every rank must issue the same collectives"):
        SPARSE_ROW.check(table(f32, f64), Facts(me=0))
    nan = SPARSE_ROW.pack(**{**base, "nan": 5}, nonfinite=3)
    with pytest.raises(NonFiniteError, match=r"^rank 1 contributed -Inf \(at vector index 5\)"):
        SPARSE_ROW.check(table(f32, nan), Facts(me=0))
    shape = {"shape_key": 7, "ndim": 2, "s0": 5, "s1": 2}
    a, b = SPARSE_ROW.pack(**base, **shape), SPARSE_ROW.pack(**base, **{**shape, "shape_key": 9, "s0": 2, "s1": 5})
    with pytest.raises(ValueError, match=r"^shape mismatch across ranks: rank 0 passed shape \(5, 2\), rank 1 "
                       r"shape \(2, 5\)"):  # fmt: skip
        SPARSE_ROW.check(table(a, b), Facts(me=1))
    named = [SPARSE_ROW.pack(**base, name_key=k) for k in (11, 13)]
    with pytest.raises(
        ValueError, match=r"^call name mismatch across replicas: replica 1's call is not replica 0's"
    ):
        SPARSE_ROW.check(table(*named), Facts(me=0, who="replica", name="x"))


def test_the_flight_recorder_labels_rows_by_their_layout() -> None:
    words = toy(color=1, size=4).tolist() + [0] * (row.WIDTH - len(TOY))
    assert row.label(words) == {"refused": 0, "op": TOY_OP, "seq": 1, "inline": -1, "color": 1, "size": 4,
                                "hole": -1}  # fmt: skip
    assert op_name(TOY_OP) == "test_row_schema.toy"
    unlabelled = [0, register_op("test_row_schema.bare"), 1]
    assert row.label(unlabelled) == unlabelled  # an op that registered no layout: the bare words


def test_the_sharded_lookup_header_is_a_schema_too() -> None:
    assert HEADER.names == ("status", "tables", "count", "widest")
    rows = [[0, 7, 3, 4], [0, 7, 5, 9]]
    assert HEADER.all_clear(rows) and HEADER.get(rows, "count") == [3, 5]
    assert not HEADER.all_clear([[0, 7, 3, 4], [1, 7, 5, 5]])
    assert not HEADER.all_clear([[0, 7, 3, 3], [0, 8, 5, 5]])


DUMP = re.compile(r"flight recorder: the last calls of rank (\d+) are in (\S+)")


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_ranks_that_disagree_on_a_column_get_its_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARSYNC_FLIGHT_DIR", str(tmp_path))
    for r, got in enumerate(launch(rw.disagree, nprocs=2, timeout=60)):
        assert re.match(r"dtype mismatch across ranks: rank 0 has dtype=torch.float32, rank 1 has "
                        r"dtype=torch.float64", got["dtype"]), got  # fmt: skip
        assert re.match(r"reduce: shape, layout, dtype or compressor mismatch across ranks: rank 1 differs from "
                        r"rank 0", got["shape"]), got  # fmt: skip
        m = DUMP.search(got["shape"])
        assert m is not None and int(m.group(1)) == r, got
        last = json.loads(Path(m.group(2)).read_text())["calls"][-1]
        # compressed_allreduce's row, labelled by its own layout
        assert last["op_code_name"] == "reduce" and last["fingerprint"]["nbytes"] == 40, last
        assert set(last["fingerprint"]) == set(REDUCE_ROW.names), last
