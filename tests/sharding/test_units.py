"""Single-process parts of ``sparsync.shard``: the stride ownership, the ids payload's round trip, the lazy
stand-in, the ``sharded`` placement and its plan kind, the ``server`` placement's mark and refusals."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import HashStore

import sparsync
from sparsync.placement import NamedParam, OnServer, ReduceEnv, Sharded, placement_of
from sparsync.placement.sharded import mark
from sparsync.plan import KINDS, Cluster, ParamStats, make_plan
from sparsync.plan.kinds import ID_WIRE_BYTES
from sparsync.sharding import LazyLookup, Ownership, plan_of
from sparsync.sharding.ids import MARGIN, Asked, dedupe_groups, ids_payload, parse_requests
from sparsync.sharding.rows import group_major, peer_major


@pytest.mark.parametrize(("rows", "P"), [(1, 1), (7, 3), (10, 5), (3, 5), (30, 3)])
def test_stride_ownership_is_balanced_and_round_trips_whole_tables(rows: int, P: int) -> None:
    own = Ownership(rows, P)
    counts = own.counts()
    assert sum(counts) == rows and max(counts) - min(counts) <= 1 and max(counts) == own.chunk
    table = torch.arange(rows * 2, dtype=torch.float64).view(rows, 2)
    blocks = own.to_blocks(table)
    for j in range(P):
        mine = own.global_rows(j)
        assert mine.numel() == counts[j]
        assert torch.equal(blocks[j, : counts[j]], table[mine])
        assert bool((own.owner(mine) == j).all()) and torch.equal(own.local(mine), torch.arange(counts[j]))
    assert torch.equal(own.from_blocks(blocks), table)


def test_hot_consecutive_ids_spread_over_the_owners() -> None:
    """A Zipf head at the low ids (the first P ids) lands on P different owners, not on rank 0."""
    own = Ownership(1000, 4)
    assert sorted(own.owner(torch.arange(4)).tolist()) == [0, 1, 2, 3]


def dedupe(ids: torch.Tensor, ownership: Ownership) -> Asked:
    """The reference for one table: ``ids`` as distinct ids in owner order, and where each id finds its row
    among them (``dedupe_groups`` does every table of an exchange at once)."""
    distinct, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    owner = ownership.owner(distinct)
    order = torch.sort(owner, stable=True).indices  # distinct ids are sorted, so each owner's stay sorted
    place = torch.empty_like(order)
    place[order] = torch.arange(order.numel(), dtype=order.dtype)
    per_owner = torch.bincount(owner, minlength=ownership.parts).tolist()
    return Asked(distinct[order], place[inverse], tuple(per_owner))


def test_each_distinct_id_travels_once_to_its_owner() -> None:
    P = 3
    owns = [Ownership(10, P), Ownership(7, P)]
    lookups = [torch.tensor([4, 1, 4, 9, 0, 1, 3]), torch.tensor([6, 6, 6])]
    asked = dedupe_groups(lookups, P)
    for ids, a, own in zip(lookups, asked, owns, strict=True):
        assert torch.equal(a.distinct[a.positions], ids)  # every id finds its row among the distinct ones
        assert a.distinct.numel() == ids.unique().numel()
        assert list(a.per_owner) == torch.bincount(own.owner(ids.unique()), minlength=P).tolist()
        assert torch.equal(own.owner(a.distinct), own.owner(a.distinct).sort().values)  # by owner
    payload, sizes = ids_payload(asked, P)
    assert sizes == [2 + asked[0].per_owner[j] + asked[1].per_owner[j] for j in range(P)]
    for j, part in enumerate(torch.split(payload, sizes)):
        served = parse_requests(part, [sizes[j]], len(owns), P)  # owner j's view, this rank its only requester
        for t, own in enumerate(owns):
            want = asked[t].distinct[own.owner(asked[t].distinct) == j]
            assert torch.equal(served.rows[t] * P + j, want)
            assert served.counts[t] == (want.numel(),)


def test_the_batched_dedupe_equals_one_table_at_a_time() -> None:
    """``dedupe_groups`` (one unique and one sort for all tables) against ``dedupe`` per table, over random tables,
    empty lookups and every P of the tests."""
    g = torch.Generator().manual_seed(3)
    for trial in range(200):
        P = (1, 2, 3, 5, 8)[trial % 5]
        rows = [int(torch.randint(1, 60, (1,), generator=g)) for _ in range(1 + trial % 6)]
        ids = [torch.randint(0, r, ((0, 1, 7, 50)[(trial + k) % 4],), generator=g) for k, r in enumerate(rows)]
        singles = [dedupe(x, Ownership(r, P)) for x, r in zip(ids, rows, strict=True)]
        for one, batched in zip(singles, dedupe_groups(ids, P), strict=True):
            assert torch.equal(one.distinct, batched.distinct) and torch.equal(one.positions, batched.positions)
            assert one.per_owner == batched.per_owner
    assert dedupe_groups([], 3) == []


@pytest.mark.parametrize("dims", [(4, 4, 4), (4, 2, 3)])  # one width (one sort) and several (a copy per piece)
def test_rows_go_peer_major_for_the_wire_and_back_to_group_major(dims: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(5)
    P = 3
    counts = torch.randint(0, 4, (len(dims), P), generator=g).tolist()  # counts[t][j]: rows of table t, peer j
    counts[1][2] = 0
    rows = [torch.randn(sum(c), d, generator=g, dtype=torch.float64) for c, d in zip(counts, dims, strict=True)]
    per_peer = [torch.split(r, c) for r, c in zip(rows, counts, strict=True)]
    want = torch.cat([per_peer[t][j].reshape(-1) for j in range(P) for t in range(len(dims))])
    flat = peer_major(rows, counts, torch.float64)
    assert torch.equal(flat, want)
    back, _ = group_major(flat, counts, dims)
    assert all(torch.equal(a, b) for a, b in zip(back, rows, strict=True))
    # with a lead in front of each peer's part (a looked-ahead exchange's verdict): the same rows, and the leads
    lead = torch.tensor([7.0], dtype=torch.float64)
    led = peer_major(rows, counts, torch.float64, lead=lead)
    sizes = [1 + sum(counts[t][j] * dims[t] for t in range(len(dims))) for j in range(P)]
    assert all(torch.equal(part[:1], lead) for part in torch.split(led, sizes))
    assert torch.equal(torch.cat([part[1:] for part in torch.split(led, sizes)]), want)
    back, leads = group_major(led, counts, dims, lead=1)
    assert all(torch.equal(a, b) for a, b in zip(back, rows, strict=True)) and leads.tolist() == [7.0] * P


def test_an_ids_payload_whose_counts_do_not_add_up_is_refused() -> None:
    owns = [Ownership(9, 2), Ownership(9, 2)]
    with pytest.raises(RuntimeError, match=r"ids payloads of \[4\] elements carry counts \[\[1, 0\]\]"):
        parse_requests(torch.tensor([1, 0, 5, 5]), [4], len(owns), 2)  # one id announced, two sent
    with pytest.raises(RuntimeError, match="an ids payload of 1 elements cannot hold the counts of 2 groups"):
        parse_requests(torch.tensor([0]), [1], len(owns), 2)


def test_a_lazy_lookup_runs_the_exchange_at_its_first_use() -> None:
    runs = []
    value = torch.arange(6.0).view(2, 3)

    def flush() -> None:
        runs.append(1)
        a.resolve(value)
        b.resolve(value + 1)

    a, b = LazyLookup(flush, "a"), LazyLookup(flush, "b")
    assert "pending" in repr(a)
    assert torch.equal(torch.cat([a, b], dim=1), torch.cat([value, value + 1], dim=1))  # __torch_function__
    assert runs == [1]  # one exchange for both
    assert torch.equal(a * 2 + b, value * 3 + 1) and a.shape == (2, 3) and torch.equal(-a[1], -value[1])
    assert torch.equal(nn.functional.linear(a, torch.eye(3)), value) and len(a) == 2
    assert runs == [1]
    c = LazyLookup(lambda: c.fail(RuntimeError("peer gone")), "c")
    with pytest.raises(ValueError, match="the lookup of c failed: peer gone"):
        c.sum()


def test_the_sharded_placement_refuses_parameters_that_are_no_shards() -> None:
    env = ReduceEnv(None, 2)  # type: ignore[arg-type]  # aggregate never communicates
    shard, plain = nn.Parameter(torch.zeros(2, 2)), nn.Parameter(torch.zeros(2, 2))
    placement = Sharded()
    mark(shard, placement)
    placement.aggregate([NamedParam("t.weight", shard)], env)  # nothing to do
    with pytest.raises(ValueError, match=r"\['fc.weight'\] are placed 'sharded' but are no shards"):
        placement.aggregate([NamedParam("t.weight", shard), NamedParam("fc.weight", plain)], env)
    assert placement_of(shard) is placement and placement_of(plain) is None
    assert not placement.communicates and not placement.replicated
    model = nn.Sequential(nn.Linear(2, 2))
    model[0].weight = shard
    assert plan_of(model) == {"0.weight": placement}


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A gloo group of this process alone: ``sparsync.shard`` is collective, at P = 1 over this process only."""
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _Two(nn.Module):
    def __init__(self, meta: bool = False) -> None:
        super().__init__()
        self.users = nn.EmbeddingBag(10, 2, mode="sum", device="meta" if meta else None)
        self.items = nn.Embedding(8, 2)
        self.fc = nn.Linear(4, 1)


