"""Workers for test_shard.py (module-level: ``launch`` pickles them). Each launch runs many cases, so the tests pay
for few process groups."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import sparsync
from sparsync.collectives.group import group_state, link_state
from sparsync.costmodel import LinkModel
from sparsync.optim import DistributedOptimizer
from sparsync.optim.optimizer import clip_grad_norm
from sparsync.placement import Sharded, placement_of
from sparsync.record import CommLog
from sparsync.sharding import auto_plan, load_optimizer_state_dict, optimizer_state_dict, plan_of
from sparsync.sharding.group import INIT_BLOCK

# name -> (module, how it is called): every mode of the issue, each table a different shape
SPECS: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "emb": (lambda: nn.Embedding(17, 4), "ids2d"),
    "emb_pad": (lambda: nn.Embedding(13, 3, padding_idx=5), "ids2d"),
    "bag_sum": (lambda: nn.EmbeddingBag(19, 4, mode="sum"), "offsets"),
    "bag_mean": (lambda: nn.EmbeddingBag(11, 2, mode="mean"), "ids2d"),
    "bag_psw": (lambda: nn.EmbeddingBag(23, 3, mode="sum"), "weights"),
    "bag_pad": (lambda: nn.EmbeddingBag(16, 3, mode="mean", padding_idx=0), "offsets"),
    "bag_last": (lambda: nn.EmbeddingBag(9, 5, mode="sum", include_last_offset=True), "last"),
    # bags of one id each (pooled as the rows themselves): by offsets 0, 1, ..., and as an [n, 1] input
    "bag_one": (lambda: nn.EmbeddingBag(21, 4, mode="mean"), "single"),
    "col_one": (lambda: nn.EmbeddingBag(8, 3, mode="sum"), "column"),
}
STEPS = 5
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
    "sparse_adam": lambda ps: torch.optim.SparseAdam(list(ps), lr=0.01),
}


class Tables(nn.Module):
    """Every table of ``SPECS``, looked up one after another; the outputs are used only after the forward (by
    the loss), so all of them travel in one exchange."""

    def __init__(self, seed: int, sparse: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        mods = {}
        for name, (make, _) in SPECS.items():
            m = make()
            m.sparse = sparse
            mods[name] = m
        self.t = nn.ModuleDict(mods)
        self.double()

    def forward(self, batch: dict[str, tuple[Any, ...]]) -> dict[str, Any]:
        return {name: self.t[name](*args) for name, args in batch.items()}


def _ids(k: int, rows: int, step: int, P: int, g: torch.Generator) -> torch.Tensor:
    """``k`` ids of a table of ``rows`` rows in the scenario of ``step``."""
    if step == 2:  # every id on one owner: o + P·j < rows, all owned by rank o = 1 mod P
        o = 1 % P
        return o + P * torch.randint(0, (rows - 1 - o) // P + 1, (k,), generator=g)
    top = rows if step != 4 else max(1, rows // 2)  # step 4: the upper half never looked up
    return torch.randint(0, top, (k,), generator=g)


def _batch(step: int, rank: int, P: int) -> dict[str, tuple[Any, ...]]:
    """One rank's inputs for every table at ``step`` (test_shard's module doc: the scenario of each step)."""
    g = torch.Generator().manual_seed(7919 * step + rank)
    n = 2 + rank  # uneven batches
    if step == 1 and rank == min(1, P - 1):
        n = 0  # an empty batch on one rank
    out: dict[str, tuple[Any, ...]] = {}
    for name, (make, how) in SPECS.items():
        rows = int(make().num_embeddings)
        k = 0 if step == 3 and name in ("emb", "bag_sum") else n  # step 3: ids absent from the whole step
        if how in ("ids2d", "column"):
            width = 3 if how == "ids2d" else 1
            out[name] = (_ids(width * k, rows, step, P, g).view(k, width),)
            continue
        if how == "single":
            out[name] = (_ids(k, rows, step, P, g), torch.arange(k))
            continue
        lengths = torch.randint(0, 4, (k,), generator=g)
        flat = _ids(int(lengths.sum()), rows, step, P, g)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        if how == "last":
            out[name] = (flat, offsets)
        elif how == "weights":
            out[name] = (flat, offsets[:-1], torch.rand(flat.numel(), generator=g, dtype=torch.float64))
        else:
            out[name] = (flat, offsets[:-1])
    return out


def _loss(outs: dict[str, torch.Tensor]) -> torch.Tensor:
    # each table its own scale, 1 to 7 (cycling: steeper ones would make the lossy wire tests measure the loss)
    return sum(((o * (1 + k % 7)).tanh() ** 2).sum() for k, o in enumerate(outs.values()))  # type: ignore[return-value]


def _shard_error(model: nn.Module, ref: nn.Module, rank: int, P: int) -> float:
    """Largest difference between this rank's shard rows and the reference tables' rows it owns."""
    worst = 0.0
    refs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        want = refs[name].detach()
        if isinstance(placement_of(p), Sharded):
            want = want[rank::P]
        worst = max(worst, float((p.detach() - want).abs().max()) if p.numel() else 0.0)
    return worst


def exact_worker(rank: int) -> dict[str, Any]:
    """Per optimizer, the sharded tables against one float64 process over every rank's batch (the mean of the
    ranks' losses, which is DistributedOptimizer's mean of their gradients); and the mixed model."""
    P = dist.get_world_size()
    out: dict[str, Any] = {}
    for opt_name, make_opt in OPTIMIZERS.items():
        log = CommLog()
        model = sparsync.shard(Tables(seed=rank), log=log)  # different inits: rank 0's rows win
        ref = Tables(seed=0, sparse=True)
        opt = DistributedOptimizer(make_opt(model.parameters()), model, plan=plan_of(model), sync_parameters=False)
        ref_opt = make_opt(ref.parameters())
        errors, identical = [], []
        for step in range(STEPS):
            mine = _batch(step, rank, P)
            opt.zero_grad()
            got = model(mine)
            if step == 0:  # pooled by torch's own functional on the gathered rows: bit for bit
                want = ref(mine)
                identical.append(all(torch.equal(got[k], want[k].detach()) for k in got))
            _loss(got).backward()
            opt.step()
            ref_opt.zero_grad()
            (sum(_loss(ref(_batch(step, r, P))) for r in range(P)) / P).backward()  # type: ignore[union-attr]
            ref_opt.step()
            errors.append(_shard_error(model, ref, rank, P))
        out[opt_name] = {
            "bytes": _bytes_as_counted(log, model, rank, P),
            "errors": errors,
            "identical": identical,
            "ops": [r.op for r in log.records],
            # all-to-all rounds of each step's lookup: the ids (one, or two when a pair overflowed), the rows
            "rounds": [r.messages // max(P - 1, 1) for r in log.records if r.op == "shard_lookup"],
            "plain": all(type(v) is torch.Tensor for v in got.values()),
        }
    out["mixed"] = mixed_case(rank, P)
    return out


def _bytes_as_counted(log: CommLog, model: nn.Module, rank: int, P: int) -> list[tuple[int, int]]:
    """(recorded, counted) bytes of step 0 that this rank sent as a requester: 8 per distinct id owned elsewhere
    (plus the G counts heading each payload, one per table group: the tables of one width) and one gradient row
    per such id, 8·D bytes in float64."""
    elsewhere = {name: int((args[0].unique() % P != rank).sum()) for name, args in _batch(0, rank, P).items()}
    dims = {name: model.t[name].embedding_dim for name in SPECS}
    lookup, grad = log.records[0], log.records[1]
    return [
        (lookup.phase_bytes["ids"], 8 * (len(set(dims.values())) * (P - 1) + sum(elsewhere.values()))),
        (grad.bytes_sent, 8 * sum(n * dims[name] for name, n in elsewhere.items())),
        (lookup.phase_bytes["header"], 8 * 4 * (P - 1)),  # a 4-word header row to each peer
    ]


class Mixed(nn.Module):
    """One table replicated (DistributedOptimizer's default path), one sharded, a dense layer over both; the
    sharded output is used inside the forward (``torch.cat``), which runs the exchange there."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.rep = nn.Embedding(20, 3, sparse=True)
        self.sh = nn.EmbeddingBag(30, 3, mode="mean")  # 30 rows: even shards at P = 1, 3, 5
        self.fc = nn.Linear(6, 2)
        self.double()

    def forward(self, x: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.rep(x).sum(1), self.sh(ids, offsets)], dim=1)).tanh()


