"""``sparsync bench tta``: time to accuracy. Every method trains the same model from the same initial weights
(bit for bit: built from one seed, their hash recorded) on the same samples (each rank's batch at step s is
drawn from a generator seeded by (seed, rank, s)), in one run, and rank 0 keeps the
time of every step, the loss (the mean over ranks of each rank's batch loss), and the bytes its link interface
sent. The methods take turns, ``block`` steps each, so that what else the host runs falls on all of them alike;
each method's clock counts its own steps only.

Methods (``METHODS``): DDP's dense allreduce; DDP with torch's fp16 hook; torch's PowerSGD hook at ranks
1, 2, 4 (DDP with one bucket for the whole model: with several buckets in flight the hook deadlocks on gloo,
since it issues a bucket's second allreduce from the first's future callback); sparsync's compressors through
``compression_hook`` (QSGD, TopK + ErrorFeedback, DGC's top-k, the same with tensors of under 64Ki entries sent
whole, Threshold = DCT-DP + ErrorFeedback, sparsync's PowerSGD), and through ``DistributedOptimizer`` (PowerSGD,
bucketed QSGD, and top-k over all the dense gradients at once with error feedback).

Models (``MODELS``): a small causal transformer with dense gradients only, an LSTM language model with a
large embedding (``lm.SampledLM``, its gradient dense here as a DDP user's ``nn.Embedding`` sends it), and an
MLP learning a fixed random teacher's labels from Gaussian inputs. The language models' data: a Zipf-Markov
token stream (each token follows its fixed successor with probability ``follow``, else a fresh Zipf draw), so
both have structure to learn beyond the unigram.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sparsync.compress import Compressor, ErrorFeedback, Memory, Threshold, from_spec
from sparsync.compress.hooks import compression_hook
from sparsync.compress.memory import MomentumCorrection
from sparsync.optim import DistributedOptimizer
from sparsync.placement import Compressed
from sparsync_bench.lm import SampledLM
from sparsync_bench.report import progress


@dataclass(frozen=True)
class Method:
    """One way to reduce the gradients. ``kind``: "ddp" (DDP, ``torch_hook`` naming torch's hook or None),
    "hook" (DDP with sparsync's ``compression_hook``), "opt" (sparsync's ``DistributedOptimizer``)."""

    label: str
    kind: str
    spec: str = ""  # sparsync compressor (``from_spec``) for "hook"/"opt"
    memory: str = ""  # "" none, "ef" ErrorFeedback, "dgc" MomentumCorrection (then SGD without momentum)
    torch_hook: str | None = None  # "fp16" or "powersgd"
    rank: int = 0  # torch PowerSGD's matrix_approximation_rank
    bucket: bool = False  # "opt": one compression of all the dense gradients (``Compressed(bucket=True)``)


METHODS: dict[str, Method] = {
    m.label: m
    for m in (
        Method("ddp", "ddp"),
        Method("ddp-fp16", "ddp", torch_hook="fp16"),
        Method("torch-powersgd-r1", "ddp", torch_hook="powersgd", rank=1),
        Method("torch-powersgd-r2", "ddp", torch_hook="powersgd", rank=2),
        Method("torch-powersgd-r4", "ddp", torch_hook="powersgd", rank=4),
        Method("qsgd4", "hook", "qsgd:bits=4,bucket=512"),
        Method("topk-ef", "hook", "topk:ratio=0.01", "ef"),
        Method("dgc", "hook", "topk:ratio=0.01,warmup=20", "dgc"),
        Method("topk-small-ef", "hook", "topk:ratio=0.01,dense_below=65536", "ef"),
        Method("dgc-small", "hook", "topk:ratio=0.01,warmup=20,dense_below=65536", "dgc"),
        Method("topk10-small-ef", "hook", "topk:ratio=0.1,dense_below=65536", "ef"),
        Method("topk-bucket-ef", "hook", "topk:ratio=0.01,scope=bucket", "ef"),
        Method("dctdp-ef", "hook", "threshold:ratio=0.01,lifespan=1000", "ef"),
        Method("dctdp-noslack-ef", "hook", "threshold:ratio=0.01,lifespan=1000,slack=None", "ef"),
        Method("powersgd-r2", "hook", "powersgd:rank=2,start_iter=2", "ef"),
        Method("opt-powersgd-r2", "opt", "powersgd:rank=2,start_iter=2", "ef"),
        Method("opt-qsgd4", "opt", "qsgd:bits=4,bucket=512", bucket=True),
        Method("opt-topk-ef", "opt", "topk:ratio=0.01", "ef", bucket=True),
    )
}
TORCH_POWERSGD_START = 2  # torch's least start_powerSGD_iter with error feedback and warm start


@dataclass(frozen=True)
class ModelSpec:
    kind: str  # "transformer", "lm" or "mlp"
    vocab: int  # mlp: classes
    dim: int  # mlp: inputs
    hidden: int  # transformer: feed-forward width; lm: LSTM width; mlp: hidden width
    layers: int  # transformer layers; mlp: hidden layers (lm: unused)
    seq: int
    batch: int  # sequences per rank per step
    lr: float
    negatives: int = 0  # lm: shared negative samples per step (sampled softmax)


MODELS: dict[str, ModelSpec] = {
    "transformer": ModelSpec("transformer", 512, 256, 1024, 3, 32, 4, 0.05),
    "lm": ModelSpec("lm", 100_000, 64, 256, 1, 20, 8, 0.5, negatives=512),
    "mlp": ModelSpec("mlp", 10, 256, 2048, 2, 0, 128, 0.05),
    "tiny-transformer": ModelSpec("transformer", 64, 16, 32, 1, 8, 2, 0.05),
    "tiny-lm": ModelSpec("lm", 500, 8, 16, 1, 6, 2, 0.5, negatives=16),
    "tiny-mlp": ModelSpec("mlp", 4, 8, 16, 1, 0, 4, 0.05),
}


@dataclass(frozen=True)
class TTAConfig:
    model: str = "transformer"  # a key of MODELS
    steps: int = 60  # training steps per method
    block: int = 10  # steps each method trains in its turn (the methods take turns, block by block)
    methods: tuple[str, ...] = tuple(METHODS)  # keys of METHODS, trained in this order
    momentum: float = 0.9  # SGD momentum (DGC applies it in its memory instead)
    zipf: float = 1.1  # the stream's Zipf exponent
    follow: float = 0.7  # probability that a token is followed by its fixed successor
    seed: int = 0
    spec: ModelSpec = field(init=False)

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; valid: {', '.join(MODELS)}")
        bad = [m for m in self.methods if m not in METHODS]
        if bad:
            raise ValueError(f"unknown methods {bad}; valid: {', '.join(METHODS)}")
        if self.steps < 4:
            raise ValueError(f"steps must be >= 4 (the target is the dense run's loss at 3/4), got {self.steps}")
        if self.block < 1:
            raise ValueError(f"block must be >= 1, got {self.block}")
        for m in self.methods:
            if METHODS[m].spec:
                from_spec(METHODS[m].spec)  # a bad spec raises before any process starts
        object.__setattr__(self, "spec", MODELS[self.model])


# --- models and data ------------------------------------------------------------------------------------------
class TinyTransformer(nn.Module):
    """Token + position embeddings, causal pre-norm transformer layers (no dropout), a linear head."""

    def __init__(self, s: ModelSpec) -> None:
        super().__init__()
        self.emb = nn.Embedding(s.vocab, s.dim)
        self.pos = nn.Parameter(torch.randn(s.seq, s.dim) * 0.02)
        layer = nn.TransformerEncoderLayer(s.dim, max(1, s.dim // 64), s.hidden, dropout=0.0, batch_first=True,
                                           norm_first=True)  # fmt: skip
        self.body = nn.TransformerEncoder(layer, s.layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(s.dim)
        self.head = nn.Linear(s.dim, s.vocab)
        self.mask: torch.Tensor
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(s.seq), persistent=False)

    def forward(self, tokens: torch.Tensor, negatives: torch.Tensor) -> torch.Tensor:
        del negatives
        inp, tgt = tokens[:, :-1], tokens[:, 1:]
        x = self.emb(inp) + self.pos[: inp.shape[1]]
        h = self.norm(self.body(x, mask=self.mask[: inp.shape[1], : inp.shape[1]], is_causal=True))
        return nn.functional.cross_entropy(self.head(h).reshape(-1, self.head.out_features), tgt.reshape(-1))


class MLP(nn.Module):
    """dim -> hidden (ReLU) x layers -> classes, trained on a fixed random teacher's labels."""

    def __init__(self, s: ModelSpec) -> None:
        super().__init__()
        widths = [s.dim] + [s.hidden] * s.layers
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise(widths):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.body = nn.Sequential(*layers, nn.Linear(widths[-1], s.vocab))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.body(x), y)


