"""The table group's C kernels (sparsync.sharding.kernels) against the torch ops they stand for, bit for bit: the
sorted unique with inverse, the row gather and its backward, the owner's sum (coalesce) and the fused optimizers'
updates, on random inputs, empty ones, one element, all-duplicate keys and keys near the int64 limits, in float32
and float64; and the torch path taken when forced."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sparsync.sharding import kernels
from sparsync.sharding.group import SGD, Adagrad, Adam, RowwiseAdagrad
from sparsync.sharding.ids import dedupe_groups

BIG = 2**63 - 1
KEYS = {
    "empty": lambda g: torch.empty(0, dtype=torch.int64),
    "one": lambda g: torch.tensor([7]),
    "duplicates": lambda g: torch.full((1000,), 42, dtype=torch.int64),
    "zipf": lambda g: (torch.rand(13312, generator=g) ** 4 * 2_600_000).long(),
    "wide": lambda g: torch.randint(-BIG - 1, BIG, (5000,), generator=g),
    "limits": lambda g: torch.tensor([BIG, -BIG - 1, 0, BIG, -1, -BIG - 1, 1, BIG - 1]),
    "few": lambda g: torch.randint(0, 3, (777,), generator=g),
}
DTYPES = (torch.float32, torch.float64)


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit pattern (so -0.0 and NaN compare as bits)."""
    return t.view(torch.int64 if t.dtype == torch.float64 else torch.int32)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def test_group_c_kernels_are_built() -> None:
    assert kernels.built(), "sparsync.sharding._group_c is not built: run `make setup` (needs gcc)"


@pytest.mark.parametrize("case", KEYS)
def test_unique_equals_torch_unique(case: str) -> None:
    keys = KEYS[case](torch.Generator().manual_seed(1))
    got, inverse = kernels.unique(keys, "c")
    want, want_inverse = torch.unique(keys, sorted=True, return_inverse=True)
    assert torch.equal(got, want) and torch.equal(inverse, want_inverse)
    assert got.dtype == inverse.dtype == torch.int64 and inverse.shape == keys.shape


def test_dedupe_groups_equals_its_torch_path() -> None:
    g = torch.Generator().manual_seed(2)
    ids = [(torch.rand(n, generator=g) ** 3 * r).long() for n, r in ((512, 10), (0, 5), (2048, 100_000), (1, 3))]
    for parts in (1, 3, 5):
        for a, b in zip(dedupe_groups(ids, parts, "c"), dedupe_groups(ids, parts, "torch"), strict=True):
            assert torch.equal(a.distinct, b.distinct) and torch.equal(a.positions, b.positions)
            assert a.per_owner == b.per_owner


def values(n: int, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    out = (torch.randn(n, d, generator=g, dtype=torch.float64) * torch.rand(n, 1, generator=g, dtype=torch.float64)
           ** 8 * 1e3).to(dtype)  # fmt: skip
    if n:
        out[0, 0] = -0.0  # 0 + -0.0 is +0.0 in both
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["empty", "one", "duplicates", "few", "zipf"])
def test_gather_and_its_backward_equal_index_select(case: str, dtype: torch.dtype) -> None:
    rows = KEYS[case](torch.Generator().manual_seed(3)) % 1000
    src = values(1000, 16, dtype, 4)
    assert same(kernels.gather(src, rows, "c"), src.index_select(0, rows))
    grad = values(rows.numel(), 16, dtype, 5)
    a, b = src.clone().requires_grad_(), src.clone().requires_grad_()
    out = kernels.pick_rows(a, rows, "c")
    assert out.grad_fn is not None and "Pick" in type(out.grad_fn).__name__  # the C path ran
    out.backward(grad)
    b.index_select(0, rows).backward(grad)
    assert a.grad is not None and b.grad is not None and same(out.detach(), src.index_select(0, rows))
    assert same(a.grad, b.grad)


def coalesced(rows: torch.Tensor, v: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    coo = torch.sparse_coo_tensor(rows.unsqueeze(0), v, (size, v.shape[1]), check_invariants=True).coalesce()
    return coo.indices()[0], coo.values()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["empty", "one", "two_requesters", "pairs", "threes"])
