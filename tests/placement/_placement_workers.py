"""Module-level workers and references for the placement tests (``placements=``, sketch, compressed pushes)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sparsync.compress import SparseSketch
from sparsync.hybrid import HybridConfig, HybridTrainer
from sparsync.placement import NamedParam, ReduceEnv, Sketch
from sparsync.ps import OptimizerConfig
from sparsync.record import CommLog

VOCAB, DIM, CLASSES, SEQ, BATCH = 40, 6, 5, 5, 4
BIG_SKETCH = SparseSketch(cols=1 << 20)  # no collisions among the few hundred non-zeros of a step


class TwoEmbLM(nn.Module):
    """Two sparse embeddings (words, tags) and a two-layer head: room for every placement at once."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.words = nn.Embedding(VOCAB, DIM, sparse=True)
        self.tags = nn.Embedding(VOCAB, DIM, sparse=True)
        self.hidden = nn.Linear(DIM, 12)
        self.out = nn.Linear(12, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.words(x).mean(1) + self.tags(x.flip(1) % (VOCAB // 2)).mean(1)
        return self.out(torch.tanh(self.hidden(h)))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7000 + 100 * step + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)


def loss_of(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    x, y = batch(step, rank)
    return nn.functional.cross_entropy(model(x), y)


SPARSE = ("words.weight", "tags.weight")


def optimizers(
    model: nn.Module, opt: str, local: list[str]
) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """(dense, sparse) torch optimizers over the ``local`` parameters (sgd lr 0.1, or adam lr 0.01)."""
    named = dict(model.named_parameters())
    dense = [named[n] for n in local if n not in SPARSE] or [torch.zeros(1, requires_grad=True)]
    sparse = [named[n] for n in local if n in SPARSE] or [torch.zeros(1, requires_grad=True)]
    if opt == "adam":
        return torch.optim.Adam(dense, lr=0.01), torch.optim.SparseAdam(sparse, lr=0.01)
    return torch.optim.SGD(dense, lr=0.1), torch.optim.SGD(sparse, lr=0.1)


def reference(world: int, steps: int, opt: str, reduce: str) -> dict[str, torch.Tensor]:
    """Single-process training on every worker's batch (loss = sum or mean of the workers' losses)."""
    model = TwoEmbLM()
    o_d, o_s = optimizers(model, opt, [n for n, _ in model.named_parameters()])
    for s in range(steps):
        o_d.zero_grad()
        o_s.zero_grad()
        loss = sum(loss_of(model, s, r) for r in range(world)) / (world if reduce == "mean" else 1)
        loss.backward()  # type: ignore[union-attr]
        o_d.step()
        o_s.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def trainer_worker(rank: int, addresses: list[str], cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Sync training with each case's ``placements``; the final parameters as rank ``rank`` sees them (local
    replicas, and rank 0 reads the servers' tables)."""
    out = []
    for i, c in enumerate(cases):
        model = TwoEmbLM()
        placements: dict[str, Any] = c["placements"]
        local = [n for n, pl in placements.items() if pl != "ps"]
        o_d, o_s = optimizers(model, c["opt"], local)
        cfg = HybridConfig(
            sparse_reduce=c["reduce"], dense_reduce=c["reduce"], timeout=30.0,
            table_prefix=f"w{c['world']}/case{i}/", procs_per_machine=c["world"] if c.get("one_machine") else 1,
            optimizer=OptimizerConfig(c["opt"], lr=0.01 if c["opt"] == "adam" else 0.1),
            sketch=c.get("sketch", BIG_SKETCH), sketch_error_feedback=c.get("ef", False),
        )  # fmt: skip
        log = CommLog()
        tr = HybridTrainer(
            model, addresses, cfg, dense_optimizer=o_d, sparse_optimizer=o_s, placements=placements, log=log
        )
        for s in range(c["steps"]):
            tr.step(lambda s=s, m=model: loss_of(m, s, rank))
        dist.barrier()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        if rank == 0:
            params.update({n: t.read_all().reshape(params[n].shape) for n, t in tr.tables.items()})
        algs = sorted({r.algorithm for r in log.records})
        if c.get("ef"):  # the sketch's state round-trips, also from the format before placement objects
            sk = next(pl for pl in tr.plan.values() if isinstance(pl, Sketch))
            st = tr.state_dict()
            assert st["placements"]["sketch"]["calls"] == c["steps"] and st["push"] is None
            assert sk.memory is not None
            saved = {n: sk.memory.error(n) for n in sk.memory.names()}
            sk.calls = 0
            sk.memory.reset()
            tr.load_state_dict({"reduced": st["placements"]["sketch"], "push": None})
            assert sk.calls == c["steps"] and saved
            assert all(torch.equal(sk.memory.error(n), e) for n, e in saved.items())  # type: ignore[arg-type]
        tr.close()
        records = [(r.op, r.dim, r.bytes_sent + r.bytes_recv) for r in log.records]
        out.append({"params": params, "algorithms": algs, "records": records})
        dist.barrier()
    return out


# --- the sketch placement by itself ---------------------------------------------------------------------------
def sketch_grad(rank: int) -> torch.Tensor:
    """A fixed embedding gradient per rank (rows overlap across ranks), sparse COO as nn.Embedding gives."""
    g = torch.Generator().manual_seed(500 + rank)
    rows = torch.cat([torch.tensor([3, 7]), torch.randint(0, 200, (30,), generator=g)])
    return torch.sparse_coo_tensor(rows[None], torch.randn(rows.numel(), 16, generator=g), (200, 16)).coalesce()


def sketch_worker(rank: int, sketch: SparseSketch, steps: int) -> dict[str, Any]:
    """``steps`` reductions of the same gradient through the sketch placement, with and without error
    feedback: each step's reduced (mean) gradient, and the residual left after the first step."""
    out: dict[str, Any] = {}
    for ef in (False, True):
        p = nn.Parameter(torch.zeros(200, 16))
        red = Sketch(sketch, error_feedback=ef)
        env = ReduceEnv(dist.group.WORLD, dist.get_world_size())  # type: ignore[arg-type]
        outs, residual = [], None
        for s in range(steps):
            p.grad = sketch_grad(rank)
            red.aggregate([NamedParam("w", p)], env)
            assert p.grad is not None
            outs.append(p.grad.to_dense().clone() / dist.get_world_size())
            if s == 0 and red.memory is not None:
                residual = red.memory.error("w")
        out[f"ef={ef}"] = {"outs": outs, "residual": residual}
    return out


# --- compressed pushes (async) --------------------------------------------------------------------------------
def async_worker(rank: int, addresses: list[str], steps: int) -> dict[str, Any]:
    """Async training (world 1 is deterministic) uncompressed, with the identity compressor, and with a
    threshold + error feedback; final tables, and the last trainer's checkpoint round trip."""
    from sparsync.compress import Identity, Threshold

    out: dict[str, Any] = {}
    for key, comp in (("none", None), ("identity", Identity()), ("threshold", Threshold(0.2, lifespan=1))):
        model = TwoEmbLM()
        cfg = HybridConfig(mode="async", optimizer=OptimizerConfig("sgd", lr=0.1), timeout=30.0,
                           table_prefix=f"async/{key}/", push_compressor=comp)  # fmt: skip
        tr = HybridTrainer(model, addresses, cfg)
        for s in range(steps):
            tr.step(lambda s=s, m=model: loss_of(m, s, rank))
        out[key] = {n: t.read_all() for n, t in tr.tables.items()}
        if comp is not None:
            state = tr.state_dict()
            tr.close()
            again = HybridTrainer(TwoEmbLM(), addresses, cfg)  # a restarted worker, same servers
            again.load_state_dict(state)
            assert (
                tr.servers.push_feedback is not None
                and again.servers.push_feedback is not None
                and tr.servers.push_feedback.memory is not None
            )
            out[key + "/restored"] = [
                torch.equal(tr.servers.push_feedback.memory.error(n), again.servers.push_feedback.memory.error(n))  # type: ignore[arg-type]
                and float(tr.servers.push_feedback.memory.error(n).abs().sum()) > 0  # type: ignore[union-attr]
                for n in tr.servers.push_feedback.memory.names()
            ] or [key == "identity"]
            again.close()
        else:
            tr.close()
    return out


def bad_placements_worker(rank: int, addresses: list[str]) -> list[str]:
    """The errors a trainer raises for bad placements (before it connects to any server)."""
    out = []
    for mode, placements in (
        ("sync", {"nope.weight": "ps"}),
        ("sync", {"hidden.weight": "allgather"}),
        ("async", {"hidden.weight": "dense_allreduce"}),
    ):
        try:
            HybridTrainer(TwoEmbLM(), addresses, HybridConfig(mode=mode), placements=placements)
            out.append("no error")
        except (KeyError, ValueError) as e:
            out.append(f"{type(e).__name__}: {e}")
    return out
