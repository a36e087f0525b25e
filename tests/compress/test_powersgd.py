"""PowerSGD (Vogels et al. 2019, Algorithm 1) against a float64 reference written here (numpy: power iteration,
warm start, error feedback), on real gloo groups of 1, 3 and 5 ranks under NCCL's rules; its error-feedback
invariant; a DDP bucket of matrices and vectors; DDP with several buckets in flight; torch's ``powerSGD_hook``;
``DistributedOptimizer`` with the ``Compressed`` placement; and the single-process parts."""

from __future__ import annotations

from typing import Any

import _powersgd_workers as pw
import numpy as np
import pytest
import torch
from _nccl_rules import check_run, merged_under_nccl_rules

from sparsync import launch
from sparsync.compress import (
    Context,
    DensePayload,
    ErrorFeedback,
    LowRankPayload,
    MomentumCorrection,
    PowerSGD,
    TensorSpec,
    from_spec,
)
from sparsync.compress.lowrank import Factor, exchange, orthogonalize_

STEPS = 4


# --- the reference ------------------------------------------------------------------------------------------
def orthonormal(p: np.ndarray) -> np.ndarray:
    """Gram-Schmidt's result, by QR: orthonormal columns spanning the same nested subspaces, R's diagonal > 0."""
    q, r = np.linalg.qr(p)
    s = np.sign(np.diag(r))
    s[s == 0] = 1.0
    return q * s  # type: ignore[no-any-return]


class Reference:
    """One tensor's PowerSGD over P ranks in float64: P = Σ M_i Q, P̂ = orthonormal(P), Q_i = M_i^T P̂,
    e_i = M_i - P̂ Q_i^T, Q ← Σ Q_i (warm start), result P̂ Q^T / P. A vector: the exact mean, no residual."""

    def __init__(self, P: int, q0: np.ndarray | None) -> None:
        self.P, self.q = P, q0
        self.e: list[np.ndarray | float] = [0.0] * P

    def step(self, grads: list[np.ndarray]) -> np.ndarray:
        shape = grads[0].shape
        xs = [g.astype(np.float64) + e for g, e in zip(grads, self.e, strict=True)]
        if self.q is None:
            return sum(xs) / self.P  # type: ignore[no-any-return]
        ms = [x.reshape(shape[0], -1) for x in xs]
        p_hat = orthonormal(sum(m @ self.q for m in ms))  # type: ignore[arg-type]
        qs = [m.T @ p_hat for m in ms]
        self.e = [(m - p_hat @ q.T).reshape(shape) for m, q in zip(ms, qs, strict=True)]
        self.q = sum(qs)  # type: ignore[assignment]
        return (p_hat @ self.q.T).reshape(shape) / self.P  # type: ignore[union-attr, no-any-return]


def reference(name: str, shape: tuple[int, ...], dtype: torch.dtype, r: int, P: int, steps: int) -> Reference:
    comp = PowerSGD(rank=r)
    fr = comp.factor_rank(shape)
    q0 = None if fr is None else comp.initial_q(name, int(np.prod(shape[1:])), fr).numpy()
    return Reference(P, q0)


def inputs(name: str, shape: tuple[int, ...], dtype: torch.dtype, P: int, step: int) -> list[np.ndarray]:
    return [pw.grad_input(rank, step, name, shape, dtype).numpy() for rank in range(P)]


def close(a: np.ndarray, b: np.ndarray, rel: float) -> bool:
    return bool(np.abs(a - b).max() <= rel * max(1.0, float(np.abs(b).max())))


