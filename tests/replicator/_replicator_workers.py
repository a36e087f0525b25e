"""Module-level replica programs for the replicator tests (spawned processes unpickle them by name).

Every program builds its model and data deterministically from seeds, so the test process rebuilds the same
model and the concatenated batches and trains the single-process reference itself.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import sparsync
from sparsync.compress import ErrorFeedback, Identity, TopK
from sparsync.replicator import (
    DCTMP,
    PER_REPLICA,
    PER_WORKER,
    Compressed,
    CustomReduce,
    DenseAllreduce,
    ReplicaContext,
    SparseAllreduce,
    split_batch,
)
from sparsync.replicator import dctmp as dct

VOCAB, EMB, CLASSES, GLOBAL_BATCH, STEPS, LR = 60, 6, 3, 12, 3, 0.3


# --- data-parallel training ------------------------------------------------------------------------------------
class TinyModel(nn.Module):
    """A sparse embedding bag plus dense features into a small MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, EMB, sparse=True)
        self.fc1 = nn.Linear(EMB + 4, 8)
        self.fc2 = nn.Linear(8, CLASSES)

    def forward(self, tokens: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.emb(tokens).mean(1), dense], dim=1)
        return self.fc2(torch.relu(self.fc1(h)))


def make_model() -> TinyModel:
    torch.manual_seed(1234)
    return TinyModel()


def batch(seed: int, size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "tokens": torch.randint(0, VOCAB, (size, 5), generator=g),
        "dense": torch.randn(size, 4, generator=g),
        "y": torch.randint(0, CLASSES, (size,), generator=g),
    }


def global_input(worker_id: int) -> Any:
    """PER_WORKER input_fn: one pipeline of global batches."""
    return [batch(100 + s, GLOBAL_BATCH) for s in range(STEPS)]


def replica_input_for(num_replicas: int) -> Any:
    def fn(replica_id: int) -> Any:
        n = GLOBAL_BATCH // num_replicas
        return (batch(1000 * s + replica_id, n) for s in range(STEPS))

    return fn


def reference_batches(mode: str, num_replicas: int) -> list[dict[str, torch.Tensor]]:
    """The global batch of every step, as the single-process reference sees it."""
    if mode == "per_worker":
        return global_input(0)
    n = GLOBAL_BATCH // num_replicas
    out = []
    for s in range(STEPS):
        parts = [batch(1000 * s + r, n) for r in range(num_replicas)]
        out.append({k: torch.cat([p[k] for p in parts]) for k in parts[0]})
    return out


def loss_of(model: TinyModel, b: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(b["tokens"], b["dense"]), b["y"])


def train_reference(mode: str, num_replicas: int) -> dict[str, torch.Tensor]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for b in reference_batches(mode, num_replicas):
        opt.zero_grad()
        loss_of(model, b).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _dense_sum(grad: torch.Tensor, name: str, group: Any) -> torch.Tensor:
    """A CustomReduce callable (the compressor plug point's signature) that sums densely."""
    out = sparsync.allreduce(grad.to_dense() if grad.is_sparse else grad, algorithm="dense", group=group)
    assert isinstance(out, torch.Tensor)
    return out


def dp_program(ctx: ReplicaContext, runs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """One training run per (input mode, plan kind), in one process group (spawning is the slow part)."""
    return [_dp_run(ctx, mode, plan_kind) for mode, plan_kind in runs]


def _dp_run(ctx: ReplicaContext, mode: str, plan_kind: str) -> dict[str, Any]:
    assert ctx.log is not None
    ctx.log.clear()
    model = make_model()
    plan: Any = None
    op = "mean"
    lr = LR
    if plan_kind == "explicit":
        plan = {"emb.weight": SparseAllreduce("ssar_split_allgather"), "fc1.weight": CustomReduce(_dense_sum)}
    elif plan_kind == "compressed":  # lossless compressors by compressed_allreduce, with error feedback
        memory = ErrorFeedback()
        plan = {
            "emb.weight": Compressed(TopK(1.0), memory),  # COO in: keeps every stored row entry
            "fc1.weight": Compressed(Identity(), memory),
        }
    elif plan_kind == "dense_sum":
        plan = {n: DenseAllreduce() for n, _ in model.named_parameters()}
        op, lr = "sum", LR / ctx.num_replicas  # a sum with lr / R is the same update as the mean with lr
    opt = ctx.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=lr), op=op, model=model, plan=plan)
    if mode == "per_worker":
        data = ctx.input(global_input, PER_WORKER)
    else:
        data = ctx.input(replica_input_for(ctx.num_replicas), PER_REPLICA)

    def step_fn(b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        opt.zero_grad()
        loss = loss_of(model, b)
        loss.backward()
        opt.step()
        return {"loss": loss, "n": torch.tensor(b["y"].shape[0])}

    losses = [ctx.run(step_fn, b, outputs="gather") for b in data]
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "losses": [x["loss"].tolist() for x in losses],
        "sizes": [x["n"].tolist() for x in losses],
        "algorithms": sorted({r.algorithm for r in ctx.log.records}),
    }