def _mixed_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(31 * step + rank)
    n = 1 + (rank + step) % 3
    return (
        torch.randint(0, 20, (n, 2), generator=g),
        torch.randint(0, 30, (2 * n,), generator=g),
        2 * torch.arange(n),
    )


CLIP = 0.05  # below every step's gradient norm here: every clipped step scales


def mixed_case(rank: int, P: int) -> dict[str, Any]:
    """The mixed model per optimizer, and SGD with ``clip_grad_norm_`` (``"clip"``: the norm of the whole
    gradient, the sharded table's rows of every rank in it) against the reference clipped alike."""
    out = {}
    for opt_name in ("sgd", "adagrad", "clip"):
        make = OPTIMIZERS["sgd" if opt_name == "clip" else opt_name]
        model = sparsync.shard(Mixed(), plan={"rep": "replicated"})
        ref = Mixed()
        opt = DistributedOptimizer(make(model.parameters()), model, plan=plan_of(model), sync_parameters=False)
        ref_opt = make(ref.parameters())
        errors, norms = [], []
        for step in range(3):
            opt.zero_grad()
            model(*_mixed_batch(step, rank)).square().sum().backward()
            if opt_name == "clip":
                norms.append((float(opt.clip_grad_norm_(CLIP)), 0.0))
            opt.step()
            ref_opt.zero_grad()
            (sum(ref(*_mixed_batch(step, r)).square().sum() for r in range(P)) / P).backward()  # type: ignore[union-attr]
            if opt_name == "clip":
                params = [q for q in ref.parameters() if q.grad is not None]
                want = clip_grad_norm([q.grad for q in params], params, CLIP, 2.0, False)  # type: ignore[misc]
                norms[-1] = (norms[-1][0], float(want))
            ref_opt.step()
            errors.append(_shard_error(model, ref, rank, P))
        kinds = {n: type(pl).__name__ for n, pl in opt.replicated.plan.items()}
        out[opt_name] = {"errors": errors, "kinds": kinds, "norms": norms}
    return out


