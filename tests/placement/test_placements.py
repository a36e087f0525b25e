"""``HybridTrainer(placements=...)``: every placement executable, checked against single-process training and
against the sketch compressor's own reference."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _placement_workers as plw
import numpy as np
import pytest
import torch

from sparsync import launch
from sparsync.compress import Identity, SparseSketch, TensorSpec, Threshold
from sparsync.costmodel import ALGORITHMS
from sparsync.placement import Compressed, DenseAllreduce, Placement, Sketch, SparseAllreduce
from sparsync.plan import Cluster, make_plan, resolve
from sparsync.plan.detect import ParamStats
from sparsync.ps import ServerProcess, start_servers
from sparsync.ps.feedback import PushFeedback

MIXED = {"words.weight": "ps", "tags.weight": "sparse_allreduce", "hidden.weight": "dense_allreduce",
         "hidden.bias": "dense_allreduce", "out.weight": "ps", "out.bias": "dense_allreduce"}  # fmt: skip
# placement objects, as wrap_optimizer takes them: a compressor (lossless here) and a fixed SparCML algorithm
OBJECTS = {**MIXED, "hidden.weight": Compressed(Identity()), "tags.weight": SparseAllreduce(algorithm="allgather")}
SGD_MEAN = {"opt": "sgd", "reduce": "mean", "steps": 3}
CASES = [
    dict(placements=MIXED, opt="sgd", reduce="sum", steps=3),
    dict(placements=MIXED, one_machine=True, **SGD_MEAN),  # local aggregation of words, whole-table out.weight
    dict(placements={**MIXED, "out.weight": "dense_allreduce"}, opt="adam", reduce="mean", steps=3),
    dict(placements={**MIXED, "tags.weight": "sketch", "words.weight": "sketch"}, ef=True, **SGD_MEAN),
    dict(placements=OBJECTS, **SGD_MEAN),
]


@pytest.fixture(scope="module")
def servers() -> Iterator[list[ServerProcess]]:
    sv = start_servers(2, wait_timeout=20.0)
    yield sv
    for s in sv:
        s.kill()


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 3])
def test_mixed_placements_equal_single_process(servers: list[ServerProcess], world: int) -> None:
    cases = [{**c, "world": world} for c in CASES]  # each world size trains its own tables on the servers
    res = launch(plw.trainer_worker, nprocs=world, args=([s.address for s in servers], cases), timeout=120)
    init = dict(plw.TwoEmbLM().named_parameters())
    for i, c in enumerate(CASES):
        ref = plw.reference(world, int(c["steps"]), str(c["opt"]), str(c["reduce"]))  # type: ignore[call-overload]
        placements: dict[str, Any] = c["placements"]  # type: ignore[assignment]
        for n, want in ref.items():
            assert (want - init[n]).abs().max() > 1e-4, n  # training moved every parameter
            ranks = [0] if placements[n] == "ps" else range(world)  # the servers' copy, or every replica
            for r in ranks:
                got = res[r][i]["params"][n]
                torch.testing.assert_close(
                    got, want, rtol=1e-5, atol=1e-6, msg=lambda m, n=n, c=c: f"{n} {c}: {m}"
                )
        if world > 1 and "sketch" in placements.values():
            _check_sketch_bytes(res[0][i]["records"], placements, world, int(c["steps"]))  # type: ignore[call-overload]
        if world > 1 and "sparse_allreduce" in placements.values():
            # auto's choice among SparCML's algorithms depends on the measured link (it took "dense", the dense
            # switch, once under load in CI): any of them, and only them
            algs = res[0][i]["algorithms"]
            assert algs and set(algs) <= set(ALGORITHMS), algs


def _check_sketch_bytes(
    records: list[tuple[str, int, int]], placements: dict[str, str], world: int, steps: int
) -> None:
    """The plan's predicted bytes per machine per step of every sketch parameter = the measured ones."""
    params = dict(plw.TwoEmbLM().named_parameters())
    sk = [n for n, pl in placements.items() if pl == "sketch"]
    stats = [ParamStats(n, tuple(params[n].shape), 0.1, True) for n in sk]
    plan = make_plan(stats, Cluster(world), overrides={n: "sketch" for n in sk}, sketch=plw.BIG_SKETCH)
    measured = sum(b for op, _, b in records if op == "reduce") / steps
    assert len([r for r in records if r[0] == "reduce"]) == steps * len(sk)
    assert abs(measured - plan.bytes_per_machine) <= 0.01 * plan.bytes_per_machine, (
        measured,
        plan.bytes_per_machine,
    )