# --- primitives -------------------------------------------------------------------------------------------------
def value_of(r: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(50 + r)
    return {
        "a": torch.randn(3, 2, generator=g, dtype=torch.float64),
        "b": [torch.randint(-5, 5, (4,), generator=g)],
    }


def bn_input(r: int) -> torch.Tensor:
    return torch.randn(4, 3, generator=torch.Generator().manual_seed(70 + r), dtype=torch.float64) * (r + 1)


def cross_replica_bn(ctx: ReplicaContext, h: torch.Tensor) -> torch.Tensor:
    """TF-Replicator §3.4: batch norm with statistics over every replica's batch, written with all_sum."""
    mean = ctx.all_sum(h.mean(0) / ctx.num_replicas)
    mean_sq = ctx.all_sum((h**2).mean(0) / ctx.num_replicas)
    return (h - mean) / torch.sqrt(mean_sq - mean**2 + 1e-5)


def _try(fn: Any) -> Any:
    try:
        return ("ok", fn())
    except Exception as e:
        return (type(e).__name__, str(e))


def primitives_program(ctx: ReplicaContext) -> dict[str, Any]:
    r, R = ctx.replica_id, ctx.num_replicas
    v = value_of(r)
    out: dict[str, Any] = {}
    out["sum"] = ctx.all_sum(v)
    out["mean"] = ctx.all_mean({"a": v["a"]})
    out["max"] = ctx.all_reduce(v, "max")
    out["min"] = ctx.all_reduce(v, "min")
    out["gather"] = ctx.all_gather(v)
    out["broadcast"] = ctx.broadcast(v, R - 1)
    out["map_reduce"] = ctx.map_reduce(lambda x: {"sq": x["a"] ** 2}, v)
    out["map_gather"] = ctx.map_gather(lambda x: x["a"].sum(0), v)
    for mode in ("local", "sum", "mean", "gather"):
        out[f"run_{mode}"] = ctx.run(lambda b: {"v": b * 2}, torch.tensor([float(r)]), outputs=mode)
    # Gradients through the primitives: objective Σ_r f_r, each replica's x_r gets ∂/∂x_r of the total.
    x = v["a"].clone().requires_grad_(True)
    w = torch.arange(6, dtype=torch.float64).view(3, 2) + r
    y = (ctx.all_sum(x) * w).sum() + (ctx.all_gather(x)[0] * w).sum() + (ctx.broadcast(x, R - 1) ** 2 * w).sum()
    y.backward()
    out["grad"] = x.grad
    # Cross-replica batch norm, forward and the gradient of a weighted sum of its output.
    h = bn_input(r).requires_grad_(True)
    z = cross_replica_bn(ctx, h)
    (z * torch.arange(12, dtype=torch.float64).view(4, 3)).sum().backward()
    out["bn"], out["bn_grad"] = z.detach(), h.grad
    return out


def split_time_major(batch: torch.Tensor, n: int) -> list[torch.Tensor]:
    """An input_split_fn for [time, batch, features] sequences (TF-Replicator §3.2's example): split dim 1."""
    return list(torch.chunk(batch, n, dim=1))


def sequence_input(worker_id: int) -> Any:
    return [torch.arange(5 * 6 * 2, dtype=torch.float32).view(5, 6, 2) + 1000 * s for s in range(2)]


def prims_and_errors(ctx: ReplicaContext) -> tuple[dict[str, Any], dict[str, Any] | None]:
    ctx.input_split_fn = split_time_major
    prims = primitives_program(ctx)
    prims["sequences"] = list(ctx.input(sequence_input, PER_WORKER))
    ctx.input_split_fn = split_batch
    return prims, errors_program(ctx) if ctx.num_replicas == 3 else None


def errors_program(ctx: ReplicaContext) -> dict[str, Any]:
    r, R = ctx.replica_id, ctx.num_replicas
    out: dict[str, Any] = {}
    out["shape"] = _try(lambda: ctx.all_sum(torch.zeros(3 if r != 1 else 4)))
    out["dtype"] = _try(lambda: ctx.all_sum(torch.zeros(2, dtype=torch.float32 if r != 1 else torch.float64)))
    out["structure"] = _try(lambda: ctx.all_sum({"a": torch.zeros(2)} if r != 1 else [torch.zeros(2)]))
    out["order"] = _try(lambda: ctx.all_sum(torch.zeros(2)) if r != 1 else ctx.all_gather(torch.zeros(2)))
    out["vs_sparse"] = _try(
        lambda: (
            ctx.all_sum(torch.zeros(2))
            if r != 1
            else sparsync.allreduce(torch.zeros(2), group=ctx.dp_group, algorithm="dense")
        )
    )
    out["source"] = _try(lambda: ctx.broadcast(torch.zeros(2), R + 4))
    out["batch_size"] = _try(lambda: ctx.per_replica_batch_size(R * 4 + 1))
    out["split"] = _try(lambda: next(ctx.input(lambda w: [{"x": torch.zeros(R * 2 + 1, 3)}])))
    out["device"] = _try(lambda: ctx.on_device(2, lambda: 0))
    out["op"] = _try(lambda: ctx.all_reduce(torch.zeros(2), "prod"))
    out["outputs"] = _try(lambda: ctx.run(lambda b: b, torch.zeros(1), outputs="median"))
    out["after"] = _try(lambda: ctx.all_sum(torch.ones(1)).item())  # the group still works after the errors
    return out


# --- model parallelism ------------------------------------------------------------------------------------------
MP_IN, MP_W, MP_OUT, MP_BATCH = 16, 256, 4, 32


def mp_stages() -> list[nn.Module]:
    torch.manual_seed(77)
    return [
        nn.Sequential(nn.Linear(MP_IN, MP_W), nn.Tanh()),
        nn.Sequential(nn.Linear(MP_W, MP_W), nn.Tanh()),
        nn.Linear(MP_W, MP_OUT),
    ]


def mp_batch(seed: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(size, MP_IN, generator=g), torch.randint(0, MP_OUT, (size,), generator=g)


def placement(k: int) -> list[int]:
    """Logical device of each of the 3 stages."""
    return {1: [0, 0, 0], 2: [0, 0, 1], 3: [0, 1, 2]}[k]


def mp_program(ctx: ReplicaContext, etas: list[float | None], steps: int) -> list[dict[str, Any]]:
    """One training run per DCT-MP setting (None: uncompressed), in one process group; then, last, a
    transfer whose sequence number diverges (the receiver skipped a call), which the receiver must report."""
    runs = [_mp_run(ctx, eta, steps) for eta in etas]
    if ctx.devices_per_replica > 1:
        x = ctx.on_device(0, lambda: torch.ones(2, 3))
        if ctx.device_id == 1:
            ctx.devices.seq += 1  # as if this device had made one more on_device transfer than device 0
        runs[0]["diverged"] = _try(lambda: ctx.on_device(1, lambda t: t * 2, x))
    return runs


def _mp_run(ctx: ReplicaContext, eta: float | None, steps: int) -> dict[str, Any]:
    n_records = len(ctx.split_records)
    stages = mp_stages()
    model = nn.ModuleList(stages)
    where = placement(ctx.devices_per_replica)
    opt = ctx.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), op="mean", model=model)
    comp = DCTMP(eta) if eta is not None else None
    first: dict[str, Any] = {}
    for s in range(steps):
        x, y = mp_batch(500 + 10 * s + ctx.replica_id, MP_BATCH)
        opt.zero_grad()
        h: Any = x
        for i, st in enumerate(stages):

            def run(t: torch.Tensor, st: nn.Module = st, i: int = i, s: int = s) -> torch.Tensor:
                if s == 0:
                    first[f"in{i}"] = t.detach().clone()
                out = st(t)
                if s == 0 and i == 0:
                    out.retain_grad()
                    first["act0"] = out
                return out

            h = ctx.on_device(where[i], run, h, compression=comp, name=f"split{i}")
        loss = ctx.on_device(where[-1], F.cross_entropy, h, y)
        loss.backward()
        opt.step()
    act = first.get("act0")
    return {
        "device": ctx.device_id,
        "replica": ctx.replica_id,
        "params": {
            f"{i}.{n}": p.detach().clone()
            for i, st in enumerate(stages)
            if where[i] == ctx.device_id
            for n, p in st.named_parameters()
        },
        "inputs": {k: v for k, v in first.items() if k.startswith("in")},
        "act0": None if act is None else act.detach().clone(),
        "act0_grad": None if act is None or act.grad is None else act.grad.clone(),
        "loss": ctx.fetch(loss).item(),
        "records": [r.__dict__ for r in ctx.split_records[n_records:]],
        "split_bytes": ctx.split_bytes(),  # cumulative over the runs so far
    }


def mp_reference(num_replicas: int, steps: int) -> dict[str, torch.Tensor]:
    stages = mp_stages()
    model = nn.Sequential(*stages)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(steps):
        xs, ys = zip(*(mp_batch(500 + 10 * s + r, MP_BATCH) for r in range(num_replicas)), strict=True)
        opt.zero_grad()
        F.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return {f"{i}.{n}": p.detach().clone() for i, st in enumerate(stages) for n, p in st.named_parameters()}


def kept_mask(act: torch.Tensor, eta: float) -> torch.Tensor:
    rows, d = act.shape[0], act[0].numel()
    idx = dct.select(act.reshape(rows, d), DCTMP(eta).kept(d))
    return torch.zeros(rows, d, dtype=torch.bool).scatter_(1, idx, True).view_as(act)


def prims_and_errors_under_nccl_rules(ctx: ReplicaContext) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``prims_and_errors`` with the replicas' group under NCCL's rules (tests/_nccl_rules.py); the rules'
    summary rides in the first dict under "nccl_rules"."""
    from _nccl_rules import NcclRules

    with NcclRules() as rules:
        prims, errors = prims_and_errors(ctx)
    prims["nccl_rules"] = rules.summary()
    return prims, errors