# --- bad input --------------------------------------------------------------------------------------------------
def message(fn: Callable[[], object]) -> str:
    """What ``fn`` raised (a ValueError or KeyError), as type and text; "no error" when it returned."""
    try:
        fn()
    except (ValueError, KeyError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def same_on_every_rank(res: list[dict[str, str]]) -> dict[str, str]:
    """Asserts that every rank got the same message in each case (the ranks' ``message`` dicts); rank 0's."""
    for case, said in res[0].items():
        assert all(r[case] == said for r in res), (case, [r[case] for r in res])
    return res[0]


def errors_worker(rank: int) -> dict[str, str]:
    """Each bad use on a process group of P ranks; the group stays usable after each (the last case looks up)."""
    P = dist.get_world_size()
    out = {}
    model = sparsync.shard(Tables(seed=0))
    good = _batch(0, rank, P)

    def with_ids(name: str, ids: torch.Tensor) -> dict[str, tuple[Any, ...]]:
        return {**good, name: (ids.view(-1, 3),)}

    out["out_of_range"] = message(lambda: model(with_ids("emb", torch.tensor([0, 1, 17 if rank == 1 else 2]))))
    out["negative"] = message(lambda: model(with_ids("bag_mean", torch.tensor([0, -1 if rank == 2 else 1, 2]))))
    psw = {**good, "bag_pad": (*good["bag_pad"], torch.ones(good["bag_pad"][0].numel(), dtype=torch.float64))}
    out["torch_refuses"] = message(lambda: model(psw if rank == 0 else good))
    skip = {k: v for k, v in good.items() if k != "bag_last"}
    out["other_tables"] = message(lambda: model(skip if rank == P - 1 else good))
    wrong = nn.Embedding(17 + (rank == 1), 4)
    out["mismatched_at_shard"] = message(lambda: sparsync.shard(nn.ModuleDict({"a": wrong})))
    out["max_mode"] = message(lambda: sparsync.shard(nn.EmbeddingBag(5, 2, mode="max")))
    out["max_norm"] = message(lambda: sparsync.shard(nn.Sequential(nn.Embedding(5, 2, max_norm=1.0))))
    out["scale_grad"] = message(lambda: sparsync.shard(nn.Embedding(5, 2, scale_grad_by_freq=True)))
    out["server"] = message(lambda: sparsync.shard(nn.Embedding(5, 2), plan="server"))  # a dict may name it
    out["auto"] = message(lambda: sparsync.shard(nn.Embedding(5, 2), plan="auto"))  # no sample
    out["unknown"] = message(lambda: sparsync.shard(nn.Embedding(5, 2), plan={"nope": "sharded"}))
    plain = nn.Embedding(5, 2, sparse=True)
    opt = DistributedOptimizer(torch.optim.SGD(plain.parameters(), lr=0.1), plain, plan={"weight": Sharded()},
                               overlap=False)  # fmt: skip
    plain(torch.tensor([1])).sum().backward()
    out["unswapped"] = message(opt.step)
    outs = model(good)  # still in step with the others
    _loss(outs).backward()
    out["after"] = f"looked up {len(outs)} tables"
    return out


# --- plan="auto" ------------------------------------------------------------------------------------------------
AUTO_LINK = LinkModel(alpha=2e-6, beta=1e-4, gamma_sparse=0.0, gamma_dense=0.0, gamma_scatter=0.0)


class Auto(nn.Module):
    """A small table every sample reads whole, two large ones each sample reads a few rows of, a dense layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.small = nn.Embedding(8, 4)
        self.big = nn.EmbeddingBag(5000, 8, mode="sum")
        self.big2 = nn.Embedding(5000, 8)
        self.fc = nn.Linear(20, 1)

    def forward(self, small: torch.Tensor, big: torch.Tensor, offsets: torch.Tensor, big2: torch.Tensor) -> Any:
        pooled = [self.small(small).sum(1), self.big(big, offsets), self.big2(big2).sum(1)]
        return self.fc(torch.cat(pooled, dim=1)).squeeze(1)


def auto_sample(rank: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(100 + rank)
    n = 6
    return (
        torch.arange(8).repeat(n, 1),
        torch.randint(0, 5000, (3 * n,), generator=g),
        3 * torch.arange(n),
        torch.randint(0, 300, (n, 2), generator=g),
    )


def auto_worker(rank: int) -> dict[str, Any]:
    """``plan="auto"`` on a fixed link model: what it measured and chose, and the modules it swapped."""
    sparsync.set_link(AUTO_LINK)
    chosen = auto_plan(Auto(), auto_sample(rank), dist.group.WORLD)
    model = sparsync.shard(Auto(), "auto", sample=auto_sample(rank))
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    opt.zero_grad()
    model(*auto_sample(rank)).square().mean().backward()
    opt.step()
    return {
        "tables": chosen.tables,
        "kinds": chosen.plan.kinds,
        "distinct": dict(chosen.distinct),
        "backward": chosen.backward_seconds,
        "overlap": chosen.overlap,
        "modules": {n: type(getattr(model, n)).__name__ for n in ("small", "big", "big2")},
        "finite": all(bool(p.isfinite().all()) for p in model.parameters()),
        "round": chosen.round_seconds,
    }


def auto_round_worker(rank: int) -> dict[str, Any]:
    """The round "auto" prices: given (slow and free, on the fixed link), and measured with the link on a group
    whose link nobody set (then kept on the group for the next "auto")."""
    world = dist.group.WORLD
    slow = auto_plan(Auto(), auto_sample(rank), world, link=AUTO_LINK, round_seconds=1.0)
    free = auto_plan(Auto(), auto_sample(rank), world, link=AUTO_LINK, round_seconds=0.0)
    measured = auto_plan(Auto(), auto_sample(rank), world)  # nothing set: the link and the round measured here
    again = auto_plan(Auto(), auto_sample(rank), world)
    return {
        "slow": slow.tables, "free": free.tables,
        "round": measured.round_seconds, "again": again.round_seconds,
        "kept": group_state(world).exchange_round, "a2a": link_state(world).link.alpha_a2a,  # type: ignore[union-attr]
    }  # fmt: skip


# --- rows in a lower precision ---------------------------------------------------------------------------------
def wire_worker(rank: int) -> dict[str, Any]:
    """Three SGD steps of float32 tables with the rows sent as they are, in bf16 and in fp16: per precision the
    bytes of each round, the losses and the shards after the steps."""
    P = dist.get_world_size()
    out: dict[str, Any] = {}
    for rows in (None, "bf16", "fp16"):
        log = CommLog()
        model = sparsync.shard(Tables(seed=0).float(), log=log, rows=rows)
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), model, plan=plan_of(model),
                                   sync_parameters=False)  # fmt: skip
        losses = []
        for step in (0, 3, 4):  # the steps of _batch whose ids are spread over every owner
            batch = {k: tuple(a.float() if a.is_floating_point() else a for a in v)
                     for k, v in _batch(step, rank, P).items()}  # fmt: skip
            opt.zero_grad()
            loss = _loss(model(batch))
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        phases: dict[str, int] = {}
        for r in log.records:
            for k, v in (r.phase_bytes or {}).items():
                phases[k] = phases.get(k, 0) + v
        out[str(rows)] = {"phases": phases, "losses": losses,
                          "shards": [p.detach().clone() for p in model.parameters()]}  # fmt: skip
    try:
        sparsync.shard(Tables(seed=0), rows="int8")
        out["bad"] = "no error"
    except ValueError as e:
        out["bad"] = str(e)
    return out


# --- a table never built whole ---------------------------------------------------------------------------------
META_ROWS = (3 * INIT_BLOCK + 5, 11)  # several init blocks, the last short; a table smaller than P·block too


def meta_worker(rank: int) -> dict[str, Any]:
    """Tables on the meta device: each rank draws only its rows; the whole tables gathered on rank 0, one SGD
    step, and the shards after it."""
    model = nn.ModuleDict({"big": nn.EmbeddingBag(META_ROWS[0], 3, mode="sum", device="meta", padding_idx=2),
                           "small": nn.Embedding(META_ROWS[1], 3, device="meta")})  # fmt: skip
    model = sparsync.shard(model, seed=7)
    whole = model.state_dict()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, META_ROWS[0], (8,), generator=g)
    small = torch.randint(0, META_ROWS[1], (4,), generator=g)
    (model["big"](ids, torch.arange(0, 8, 2)).sum() + model["small"](small).sum()).backward()
    opt.step()
    return {
        "shapes": [tuple(p.shape) for p in model.parameters()],
        "whole": {k: v.clone() for k, v in whole.items()},
        "shards": [p.detach().clone() for p in model.parameters()],
        "devices": sorted({p.device.type for p in model.parameters()}),
        "ids": (ids, small),
    }


# --- checkpoints ------------------------------------------------------------------------------------------------
def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int, P: int) -> None:
    for step in steps:
        opt.zero_grad()
        _loss(model(_batch(step, rank, P))).backward()
        opt.step()


def save_worker(rank: int, path: str) -> None:
    """Two SGD steps of the sharded tables at this P; rank 0 saves the whole tables (state_dict is collective)."""
    P = dist.get_world_size()
    model = sparsync.shard(Tables(seed=0))
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model, plan=plan_of(model),
                               sync_parameters=False, overlap=False)  # fmt: skip
    _train(model, opt, range(2), rank, P)
    state = model.state_dict()
    if rank == 0:
        torch.save(state, path)
    else:
        assert not state, f"rank {rank} got {sorted(state)} from a full state dict"


def load_worker(rank: int, path: str) -> dict[str, Any]:
    """The checkpoint of another P: every table equals the saved one, and one more step equals the replicated
    path's step from the same checkpoint; the local layout round-trips at this P."""
    P = dist.get_world_size()
    saved = torch.load(path)
    model = sparsync.shard(Tables(seed=rank))  # other values: the checkpoint must replace them
    model.load_state_dict(saved)
    full = model.state_dict()
    loaded_equal = rank != 0 or all(torch.equal(full[k], saved[k]) for k in saved)
    rep = Tables(seed=rank, sparse=True)
    rep.load_state_dict(saved)
    opts = []
    for m in (model, rep):
        plan = plan_of(m) or None
        opts.append(DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05), m, plan=plan,
                                         sync_parameters=False, overlap=False))  # fmt: skip
    _train(model, opts[0], range(2, 3), rank, P)
    _train(rep, opts[1], range(2, 3), rank, P)
    error = _shard_error(model, rep, rank, P)
    local = sparsync.shard(Tables(seed=1), state_dict="local")
    local.load_state_dict(saved)
    mine = local.state_dict()
    again = sparsync.shard(Tables(seed=2), state_dict="local")
    again.load_state_dict(mine)
    local_equal = all(torch.equal(a, b) for a, b in zip(mine.values(), again.state_dict().values(), strict=True))
    return {"loaded_equal": loaded_equal, "step_error": error, "local_equal": local_equal}


