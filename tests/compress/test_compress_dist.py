"""Every compressor through ``sparsync.compressed_allreduce`` and the DDP hook on real gloo groups of 1, 3 and 4
ranks, checked against references computed here from every rank's (rebuilt) input."""

from __future__ import annotations

import itertools
from typing import Any

import _compress_workers as cw
import numpy as np
import pytest
import torch
from _nccl_rules import check_run, merged_under_nccl_rules

from sparsync import launch
from sparsync.compress import (
    QSGD,
    Compressor,
    Context,
    DensePayload,
    ErrorFeedback,
    Payload,
    QuantizedPayload,
    SketchPayload,
    SparsePayload,
    TensorSpec,
    from_spec,
)
from sparsync.compress.cast_allreduce import MIN_VALUES
from sparsync.compress.cast_allreduce import chunks as cast_chunks
from sparsync.compress.qsgd_allreduce import encode_remote, local_estimate, partitions, segments, simulate
from sparsync.stream import sum_streams

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]
STEPS = 3


# "-nccl": the same run with the payload under NCCL's rules on gloo (tests/_nccl_rules.py), at P = 1, 3, 5.
# P = 4 by hand (`-m large`, CI time)
@pytest.fixture(
    scope="module",
    params=[1, 3, pytest.param(4, marks=pytest.mark.large), "1-nccl", "3-nccl", "5-nccl"],
    ids=lambda p: f"P{p}",
)
def run(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    P = int(str(request.param).split("-")[0])
    if "nccl" in str(request.param):
        return P, launch(merged_under_nccl_rules, nprocs=P, args=(cw.reduce_worker, STEPS), timeout=120)
    return P, launch(cw.reduce_worker, nprocs=P, args=(STEPS,), timeout=120)


def reduce_scatter_reference(spec: str, P: int, steps: int) -> list[np.ndarray]:
    """QSGD's reduce-scatter without a memory (the worker's ``summed`` call): each partition decoded, summed and
    re-quantized with its rank's noise, a rank's own partitions travelling exactly."""
    comps = [from_spec(spec) for _ in range(P)]
    mems = [ErrorFeedback() for _ in range(P)]  # empty at step 0: the replay below is memoryless there
    out = []
    c = comps[0]
    if True:
        ctxs = [Context("w", r, P) for r in range(P)]
        for step in range(steps):
            xs = [mems[r].compensate("w", cw.rank_input(r, step)) for r in range(P)]
            sent = [encode_remote(q, x, x.numel(), ctx, P) for q, x, ctx in zip(comps, xs, ctxs, strict=True)]  # type: ignore[arg-type]
            for r in range(P):
                mems[r].update("w", xs[r], local_estimate(c, sent[r], xs[r], P, r))  # type: ignore[arg-type]
            out.append((simulate(c, sent, xs, ctxs, comps) / P).numpy())  # type: ignore[arg-type]
    return out


def combine(c: Compressor, payloads: list[Payload], spec: TensorSpec) -> torch.Tensor:
    """The ranks' payloads aggregated with plain float64 sums (sparse: sum of the streams; linear: sum of the
    buffers; quantized: decode each, as QSGD's allgather does), decompressed for ``spec``."""
    p0 = payloads[0]
    if isinstance(p0, SparsePayload):
        return c.decompress(SparsePayload(sum_streams([p.stream for p in payloads])), spec)  # type: ignore[attr-defined]
    if isinstance(p0, DensePayload | SketchPayload):
        buf = sum(p.to_buffer().double() for p in payloads).to(p0.to_buffer().dtype)  # type: ignore[attr-defined]
        return c.decompress(p0.from_buffer(buf), spec)
    assert isinstance(p0, QuantizedPayload) and isinstance(c, QSGD)
    return c.decompress_gathered(payloads, spec)  # type: ignore[arg-type]


def reference(spec: str, P: int, steps: int) -> list[np.ndarray]:
    """What every rank must get from the worker's calls with error feedback: each rank's compensate -> compress
    replayed here, the payloads aggregated with plain float64 sums (sparse: sum of the streams; linear: sum of
    the buffers; quantized: decode each: with a memory QSGD gathers, whatever P, as the reduce-scatter's
    re-quantization would leave an error no memory holds)."""
    comps = [from_spec(spec) for _ in range(P)]
    mems = [ErrorFeedback() for _ in range(P)]
    out = []
    c = comps[0]
    spec0 = TensorSpec.of(cw.rank_input(0, 0))
    for step in range(steps):
        payloads = []
        for r in range(P):
            x = mems[r].compensate("w", cw.rank_input(r, step))
            p = comps[r].compress(x, Context("w", r, P))
            mems[r].update("w", x, comps[r].decompress(p, TensorSpec.of(x)))
            payloads.append(p)
        total = combine(c, payloads, spec0)
        out.append((total / P).numpy())
    return out


def coo_reference(spec: str, P: int) -> tuple[np.ndarray, np.ndarray | None]:
    """The worker's one memoryless call on ``rank_embedding_grad`` (sparse COO), replayed: each rank's compress
    (of the COO gradient where the compressor takes one, else of it densified), the payloads combined as
    ``reference`` does, QSGD re-quantizing on its reduce-scatter where P calls for it; the average, dense.
    Second, for a sparse payload, the average of the entries each rank's payload names, taken from the
    gradients themselves (numpy, no decompress): what a sparsifier that sends exact copies must give."""
    comps = [from_spec(spec) for _ in range(P)]
    c = comps[0]
    grads = [cw.rank_embedding_grad(r) for r in range(P)]
    xs = grads if c.accepts_sparse else [x.to_dense() for x in grads]
    ctxs = [Context("emb", r, P) for r in range(P)]
    spec0 = TensorSpec.of(xs[0])
    if isinstance(c, QSGD) and c.uses_reduce_scatter(P):
        sent = [encode_remote(q, x, x.numel(), ctx, P) for q, x, ctx in zip(comps, xs, ctxs, strict=True)]  # type: ignore[arg-type]
        return (simulate(c, sent, xs, ctxs, comps).view(spec0.shape) / P).numpy(), None  # type: ignore[arg-type]
    payloads = [q.compress(x, ctx) for q, x, ctx in zip(comps, xs, ctxs, strict=True)]
    ref = (combine(c, payloads, spec0).to_dense() / P).numpy()
    if not isinstance(payloads[0], SparsePayload):
        return ref, None
    copies = np.zeros(tuple(spec0.shape), dtype=np.float32)
    for g, p in zip(grads, payloads, strict=True):
        st = p.stream  # type: ignore[attr-defined]
        if st.indices is None:  # the dense format: every value it holds
            named = st.values.numpy() != 0
        else:
            named = np.zeros(spec0.numel, dtype=bool)
            named.reshape(-1, st.row)[st.indices.numpy()] = True
        copies += np.where(named.reshape(copies.shape), g.to_dense().numpy(), np.float32(0))
    return ref, copies / np.float32(P)


# fp16/bf16 sums round at 16 bits; a sketch query reads a table cell that sums colliding values of magnitude
# up to ~50, so gloo's summation order moves it by a few float32 ulps of that cell.
TOL = {"fp16": 2e-3, "bf16": 2e-2, "sketch:rows=3,cols=300,block=8": 2e-5}
# The COO gradients' values are small integers: every sum is exact, so the replay matches bit for bit, but for
# QSGD's reduce-scatter, which divides its scales by P before decoding where the replay divides the decoded sum:
# each side rounds twice (a scale or a product, then the product or the quotient), at most 4 half-ulps apart.
COO_TOL = {"qsgd": 2 * float(np.finfo(np.float32).eps)}


@pytest.mark.parametrize("spec", cw.SPECS)
def test_every_compressor_matches_its_reference(run: tuple[int, list[dict[str, Any]]], spec: str) -> None:
    P, results = run
    errors = [f"rank {r}: {res[spec]['error']}" for r, res in enumerate(results) if "error" in res[spec]]
    assert not errors, "\n".join(errors)
    ref = reference(spec, P, STEPS)
    tol = TOL.get(spec, 1e-6)
    for r, res in enumerate(results):
        for step in range(STEPS):
            np.testing.assert_allclose(
                res[spec]["steps"][step], ref[step], rtol=tol, atol=tol, err_msg=f"rank {r}"
            )
            # async gives the same as sync, and every rank the same as rank 0, bitwise
            assert np.array_equal(res[spec]["async"][step], res[spec]["steps"][step])
            assert np.array_equal(res[spec]["steps"][step], results[0][spec]["steps"][step])
        c = from_spec(spec)
        summed_ref = (
            reduce_scatter_reference(spec, P, 1)[0] if isinstance(c, QSGD) and c.uses_reduce_scatter(P) else ref[0]
        )
        np.testing.assert_allclose(res[spec]["summed"] / P, summed_ref, rtol=tol, atol=tol)
        assert res[spec]["inplace_same_object"]


def test_nccl_rules_refuse_nothing(run: tuple[int, list[dict[str, Any]]]) -> None:
    """Under NCCL's rules every compressor ran (the tests above passed on the same results) without one call
    NCCL would refuse: no BOR (the sketch's bitmap), equal-size gathers (QSGD), batched p2p of exact sizes."""
    _, results = run
    if "nccl_rules" not in results[0]:
        pytest.skip("this run is not under NCCL's rules")
    check_run(
        results,
        {
            "all_reduce": 0,  # casts, identity, the sketch
            ("all_gather_into_tensor", "all_gather_single"): 0,
            "all_to_all_single": 0,  # QSGD's reduce-scatter at P > 2
            "batch_isend_irecv": 0,  # the sparsifiers' sparse_allreduce
        },
    )


def test_identity_equals_plain_dense_allreduce(run: tuple[int, list[dict[str, Any]]]) -> None:
    _, results = run
    for res in results:
        assert np.array_equal(res["identity"]["inplace"], res["plain_allreduce"])
        assert np.array_equal(res["identity"]["steps"][0], res["plain_allreduce"])


@pytest.mark.parametrize("spec", cw.SPECS)
def test_sparse_embedding_gradients(run: tuple[int, list[dict[str, Any]]], spec: str) -> None:
    """COO gradients keep their layout; identity and the casts equal the dense average bit for bit; every
    compressor's values equal its replayed reference (``coo_reference``); all ranks agree."""
    P, results = run
    dense = sum(cw.rank_embedding_grad(r).to_dense() for r in range(P)).numpy() / P  # type: ignore[union-attr]
    for res in results:
        assert res[spec]["sparse_is_sparse"]
        assert np.array_equal(res[spec]["sparse"], results[0][spec]["sparse"])
    got = results[0][spec]["sparse"]
    name = spec.split(":")[0]
    if name in ("identity", "fp16", "bf16"):
        # the gradient's values are small integers (at most 10·P), exact in fp16 and bf16 and in any order of
        # summation; the one float32 division by P then rounds as the reference's does
        np.testing.assert_array_equal(got, dense)
    ref, copies = coo_reference(spec, P)
    np.testing.assert_allclose(got, ref, rtol=COO_TOL.get(name, 0), atol=0)
    if name in ("topk", "threshold", "blocktopk"):  # exact copies of the entries each rank selected, summed
        assert copies is not None and np.abs(copies).max() > 0  # the largest entries are not zero
        np.testing.assert_array_equal(got, copies)
    rows = np.nonzero(np.abs(got).sum(1))[0]
    assert set(rows) <= set(np.nonzero(np.abs(dense).sum(1))[0])  # no rows appear from nowhere


# --- DDP ------------------------------------------------------------------------------------------------
def test_ddp_identity_hook_equals_no_hook() -> None:
    res = launch(cw.ddp_worker, nprocs=3, args=((None, "identity", "identity|sync"), False, 4), timeout=120)
    base, hooked = res[0][None], res[0]["identity"]
    assert not isinstance(hooked, str), hooked
    for a, b, c in zip(base, hooked, res[0]["identity|sync"], strict=True):
        # DDP divides before its allreduce, sparsync after: the two differ by float rounding only
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        assert np.array_equal(b, c)  # the async hook computes what the blocking one does
    for r in range(3):
        for a, b in zip(hooked, res[r]["identity"], strict=True):
            assert np.array_equal(a, b)


@pytest.mark.parametrize("spec", ["identity", "threshold:ratio=0.1"])
def test_ddp_hook_never_blocks_the_autograd_thread(spec: str) -> None:
    """DDP's overlap kept: the hook returns its future while the bucket is still on the wire, and autograd
    reaches the next bucket before the previous one's reduction completes. Rank 1 holds each reduction back by
    DELAY s. The blocking hook (``async_op=False``) is the control: the same checks catch it. Identity goes by
    DDP's allreduce after its checked step, DCT-DP by one sparse allreduce per bucket."""
    delay = 0.4
    res = launch(cw.hook_overlap_worker, nprocs=2, args=(True, delay, 3, spec), timeout=120)
    calls = res[0]
    assert len({c["bucket"] for c in calls}) >= 2 and {c["step"] for c in calls} == {0, 1, 2}  # checked + fast
    for c in calls:
        assert not c["done"] and c["call_s"] < delay / 4, c
    for step in range(3):
        mine = sorted((c for c in calls if c["step"] == step), key=lambda c: c["called"])
        for a, b in itertools.pairwise(mine):
            assert b["called"] < a["completed"], (a, b)  # the next bucket's gradient came while a was in flight
    blocking = launch(cw.hook_overlap_worker, nprocs=2, args=(False, delay, 1, spec), timeout=120)[0]
    assert all(c["done"] for c in blocking) and max(c["call_s"] for c in blocking) > delay / 2, blocking


@pytest.mark.parametrize("nan_step", [0, 2], ids=["checked", "allreduce"])
def test_ddp_hook_refuses_a_nan_gradient_on_every_rank(nan_step: int) -> None:
    """One rank's NaN gradient makes every rank's backward() raise, on the layout's checked step (the metadata
    round names the rank) and on later steps (DDP's allreduce path, checked on the averaged result)."""
    for err in launch(cw.hook_nan_worker, nprocs=2, args=(nan_step,), timeout=60):
        assert "NaN" in err, err


def test_hook_allreduce_queues_behind_sparsync_work_on_its_group() -> None:
    res = launch(cw.hook_behind_the_queue_worker, nprocs=2, timeout=30)
    for first, bucket in res:
        assert np.array_equal(first, np.full(7, 3.0)) and np.array_equal(bucket, np.full(5, 21.0))


def test_ddp_sparse_embedding_every_compressor() -> None:
    """nn.Embedding(sparse=True) under DDP with every compressor's hook: completes (launch's timeout turns a
    hang into a failure), ranks stay identical, and training moved the weights."""
    init = [p.detach().numpy() for p in cw._ddp_model(True).parameters()]
    res = launch(cw.ddp_worker, nprocs=3, args=(cw.SPECS, True, 3), timeout=120)
    for spec in cw.SPECS:
        errors = [f"rank {r}: {res[r][spec]}" for r in range(3) if isinstance(res[r][spec], str)]
        assert not errors, "\n".join(errors)
        for r in range(1, 3):
            for a, b in zip(res[0][spec], res[r][spec], strict=True):
                assert np.array_equal(a, b), spec
        assert any(not np.array_equal(a, b) for a, b in zip(res[0][spec], init, strict=True)), spec


@pytest.mark.large  # 25 s: `-m large` (CI time); exactness of every compressor stays in the default run
def test_convergence_on_digits_within_one_point() -> None:
    """An MLP on scikit-learn's digits, 4 ranks; TopK 1% + error feedback and QSGD 4-bit reach the
    uncompressed test accuracy within 1 point."""
    specs = ("identity", "topk:ratio=0.01", "qsgd:bits=4")
    res = launch(cw.digits_worker, nprocs=4, args=(specs, 400, 0.3), timeout=300)
    acc = res[0]
    assert all(r == acc for r in res)  # every rank holds the same model
    assert acc["identity"] > 90.0, acc
    assert acc["topk:ratio=0.01"] >= acc["identity"] - 1.0, acc
    assert acc["qsgd:bits=4"] >= acc["identity"] - 1.0, acc


# --- QSGD's quantized reduce-scatter ------------------------------------------------------
@pytest.mark.parametrize("P", [1, 3, 5])
def test_qsgd_reduce_scatter_is_unbiased_within_its_variance_bound(P: int) -> None:
    """E[Q₂(Σ_r Q₁(x_r))] = Σ_r x_r on a real gloo group: the mean of DRAWS sums (one seed each) is within 5
    standard errors of the exact sum at every value, the standard error taken from the variance bound in
    qsgd_allreduce's docstring: the first rounding's exact variance Σ_{r≠owner} (M_rb/s)²p(1-p) plus the
    re-quantization's (Σ_r M_rb)²/(4s²) per value (none at P = 1: the sum is the input, exactly).
    The measured variance lies below that bound (and above the first stage's alone when P > 1); every rank
    gets the same sums; casts and the identity leave their inputs alone."""
    draws, bits = 300, 4
    res = launch(cw.unbiased_worker, nprocs=P, args=(draws, bits), timeout=300)
    for r, out in enumerate(res):
        assert np.array_equal(out["sum"], res[0]["sum"]) and np.array_equal(out["squares"], res[0]["squares"])
        assert all(out["untouched"].values()), (r, out["untouched"])
        assert np.array_equal(out["small"], res[0]["small"])
    q, ctxs = QSGD(bits=4, bucket=16), [Context("s", r, P) for r in range(P)]
    xs40 = [cw.unbiased_input(r)[:40] for r in range(P)]
    small = simulate(q, [encode_remote(q, x, 40, c, P) for x, c in zip(xs40, ctxs, strict=True)], xs40, ctxs)
    np.testing.assert_allclose(res[0]["small"], small.numpy() / P, rtol=1e-6, atol=1e-7)  # empty partitions
    xs = [cw.unbiased_input(r).double().numpy() for r in range(P)]
    exact = np.sum(xs, axis=0)
    s, B = 2 ** (bits - 1) - 1, cw.UNBIASED_BUCKET
    first, maxsum = np.zeros_like(exact), np.zeros_like(exact)
    parts = partitions(QSGD(bucket=B), exact.size, P)  # one segment: rank j does not round partition j
    owner = np.concatenate([np.full(hi - lo, j) for j, (lo, hi) in enumerate(parts)])
    for r, x in enumerate(xs):
        M = np.repeat(np.abs(np.pad(x, (0, -x.size % B))).reshape(-1, B).max(1), B)[: x.size]
        lev = np.abs(x) * s / M
        p = lev - np.floor(lev)
        first += (M / s) ** 2 * p * (1 - p) * (owner != r)
        maxsum += M
    mean = res[0]["sum"] / draws
    var = res[0]["squares"] / draws - mean**2
    if P == 1:  # nothing travels: every draw is the input itself
        np.testing.assert_allclose(mean, exact, rtol=1e-6, atol=1e-6)
        assert np.abs(var).max() < 1e-6 * np.abs(exact).max() ** 2
        return
    bound = first + maxsum**2 / (4 * s**2)
    z = (mean - exact) / (np.sqrt(bound / draws) + 1e-6)
    assert np.abs(z).max() < 5.0, f"max |z| = {np.abs(z).max():.2f} at value {np.abs(z).argmax()}"
    assert abs((mean - exact).sum()) / np.sqrt(bound.sum() / draws) < 5.0  # the whole error averages out
    assert var.sum() <= 1.1 * bound.sum()
    assert var.sum() > first.sum()  # the re-quantization's variance is real, and bounded above


@pytest.mark.parametrize("P", [1, 3, 5])
def test_qsgd_pipelined_reduce_scatter_over_segments(P: int) -> None:
    """Several pipeline segments (qsgd_allreduce.segments; the other tests fit in one): every rank gets
    bitwise ``simulate``'s sum; sync (encoded while sending), async (encoded first) and a pre-encoded payload
    agree bit for bit; the average is the sum's scales / P; at P = 1 the sum is the input itself. (With error
    feedback the reduce-scatter is refused: tests/compress/test_feedback_invariant.py.)"""
    assert len(segments(QSGD(bucket=512), cw.PIPELINE_N)) == 3
    res = launch(cw.pipeline_worker, nprocs=P, timeout=180)
    q = QSGD(bits=4, bucket=512, aggregation="reduce_scatter")
    ctxs = [Context("big", r, P) for r in range(P)]
    xs = [cw.pipeline_input(r) for r in range(P)]
    sent = [encode_remote(q, x, cw.PIPELINE_N, c, P) for x, c in zip(xs, ctxs, strict=True)]
    want = simulate(q, sent, xs, ctxs).numpy()
    for r, out in enumerate(res):
        assert np.array_equal(out["sync"], want), f"rank {r}: max diff {np.abs(out['sync'] - want).max()}"
        assert out["async_equal"] and out["payload_equal"], (r, out)
        assert out["mean_error"] < 1e-6, (r, out["mean_error"])
        assert out["input_untouched"], r
    exact = sum(x.double() for x in xs).numpy()
    rel = np.linalg.norm(want - exact) / np.linalg.norm(exact)
    assert (rel == 0) if P == 1 else 0.01 < rel < 0.5, rel  # 4-bit noise (about 0.2 per rounding), not garbage


@pytest.mark.parametrize("P", [2, 3, 5])
def test_casts_chunked_allreduce(P: int) -> None:
    """FP16/BF16 on tensors from ``cast_allreduce.MIN_VALUES`` up (cast, allreduced and widened chunk by chunk):
    bitwise gloo's allreduce of each chunk's 16-bit values, the same on every rank, sync = async; the average is
    the sum / P in float32; the residual is x - the 16-bit round trip; the input is left alone; and the sum is
    within P - 1 roundings of the exact sum of the 16-bit values (numpy, float64)."""
    assert cw.CAST_N >= MIN_VALUES and len(cast_chunks(cw.CAST_N)) == 4
    res = launch(cw.cast_worker, nprocs=P, timeout=180)
    xs = [cw.cast_input(r) for r in range(P)]
    for name, wire in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        halves = [x.to(wire).double().numpy() for x in xs]
        exact = np.sum(halves, axis=0)
        bound = (P - 1) * torch.finfo(wire).eps * np.sum(np.abs(halves), axis=0)
        for r, out in enumerate(res):
            got = out[name]
            assert np.array_equal(got["sum"], res[0][name]["reference"]), (name, r)
            assert np.array_equal(got["reference"], res[0][name]["reference"]), (name, r)
            assert got["async_equal"] and got["residuals_equal"] and got["input_untouched"], (name, r)
            assert np.array_equal(got["mean"], got["sum"] / np.float32(P)), (name, r)
            residual = xs[r] - xs[r].to(wire).float()
            assert np.array_equal(got["residual"], residual.numpy()), (name, r)
            assert np.all(np.abs(got["sum"] - exact) <= bound), (name, r, np.abs(got["sum"] - exact).max())


# --- error feedback on a real group ---------------------------------------------------------------------------
# Relative gaps allowed (of the result's largest value); 0: bit for bit. RandomK scales its values by n/k
# in float32; QSGD's allgather decodes in float32 and gloo sums in another order; fp16 sums round at 16 bits.
EF_OWN_TOL = {"randomk:ratio=0.05": 1e-6}
EF_WIRE_TOL = {
    "randomk:ratio=0.05": 1e-6,
    "qsgd:bits=4,bucket=64": 1e-6,
    "qsgd:bits=4,bucket=64,aggregation=allgather": 1e-6,
    "fp16": 2e-3,
}
# The aggregate is no sum of the ranks' contributions: the sketch's median query is not linear. (QSGD with a
# memory gathers, so its aggregate is the sum of the decoded contributions.)
EF_NO_WIRE = ("sketch:rows=3,cols=300,block=8",)


def test_error_feedback_memory_holds_exactly_what_was_not_sent() -> None:
    """P = 3, three steps, every lossy compressor through each place ``compressed_allreduce`` fills a residual
    (QSGD also async): per rank ``g + e_old == own + e_new``, with ``own`` this rank's
    contribution decompressed by a copy of the compressor taken before the call; the group's sum of
    ``g + e_old - e_new`` is the call's result (``average=False``) where the aggregate is a sum of the
    contributions; and something was kept."""
    steps = 3
    res = launch(cw.ef_worker, nprocs=3, args=(steps,), timeout=180)
    for spec, _, async_op, _ in cw.EF_CASES:
        key = f"{spec}|{'async' if async_op else 'sync'}"
        errors = [f"rank {r}: {out[key]}" for r, out in enumerate(res) if isinstance(out[key], str)]
        assert not errors, "\n".join(errors)
        for r, out in enumerate(res):
            for step, row in enumerate(out[key]):
                where = f"{key}, rank {r}, step {step}: {row}"
                assert row["own_gap"] <= EF_OWN_TOL.get(spec, 0.0) * row["scale"], where
                if spec not in EF_NO_WIRE:
                    assert row["wire_gap"] <= EF_WIRE_TOL.get(spec, 0.0) * row["scale"], where
            assert max(row["residual"] for row in out[key]) > 0, f"{key}, rank {r}: nothing was kept"


# --- the hook's fused path: a dense bucket of sparsifiers as one sparse allreduce -------------------------------
FUSED_SPECS = ("threshold:ratio=0.1,lifespan=2", "topk:ratio=0.1")


def fused_reference(spec: str, calls: list[list[dict[str, Any]]]) -> tuple[list[np.ndarray], list[dict[str, Any]]]:
    """Every hook call's average, from every rank's recorded gradients: each rank's compensate -> compress ->
    update replayed here per parameter with its own compressor and memory, the selected entries summed in
    float64 at their offsets in the bucket. Also each rank's final residuals."""
    P = len(calls)
    comps = [from_spec(spec) for _ in range(P)]
    mems = [ErrorFeedback() for _ in range(P)]
    outs = []
    for i in range(len(calls[0])):
        total = np.zeros(sum(g.size for g in calls[0][i]["grads"]))
        for r in range(P):
            offset = 0
            for name, g in zip(calls[r][i]["names"], calls[r][i]["grads"], strict=True):
                x = mems[r].compensate(name, torch.from_numpy(g))
                p = comps[r].compress(x, Context(name, r, P))
                mems[r].update(name, x, comps[r].decompress(p, TensorSpec.of(x)))
                assert isinstance(p, SparsePayload)
                s = p.stream
                assert s.indices is not None
                total[offset + s.indices.long().numpy()] += s.values.double().numpy()
                offset += g.size
        outs.append(total / P)
    residuals = [{n: e.numpy() for n in m.names() if (e := m.error(n)) is not None} for m in mems]
    return outs, residuals


@pytest.mark.parametrize("P", [1, 3, 5])
def test_ddp_hook_sends_a_bucket_of_sparsifiers_as_one_sparse_allreduce(P: int) -> None:
    """DCT-DP and TopK through the hook on a DDP model whose six parameters share one bucket: every hook call
    equals the float64 sum of every rank's per-parameter selection (same compressor, same memory, replayed
    here), divided by P; the residuals are exactly the reference's and the per-parameter path's on the same
    gradients; one CommRecord per bucket (one sparse allreduce). A bucket mixing Identity in (``plan=``) keeps
    one reduction per gradient."""
    specs = (*FUSED_SPECS, f"mixed:{FUSED_SPECS[0]}")
    res = launch(cw.fused_hook_worker, nprocs=P, args=(specs, cw.FUSED_STEPS), timeout=180)
    for spec in specs:
        errors = [f"rank {r}: {res[r][spec]}" for r in range(P) if isinstance(res[r][spec], str)]
        assert not errors, "\n".join(errors)
    for spec in FUSED_SPECS:
        runs = [res[r][spec] for r in range(P)]
        calls = [run["calls"] for run in runs]
        assert len(calls[0]) == cw.FUSED_STEPS and len(calls[0][0]["names"]) == 6  # one bucket per step
        ref, ref_residuals = fused_reference(spec, calls)
        numel = sum(g.size for g in calls[0][0]["grads"])  # the bucket's
        for r, run in enumerate(runs):
            assert run["records"] == [("sparse_allreduce", numel)] * cw.FUSED_STEPS, run["records"]
            for i, call in enumerate(run["calls"]):
                assert np.array_equal(call["out"], runs[0]["calls"][i]["out"])  # every rank the same bits
                scale = max(1.0, float(np.abs(ref[i]).max()))
                np.testing.assert_allclose(call["out"], ref[i], rtol=1e-6, atol=1e-6 * scale, err_msg=f"rank {r}")
                np.testing.assert_allclose(run["per_param"][i], call["out"], rtol=1e-6, atol=1e-6 * scale)
            assert run["residuals"].keys() == ref_residuals[r].keys() == run["per_param_residuals"].keys()
            for name, e in run["residuals"].items():
                assert np.array_equal(e, ref_residuals[r][name]), (spec, r, name)
                assert np.array_equal(e, run["per_param_residuals"][name]), (spec, r, name)
    mixed = res[0][specs[-1]]
    assert len(mixed["records"]) == 6 * cw.FUSED_STEPS, mixed["records"]  # one reduction per gradient


def test_fused_hook_refuses_a_bucket_whose_members_differ_on_every_rank() -> None:
    """Rank 1's bucket lists two same-shape weights in the other order: every rank's future raises the name
    mismatch, and the group stays in step for the next bucket."""
    for out in launch(cw.fused_bucket_worker, nprocs=3, args=("swap",), timeout=60):
        assert out["error"].startswith("ValueError") and "name mismatch" in out["error"], out["error"]
        assert np.array_equal(out["after"], np.ones(40))


def test_fused_hook_with_all_zero_gradients() -> None:
    """All-zero gradients: DCT-DP selects nothing (an empty stream from every rank), TopK k zeros; the bucket
    comes back zero every step."""
    for out in launch(cw.fused_bucket_worker, nprocs=3, args=("zeros",), timeout=60):
        for comp in ("Threshold", "TopK"):
            assert all(np.array_equal(b, np.zeros(40)) for b in out[comp]["bufs"]), out[comp]
        assert out["Threshold"]["nnz_in"] == [0, 0, 0]
        assert out["TopK"]["nnz_in"] == [4 + 1 + 4 + 1] * 3
