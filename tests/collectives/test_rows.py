"""Row-sparse streams on real gloo groups of 1, 3, 5 and 8 ranks: every algorithm and partition
against the exact dense sum (bit for bit: the inputs make every partial sum exact), half precision rounded once,
COO round trips keeping the union of rows, the eager region, and bad input reported on every rank."""

from __future__ import annotations

from typing import Any

import _row_workers as rw
import numpy as np
import pytest
import torch

from sparsync import SparseStream, launch
from sparsync.collectives.meta import EAGER_BYTES, ROW_BYTES
from sparsync.collectives.partition import Partition

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]


@pytest.fixture(scope="module", params=(1, 3, 5, pytest.param(8, marks=pytest.mark.large)), ids=lambda p: f"P{p}")
def run(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    world = request.param
    return world, launch(rw.rows_worker, nprocs=world, timeout=300)


def test_every_algorithm_and_partition_is_exact(run: tuple[int, list[dict[str, Any]]]) -> None:
    world, results = run
    failures = []
    for case in rw.cases():
        want = rw.expected(case, world)
        union = np.unique(np.concatenate([rw.rows_of(case, r, world) for r in range(world)]))
        for alg, part in rw.calls():
            key = f"{case.pattern}/{case.width}/{case.dtype}/{alg}/{part}"
            got = [res["grid"][key] for res in results]
            if any("error" in g for g in got):
                failures.append(f"{key}: {[g.get('error') for g in got]}")
                continue
            for g in got:
                if (
                    not np.array_equal(g["dense"], want)
                    or g["row"] != case.width
                    or g["dtype"] != f"torch.{case.dtype}"
                ):
                    failures.append(f"{key}: wrong sum, row or dtype")
                if not g["unchanged"]:
                    failures.append(f"{key}: input modified")
                if g["indices"] is not None and not np.array_equal(g["indices"], union):
                    failures.append(f"{key}: sparse result rows {g['indices'][:8]} != union {union[:8]}")
            if len({g["dense"].tobytes() for g in got}) != 1:
                failures.append(f"{key}: ranks differ")
    assert not failures, "\n".join(failures[:20])


def test_stride_partition_balances_hot_rows(run: tuple[int, list[dict[str, Any]]]) -> None:
    world, results = run
    if world == 1:
        pytest.skip("one rank owns every row at P = 1: there is no balance to compare")
    ratio = {}
    for part in ("stride", "range"):
        key = f"hot/64/float32/ssar_split_allgather/{part}"
        per_owner = np.sum([res["grid"][key]["partition_bytes"] for res in results], axis=0)
        assert per_owner.shape == (world,)
        ratio[part] = per_owner.max() / per_owner.mean()
        if part == "range":  # the hot rows 0, 1, 2, 5 of every rank all sit in the first contiguous range
            assert int(np.argmax(per_owner)) == 0, per_owner
    # Stride spreads them over different owners (at P = 2: rows 0 and 2 on one, 1 and 5 on the other).
    assert ratio["stride"] < ratio["range"], ratio


def test_half_precision_is_summed_in_float32_and_rounded_once(run: tuple[int, list[dict[str, Any]]]) -> None:
    world, results = run
    for name, dtype in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        exact = sum(rw.half_input(r, dtype).to_dense().double() for r in range(world))
        once = exact.to(dtype).double().numpy()
        eps = torch.finfo(dtype).eps
        for alg in ("allgather", "ssar_split_allgather", "dsar_split_allgather"):
            for res in results:
                np.testing.assert_array_equal(res["half"][f"{name}/{alg}"]["dense"], once, err_msg=alg)
        for alg in (
            "ssar_recursive_double",
            "dense",
        ):  # partial sums travel in half precision: log2 P / P roundings
            for res in results:
                np.testing.assert_allclose(res["half"][f"{name}/{alg}"]["dense"], exact.numpy(), rtol=world * eps)


def test_coo_round_trip_keeps_the_union_of_rows(run: tuple[int, list[dict[str, Any]]]) -> None:
    world, results = run
    for name in ("dense_dims_1", "dense_dims_2"):
        inputs = [rw.coo_inputs(r)[name] for r in range(world)]
        want = sum(t.to_dense() for t in inputs)
        rows = torch.unique(torch.cat([t.coalesce().indices()[0] for t in inputs]))
        for alg, part in rw.calls():
            for res in results:
                g = res["coo"][f"{name}/{alg}/{part}"]
                assert g["sparse"] and g["coalesced"] and g["shape"] == tuple(want.shape), (name, alg)
                assert g["dims"] == (1, want.dim() - 1)
                assert g["row"] == int(np.prod(want.shape[1:])), "a COO tensor travels as a row stream"
                np.testing.assert_array_equal(g["indices"][0], rows.numpy(), err_msg=f"{name} {alg} {part}")
                dense = np.zeros(tuple(want.shape))
                dense[g["indices"][0]] = g["values"]
                np.testing.assert_allclose(dense, want.numpy(), rtol=1e-6, atol=1e-6)


def test_small_call_never_pays_for_an_earlier_large_one(run: tuple[int, list[dict[str, Any]]]) -> None:
    world, results = run
    for res in results:
        b = res["bytes"]
        if world == 1:  # no peer: neither call puts a byte on the wire
            assert b["small_sent"] == b["small_meta"] == b["big_meta"] == 0, b
            continue
        payload = 19 * 8  # the 19 float64 values of the small call, dense
        # Recursive doubling sends each block at most twice per rank (once more when folding): the rows and
        # payloads themselves, never the 78 kB the large calls inline.
        assert b["small_meta"] <= 2 * world * (ROW_BYTES + payload + 8), b
        assert b["small_sent"] < EAGER_BYTES * world < b["big_meta"], b
    # The large signature kept its grown limit: after the small call it still finishes in the metadata round.
    assert all(res["bytes"]["big_phases"] == 2 for res in results)  # meta + sum


def test_bad_rows_raise_the_same_error_on_every_rank(run: tuple[int, list[dict[str, Any]]]) -> None:
    world, results = run
    msgs = {res["errors"]["out_of_range"] for res in results}
    assert len({m.split(" (seen on")[0] for m in msgs}) == 1, msgs
    assert all(f"rank {world - 1} passed index 70" in m and "[0, 10)" in m for m in msgs), msgs
    if world > 1:
        msgs = {res["errors"]["row_mismatch"].split(" (seen on")[0] for res in results}
        assert len(msgs) == 1 and "row width mismatch" in next(iter(msgs)), msgs
    assert all(float(res["errors"]["after"]) == 4.0 * world for res in results)


@pytest.mark.parametrize("kind", ["stride", "range"])
@pytest.mark.parametrize(("rows", "parts"), [(1, 1), (5, 8), (97, 3), (1000, 7)])
def test_partition_split_assemble_round_trip(kind: str, rows: int, parts: int) -> None:
    g = torch.Generator().manual_seed(rows + parts)
    for dense in (False, True):
        idx = torch.randperm(rows, generator=g)[: max(1, rows // 3)].sort().values
        s = SparseStream(idx, torch.randn(idx.numel() * 3, generator=g), rows * 3, row=3)
        if dense:
            s = s.densified()
        p = Partition(kind, rows, parts)
        blocks = p.split(s)
        assert sum(blk.num_rows for blk in blocks if blk is not None) == rows
        assert [blk.num_rows if blk is not None else 0 for blk in blocks] == p.counts()
        back = p.assemble(blocks, s.dim, 3, s.dtype)
        assert torch.equal(back.to_dense(), s.to_dense())
        chunk = max(p.counts())
        gathered = torch.cat(
            [
                torch.cat([b.to_dense(), torch.zeros((chunk - b.num_rows) * 3)])
                if b is not None
                else torch.zeros(chunk * 3)
                for b in blocks
            ]
        )
        assert torch.equal(p.gather_dense(gathered, chunk, 3), s.to_dense())