def test_sketch_payload_numel_is_what_compress_sends() -> None:
    for shape, sketch in [((200, 16), SparseSketch(ratio=0.05)), ((1000,), SparseSketch(rows=4, ratio=0.3)),
                          ((50, 3), SparseSketch(cols=17, block=7))]:  # fmt: skip
        g = torch.zeros(shape)
        g.view(-1)[::5] = 1.0
        payload = sketch.compress(g)
        assert payload.to_buffer().numel() == sketch.payload_numel(shape)
        assert payload.nbytes == sketch.payload_nbytes(shape) == payload.table.numel() * 4 + 4 * -(-g.numel() // (
            sketch.block_size(TensorSpec.of(g)) * 32))  # fmt: skip
        plan = make_plan([ParamStats("w", shape, 0.2, True)], Cluster(4), overrides={"w": "sketch"}, sketch=sketch)
        assert plan.bytes_per_machine == pytest.approx(4 * sketch.payload_nbytes(shape) * 3 / 4)


def test_placements_resolve_plan_or_dict_and_name_bad_entries() -> None:
    params = ["a", "b", "c"]
    default = {"a": "ps", "b": "dense_allreduce", "c": "dense_allreduce"}
    assert resolve(params, default, {"c": "sketch"}) == {**default, "c": "sketch"}
    plan = make_plan(
        [ParamStats("a", (1000, 8), 0.01, True), ParamStats("b", (8,), 1.0, False)],
        Cluster(4),
        overrides={"a": "sparse_allreduce"},
    )
    got = resolve(params, default, plan.kinds)  # a Plan names a subset: the rest keep the default
    assert got == {"a": "sparse_allreduce", "b": "dense_allreduce", "c": "dense_allreduce"}
    mine = SparseAllreduce(algorithm="allgather")  # an object stands for itself
    assert resolve(params, default, {"b": mine})["b"] is mine
    with pytest.raises(KeyError, match="'zz'"):
        resolve(params, default, {"zz": "ps"})
    with pytest.raises(KeyError, match="'allgather'"):
        resolve(params, default, {"a": "allgather"})