def test_a_server_table_stays_whole_and_plan_of_reports_it(one_rank_group: None) -> None:
    model = _Two()
    users, weight = model.users, model.users.weight.detach().clone()
    out = sparsync.shard(model, plan={"users": "server", "items": "sharded"})
    assert out is model and model.users is users and torch.equal(model.users.weight, weight)  # whole, untouched
    plan = plan_of(model)
    assert set(plan) == {"users.weight", "items.weight"}
    assert isinstance(plan["users.weight"], OnServer) and plan["users.weight"].kind == "ps"
    assert isinstance(plan["items.weight"], Sharded) and type(model.items).__name__ == "ShardedEmbedding"
    assert plan["users.weight"].replicated and not plan["users.weight"].overlaps  # whole on every rank
    with pytest.raises(ValueError, match=r"\['users.weight'\] are placed on the parameter server.*HybridTrainer"):
        plan["users.weight"].aggregate([NamedParam("users.weight", model.users.weight)], ReduceEnv(None, 2))  # type: ignore[arg-type]
    assert plan_of(sparsync.shard(_Two(), plan={"users": "replicated", "items": "replicated"})) == {}


def test_the_server_placement_refuses_what_it_cannot_place(one_rank_group: None) -> None:
    with pytest.raises(KeyError, match=r"plan names \['fc'\], which are no nn.Embedding or nn.EmbeddingBag"):
        sparsync.shard(_Two(), plan={"fc": "server"})
    with pytest.raises(ValueError, match=r"plan='server' would put every table on the parameter server"):
        sparsync.shard(_Two(), plan="server")
    with pytest.raises(ValueError, match=r"cannot place 'users' on the server: its table is on the meta device"):
        sparsync.shard(_Two(meta=True), plan={"users": "server"})
    with pytest.raises(ValueError, match=r"plan\['users'\] = 'servers': unknown placement; choose one of"):
        sparsync.shard(_Two(), plan={"users": "servers"})


