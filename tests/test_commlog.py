"""``DistributedOptimizer(log=CommLog())`` records every collective it issues: the bytes the log adds up to equal
what this rank's torch.distributed calls sent (counted by ``_commlog_workers.Wire`` where they are made), from
the broadcast at construction through the agreement rounds and "auto"'s link measurement to the buckets, in
backward and in ``step()``; and the byte model of gloo's broadcast against gloo's own loop."""

from __future__ import annotations

import _commlog_workers as cw
import numpy as np
import pytest

from sparsync import launch
from sparsync.collectives.comm import broadcast_children

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


@pytest.mark.parametrize("P", [1, 3])
def test_the_log_adds_up_to_what_the_group_sent(P: int) -> None:
    res = launch(cw.log_worker, nprocs=P, timeout=240)
    for rank, r in enumerate(res):
        for run in cw.RUNS:
            got = r[run]
            assert got["unmodelled"] == [], (run, got["unmodelled"])
            assert got["log_bytes"] == got["wire_bytes"], (rank, run, got["wire"], got["records"])
            np.testing.assert_array_equal(got["weights"], res[0][run]["weights"])  # the same model everywhere
            if P == 1:
                assert got["wire_bytes"] == 0, got["wire"]
                continue
            ops = [op for op, _, _ in got["records"]]
            # the construction's broadcast first (rank 0's weights: its metadata round, then gloo's broadcast)
            assert ops[0] == "broadcast" and got["records"][0][1] == ["broadcast", "meta"], got["records"][0]
            phases = {p for op, ph, _ in got["records"] if op == "agree" for p in ph}
            if run == "step":  # reduction in step(): the gradient layouts, agreed every step
                assert ops.count("agree") == 3 and phases == {"layouts"}, got["records"]
            else:  # the first round's layouts, the bucket layout once, then a header per bucket of no fast path
                assert {"layouts", "order", "fingerprints"} <= phases, got["records"]
                assert run != "compressed" or "header" in phases, got["records"]
        # "auto"'s link measured once, at its first call, in that call's record; sparsync's own groups (the
        # buckets' lanes) and the later runs use it
        assert [r[run]["calibrations"] for run in cw.RUNS] == [1, 0, 0], r  # at P = 1: a record of 0 bytes
    if P == 3:  # gloo's broadcast tree at P = 3: the root sends the weights to both others; the metadata
        # round costs every rank alike
        sent = [r["overlap"]["records"][0][2] for r in res]
        weights = 4 * sum(p.numel() for p in cw.Mixed().parameters())
        assert sent[0] - sent[1] == 2 * weights and sent[1] == sent[2], sent


def test_set_deterministic_reaches_the_optimizers_own_groups() -> None:
    """Before side groups took their caller's link model, each of the optimizer's groups measured the link
    although ``set_deterministic()`` had fixed it (6-13 MB of timing traffic, and "auto" choosing by timing)."""
    assert launch(cw.deterministic_worker, nprocs=3, timeout=240) == [0, 0, 0]


def test_the_broadcast_model_is_gloos_tree() -> None:
    """``broadcast_children`` against gloo's loop (gloo/broadcast.cc), every P up to 40 and every root: each rank
    but the root receives once, P - 1 sends in all."""

    def gloo(rank: int, size: int, root: int) -> tuple[int, int]:
        vrank, dim = (rank - root) % size, (size - 1).bit_length()
        mask, sends, recvs = (1 << dim) - 1, 0, 0
        for i in range(dim):
            mask ^= 1 << i
            if vrank & mask or (vrank ^ (1 << i)) >= size:
                continue
            if vrank & (1 << i):
                recvs += 1
            else:
                sends += 1
        return sends, recvs

    for size in range(1, 41):
        for root in range(size):
            counts = [gloo(r, size, root) for r in range(size)]
            assert [s for s, _ in counts] == [broadcast_children(r, size, root) for r in range(size)]
            assert [rc for _, rc in counts] == [int(r != root) for r in range(size)]
            assert sum(s for s, _ in counts) == size - 1
