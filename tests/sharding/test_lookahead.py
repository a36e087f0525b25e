"""``sparsync.shard.Lookahead`` on real gloo groups: training through it equals training without it, bit for bit
after every step, at P = 1, 3, 5 under SGD, Adagrad and SparseAdam, over test_shard's scenarios (uneven batches,
an empty batch, every id on one owner, absent ids); each forward then starts one all-to-all (the rows) instead
of two or three; the same clear error on every rank for ids that differ from the forward's or are out of range.
"""

from __future__ import annotations

from typing import Any

import _lookahead_workers as lw
import _shard_workers as sw
import pytest

from sparsync import launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


IDS_PARTS = ("header", "ids", "padding")  # an ids round's phases


def _plus(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: a.get(k, 0) + b.get(k, 0) for k in {**a, **b}}


def check_bytes(r: dict[str, Any], P: int, word: int) -> None:
    """Per step: the gradient rows round of step s carried step s + 1's ids blocks (its record counts their
    header, ids and padding beside the gradient rows, its messages once), so step s + 1's lookup record counts
    its rows round only (and a second ids round when a block overflowed); together the same bytes as without
    lookahead, plus one verdict word (``word`` bytes: the rows' wire precision) per block of the rows round."""
    steps = len(r["bytes"]) // 2
    came: dict[str, int] = {}
    for s in range(steps):
        (lookup, lookup_ahead), (grad, grad_ahead) = r["bytes"][2 * s], r["bytes"][2 * s + 1]
        assert _plus(lookup_ahead, came) == {**lookup, "header": lookup["header"] + word * (P - 1)}, (s, lookup)
        came = {k: v for k, v in grad_ahead.items() if k in IDS_PARTS}
        assert {k: v for k, v in grad_ahead.items() if k not in IDS_PARTS} == grad, (s, grad, grad_ahead)
        assert bool(came) == (P > 1 and s < steps - 1), (s, grad_ahead)
        (m_lookup, m_lookup_ahead), (m_grad, m_grad_ahead) = r["messages"][2 * s], r["messages"][2 * s + 1]
        assert m_grad_ahead == m_grad and m_lookup_ahead == m_lookup - (P - 1 if s else 0), (s, r["messages"])


@pytest.mark.parametrize("P", [1, 3, 5])
def test_training_through_lookahead_equals_training_without_it_bit_for_bit(P: int) -> None:
    """Torch's SGD, Adagrad and SparseAdam over sparse gradients, and the tables' SGD, Adagrad and Adam in their
    backward (Adagrad also with the rows in bf16 on the wire); an empty batch on one rank at step 1."""
    for rank, res in enumerate(launch(lw.same_worker, nprocs=P)):
        assert sorted(res) == sorted([*sw.OPTIMIZERS, *(f"fused_{n}" for n in lw.FUSED), "bf16_fused_adagrad"])
        for opt, r in res.items():
            assert r["steps"] == sw.STEPS and r["identical"] == [True] * sw.STEPS, (P, rank, opt, r["identical"])
            assert r["losses_equal"], (P, rank, opt)
            assert r["ops"] == ["shard_lookup", "shard_grad"] * sw.STEPS, r["ops"]
            plain, ahead = r["rounds"]
            whole, whole_ahead = r["step_rounds"]
            if P > 1:  # without: the ids (two rounds when a pair overflowed) and the rows; with: the rows
                assert plain[0] == 3 and min(plain) == 2, plain
                assert ahead == [1] * sw.STEPS, ahead
                # a step with lookahead: one round fewer, the ids having gone in the gradient rows round before
                assert [a - b for a, b in zip(whole, whole_ahead, strict=True)] == [0] + [1] * (sw.STEPS - 1)
            else:
                assert whole == whole_ahead == [0] * sw.STEPS, (whole, whole_ahead)
            check_bytes(r, P, 2 if opt.startswith("bf16") else 8)  # float64 tables, or bf16 on the wire


