"""``sparsync bench hybrid``: Parallax Table 4 on one machine. A language model with a large sparse embedding
and a dense LSTM, trained with P ranks by eight methods side by side:

- ``allreduce``: every gradient dense, one dense allreduce (the embedding gradient densified);
- ``allgather``: dense allreduce for the LSTM, the embedding's sparse gradients allgathered (Horovod/DDP way);
- ``ddp_sparse``: torch's ``DistributedDataParallel`` on gloo, the embedding ``sparse=True``: its COO gradient
  by gloo's sparse allreduce (an allgather of every rank's rows), the LSTM in DDP's dense buckets; no sparsync
  (the baseline a PyTorch user would pick). Its bytes are computed from what gloo sends
  (``ddp_baseline``), its ``comm_ms`` is DDP's own logged communication span per step (first bucket launched to
  last bucket reduced, overlapping the backward pass);
- ``sparse_ar``: the embedding by sparsync's sparse allreduce (SparCML, ``auto``);
- ``ps``: every parameter on the parameter servers (one per rank, colocated), sync; each dense variable whole
  on one server, round-robin, as Parallax places them;
- ``ps_split``: ``ps`` with every dense variable split by rows across all servers;
- ``hybrid``: LSTM by dense allreduce, embedding on the servers (Parallax);
- ``hybrid_noagg``: hybrid without local aggregation (one gradient row per token occurrence on the wire);
- ``hybrid_sketch`` (on request, ``--methods``): LSTM by dense allreduce, embedding by the S2 sketch placement
  (``HybridConfig.sketch``, ratio ``sketch_ratio``): lossy, so its loss differs from the others'.

The PS methods prefetch the next step's rows during the dense allreduce unless ``prefetch`` is off, and report
the trainer's timing scopes as ``<phase>_ms`` (mean ms per measured step; None for the collective methods).
Every method reports ``comm_ms``, its measured communication time per step (the collectives' logged call times;
for the PS methods every phase but forward_backward), and rank 0's rows carry the group's measured ``link``
(α, β) so ``sparsync plan``'s predicted time can be set beside it.
All methods run plain SGD with mean reduction on the same data and initial weights, so their losses agree.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sparsync.collectives.calibrate import measure_link
from sparsync.collectives.tensor import allreduce
from sparsync.compress.sketch import SparseSketch
from sparsync.hybrid import PHASES, HybridConfig, HybridTrainer
from sparsync.ps.optim import OptimizerConfig
from sparsync.record import CommLog, workload_bytes
from sparsync_bench.ddp_baseline import ddp_step_bytes
from sparsync_bench.lm import Corpus, SampledLM
from sparsync_bench.omnireduce import block_allreduce
from sparsync_bench.report import progress

METHODS = ("allreduce", "allgather", "ddp_sparse", "sparse_ar", "ps", "ps_split", "hybrid", "hybrid_noagg")
# run only when named: hybrid_sketch (lossy, so not in the equal-loss comparison) and omnireduce (S2's baseline:
# the embedding by the OmniReduce-style block-sparse allreduce, omnireduce.py; for sparsync reproduce)
OPTIONAL_METHODS = ("hybrid_sketch", "omnireduce")
PS_METHODS = ("ps", "ps_split", "hybrid", "hybrid_noagg")


@dataclass(frozen=True)
class HybridBenchConfig:
    vocab: int = 100_000  # embedding rows
    dim: int = 128  # embedding width
    hidden: int = 256  # LSTM width
    batch: int = 32  # sequences per worker per step
    seq: int = 20  # words per sequence (controls α, as Parallax Table 6)
    negatives: int = 256  # shared negative samples of the sampled softmax
    steps: int = 10  # measured steps per method, split into ``rounds``
    rounds: int = 2  # methods interleave: each round runs steps/rounds steps of every method
    warmup: int = 3  # unmeasured steps first
    lr: float = 0.5  # SGD, every method
    zipf: float = 1.0
    files: tuple[str, ...] = ()  # text files instead of Zipf tokens
    methods: tuple[str, ...] = METHODS
    seed: int = 0
    partitions: int | None = None  # PS partitions per table (None: one per server)
    prefetch: bool = True  # PS methods: pull the next step's rows during this step's dense allreduce
    sketch_ratio: float = 0.05  # hybrid_sketch: sketch cells / embedding entries (SparseSketch ratio)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        bad = [m for m in self.methods if m not in METHODS + OPTIONAL_METHODS]
        if bad:
            raise KeyError(f"unknown methods {bad}; valid: {', '.join(METHODS + OPTIONAL_METHODS)}")
        if min(self.vocab, self.dim, self.hidden, self.batch, self.seq, self.steps, self.rounds) < 1:
            raise ValueError("vocab, dim, hidden, batch, seq, steps, rounds must be >= 1")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")


class _Collective:
    """allreduce, allgather, sparse_ar, omnireduce: gradients through sparsync collectives, a local SGD."""

    def __init__(self, model: SampledLM, method: str, lr: float, log: CommLog) -> None:
        self.model, self.method, self.log = model, method, log
        self.opt = torch.optim.SGD(model.parameters(), lr=lr)
        self.P = dist.get_world_size()
        self.dense = [p for n, p in model.named_parameters() if n != "emb.weight"]

    def step(self, closure: Any) -> float:
        self.opt.zero_grad(set_to_none=True)
        loss = closure()
        loss.backward()
        emb = self.model.emb.weight
        assert emb.grad is not None
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.dense]
        if self.method == "allreduce":
            flat = torch.cat([emb.grad.to_dense().reshape(-1)] + [g.reshape(-1) for g in grads])
        else:
            flat = torch.cat([g.reshape(-1) for g in grads])
            alg = "allgather" if self.method == "allgather" else "auto"
            g = (
                block_allreduce(emb.grad.coalesce(), log=self.log)
                if self.method == "omnireduce"
                else allreduce(emb.grad.coalesce(), algorithm=alg, log=self.log)
            )
            assert isinstance(g, torch.Tensor)
            emb.grad = g / self.P
        out = allreduce(flat, algorithm="dense", log=self.log)
        assert isinstance(out, torch.Tensor)
        out /= self.P
        off = 0
        if self.method == "allreduce":
            emb.grad = out[: emb.numel()].reshape(emb.shape).clone()
            off = emb.numel()
        for p in self.dense:
            p.grad = out[off : off + p.numel()].reshape(p.shape).clone()
            off += p.numel()
        self.opt.step()
        return float(loss.detach())


class _DDPSparse:
    """``ddp_sparse``: DDP averages (divides each gradient by P, then sums), a local SGD; ``comm_s`` holds DDP's
    logged communication span of each step, by step number."""

    def __init__(self, model: SampledLM, lr: float) -> None:
        from torch.nn.parallel import DistributedDataParallel

        self.model = model
        self.ddp = DistributedDataParallel(model)
        # DDP's logger samples its timers every 100 steps by default; every step here (CPU clock reads).
        self.ddp._set_ddp_runtime_logging_sample_rate(1)  # type: ignore[no-untyped-call]
        self.opt = torch.optim.SGD(model.parameters(), lr=lr)
        self.steps = 0
        self.comm_s: dict[int, float] = {}

    def step(self, closure: Any) -> float:
        self.opt.zero_grad(set_to_none=True)
        loss = closure()
        # DDP logs a step's timings at the next step's forward: this data is the previous step's.
        data = self.ddp._get_ddp_logging_data()  # type: ignore[no-untyped-call]
        if self.steps > 0 and "backward_comm_time" in data:
            self.comm_s[self.steps - 1] = float(data["backward_comm_time"]) / 1e9
        loss.backward()
        self.opt.step()
        self.steps += 1
        return float(loss.detach())


class _MethodRun:
    """One method's model, data and trainer on this rank; ``run(n)`` trains n steps and accumulates the
    measured time, bytes, losses and α."""

    def __init__(self, rank: int, cfg: HybridBenchConfig, method: str, addresses: list[str]) -> None:
        self.rank, self.cfg, self.method = rank, cfg, method
        self.model = SampledLM(cfg.vocab, cfg.dim, cfg.hidden, seed=cfg.seed)
        self.corpus = Corpus(
            cfg.vocab, files=[Path(f) for f in cfg.files], zipf=cfg.zipf, seed=cfg.seed * 1009 + rank
        )
        self.log = CommLog()
        self.trainer: Any
        if method in (*PS_METHODS, "hybrid_sketch"):
            dense = [p for n, p in self.model.named_parameters() if n != "emb.weight"]
            hc = HybridConfig(
                mode="sync",
                sparse_reduce="mean",
                dense_reduce="mean",
                optimizer=OptimizerConfig("sgd", lr=cfg.lr),
                local_aggregation=method != "hybrid_noagg",
                ps_dense=method in ("ps", "ps_split"),
                dense_whole=method == "ps",
                partitions=cfg.partitions,
                table_prefix=f"{method}/",
                timeout=300.0,
                sketch=SparseSketch(ratio=cfg.sketch_ratio),
            )
            opt = torch.optim.SGD(dense, lr=cfg.lr)
            sketched = method == "hybrid_sketch"
            self.trainer = HybridTrainer(
                self.model, addresses, hc, dense_optimizer=opt, log=self.log,
                sparse_optimizer=torch.optim.SGD([self.model.emb.weight], lr=cfg.lr) if sketched else None,
                placements={"emb.weight": "sketch"} if sketched else None,
            )  # fmt: skip
        elif method == "ddp_sparse":
            self.trainer = _DDPSparse(self.model, cfg.lr)
        else:
            self.trainer = _Collective(self.model, method, cfg.lr, self.log)
        # what a step's closure calls: DDP's wrapper, whose forward arms its gradient reduction
        self.forward: torch.nn.Module = self.trainer.ddp if method == "ddp_sparse" else self.model
        self.ddp_steps: list[int] = []  # ddp_sparse: the trainer's numbers of the measured steps
        self.losses: list[float] = []
        self.alphas: list[float] = []
        self.step_times: list[float] = []
        self.seconds = 0.0
        self.comm_seconds = 0.0
        self.bytes = 0.0
        self.steps = 0
        self.phases = dict.fromkeys(PHASES, 0.0)
        self.next_batch = self._batch()

    def _batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.corpus.batch(self.cfg.batch, self.cfg.seq), self.corpus.negatives(self.cfg.negatives)

    def run(self, n: int, *, measured: bool, update: Callable[[str | None, int], None]) -> None:
        self.log.clear()
        ps0 = ps_remote_bytes(self.trainer, self.rank)
        hybrid = isinstance(self.trainer, HybridTrainer)
        ph0 = dict(self.trainer.phases) if hybrid else {}
        ddp = isinstance(self.trainer, _DDPSparse)
        rows: list[int] = []
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            ts = time.perf_counter()
            tokens, neg = self.next_batch
            self.next_batch = self._batch()
            ids = torch.unique(torch.cat([tokens.reshape(-1), neg]))
            self.alphas.append(ids.numel() / self.cfg.vocab)
            rows.append(ids.numel())  # the embedding gradient's rows (the model's one lookup: tokens, negatives)
            if ddp and measured:
                self.ddp_steps.append(self.trainer.steps)
            closure = lambda tokens=tokens, neg=neg: self.forward(tokens, neg)  # noqa: E731
            if hybrid and self.cfg.prefetch:
                nxt = torch.cat([self.next_batch[0].reshape(-1), self.next_batch[1]])
                self.losses.append(self.trainer.step(closure, prefetch=nxt))
            else:
                self.losses.append(self.trainer.step(closure))
            if measured:
                self.step_times.append(time.perf_counter() - ts)
            update(None, 1)
        dist.barrier()
        if measured:
            sec = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(sec, op=dist.ReduceOp.MAX)
            self.seconds += float(sec)
            self.steps += n
            # Per machine, sent + received: collectives log both ends; a PS byte is counted at the client and at
            # the remote server, so a machine's share is twice its client's remote traffic on average (Table 3
            # counts both ends too).
            self.bytes += sum(workload_bytes(r) + r.bytes_recv for r in self.log.records)
            self.bytes += 2 * (ps_remote_bytes(self.trainer, self.rank) - ps0)
            if ddp:
                self.bytes += self._ddp_bytes(rows)
            delta = {k: self.trainer.phases[k] - ph0[k] for k in ph0}
            for k, ms in delta.items():
                self.phases[k] += ms
            # PS methods: the phases (the log also holds their dense allreduce, inside a phase already).
            comm_ms = sum(ms for k, ms in delta.items() if k != "forward_backward")
            self.comm_seconds += comm_ms / 1e3 if hybrid else self.log.total_seconds()

    def _ddp_bytes(self, rows: list[int]) -> float:
        """Sent + received by this rank over the steps whose gradient rows were ``rows`` (every rank's rows
        gathered after the timed steps)."""
        every = [torch.zeros(len(rows), dtype=torch.int64) for _ in range(dist.get_world_size())]
        dist.all_gather(every, torch.tensor(rows, dtype=torch.int64))
        total = 0.0
        for i in range(len(rows)):
            b = ddp_step_bytes(self.model, [int(t[i]) for t in every], self.rank)
            total += b.sent + b.recv
        return total

    def result(self) -> dict[str, Any]:
        P, cfg = dist.get_world_size(), self.cfg
        last = self.losses[-3:]
        hybrid = isinstance(self.trainer, HybridTrainer)
        if isinstance(self.trainer, _DDPSparse):
            # The last step's span is logged at a forward that never comes: the mean over the others (over the
            # warm-up steps' where no other measured step was logged).
            logged = self.trainer.comm_s
            spans = [logged[i] for i in self.ddp_steps if i in logged] or list(logged.values())
            self.comm_seconds = self.steps * sum(spans) / len(spans) if spans else 0.0
        per_step = [self.phases[k] / self.steps for k in PHASES]
        stats = torch.tensor(
            [
                self.bytes / self.steps,
                sum(last) / len(last),
                sum(self.alphas) / len(self.alphas),
                1e3 * self.comm_seconds / self.steps,
                *per_step,
            ]
        )
        dist.all_reduce(stats)
        stats /= P
        if hybrid:
            self.trainer.close()
        words = P * cfg.batch * cfg.seq * self.steps
        return {
            "method": self.method,
            "P": P,
            "seq": cfg.seq,
            "alpha": float(stats[2]),
            "words_per_s": words / self.seconds,
            "step_s": self.seconds / self.steps,
            "bytes_per_step_per_machine": float(stats[0]),
            "loss": float(stats[1]),
            "steps": len(self.losses),
            "partitions": cfg.partitions or P,
            "prefetch": cfg.prefetch if hybrid else None,
            "comm_ms": float(stats[3]),
            **{f"{k}_ms": float(stats[4 + i]) if hybrid else None for i, k in enumerate(PHASES)},
            "times_s": self.step_times,
        }


def ps_remote_bytes(trainer: Any, rank: int) -> int:
    """Bytes (sent + received) between ``trainer``'s client and the servers of other ranks (server i is colocated
    with rank i, as ``bench_servers`` starts them); 0 for a trainer without servers."""
    if not isinstance(trainer, HybridTrainer):
        return 0
    per = trainer.client.bytes_per_server
    return sum(per) - per[rank % len(per)]  # server i is colocated with rank i


def worker(rank: int, cfg: HybridBenchConfig, show_progress: bool, addresses: list[str]) -> list[dict[str, Any]]:
    """Runs on every rank (``addresses``: the servers, one per rank); rank 0 returns the rows."""
    total = len(cfg.methods) * (cfg.warmup + max(1, cfg.steps // cfg.rounds) * cfg.rounds)
    title = f"P={dist.get_world_size()} seq={cfg.seq}"
    with progress(show_progress and rank == 0, title, total) as update:
        link = asdict(measure_link())  # the group's α, β: the plan's predicted time uses them (bench.hybrid)
        runs = {m: _MethodRun(rank, cfg, m, addresses) for m in cfg.methods}
        for r in runs.values():
            r.run(cfg.warmup, measured=False, update=update)
        # Rounds of every method in a fresh order (same seed on every rank): drift in the shared machine's load
        # hits all methods alike.
        order = random.Random(cfg.seed)
        per_round = max(1, cfg.steps // cfg.rounds)
        for _ in range(cfg.rounds):
            for m in order.sample(list(runs), len(runs)):
                runs[m].run(per_round, measured=True, update=update)
        rows = [{**runs[m].result(), "link": link} for m in cfg.methods]
    return rows if rank == 0 else []


def config_dict(cfg: HybridBenchConfig) -> dict[str, Any]:
    return asdict(cfg)
