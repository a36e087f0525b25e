"""``torch.compile`` under sparsync, on real gloo groups: a compiled model trained under ``DistributedOptimizer``
(a sparse-gradient table, a dense-gradient table, a sparse bag, a dense layer), under DDP with
``compression_hook`` (Identity; TopK with error feedback), and with ``sparsync.shard`` tables, ends with the
parameters of the same model run eagerly (docs/compile.md says what holds where).

Why bit for bit with ``backend="aot_eager"``: dynamo and AOTAutograd trace the model, but the graphs run
torch's eager kernels, so every rank's local gradients have the eager run's bits (checked for these batches).
What a compiled backward does change is the order in which autograd hands the gradients over (one compiled
node produces them all), so ``DistributedOptimizer``'s overlap and DDP fill their dense buckets in another
order. At P = 2 a sum over the ranks is a + b whatever the order; at P = 3 gloo's ring allreduce sums an
element in an order that depends on its offset in the bucket, so a gradient placed elsewhere can differ in the
last bit (as between two DDP runs with different bucket orders). Hence: everything bit for bit at P = 2; at
P = 3 bit for bit where the order cannot move (reduction in ``step()``, the sparse allreduces, sharded tables),
and within ``NEAR`` where it can. ``sparsync.set_deterministic()`` in the workers keeps ``auto``'s choices
fixed between the two runs.

The default backend (inductor) fuses the forward's and backward's pointwise operations and reductions into
generated C++ kernels, which round differently from torch's own: there the parameters agree within ``NEAR``
(measured: at most 1.8e-7 apart after three steps, on parameters of magnitude 0.1 to 1)."""

from __future__ import annotations

from typing import Any

import _compile_workers as cw
import numpy as np
import pytest

from sparsync import launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

NEAR = {"rtol": 1e-5, "atol": 1e-6}


def _check(res: list[dict[str, Any]], exact: dict[str, bool]) -> None:
    """Per case (``exact[case]``: bit for bit, else within ``NEAR``): the compiled run compiled at least one graph
    and the eager run none, both trained every parameter, ran the same collectives with the same sizes, and end
    at the same parameters; replicated parameters hold the same bits on every rank."""
    for rank, r in enumerate(res):
        for case, bitwise in exact.items():
            eager, compiled = r[case]["eager"], r[case]["compiled"]
            assert eager["graphs"] == 0 and compiled["graphs"] >= 1, (case, eager["graphs"], compiled["graphs"])
            assert eager["moved"] and compiled["moved"], case
            assert compiled["ops"] == eager["ops"], (case, rank)  # sorted: the order may differ (module doc)
            for name, want in eager["params"].items():
                got = compiled["params"][name]
                if bitwise:
                    assert np.array_equal(got, want), (case, rank, name, float(np.abs(got - want).max()))
                else:
                    np.testing.assert_allclose(got, want, **NEAR, err_msg=f"{case} rank {rank} {name}")
            if case != "shard":  # a shard's rows are its rank's own
                for name, p in compiled["params"].items():
                    assert np.array_equal(p, res[0][case]["compiled"]["params"][name]), (case, rank, name)


def test_compiled_under_distributed_optimizer_hook_and_shard_equals_eager_bit_for_bit_at_two_ranks() -> None:
    """DistributedOptimizer reducing during the compiled backward (its hooks run on the leaves' gradients, after
    the compiled backward node); DDP compiled (dynamo splits the graph at bucket boundaries), its buckets
    reduced by sparsync's hook; two tables sharded and one replicated (dynamo breaks the graph in each sharded
    lookup and runs the exchange, a custom autograd node over all-to-alls, outside the compiled graphs)."""
    cases = ("optimizer", "hook_identity", "hook_topk", "shard")
    _check(launch(cw.compare_worker, nprocs=2, args=(cases, "aot_eager")), dict.fromkeys(cases, True))


@pytest.mark.large
def test_compiled_at_three_ranks_bit_for_bit_where_the_bucket_order_cannot_move() -> None:
    """P = 3 (module doc): reduction in ``step()`` and TopK's sparse allreduces bit for bit; the overlapped
    buckets and DDP's lossless dense buckets within ``NEAR``."""
    exact = {"optimizer_in_step": True, "hook_topk": True, "optimizer": False, "hook_identity": False}
    _check(launch(cw.compare_worker, nprocs=3, args=(tuple(exact), "aot_eager")), exact)


def test_the_default_backend_agrees_within_a_tolerance() -> None:
    """inductor's fused kernels (module doc): DistributedOptimizer and the lossless hook. TopK is left out: a
    gradient rounded differently could swap which of two near-equal magnitudes it keeps."""
    cases = ("optimizer", "hook_identity")
    _check(launch(cw.compare_worker, nprocs=2, args=(cases, "inductor")), dict.fromkeys(cases, False))


@pytest.mark.large
def test_sharded_tables_at_three_ranks_and_under_the_default_backend() -> None:
    _check(launch(cw.compare_worker, nprocs=3, args=(("shard",), "aot_eager")), {"shard": True})
    _check(launch(cw.compare_worker, nprocs=2, args=(("shard",), "inductor")), {"shard": False})


def test_fullgraph_on_sharded_tables_says_why_it_cannot() -> None:
    """A sharded lookup's exchange runs eagerly (``torch.compiler.disable``): ``fullgraph=True`` refuses it with
    sparsync's reason rather than a data-dependent guard deep inside the lookup."""
    for err in launch(cw.fullgraph_worker, nprocs=2):
        assert err != "no error" and "sparsync.shard: a sharded lookup runs its exchange" in err, err