# --- compressed_allreduce and the hook's bucket at P = 1, 3, 5 under NCCL's rules ----------------------------
@pytest.fixture(scope="module", params=[1, 3, 5], ids=lambda p: f"P{p}")
def run(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    P = int(request.param)
    return P, launch(merged_under_nccl_rules, nprocs=P, args=(pw.reduce_worker, STEPS), timeout=60)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_matches_the_float64_reference_over_steps(run: tuple[int, list[dict[str, Any]]]) -> None:
    P, results = run
    check_run(results, {"all_reduce": 2 * STEPS})
    for name, (shape, dtype, r) in pw.TENSORS.items():
        ref = reference(name, shape, dtype, r, P, STEPS)
        rel = 1e-10 if dtype == torch.float64 else 1e-4
        for step in range(STEPS):
            want = ref.step(inputs(name, shape, dtype, P, step))
            for rank, res in enumerate(results):
                got = res[name]
                assert close(got["steps"][step], want, rel), (name, step, rank)
                assert np.array_equal(got["steps"][step], results[0][name]["steps"][step])  # the same bits
                assert np.array_equal(got["async"][step], got["steps"][step])
                assert close(got["residuals"][step], np.broadcast_to(ref.e[rank], shape), rel), (name, step, rank)
        if ref.q is not None:
            assert close(results[0][name]["q"], ref.q, rel), name  # the warm start: Σ_i Q_i
        else:
            assert results[0][name]["q"] is None


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_error_feedback_invariant(run: tuple[int, list[dict[str, Any]]]) -> None:
    """sent_i + e_new_i == g_i + e_old_i on every rank, where the ranks' sent_i add up to P times the result:
    Σ_i (g_i + e_old_i - e_new_i) == P · result at every step (nothing sent is lost or counted twice)."""
    P, results = run
    for name, (shape, dtype, _r) in pw.TENSORS.items():
        rel = 1e-12 if dtype == torch.float64 else 1e-5
        for step in range(STEPS):
            grads = inputs(name, shape, dtype, P, step)
            sent = 0.0
            for rank, res in enumerate(results):
                old = res[name]["residuals"][step - 1] if step else 0.0
                sent = sent + grads[rank].astype(np.float64) + old - res[name]["residuals"][step]
            total = P * results[0][name]["steps"][step].astype(np.float64)
            assert close(np.asarray(sent), total, rel), (name, step)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_bucket_of_matrices_and_vectors(run: tuple[int, list[dict[str, Any]]]) -> None:
    """The hook's bucket route: each matrix as the reference, each vector the exact mean with no residual, two
    allreduces per bucket (P's with the vectors, then Q's) and the bytes of both."""
    P, results = run
    params = dict(pw.bucket_model().named_parameters())
    order = results[0]["bucket"]["order"]
    refs = {n: reference(n, tuple(params[n].shape), torch.float64, pw.BUCKET_RANK, P, STEPS) for n in order}
    for step in range(STEPS):
        want = [refs[n].step(inputs(n, tuple(params[n].shape), torch.float64, P, step)).reshape(-1) for n in order]
        for res in results:
            assert close(res["bucket"]["buffers"][step], np.concatenate(want), 1e-10), step
    wire = 0
    for n in order:
        shape = tuple(params[n].shape)
        fr = PowerSGD(rank=pw.BUCKET_RANK).factor_rank(shape)
        assert (fr is None) == (len(shape) == 1)  # this model's matrices are all factored
        wire += int(np.prod(shape)) if fr is None else (shape[0] + shape[1]) * fr
    for rank, res in enumerate(results):
        for n in order:
            want_e = refs[n].e[rank] if refs[n].q is not None else 0.0  # a vector travels whole: nothing left
            assert close(res["bucket"]["residuals"][n], np.broadcast_to(want_e, params[n].shape), 1e-10), n
        assert [r[:2] for r in res["bucket"]["records"]] == [("powersgd", wire)] * STEPS
        assert all(r[3] == 4 * (P - 1) for r in res["bucket"]["records"])  # two ring allreduces


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_reports_the_bytes_it_sends(run: tuple[int, list[dict[str, Any]]]) -> None:
    P, results = run
    ring = lambda nbytes: 2 * (P - 1) * nbytes // P  # noqa: E731  # gloo's ring allreduce, per rank
    for res in results:
        # "w": 12 x 15 at rank 2: P 24 values, Q 30 values, float64
        assert res["w"]["records"] == [("powersgd", 54, ring(24 * 8) + ring(30 * 8))] * STEPS
        assert res["v"]["records"] == [("powersgd", 7, ring(7 * 8))] * STEPS  # a vector: whole, one allreduce


# --- DDP (several buckets; torch's hook) and DistributedOptimizer, at P = 3 ---------------------------------
@pytest.fixture(scope="module")
def ddp() -> list[dict[str, Any]]:
    return launch(pw.ddp_and_optimizer_worker, nprocs=3, timeout=60)  # a hang fails every collective at 60 s


def _grads_close(a: list[list[np.ndarray]], b: list[list[np.ndarray]], rel: float) -> bool:
    return all(close(x, y, rel) for sa, sb in zip(a, b, strict=True) for x, y in zip(sa, sb, strict=True))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_ddp_with_several_buckets_in_flight(ddp: list[dict[str, Any]]) -> None:
    """Several buckets on gloo at P = 3 (torch's own PowerSGD hook hangs there): no hang, and the same gradients
    as with one bucket for the whole model (per-name state: the bucket layout changes no result)."""
    for res in ddp:
        assert len(res["ours_many_buckets"]) > 2, res["ours_many_buckets"]
        assert res["ours_one_buckets"] == [0]
        assert _grads_close(res["ours_many"], res["ours_one"], 1e-12)  # float64 sums in another order: 1e-15
        assert _grads_close(res["ours_many"], ddp[0]["ours_many"], 0.0)  # the same on every rank
    first, last = ddp[0]["ours_one"][0], ddp[0]["ours_one"][-1]
    assert not _grads_close([first], [last], 1e-3)  # the model did train


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_same_result_as_torch_powersgd_hook(ddp: list[dict[str, Any]]) -> None:
    """torch's ``powerSGD_hook`` with one bucket (rank 2, ``start_powerSGD_iter`` 2, warm start, error feedback,
    ``min_compression_rate`` 1) against ours from the same first Qs: the same gradients at every step, to float64
    rounding (relative 1e-12; 4e-15 measured). Not bitwise: torch divides before its allreduce, sends the vectors
    in an allreduce of their own (sums in another order), re-orthogonalizes the warm-start Q, and keeps
    x - P̂ Q^T / P as each rank's residual where ours keeps x - P̂ Q_i^T: the residuals differ per rank, their
    sum is the same, and the result depends on the ranks' inputs only through that sum."""
    for res in ddp:
        assert res["torch_order"], "torch's hook never compressed"
        for step, (mine, theirs) in enumerate(zip(res["ours_torch_q"], res["torch"], strict=True)):
            assert _grads_close([mine], [theirs], 1e-12), step  # measured: at most 4e-15
    # from its own first Qs ours differs (a different, equally valid start): the comparison above can fail
    assert not _grads_close(ddp[0]["ours_one"][pw.START :], ddp[0]["torch"][pw.START :], 1e-6)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_distributed_optimizer_compressed_placement(ddp: list[dict[str, Any]]) -> None:
    """``Compressed(PowerSGD(rank=2), ErrorFeedback())`` for every parameter: each step's averaged gradient is the
    reference's of the ranks' local gradients; with overlap the same training."""
    P = len(ddp)
    opt = [res["optimizer"] for res in ddp]
    names = list(opt[0]["local"][0])
    params = dict(pw.bucket_model().named_parameters())
    refs = {n: reference(n, tuple(params[n].shape), torch.float64, pw.BUCKET_RANK, P, pw.OPT_STEPS) for n in names}
    for step in range(pw.OPT_STEPS):
        for n in names:
            want = refs[n].step([o["local"][step][n] for o in opt])
            for o in opt:
                assert close(o["averaged"][step][n], want, 1e-10), (step, n)
    for res in ddp:
        for n in names:
            assert close(res["optimizer_overlap"]["params"][n], res["optimizer"]["params"][n], 1e-12), n


# --- one process ------------------------------------------------------------------------------------------
def test_registry_settings_and_bad_settings() -> None:
    c = from_spec("powersgd:rank=4,min_compression_rate=2,start_iter=10")
    assert isinstance(c, PowerSGD) and (c.rank, c.min_compression_rate, c.start_iter) == (4, 2, 10)
    for kwargs, match in (
        ({"rank": 0}, "rank"),
        ({"rank": 1.5}, "rank"),
        ({"min_compression_rate": -1}, "min_compression_rate"),
        ({"start_iter": -1}, "start_iter"),
        ({"warm_start": 1}, "warm_start"),
    ):
        with pytest.raises(ValueError, match=match):
            PowerSGD(**kwargs)  # type: ignore[arg-type]


def test_what_is_factored() -> None:
    c = PowerSGD(rank=4)
    assert c.factor_rank((100,)) is None  # a vector: whole
    assert c.factor_rank((64, 3, 3, 3)) == 4  # a conv kernel: 64 x 27
    assert c.factor_rank((6, 5)) is None  # 4·(6 + 5) = 44 values > 30: no gain
    assert c.factor_rank((2, 100)) is None  # at r = min(n, m) factors never gain at a rate >= 1 ...
    assert PowerSGD(rank=4, min_compression_rate=0.5).factor_rank((2, 100)) == 2  # ... r is capped there
    assert PowerSGD(rank=4, min_compression_rate=2).factor_rank((12, 12)) is None  # 96·2 >= 144


def test_one_rank_round_trip_is_the_reference_and_warm_starts() -> None:
    c = PowerSGD(rank=2)
    ref = reference("w", (10, 8), torch.float64, 2, 1, 3)
    for step in range(3):
        x = pw.grad_input(0, step, "w", (10, 8), torch.float64)
        payload = c.compress(x, Context("w"))
        assert isinstance(payload, LowRankPayload) and payload.nbytes == (10 + 8) * 2 * 8
        ref.e = [0.0]  # compress alone keeps no residual (that is the memory's)
        assert close(c.decompress(payload, TensorSpec.of(x)).numpy(), ref.step([x.numpy()]), 1e-10), step
    v = c.compress(torch.arange(5.0), Context("v"))
    assert isinstance(v, DensePayload)
    assert torch.equal(c.decompress(v, TensorSpec.of(torch.arange(5.0))), torch.arange(5.0))


def roundtrip(c: PowerSGD, x: torch.Tensor, name: str) -> torch.Tensor:
    return c.decompress(c.compress(x, Context(name)), TensorSpec.of(x))


def test_state_dict_round_trip_restores_the_warm_start() -> None:
    a = PowerSGD(rank=2)
    xs = [pw.grad_input(0, s, "w", (9, 7), torch.float64) for s in range(4)]
    for x in xs[:2]:
        roundtrip(a, x, "w")
    b = PowerSGD(rank=2)
    b.load_state_dict(a.state_dict())
    assert a.state_dict()["w"]["calls"] == 2
    for x in xs[2:]:
        assert torch.equal(roundtrip(a, x, "w"), roundtrip(b, x, "w"))
    fresh = PowerSGD(rank=2)  # without the state: another start, another result
    assert not torch.equal(roundtrip(fresh, xs[3], "w"), roundtrip(a, xs[3], "w"))
    with pytest.raises(ValueError, match="calls"):
        b.load_state_dict({"w": {"q": None}})
    with pytest.raises(ValueError, match="one name per tensor"):
        a.compress(torch.ones(5, 6, dtype=torch.float64), Context("w"))


def test_orthogonalize_dependent_and_zero_columns() -> None:
    """Column 2 is column 1 twice (what is left of it is rounding noise), column 3 is zero: both become zero, the
    first is normalized, and nothing is NaN."""
    p = torch.tensor([[1.0, 2.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 2.0, 0.0]])
    orthogonalize_([p])
    assert torch.allclose(p[:, 0], torch.tensor([1.0, 0.0, 0.0, 1.0]) / 2**0.5)
    assert not p[:, 1:].any()
    assert not roundtrip(PowerSGD(rank=2), torch.zeros(6, 5), "z").any()


def test_a_rank_one_gradient_at_rank_two_is_itself() -> None:
    """A rank-1 matrix (a Linear layer's gradient for one sample) at r = 2: P̂ P̂^T M is a projection of M onto a
    subspace holding its column space, so M itself, at every warm-started step."""
    g = torch.Generator().manual_seed(3)
    m = torch.outer(torch.randn(30, generator=g), torch.randn(20, generator=g))
    c = PowerSGD(rank=2)
    for _ in range(3):
        assert torch.allclose(roundtrip(c, m, "m"), m, atol=1e-5 * float(m.abs().max()))


def test_the_residual_handed_to_the_memory_is_what_update_would_store() -> None:
    """PowerSGD hands the memory its residual, x - P̂ Q_i^T, taken in one pass (``update_residual``):
    ErrorFeedback keeps it as given, and a memory without that method of its own (MomentumCorrection: it masks its
    velocity where something was sent) ends in the state ``update`` with what was sent leaves."""
    x = pw.grad_input(0, 0, "w", (10, 8), torch.float64)
    q = PowerSGD(rank=2).initial_q("w", 8, 2)
    (out,) = exchange([Factor(x, q)], None, residual=True)
    assert out.residual is not None
    sent = x - out.residual
    assert torch.allclose(sent, out.total, rtol=0, atol=1e-12)  # one rank: its part is the whole sum
    ef = ErrorFeedback()
    ef.update_residual("w", x, out.residual)
    kept = ef.error("w")
    assert kept is not None and torch.equal(kept, out.residual)
    assert kept.data_ptr() == out.residual.data_ptr()  # kept, not copied
    a, b = MomentumCorrection(0.9), MomentumCorrection(0.9)
    for m in (a, b):
        m.compensate("w", x)
    a.update_residual("w", x, out.residual)
    b.update("w", x, sent)
    for got, want in ((a.error("w"), b.error("w")), (a.velocity("w"), b.velocity("w"))):
        assert got is not None and want is not None and torch.equal(got, want)
    v = a.velocity("w")
    assert v is not None and not v.any()  # a dense P̂ Q^T: every entry was sent, all masked


@pytest.mark.parametrize("r", [1, 2, 3])  # 1 and 2: broadcast multiply-adds; 3: one gemm (lowrank.OUTER_RANK)
def test_exchange_divides_and_writes_into_the_given_buffers(r: int) -> None:
    """``exchange``'s ``divisor`` and ``into`` (the hook's path: the sums written straight into the bucket) give
    the plain sums divided, for factors and a tensor sent whole; ``into`` may be the inputs' own storage."""
    xs = [pw.grad_input(0, 0, n, shape, torch.float64) for n, shape in (("a", (9, 7)), ("v", (5,)))]
    q = PowerSGD(rank=r).initial_q("a", 7, r)
    plain = exchange([Factor(xs[0], q), Factor(xs[1], None)], None)
    flat = torch.cat([x.reshape(-1) for x in xs])
    pieces = list(torch.split(flat, [x.numel() for x in xs]))
    views = [p.view(x.shape) for p, x in zip(pieces, xs, strict=True)]
    got = exchange([Factor(views[0], q), Factor(views[1], None)], None, divisor=3, into=pieces)
    for p, g, piece in zip(plain, got, pieces, strict=True):
        assert torch.allclose(g.total, p.total / 3, rtol=1e-14, atol=1e-15)
        assert g.total.data_ptr() == piece.data_ptr()
    assert not torch.allclose(plain[0].total, xs[0], atol=1e-6)  # factored: an approximation of rank r < 7
    assert torch.equal(plain[1].total, xs[1])  # whole: itself