def test_the_sharded_kind_prices_the_issue_formula_and_is_chosen_only_where_modules_are_swapped() -> None:
    rows, D, P = 100_000, 16, 8
    u = 1000  # distinct rows one rank reads per step
    s = ParamStats("t.weight", (rows, D), u / rows, True)
    est = KINDS.entry("sharded").estimate(s, Cluster(P, 1, 1.25e8, 1e-4), sketch=None)  # type: ignore[arg-type]
    assert est is not None
    one_way = (P - 1) / P * u * (10 + 8 * D)  # f·u·(i + 8D): ids out, rows in, gradient rows out (fp32)
    assert ID_WIRE_BYTES == 8 * MARGIN  # i: an int64 id, in blocks padded to MARGIN x the widest count
    assert est.nbytes == pytest.approx(2 * one_way)  # and as much served to the others
    assert est.seconds == pytest.approx(one_way / 1.25e8)  # a table adds its bytes' time
    # the three all-to-all rounds' latency, shared by every sharded table of the step's one exchange
    assert KINDS.entry("sharded").shared_seconds(Cluster(P, 1, 1.25e8, 1e-4)) == pytest.approx(3 * (P - 1) * 1e-4)
    # one rank: nothing crosses; chosen only when pinned (a tie goes to the kind listed first)
    alone = KINDS.entry("sharded").estimate(s, Cluster(1), sketch=None)  # type: ignore[arg-type]
    assert alone is not None and (alone.nbytes, alone.seconds) == (0.0, 0.0)
    assert make_plan([s], Cluster(1), swap_modules=True).placement("t.weight") != "sharded"
    assert make_plan([s], Cluster(1), overrides={"t.weight": "sharded"}).placement("t.weight") == "sharded"
    assert not KINDS.entry("sharded").lossy
    stats = [s, ParamStats("fc.weight", (64, 64), 1.0, False)]
    plain = make_plan(stats, Cluster(P, 1, 1.25e8, 1e-4))
    assert "sharded" not in plain.entries[0].candidates  # HybridTrainer and the CLI see the plans they saw
    # against the replicated placements (the parameter server's Table 3 price, which counts no ids and six
    # latencies, undercuts it on this link: choosing between the two is the auto plan's work)
    no_ps = [k for k in KINDS if k.name != "ps"]
    swapped = make_plan(stats, Cluster(P, 1, 1.25e8, 1e-4), swap_modules=True, kinds=no_ps)
    assert swapped.placement("t.weight") == "sharded" and swapped.placement("fc.weight") == "dense_allreduce"
    assert swapped.entries[0].candidates["sparse_allreduce"][0] > est.nbytes
    forced = make_plan(stats, Cluster(P, 1, 1.25e8, 1e-4), overrides={"t.weight": "sharded"})
    assert forced.placement("t.weight") == "sharded"
    assert isinstance(forced.placements()["t.weight"], Sharded)
    assert math.isclose(forced.entries[0].bytes_per_machine, est.nbytes)