def build_model(s: ModelSpec, seed: int) -> nn.Module:
    """The model, its weights drawn from ``seed`` alone."""
    torch.manual_seed(seed)
    if s.kind == "transformer":
        return TinyTransformer(s)
    if s.kind == "mlp":
        return MLP(s)
    m = SampledLM(s.vocab, s.dim, s.hidden, seed=seed)
    m.emb.sparse = False  # a dense gradient, as DDP's hooks take it
    return m


def weights_hash(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class Stream:
    """The Zipf-Markov token stream; ``batch(rank, step)`` depends on (seed, rank, step) only."""

    def __init__(self, cfg: TTAConfig) -> None:
        s = cfg.spec
        p = 1.0 / np.arange(1, s.vocab + 1, dtype=float) ** cfg.zipf
        self.cdf = np.cumsum(p / p.sum())
        self.succ = np.random.default_rng([cfg.seed, 7]).permutation(s.vocab)
        self.cfg = cfg
        teacher = np.random.default_rng([cfg.seed, 11])
        self.teacher = (teacher.standard_normal((s.dim, 64)), teacher.standard_normal((64, s.vocab)))

    def _zipf(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.minimum(np.searchsorted(self.cdf, rng.random(n)), len(self.cdf) - 1)

    def batch(self, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, negatives) of the language models; (inputs, the teacher's labels) of the mlp."""
        s = self.cfg.spec
        rng = np.random.default_rng([self.cfg.seed, rank, step])
        if s.kind == "mlp":
            x = rng.standard_normal((s.batch, s.dim)).astype(np.float32)
            y = (np.tanh(x @ self.teacher[0] / 16) @ self.teacher[1]).argmax(1)
            return torch.from_numpy(x), torch.from_numpy(y)
        out = np.empty((s.batch, s.seq + 1), dtype=np.int64)
        out[:, 0] = self._zipf(rng, s.batch)
        for t in range(1, s.seq + 1):
            follow = rng.random(s.batch) < self.cfg.follow
            out[:, t] = np.where(follow, self.succ[out[:, t - 1]], self._zipf(rng, s.batch))
        neg = rng.integers(0, s.vocab, max(1, s.negatives))
        return torch.from_numpy(out), torch.from_numpy(neg)


# --- the methods ----------------------------------------------------------------------------------------------
def _memory(method: Method, momentum: float) -> Memory | None:
    if method.memory == "ef":
        return ErrorFeedback()
    if method.memory == "dgc":
        return MomentumCorrection(momentum)
    return None


def wrap(
    method: Method, model: nn.Module, cfg: TTAConfig, comp: Compressor | None = None
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model as the method trains it (DDP-wrapped, or itself) and its optimizer: SGD with momentum, or
    without where DGC's momentum correction applies it before compression. ``comp``: the method's compressor
    (default: a new one from its spec)."""
    if comp is None and method.spec:
        comp = from_spec(method.spec)
    momentum = 0.0 if method.memory == "dgc" else cfg.momentum
    sgd = torch.optim.SGD(model.parameters(), lr=cfg.spec.lr, momentum=momentum)
    memory = _memory(method, cfg.momentum)
    if method.kind == "opt":
        assert comp is not None
        placement = Compressed(comp, memory, bucket=method.bucket)
        return model, DistributedOptimizer(sgd, model, default=placement)
    if method.torch_hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

        # one bucket for the whole model: with two or more in flight torch's hook deadlocks on gloo
        ddp = DistributedDataParallel(model, bucket_cap_mb=1024)
        state = ps.PowerSGDState(None, matrix_approximation_rank=method.rank, random_seed=cfg.seed,
                                 start_powerSGD_iter=TORCH_POWERSGD_START)  # fmt: skip
        ddp.register_comm_hook(state, ps.powerSGD_hook)
        return ddp, sgd
    ddp = DistributedDataParallel(model)
    if method.torch_hook == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif method.kind == "hook":
        assert comp is not None
        ddp.register_comm_hook(None, compression_hook(comp, memory, module=ddp))
    return ddp, sgd


def sent_bytes() -> int:
    """Bytes this process's network namespace sent on its gloo interface (``/proc/self/net/dev``); on
    loopback, everything every process of the host sent on ``lo``."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    for line in Path("/proc/self/net/dev").read_text().splitlines()[2:]:
        name, _, stats = line.partition(":")
        if name.strip() == ifname:
            return int(stats.split()[8])
    return 0


def warm_up(cfg: TTAConfig, stream: Stream, rank: int) -> None:
    """One untimed step of every method of ``cfg`` on a throwaway model: what a process sets up once (sparsync's
    own group, the link calibration of its sparse allreduce) is then charged to no method's time."""
    for label in cfg.methods:
        net, opt = wrap(METHODS[label], build_model(cfg.spec, cfg.seed), cfg)
        net(*stream.batch(rank, 0)).backward()
        opt.step()
    dist.barrier()


class Trainer:
    """One method's model, optimizer and record: the wall time of each step (summed: the method's own clock,
    whatever ran between its blocks), the local loss, the bytes sent since its first step."""

    def __init__(self, rank: int, cfg: TTAConfig, method: Method, stream: Stream) -> None:
        self.rank, self.cfg, self.method, self.stream = rank, cfg, method, stream
        model = build_model(cfg.spec, cfg.seed)
        self.weights = weights_hash(model)
        self.comp = from_spec(method.spec) if method.spec else None
        self.net, self.opt = wrap(method, model, cfg, self.comp)
        self.losses: list[float] = []
        self.times: list[float] = []  # the method's clock after each step
        self.sent: list[int] = []  # bytes sent since its first step, after each step

    def run(self, steps: int) -> None:
        """The next ``steps`` steps, after a barrier (each step's time is its own)."""
        dist.barrier()
        for _ in range(steps):
            step = len(self.losses)
            tokens, negatives = self.stream.batch(self.rank, step)
            b0, t0 = sent_bytes(), time.perf_counter()
            self.opt.zero_grad(set_to_none=True)
            loss = self.net(tokens, negatives)
            loss.backward()
            self.opt.step()
            self.losses.append(loss.item())
            self.times.append((self.times[-1] if self.times else 0.0) + time.perf_counter() - t0)
            self.sent.append((self.sent[-1] if self.sent else 0) + sent_bytes() - b0)

    def row(self) -> dict[str, Any]:
        """The run's row (collective: every rank calls it; the loss is the mean over ranks)."""
        P = dist.get_world_size()
        mean = torch.tensor(self.losses, dtype=torch.float64)
        dist.all_reduce(mean)
        local = "lo" if "GLOO_SOCKET_IFNAME" not in os.environ else "link"
        share = P if local == "lo" else 1  # every rank's traffic crosses lo
        samples = hashlib.sha256(self.stream.batch(self.rank, 0)[0].numpy().tobytes()).hexdigest()[:16]
        return {"model": self.cfg.model, "method": self.method.label, "P": P, "steps": len(self.losses),
                "weights": self.weights, "samples": samples, "loss": (mean / P).tolist(), "times_s": self.times,
                "bytes_per_step": self.sent[-1] / share / len(self.losses), "sent_bytes": [b / share for b in
                self.sent], "bytes_from": local, "tau_recomputations": self.recomputations()}  # fmt: skip

    def recomputations(self) -> dict[str, int]:
        """DCT-DP: how many times each parameter's τ was computed (empty for other methods)."""
        if not isinstance(self.comp, Threshold):
            return {}
        return {name: int(st["recomputations"]) for name, st in self.comp.state_dict().items()}


def worker(rank: int, cfg: TTAConfig, show_progress: bool) -> list[dict[str, Any]]:
    """Every method of ``cfg`` on this rank, interleaved: ``cfg.block`` steps of each in turn (the first method
    of a round rotating), so that a slower or busier stretch of the host falls on every method alike; rank 0
    returns the rows."""
    stream = Stream(cfg)
    with progress(show_progress and rank == 0, f"{cfg.model}", cfg.steps * len(cfg.methods)) as update:
        update(f"{cfg.model}: warm-up", 0)
        warm_up(cfg, stream, rank)
        trainers = [Trainer(rank, cfg, METHODS[label], stream) for label in cfg.methods]
        for i, start in enumerate(range(0, cfg.steps, cfg.block)):
            n = min(cfg.block, cfg.steps - start)
            for j in range(len(trainers)):
                t = trainers[(i + j) % len(trainers)]
                update(f"{cfg.model}: steps {start}-{start + n} of {t.method.label}", 0)
                t.run(n)
                update(None, n)
        rows = [t.row() for t in trainers]
    return rows if rank == 0 else []
