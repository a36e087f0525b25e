"""docs/integrations.md's Hugging Face Accelerate recipes on a real gloo group at P = 2: the prepared (DDP) model
with sparsync's ``compression_hook`` registered on it, and ``DistributedOptimizer`` prepared without the model,
each end bit for bit at the parameters of the plain sparsync loop (DDP with the same hook; the
``DistributedOptimizer`` loop) on the batches the prepared loader gave each rank. Bit for bit: the recipes run
the same forward, ``loss.backward()`` (``accelerator.backward`` at fp32, no accumulation) and step; Accelerate
adds no arithmetic."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("accelerate", reason="needs the accelerate extra: pip install -e '.[accelerate]'")

import _accelerate_workers as aw  # imports accelerate

from sparsync import launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def test_recipes_equal_the_plain_loop_bit_for_bit_at_two_ranks() -> None:
    cases = ("hook", "optimizer")
    res = launch(aw.compare_worker, nprocs=2, args=(cases,))
    for case in cases:
        assert res[0][case]["batches"] == res[1][case]["batches"] == aw.EPOCHS * aw.SAMPLES // (2 * aw.BATCH)
        assert not np.array_equal(res[0][case]["first_ids"], res[1][case]["first_ids"]), "the ranks' data"
        for rank, r in enumerate(res):
            for name, want in r[case]["plain"].items():
                got = r[case]["accelerate"][name]
                assert np.array_equal(got, want), (case, rank, name, float(np.abs(got - want).max()))
                assert not np.array_equal(want, r["start"][name]), (case, rank, name, "did not train")
                assert np.array_equal(want, res[0][case]["plain"][name]), (case, rank, name, "ranks differ")