def test_the_plan_pays_the_grouped_exchange_latency_once_and_shards_where_the_whole_step_gains() -> None:
    """The sharded tables share one exchange's latency, and the replicated ones one grouped call: the plan
    shards where the whole step, priced so, is faster. One small table alone stays replicated; 26 such tables
    are sharded together; the plan's time counts the shared latency once."""
    P, link = 4, (1.25e8, 1e-4)
    no_ps = [k for k in KINDS if k.name != "ps"]
    no_shard = [k for k in no_ps if k.name != "sharded"]
    fixed = KINDS.entry("sharded").shared_seconds(Cluster(P, 1, *link))
    mlp = ParamStats("mlp.weight", (1000, 1000), 1.0, False)

    def tables(n: int) -> list[ParamStats]:
        return [ParamStats(f"t{j}.weight", (100_000, 16), 100 / 100_000, True) for j in range(n)] + [mlp]

    for n, want in ((1, "sparse_allreduce"), (26, "sharded")):
        plan = make_plan(tables(n), Cluster(P, 1, *link), swap_modules=True, kinds=no_ps)
        replicated = make_plan(tables(n), Cluster(P, 1, *link), kinds=no_shard)
        pinned = make_plan(tables(n), Cluster(P, 1, *link), kinds=no_ps,
                           overrides={f"t{j}.weight": "sharded" for j in range(n)})  # fmt: skip
        assert {plan.placement(f"t{j}.weight") for j in range(n)} == {want}, n
        assert plan.placement("mlp.weight") == "dense_allreduce"
        assert pinned.shared == {"sharded": pytest.approx(fixed)}  # once, for all n tables
        assert pinned.seconds == pytest.approx(sum(e.seconds for e in pinned.entries) + fixed)
        best = min(replicated, pinned, key=lambda q: q.grouped_seconds)
        assert plan.kinds == best.kinds and plan.grouped_seconds == pytest.approx(best.grouped_seconds), n
        if want == "sparse_allreduce":
            assert plan.shared == {} and plan.entries[0].detail  # the replicated entry names its algorithm