def test_plan_as_placement_objects() -> None:
    """make_plan's kinds become sparsync.placement objects: one shared object per kind (the sketch's hash
    counter and residuals are one per trainer), the plan's own sketch; a ps entry needs the servers' placement."""
    sketch = SparseSketch(rows=3, ratio=0.1)
    stats = [ParamStats("a", (1000, 8), 0.01, True), ParamStats("b", (8,), 1.0, False),
             ParamStats("c", (500, 8), 0.01, True), ParamStats("d", (500, 8), 0.01, True)]  # fmt: skip
    plan = make_plan(stats, Cluster(4), overrides={"a": "sparse_allreduce", "c": "sketch", "d": "sketch"},
                     sketch=sketch)  # fmt: skip
    objs = plan.placements()
    assert isinstance(objs["a"], SparseAllreduce) and isinstance(objs["b"], DenseAllreduce)
    assert isinstance(objs["c"], Sketch) and objs["c"] is objs["d"] and objs["c"].sketch == sketch
    assert {n: o.kind for n, o in objs.items()} == plan.kinds
    on_ps = make_plan(stats, Cluster(4), overrides={"a": "ps", "c": "sketch", "d": "sketch"})
    with pytest.raises(ValueError, match=r"\['a'\] on the parameter server"):
        on_ps.placements()

    class Servers(Placement):
        kind = "ps"

        def aggregate(self, params: list[Any], env: Any) -> None:
            raise AssertionError("not called here")

    servers = Servers()
    assert on_ps.placements(servers=servers)["a"] is servers


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 3])
def test_sketch_placement_matches_compressor_reference_and_feedback(world: int) -> None:
    steps = 8
    sketch = SparseSketch(ratio=1.0)  # 200 x 16 gradient, ~30 rows per worker: collisions at every step
    res = launch(plw.sketch_worker, nprocs=world, args=(sketch, steps), timeout=60)
    grads = [plw.sketch_grad(r) for r in range(world)]
    spec = TensorSpec.of(grads[0])
    exact = sum(g.to_dense() for g in grads) / world
    # First step: the sketch of the sum, decoded once, i.e. decompress(Σ compress(g_r)) / P (S2 Alg. 1).
    payloads = [sketch.compress(g) for g in grads]
    summed = payloads[0].from_buffer(sum(p.to_buffer() for p in payloads))
    want = sketch.decompress(summed, spec).to_dense() / world
    for r in range(world):
        for key in ("ef=False", "ef=True"):
            torch.testing.assert_close(res[r][key]["outs"][0], want, rtol=1e-5, atol=1e-6)
            for s in range(steps):  # every rank applies the same reduced gradient
                torch.testing.assert_close(res[r][key]["outs"][s], res[0][key]["outs"][s], rtol=0, atol=0)
        # The residual a worker keeps is exactly what its own sketch lost.
        mine = grads[r].to_dense() - sketch.decompress(payloads[r], spec).to_dense()
        torch.testing.assert_close(res[r]["ef=True"]["residual"], mine, rtol=0, atol=1e-6)
    assert (want - exact).abs().max() > 1e-2  # the sketch is lossy at this size
    assert not torch.equal(res[0]["ef=False"]["outs"][0], res[0]["ef=False"]["outs"][1])  # fresh hashes per step
    if world == 1:
        # Error feedback: what was applied over the steps sums to the gradients up to the last residual; without
        # it every step's collision error stays in the sum.
        err = {k: (sum(res[0][k]["outs"]) - steps * exact).norm() for k in ("ef=False", "ef=True")}
        assert err["ef=True"] < 0.5 * err["ef=False"], err


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_async_push_compression_identity_equals_uncompressed(servers: list[ServerProcess]) -> None:
    steps = 4
    res = launch(plw.async_worker, nprocs=1, args=([s.address for s in servers], steps), timeout=60)[0]
    ref = plw.reference(1, steps, "sgd", "sum")  # one async worker applies every push at once: plain SGD
    for n, want in ref.items():
        for key in ("none", "identity"):
            torch.testing.assert_close(res[key][n].reshape(want.shape), want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(res["identity"][n], res["none"][n], rtol=0, atol=0)
    assert any((res["threshold"][n] - res["none"][n]).abs().max() > 1e-4 for n in ref)  # compression is lossy
    assert res["threshold/restored"] and all(res["threshold/restored"])  # residuals survive the checkpoint


@pytest.mark.parametrize("error_feedback", [True, False])
def test_push_feedback_residual_plus_sent_is_the_gradient(error_feedback: bool) -> None:
    pf = PushFeedback(Threshold(0.1, lifespan=2), error_feedback=error_feedback)
    rng = np.random.default_rng(0)
    total_g, total_sent = np.zeros((30, 8), np.float32), np.zeros((30, 8), np.float32)
    for step in range(6):
        g = rng.standard_normal((30, 8)).astype(np.float32)
        g[step] = 0  # a zero row stays out of the push unless its residual carries it
        e_old = pf.memory.error("w") if pf.memory is not None else None
        rows, vals = pf.rows("w", torch.from_numpy(g))
        sent = np.zeros_like(g)
        sent[rows.numpy()] = vals.numpy()
        assert (np.abs(vals.numpy()).sum(1) > 0).all()  # only rows with something to send
        x = g + (e_old.numpy() if e_old is not None else 0)
        if error_feedback:
            assert pf.memory is not None
            e_new = pf.memory.error("w").numpy()  # type: ignore[union-attr]
            np.testing.assert_array_equal(e_new + sent, x)  # exact: each entry is sent or kept, never split
        else:
            np.testing.assert_array_equal(np.where(sent != 0, sent, x), x)  # sent entries are the gradient's
        total_g += g
        total_sent += sent
    if error_feedback:
        e = pf.memory.error("w")
        assert e is not None
        np.testing.assert_allclose(total_sent + e.numpy(), total_g, rtol=1e-5, atol=1e-5)
    # The compressor's state (DCT's τ) and the residuals come back from a checkpoint.
    again = PushFeedback(Threshold(0.1, lifespan=2), error_feedback=error_feedback)
    again.load_state_dict(pf.state_dict())
    g = torch.from_numpy(rng.standard_normal((30, 8)).astype(np.float32))
    for a, b in zip(pf.rows("w", g), again.rows("w", g), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_trainer_names_bad_placements() -> None:
    errs = launch(plw.bad_placements_worker, nprocs=1, args=(["tcp://127.0.0.1:1"],), timeout=30)[0]
    assert errs[0].startswith("KeyError") and "nope.weight" in errs[0], errs
    assert errs[1].startswith("KeyError") and "allgather" in errs[1], errs
    assert errs[2].startswith("ValueError") and "async" in errs[2] and "hidden.weight" in errs[2], errs


@pytest.mark.large
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_async_error_feedback_example() -> None:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(root / "examples" / "async_error_feedback.py")],
                          capture_output=True, text=True, timeout=240, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    loss = {m: float(v) for m, v in re.findall(r"^  (\S.*?)\s+loss (\d+\.\d+)", proc.stdout, re.M)}
    assert len(loss) == 3, proc.stdout
    # Error feedback keeps the 1% threshold close to uncompressed training; without it the loss stays higher.
    assert loss["threshold 1% + EF"] < loss["uncompressed"] + 0.1, loss
    assert loss["threshold 1%, no EF"] > loss["threshold 1% + EF"] + 0.2, loss


def test_load_optional_state_refuses_a_checkpoint_that_does_not_match() -> None:
    from sparsync.ps.feedback import load_optional_state

    class Keeper:
        loaded: object = None

        def load_state_dict(self, state: object) -> None:
            self.loaded = state

    k = Keeper()
    load_optional_state(k, {"errors": {}}, "residuals", "push_error_feedback")
    assert k.loaded == {"errors": {}}
    load_optional_state(None, None, "residuals", "push_error_feedback")  # neither side keeps any: nothing to do
    with pytest.raises(
        ValueError, match=r"checkpoint has no residuals, this trainer keeps it \(push_error_feedback\)"
    ):
        load_optional_state(Keeper(), None, "residuals", "push_error_feedback")
    with pytest.raises(ValueError, match=r"checkpoint has residuals, this trainer does not keep it"):
        load_optional_state(None, {"errors": {}}, "residuals", "push_error_feedback")
