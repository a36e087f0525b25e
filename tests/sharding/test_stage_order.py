"""A sharded step runs through ``sparsync.sharding`` in stage order (``exchange``'s module doc), traced at P = 2
on test_shard's nine tables (three groups; embeddings and bags of every kind), every call that enters a module
of the package from outside it recorded (``_stage_order_workers.Entries``):

- the exchange: the stand-in asks the driver (``exchange``) to run, the driver reads the layout (``group``),
  runs the ids stage (``ids``), then the rows stage and the pooling (``rows``), and the stand-ins hand out their
  tensors (``exchange``): each module entered in one stretch, in that order, ``ids`` and ``rows`` once each from
  the driver;
- with ``Lookahead``, the same without ``ids`` (the batch's ids stage ran during the step before);
- the backward: the gradient rows stage (``rows``), then with a fused optimizer the update of the group's rows
  (``group``, called by ``rows``);
- the layers: the driver calls the stages, the stages call the storage they run on (``group``: the layout and the
  rows' update) and the primitives (``kernels``: the C kernels and the rounds' transport); no module calls one
  above it, and ``kernels`` calls nothing of the package.
"""

from __future__ import annotations

import _stage_order_workers as so
import pytest

from sparsync import launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

ORDER = ("exchange", "ids", "rows", "group")  # the driver, the stages, the storage they run on (layout, update)
PRIMITIVES = ("kernels",)


def stretches(entries: list[tuple[str | None, str]]) -> list[str]:
    """The modules entered, primitives left out, consecutive repeats collapsed."""
    out: list[str] = []
    for _, module in entries:
        if module not in PRIMITIVES and (not out or out[-1] != module):
            out.append(module)
    return out


def check(entries: list[tuple[str | None, str]]) -> None:
    """Calls go down ``ORDER`` (or into the primitives) only, and the primitives call nothing of the package."""
    for caller, callee in entries:
        assert caller not in PRIMITIVES, (caller, callee)
        if caller is not None and callee not in PRIMITIVES:
            assert ORDER.index(callee) > ORDER.index(caller), (caller, callee)


@pytest.mark.parametrize(("fused", "ahead"), [(False, False), (True, False), (False, True)])
def test_a_sharded_step_enters_each_module_once_in_stage_order(fused: bool, ahead: bool) -> None:
    """With ``Lookahead`` the forward's ids stage ran during the step before: the forward skips ``ids``."""
    res = launch(so.step_worker, nprocs=2, args=(fused, ahead))
    stages = ["rows"] if ahead else ["ids", "rows"]
    for rank, r in enumerate(res):
        forward, backward = r["forward"], r["backward"]
        assert stretches(forward) == ["exchange", "group", *stages, "exchange"], (rank, forward)
        entered = [(c, m) for c, m in forward if m in ("ids", "rows") and c is not None]
        assert entered == [("exchange", m) for m in stages], (rank, forward)
        assert all((m, "kernels") in forward for m in stages), (rank, forward)  # the rounds ran
        assert stretches(backward) == (["rows", "group"] if fused else ["rows"]), (rank, backward)
        assert (("rows", "group") in backward) == fused, (rank, backward)  # the update, from the rows stage
        check(forward)
        check(backward)


def test_the_check_refuses_a_call_back_up_the_order_and_one_out_of_a_primitive() -> None:
    good = [(None, "exchange"), ("exchange", "ids"), ("ids", "kernels"), ("exchange", "rows")]
    check(good)
    assert stretches(good) == ["exchange", "ids", "rows"]
    for bad in (
        ("rows", "ids"),
        ("kernels", "rows"),
        ("ids", "exchange"),
        ("group", "rows"),
        ("kernels", "group"),
    ):
        with pytest.raises(AssertionError):
            check([*good, bad])
    assert stretches([*good, (None, "ids"), (None, "rows")]) == ["exchange", "ids", "rows", "ids", "rows"]