def test_backward_hides_the_replicated_reduction_and_not_the_exchange() -> None:
    """With backward's compute as overlap, the replicated tables' reduction hides behind it and the sharded
    exchange does not: the 26 tables the plan shards with no overlap stay replicated once backward is as long as
    their reduction; the exposed time of each plan is what the model says."""
    P, link = 4, (1.25e8, 1e-4)
    no_ps = [k for k in KINDS if k.name != "ps"]
    stats = [ParamStats(f"t{j}.weight", (100_000, 16), 100 / 100_000, True) for j in range(26)]
    stats.append(ParamStats("mlp.weight", (1000, 1000), 1.0, False))
    bare = make_plan(stats, Cluster(P, 1, *link), swap_modules=True, kinds=no_ps)
    assert set(bare.kinds.values()) == {"sharded", "dense_allreduce"} and bare.overlap == 0
    assert bare.exposed_seconds == pytest.approx(bare.grouped_seconds)
    replicated = make_plan(stats, Cluster(P, 1, *link), kinds=[k for k in no_ps if k.name != "sharded"])
    hidden = replicated.grouped_seconds
    plan = make_plan(stats, Cluster(P, 1, *link), swap_modules=True, kinds=no_ps, overlap_seconds=hidden)
    assert "sharded" not in plan.kinds.values() and plan.exposed_seconds == 0.0
    pinned = make_plan(stats, Cluster(P, 1, *link), kinds=no_ps, overlap_seconds=hidden,
                       overrides={s.name: "sharded" for s in stats if s.sparse})  # fmt: skip
    exchange = pinned.shared["sharded"] + sum(e.seconds for e in pinned.entries if e.placement == "sharded")
    assert pinned.exposed_seconds == pytest.approx(exchange)  # the MLP's allreduce hides, the exchange does not


def test_the_replicated_reduction_hides_behind_backward_only_where_a_core_is_spare_for_it() -> None:
    from sparsync.sharding.auto import _hidden_share

    assert _hidden_share([("a", 2, True)] * 4) == 0.0  # 4 ranks on 2 cores: the reduction takes backward's cores
    assert _hidden_share([("a", 2, True)] * 2) == 0.0
    assert _hidden_share([("a", 16, True)] * 4) == 1.0  # a spare core per rank
    assert _hidden_share([("a", 6, True)] * 4) == 0.5  # two spare cores for four ranks
    assert _hidden_share([("a", 8, True)] * 2 + [("b", 8, True)] * 6) == pytest.approx(2 / 6)  # the fullest host
    assert _hidden_share([("a", 2, False)] * 8) == 1.0  # backward on a GPU: the CPU is free for the reduction