def test_sum_rows_equals_coalesce(case: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(8)
    draws = {
        "empty": lambda: torch.empty(0, dtype=torch.int64),
        "one": lambda: torch.tensor([5]),
        "two_requesters": lambda: torch.cat(
            [torch.randperm(5000, generator=g)[:n].sort().values for n in (3000, 2500)]
        ),
        "pairs": lambda: torch.randperm(5000, generator=g)[:2000].repeat(2)[torch.randperm(4000, generator=g)],
        "threes": lambda: torch.randint(0, 50, (4000,), generator=g),  # coalesce's order matters: coalesce runs
    }
    rows = draws[case]()
    v = values(rows.numel(), 16, dtype, 9)
    calls = []
    real = kernels._native.sum_rows
    monkeypatch.setattr(kernels._native, "sum_rows", lambda *a: calls.append(real(*a)) or calls[-1])
    got_rows, got = kernels.sum_rows(rows, v, 5000, "c")
    want_rows, want = coalesced(rows, v, 5000)
    assert torch.equal(got_rows, want_rows) and same(got, want)
    assert calls == [-1 if case == "threes" else len(want_rows)]  # C, or its refusal then coalesce


def test_a_row_out_of_range_raises_and_writes_nothing() -> None:
    src = torch.zeros(4, 2)
    with pytest.raises(IndexError, match="row 4 at position 1"):
        kernels.gather(src, torch.tensor([0, 4]), "c")
    with pytest.raises(IndexError, match="row -1 at position 0"):
        kernels.scatter_add(src, torch.tensor([-1, 0, 1, 2]), 4, "c")
    w = torch.zeros(4, 2)
    with pytest.raises(IndexError, match="row 9 at position 1"):
        kernels.step_rows(w, torch.tensor([0, 9]), torch.ones(2, 2), 0.1, kernels="c")
    with pytest.raises(IndexError, match="row -4 at position 2"):
        kernels.add_rows(w, torch.tensor([0, 1, -4]), torch.ones(3, 2), "c")
    assert not w.any()


class _Group:
    """What ``Fused.update`` reads of a group: its flat tensor, and its slots (Adam: one table, first row 0)."""

    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat
        self.slots = [SimpleNamespace(index=0, first=0)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("make", [SGD, Adagrad, RowwiseAdagrad, Adam], ids=lambda m: m.__name__)
@pytest.mark.parametrize("n", [0, 1, 300])
def test_fused_updates_equal_their_torch_path(make: type, n: int, dtype: torch.dtype) -> None:
    R, D = 1000, 16
    rows = torch.randperm(R, generator=torch.Generator().manual_seed(n))[:n].sort().values
    runs = []
    for setting in ("c", "torch"):
        opt = make(lr=0.37, kernels=setting)
        group = _Group(values(R, D, dtype, 6))
        opt.init(group)
        for step in range(3):  # the state carries over: its sums feed the next step's update
            opt.update(group, rows, values(n, D, dtype, 7 + step), group.slots)  # type: ignore[arg-type]
        runs.append((group.flat, opt.state))
    (w_c, s_c), (w_t, s_t) = runs
    assert same(w_c, w_t)
    assert s_c.keys() == s_t.keys() and all(same(s_c[k], s_t[k]) for k in s_c if k != "step")


def test_kernels_setting_is_checked_and_torch_forces_the_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="'fast'"):
        SGD(lr=0.1, kernels="fast")
    with pytest.raises(ValueError, match="'gpu'"):
        kernels.unique(torch.tensor([1]), "gpu")

    def refuse(*args: object) -> None:
        raise AssertionError("the C kernel ran")

    for name in ("unique", "gather", "scatter_add", "sum_rows", "update"):  # every C kernel
        monkeypatch.setattr(kernels._native, name, refuse)
    kernels.unique(torch.tensor([3, 1, 3]), "torch")
    kernels.sum_rows(torch.tensor([3, 1, 3]), torch.ones(3, 2), 4, "torch")
    src = torch.ones(3, 2, requires_grad=True)
    kernels.pick_rows(src, torch.tensor([2, 2]), "torch").sum().backward()
    w = torch.zeros(3, 2)
    SGD(lr=0.1, kernels="torch").update(_Group(w), torch.tensor([1]), torch.ones(1, 2), [])  # type: ignore[arg-type]
    assert torch.equal(w[1], torch.full((2,), -0.1))
    with pytest.raises(AssertionError, match="the C kernel ran"):
        kernels.unique(torch.tensor([3, 1, 3]), "auto")
    monkeypatch.setattr(kernels, "_native", None)
    with pytest.raises(RuntimeError, match="not built"):
        SGD(lr=0.1, kernels="c")
    assert torch.equal(kernels.unique(torch.tensor([3, 1, 3]))[1], torch.tensor([1, 0, 1]))  # auto: torch