# --- optimizer state across world sizes -------------------------------------------------------------------------
STATEFUL = ("adagrad", "sparse_adam")


def save_state_worker(rank: int, path: str) -> None:
    """Two steps of each stateful optimizer at this P; rank 0 saves the whole tables and the whole state."""
    P = dist.get_world_size()
    saved = {}
    for name in STATEFUL:
        model = sparsync.shard(Tables(seed=0))
        opt = DistributedOptimizer(OPTIMIZERS[name](model.parameters()), model, overlap=False)
        _train(model, opt, range(2), rank, P)
        saved[name] = (model.state_dict(), optimizer_state_dict(opt, model))
    if rank == 0:
        torch.save(saved, path)


def load_state_worker(rank: int, path: str, saved_at: int) -> dict[str, float]:
    """The checkpoint of another P, one more step at this P; each shard against one float64 process that took the
    same three steps (two on ``saved_at`` ranks' batches, the third on this P's)."""
    P = dist.get_world_size()
    saved = torch.load(path)
    out = {}
    for name in STATEFUL:
        model = sparsync.shard(Tables(seed=rank))  # other values: the checkpoint must replace them
        opt = DistributedOptimizer(OPTIMIZERS[name](model.parameters()), model, overlap=False)
        tables, state = saved[name]
        model.load_state_dict(tables)
        load_optimizer_state_dict(opt, model, state)
        _train(model, opt, range(2, 3), rank, P)
        ref = Tables(seed=0, sparse=True)
        ref_opt = OPTIMIZERS[name](ref.parameters())
        for step, world in ((0, saved_at), (1, saved_at), (2, P)):
            ref_opt.zero_grad()
            (sum(_loss(ref(_batch(step, r, world))) for r in range(world)) / world).backward()  # type: ignore[operator]
            ref_opt.step()
        out[name] = _shard_error(model, ref, rank, P)
    return out