class _Three(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tables = nn.ModuleList([nn.EmbeddingBag(50, 4, mode="sum") for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([t(x[:, i : i + 1]) for i, t in enumerate(self.tables)], 1)


def test_an_exchange_enters_each_stage_module_once_in_stage_order(one_rank_group: None) -> None:
    """What runs when the stand-ins are first used (the exchange of the three tables' calls), at P = 1: the
    package's modules control is in, by calls and returns, consecutive repeats collapsed, the primitives the
    stages call (``kernels``: the C kernels and the transport) left out: the layout (``group``), the ids stage,
    the rows stage, each once, in that order, between the driver and the stand-ins (both ``exchange``;
    test_stage_order.py traces a step at P = 2)."""
    import sys
    from types import FrameType

    model = sparsync.shard(_Three())
    x = torch.randint(0, 50, (4, 3))
    model(x).sum().backward()  # a first step: the capacities settle
    outs = [t(x[:, i : i + 1]) for i, t in enumerate(model.tables)]
    entered: list[str] = []

    def profile(frame: FrameType, event: str, arg: object) -> None:
        now = frame if event == "call" else frame.f_back if event == "return" else None  # where control is
        path = now.f_code.co_filename if now is not None else ""
        if "/sparsync/sharding/" in path:
            name = path.rsplit("/", 1)[1].removesuffix(".py")
            if name != "kernels" and (not entered or entered[-1] != name):
                entered.append(name)

    sys.setprofile(profile)
    try:
        outs[0].wait()
    finally:
        sys.setprofile(None)
    stages = [m for m in entered if m in ("group", "ids", "rows")]
    assert stages == ["group", "ids", "rows"], entered
    assert entered[0] == entered[-1] == "exchange" and all(o.done for o in outs), entered


@pytest.mark.parametrize("lens", [(4, 4, 4), (4, 0, 2), (1, 6, 3)])
def test_the_range_check_names_the_first_table_with_an_id_outside_it(lens: tuple[int, ...]) -> None:
    """``out_of_range`` over a group of three tables (as many keys each, or not, one table not looked up): None
    while every id lies in its table; else the words for the first table, in the group's order, whose ids do
    not, against a check of each table's ids one by one."""
    from sparsync.sharding.exchange import Sent, out_of_range
    from sparsync.sharding.group import TableGroup

    rows = (5, 7, 3)
    group = TableGroup(rows, 2, torch.float32, 2, 0)
    gen = torch.Generator().manual_seed(sum(lens))
    for bad in (None, *((t, v) for t in range(3) if lens[t] for v in (-1, rows[t]))):
        ids = [torch.randint(0, r, (n,), generator=gen) for r, n in zip(rows, lens, strict=True)]
        if bad is not None:
            ids[bad[0]][-1] = bad[1]
        keys = tuple(x + s.base for x, s in zip(ids, group.slots, strict=True))
        names = ("t0", "t1", "t2")
        sent = Sent((0,), ((0, 1, 2),), (keys,), (names,), (torch.cat(keys),))
        expect = None
        for name, x, r in zip(names, ids, rows, strict=True):
            if x.numel() and (x.min() < 0 or x.max() >= r):
                low, high = int(x.min()), int(x.max())
                v = low if low < 0 else high
                expect = f"{name}: id {v} is {'negative' if v < 0 else 'out of range'}; ids must lie in [0, {r})"
                break
        assert out_of_range(sent, [group]) == expect, (bad, lens)


@pytest.mark.parametrize("fused", [False, True])
def test_plan_auto_is_told_whether_the_tables_update_in_backward(
    one_rank_group: None, monkeypatch: pytest.MonkeyPatch, fused: bool
) -> None:
    """``sparsync.shard(plan="auto", optimizer=...)`` prices the tables' update as fused (``auto_plan``'s
    ``fused``), and without ``optimizer`` as a sparse gradient per table."""
    import types

    import sparsync.sharding.api as api

    told: list[bool] = []

    def fake_auto_plan(model: nn.Module, sample: object, group: object, *, fused: bool = False) -> object:
        told.append(fused)
        return types.SimpleNamespace(tables={})

    monkeypatch.setattr(api, "auto_plan", fake_auto_plan)
    optimizer = sparsync.sharding.SGD(lr=0.1) if fused else None
    sparsync.shard(_Three(), "auto", sample=(torch.zeros(2, 3, dtype=torch.int64),), optimizer=optimizer)
    assert told == [fused]


class _Mutating(nn.Module):
    """Three tables looked up with one ids tensor, modified in place between the calls (``bump``) or not."""

    def __init__(self, bump: bool) -> None:
        super().__init__()
        self.bump = bump
        self.tables = nn.ModuleList([nn.EmbeddingBag(50, 4, mode="sum") for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for t in self.tables:
            outs.append(t(x))
            if self.bump:
                x.add_(1)  # the next table looks up the next ids; the pending lookups read theirs later
        return torch.cat(outs, 1)


def test_ids_modified_in_place_before_the_exchange_are_refused(one_rank_group: None) -> None:
    """A call's ids are read when its exchange runs: ids modified in place since the call are refused with words
    naming the table (not looked up as modified); left as they are, the three tables give torch's outputs."""
    x = torch.randint(0, 40, (6, 2))
    torch.manual_seed(0)
    model = sparsync.shard(_Mutating(bump=False))
    torch.manual_seed(0)
    assert torch.equal(model(x.clone()), _Mutating(bump=False)(x.clone()))
    model.bump = True
    with pytest.raises(ValueError, match=r"ids were modified in place after the call") as e:
        model(x.clone())
    assert "EmbeddingBag(50, 4" in str(e.value)