@pytest.mark.parametrize("P", [1, 3, 5])
def test_one_group_through_lookahead_equals_training_without_it_bit_for_bit(P: int) -> None:
    """Tables of one width (one group: ``rows.with_verdicts`` takes the verdict words and the rows out of the
    block received in one split, not through ``group_major``; two of the tables with padding rows): bit for bit
    as without lookahead (torch's SGD, the tables' Adam and Adagrad in backward, bf16 rows on the wire), one
    round per forward, the same bytes plus a verdict word per block; ranks that disagree on carrying the ids all
    raise the same error."""
    res = launch(lw.one_group_worker, nprocs=P)
    for rank, r_all in enumerate(res):
        for opt in ("sgd", "fused_adam", "bf16_fused_adagrad"):
            r = r_all[opt]
            assert r["identical"] == [True] * sw.STEPS and r["losses_equal"], (P, rank, opt, r["identical"])
            whole, whole_ahead = r["step_rounds"]
            if P > 1:
                assert r["rounds"][1] == [1] * sw.STEPS, r["rounds"]
                assert [a - b for a, b in zip(whole, whole_ahead, strict=True)] == [0] + [1] * (sw.STEPS - 1)
            check_bytes(r, P, 2 if opt.startswith("bf16") else 8)
    if P == 3:
        m = sw.same_on_every_rank([{k: r[k] for k in ("mismatch", "after")} for r in res])
        assert m["mismatch"].startswith("ValueError: Lookahead: ranks [0, 2] would send the next batch's ids")
        assert m["after"] == "trained"


@pytest.mark.parametrize("P", [3, 5])
def test_a_step_through_lookahead_runs_two_all_to_alls_against_three(P: int) -> None:
    """Ids that fit the blocks after the first step: with a backward every step, each step after the first runs
    the rows round and the gradient rows round (which carries the next batch's ids), with torch's SGD over sparse
    gradients and with the tables' Adam in backward."""
    for rank, res in enumerate(launch(lw.steady_worker, nprocs=P)):
        for opt, r in res.items():
            assert r["identical"] == [True] * sw.STEPS, (rank, opt)
            whole, whole_ahead = r["step_rounds"]
            # the first step: the ids, their overflow (the first blocks carry none), the rows and the gradient rows
            assert whole == [4] + [3] * (sw.STEPS - 1), (rank, opt, whole)
            assert whole_ahead == [4] + [2] * (sw.STEPS - 1), (rank, opt, whole_ahead)


@pytest.mark.parametrize("P", [1, 3])
def test_steps_without_a_backward_send_the_ids_ahead_in_a_round_of_their_own(P: int) -> None:
    """Forwards under no_grad and a forward with no backward between training steps: the same outputs and tables
    as without lookahead; a step after one with no backward runs the ids round itself."""
    for rank, res in enumerate(launch(lw.eval_worker, nprocs=P)):
        for opt, r in res.items():
            n = len(lw.KINDS)
            assert r["outs"] == [True] * n and r["states"] == [True] * n, (rank, opt, r)
            whole, whole_ahead = r["step_rounds"]
            carried = [0] + [int(P > 1 and k == "train") for k in lw.KINDS[:-1]]  # by the step before
            assert [a - b for a, b in zip(whole, whole_ahead, strict=True)] == carried, (rank, opt, r)


def test_ranks_that_disagree_on_carrying_the_ids_or_a_bad_id_ahead_raise_the_same_error() -> None:
    m = sw.same_on_every_rank(launch(lw.ahead_errors_worker, nprocs=3))
    assert m["mismatch"] == (
        "ValueError: Lookahead: ranks [0, 2] would send the next batch's ids in this step's gradient rows round, "
        "ranks [1] would not (a forward under torch.no_grad, or of tables that need no gradient, on some ranks "
        "only); every rank must run the same forwards, with gradients or without, and the same backwards"
    )
    assert m["carried"] == str(sorted(["grads", *IDS_PARTS])), m["carried"]
    assert m["bad_ahead"].startswith("ValueError: sharded lookup refused on rank 2: 't.bag_mean'"), m["bad_ahead"]
    assert "id 11 is out of range; ids must lie in [0, 11)" in m["bad_ahead"]
    assert m["untouched"] == "True"
    assert m["after"] == "trained"


def test_ids_that_differ_from_the_forwards_get_the_same_clear_error_on_every_rank() -> None:
    res = launch(lw.errors_worker, nprocs=3)
    m = sw.same_on_every_rank(res)
    assert m["other_ids"].startswith("ValueError: sharded lookup refused on rank 1: the forward looked up")
    assert "'t.emb'" in m["other_ids"] and "the lookahead sent" in m["other_ids"]
    # the forward's ids changed in place after they went ahead
    assert m["changed"].startswith("ValueError: sharded lookup refused on rank 1: the forward looked up")
    assert "'t.bag_mean'" in m["changed"] and "the lookahead sent" in m["changed"]
    assert m["bad_id"].startswith("ValueError: sharded lookup refused on rank 2: 't.bag_mean'")
    assert "id 11 is out of range; ids must lie in [0, 11)" in m["bad_id"]
    assert "the forward looked up the tables" in m["fewer_tables"] and "t.bag_sum" in m["fewer_tables"]
    assert m["unknown"].startswith("KeyError") and "t.nope" in m["unknown"]
    assert "has no sharded tables" in m["no_tables"]
    assert m["after"] == "trained"  # every error left the ranks in step
