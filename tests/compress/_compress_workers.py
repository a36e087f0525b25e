"""Module-level rank functions for the compressor tests (``launch`` unpickles workers by qualified name).

Inputs are deterministic functions of (rank, step), so the parent rebuilds every rank's input and computes
the exact reference itself. Each case's exception is caught and returned as text: one failing compressor does
not abort the others, and every collective runs under the group timeout set by ``launch``.
"""

from __future__ import annotations

import time
import traceback
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import sparsync
from sparsync.compress import QSGD, ErrorFeedback, from_spec
from sparsync.compress.cast_allreduce import CHUNK as CAST_CHUNK
from sparsync.compress.hooks import compression_hook
from sparsync.compress.qsgd_allreduce import SEGMENT
from sparsync_bench.grad_bucket import GradBucket

SPECS = (
    "identity",
    "fp16",
    "bf16",
    "topk:ratio=0.05",
    "topk:ratio=0.05,bucket=64",
    "threshold:ratio=0.05,lifespan=2",
    "randomk:ratio=0.05",
    "qsgd:bits=4,bucket=64",
    "sketch:rows=3,cols=300,block=8",
    "blocktopk:ratio=0.1,block=16",
)


def rank_input(rank: int, step: int, n: int = 3001) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, generator=g)
    return x * (torch.rand(n, generator=g) < 0.5)  # half zeros: the sketch's bitmap has work to do


def rank_embedding_grad(rank: int) -> torch.Tensor:
    emb = torch.nn.Embedding(60, 5, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(torch.arange(300, dtype=torch.float32).reshape(60, 5) / 100)
    idx = torch.tensor([rank, 2 * rank + 1, 17, 17])
    (emb(idx) * torch.arange(1, 6)).sum().backward()
    assert emb.weight.grad is not None
    return emb.weight.grad


def reduce_worker(rank: int, steps: int) -> dict[str, Any]:
    """Every compressor for ``steps`` steps with error feedback, sync and async; plus sparse COO inputs."""
    out: dict[str, Any] = {}
    P = dist.get_world_size()
    x = rank_input(rank, 0)
    ref = x.clone()
    dist.all_reduce(ref)
    out["plain_allreduce"] = (ref / P).numpy()
    for spec in SPECS:
        try:
            comp, mem = from_spec(spec), ErrorFeedback()
            acomp, amem = from_spec(spec), ErrorFeedback()
            res, ares = [], []
            for step in range(steps):
                xs = rank_input(rank, step)
                res.append(sparsync.compressed_allreduce(xs, comp, memory=mem, name="w").numpy())
                ares.append(
                    sparsync.compressed_allreduce(xs, acomp, memory=amem, name="w", async_op=True).wait().numpy()
                )
            summed = sparsync.compressed_allreduce(
                rank_input(rank, 0), from_spec(spec), name="w", average=False
            ).numpy()
            g = rank_embedding_grad(rank)
            sp = sparsync.compressed_allreduce(g, from_spec(spec), name="emb")
            inplace = rank_input(rank, 0)
            back = sparsync.compressed_allreduce(inplace, from_spec(spec), name="w", inplace=True)
            out[spec] = {
                "steps": res,
                "async": ares,
                "summed": summed,
                "sparse_is_sparse": sp.is_sparse,
                "sparse": sp.to_dense().numpy(),
                "inplace_same_object": back is inplace,
                "inplace": inplace.numpy(),
            }
        except Exception:
            out[spec] = {"error": traceback.format_exc()}
    return out


def _ddp_model(sparse: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(30, 4, sparse=sparse),
        torch.nn.Flatten(),
        torch.nn.Linear(12, 16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 3),
    )


def ddp_worker(rank: int, specs: tuple[str | None, ...], sparse: bool, steps: int) -> dict[str | None, Any]:
    """For each spec (None: no hook), a few SGD steps of a fresh small DDP model with that spec's hook.
    Returns the final parameters, or the error text, per spec."""
    out: dict[str | None, Any] = {}
    for spec in specs:
        try:
            out[spec] = _ddp_run(rank, spec, sparse, steps)
        except Exception:
            out[spec] = traceback.format_exc()
    return out


def _ddp_run(rank: int, spec: str | None, sparse: bool, steps: int) -> list[np.ndarray]:
    from torch.nn.parallel import DistributedDataParallel

    model = _ddp_model(sparse)
    ddp = DistributedDataParallel(model)
    if spec is not None:
        name, _, mode = spec.partition("|")  # "identity|sync": the hook without async_op
        comp = from_spec(name)
        mem = None if comp.name in ("identity", "fp16", "bf16") else ErrorFeedback()
        hook = compression_hook(comp, mem, module=ddp, async_op=mode != "sync")
        ddp.register_comm_hook(None, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        xb = torch.randint(0, 30, (8, 3), generator=gen)
        loss = (ddp(xb) - 1).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().numpy().copy() for p in model.parameters()]


def hook_overlap_worker(
    rank: int, async_op: bool, delay: float, steps: int, spec: str = "identity"
) -> list[dict[str, Any]]:
    """DDP with the hook of ``spec`` (default identity), one bucket per parameter; rank 1 sleeps ``delay`` s
    before each of its hook calls, so that rank 0's reductions stay in flight at least that long. Rank 0 returns
    one row per hook call: step, bucket index, the seconds the call took, whether its future was done when it
    returned, when the call began and when its future completed (``time.perf_counter``)."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    ddp = DistributedDataParallel(model, bucket_cap_mb=1e-6)
    real = compression_hook(from_spec(spec), module=ddp, async_op=async_op)
    calls: list[dict[str, Any]] = []
    step = 0

    def hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        if rank == 1:
            time.sleep(delay)
        t0 = time.perf_counter()
        fut = real(state, bucket)
        row = {"step": step, "bucket": bucket.index(), "call_s": time.perf_counter() - t0, "done": fut.done(),
               "called": t0, "completed": None}  # fmt: skip
        calls.append(row)

        def completed(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            row["completed"] = time.perf_counter()
            return f.value()

        return fut.then(completed)

    hook.__annotations__ = real.__annotations__  # DDP reads them
    ddp.register_comm_hook(None, hook)
    gen = torch.Generator().manual_seed(rank)
    for step in range(steps):  # noqa: B007  # read by the hook
        ddp(torch.randn(4, 32, generator=gen)).pow(2).mean().backward()
    return calls if rank == 0 else []


def hook_nan_worker(rank: int, nan_step: int) -> str:
    """DDP with the identity hook; at ``nan_step`` rank 1's loss is NaN. Returns the error backward() raised on
    this rank ("" if none)."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    ddp = DistributedDataParallel(torch.nn.Linear(4, 1))
    ddp.register_comm_hook(None, compression_hook(from_spec("identity"), module=ddp))
    for step in range(nan_step + 1):
        loss = ddp(torch.ones(2, 4)).sum()
        if rank == 1 and step == nan_step:
            loss = loss * float("nan")
        try:
            loss.backward()
        except Exception as e:
            return f"{type(e).__name__}: {e}"
    return ""


class _Bucket:
    """What a DDP comm hook reads of a ``dist.GradBucket`` (torch builds those in C++ only)."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return 0


def hook_behind_the_queue_worker(rank: int) -> list[np.ndarray]:
    """A sparsync call queued on the hook's group (rank 0's starts late), then an uncompressed bucket through
    the hook's allreduce path: each rank must issue the two collectives in the same order (the bucket's behind
    the queue), or they meet the other rank's other collective. Returns both sums."""
    from sparsync.collectives.background import background_group
    from sparsync.collectives.fifo import submit
    from sparsync.compress.bucket_allreduce import BucketAllreduce

    own = background_group(None)
    world = dist.group.WORLD
    assert world is not None
    plain = BucketAllreduce(own, world, average=False, log=None)
    first = torch.full((7,), float(rank + 1))

    def queued() -> None:
        if rank == 0:
            time.sleep(0.5)
        dist.all_reduce(first, group=own)

    work = submit(own, queued, True)
    out = plain(_Bucket(torch.full((5,), float(rank + 10)))).wait()
    work.wait()
    return [first.numpy(), out.numpy()]


def digits_worker(rank: int, specs: tuple[str, ...], steps: int, lr: float) -> dict[str, float]:
    """Data-parallel training of a small MLP on scikit-learn's bundled digits data: each rank holds a shard of
    the training set, the flattened gradient is reduced through ``spec`` (error feedback on). Returns the
    test accuracy (%) per spec; every run starts from the same initialisation."""
    from sklearn.datasets import load_digits

    P = dist.get_world_size()
    X, y = load_digits(return_X_y=True)
    perm = np.random.default_rng(0).permutation(len(y))
    X, y = torch.tensor(X[perm] / 16.0, dtype=torch.float32), torch.tensor(y[perm])
    n_train = 1400
    Xtr, ytr, Xte, yte = X[:n_train], y[:n_train], X[n_train:], y[n_train:]
    Xs, ys = Xtr[rank::P], ytr[rank::P]
    out: dict[str, float] = {}
    for spec in specs:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
        comp, mem = from_spec(spec), ErrorFeedback()
        gen = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            idx = torch.randint(0, len(ys), (32,), generator=gen)
            loss = torch.nn.functional.cross_entropy(model(Xs[idx]), ys[idx])
            model.zero_grad()
            loss.backward()
            # one flat gradient per step (one reduce, not one per layer: keeps the test fast)
            flat = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
            avg = sparsync.compressed_allreduce(flat, comp, memory=mem, name="mlp")
            with torch.no_grad():
                offset = 0
                for p in model.parameters():
                    p -= lr * avg[offset : offset + p.numel()].reshape(p.shape)
                    offset += p.numel()
        with torch.no_grad():
            out[spec] = float((model(Xte).argmax(1) == yte).float().mean()) * 100
    return out


# --- QSGD's quantized reduce-scatter ------------------------------------------------------
UNBIASED_N, UNBIASED_BUCKET = 600, 64  # 10 buckets, the last one short


def unbiased_input(rank: int) -> torch.Tensor:
    """Rank r's input: a different scale per bucket, so bucket scales and fractional levels vary."""
    g = torch.Generator().manual_seed(77 + rank)
    return torch.randn(UNBIASED_N, generator=g) * torch.linspace(0.2, 3.0, UNBIASED_N)


def unbiased_worker(rank: int, draws: int, bits: int) -> dict[str, Any]:
    """``draws`` sums (average=False) of ``unbiased_input`` through QSGD's reduce-scatter path, one seed per
    draw; returns their per-value sum and sum of squares (float64), which the parent turns into a mean and
    a variance. Also: 16-bit casts and the identity leave their inputs alone (their payloads are summed in
    place only when they are a fresh copy)."""
    x = unbiased_input(rank)
    total = torch.zeros(UNBIASED_N, dtype=torch.float64)
    squares = torch.zeros(UNBIASED_N, dtype=torch.float64)
    for seed in range(draws):
        q = QSGD(bits=bits, bucket=UNBIASED_BUCKET, seed=seed, aggregation="reduce_scatter")
        y = sparsync.compressed_allreduce(x, q, name="u", average=False).double()
        total += y
        squares += y * y
    untouched = {}
    for spec, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16), ("identity", torch.float32)):
        for inp in (x.to(dtype), x.double()):
            keep = inp.clone()
            sparsync.compressed_allreduce(inp, from_spec(spec), name="c")
            untouched[f"{spec}/{inp.dtype}"] = torch.equal(inp, keep)
    # a tensor of 3 buckets: at P = 5 the last two partitions are empty
    small = sparsync.compressed_allreduce(
        x[:40], QSGD(bits=4, bucket=16, aggregation="reduce_scatter"), name="s"
    ).numpy()
    return {"sum": total.numpy(), "squares": squares.numpy(), "untouched": untouched, "small": small}


PIPELINE_N = 2 * SEGMENT + 3 * (1 << 17) + 777  # two and a bit pipeline segments, a partial bucket


def pipeline_input(rank: int) -> torch.Tensor:
    return torch.randn(PIPELINE_N, generator=torch.Generator().manual_seed(77 + rank)) * (rank + 1)


def pipeline_worker(rank: int) -> dict[str, Any]:
    """QSGD's pipelined reduce-scatter over several segments: sync (encoded while sending), async (encoded
    first), and with a payload source; all sums (average=False)."""
    from sparsync.compress import Context
    from sparsync.compress.qsgd_allreduce import encode_remote, quantized_allreduce

    P = dist.get_world_size()
    x = pipeline_input(rank)

    def q() -> QSGD:
        return QSGD(bits=4, bucket=512, aggregation="reduce_scatter")

    sync = sparsync.compressed_allreduce(x, q(), name="big", average=False)
    asy = sparsync.compressed_allreduce(x, q(), name="big", average=False, async_op=True).wait()
    q3, ctx = q(), Context("big", rank, P)
    payload = encode_remote(q3, x, PIPELINE_N, ctx, P)
    from_payload = quantized_allreduce(q3, x, PIPELINE_N, ctx, dist.group.WORLD, payload=payload)
    mean = sparsync.compressed_allreduce(x, q(), name="big")
    return {
        "sync": sync.numpy(),
        "async_equal": bool(torch.equal(asy, sync)),
        "payload_equal": bool(torch.equal(from_payload.total, sync)),
        "mean_error": float((mean - sync / P).abs().max() / (sync / P).abs().max()),  # scales / P: rounding
        "input_untouched": bool(torch.equal(x, pipeline_input(rank))),
    }


def _residual(mem: ErrorFeedback) -> torch.Tensor:
    errors = mem.state_dict()["errors"]
    assert isinstance(errors, dict)
    out: torch.Tensor = errors["big"]
    return out


CAST_N = 3 * CAST_CHUNK + 12_345  # three chunks and a short one


def cast_input(rank: int) -> torch.Tensor:
    return torch.randn(CAST_N, generator=torch.Generator().manual_seed(500 + rank)) * (rank + 1)


def cast_worker(rank: int) -> dict[str, Any]:
    """FP16 and BF16 on a large tensor (cast_allreduce): sums (sync, async), the average, the residual, and the
    reference: gloo's allreduce of each chunk's 16-bit values, widened."""
    from sparsync.compress import BF16, FP16
    from sparsync.compress.cast_allreduce import chunks

    out: dict[str, Any] = {}
    x = cast_input(rank)
    for comp in (FP16(), BF16()):
        mem, amem = ErrorFeedback(), ErrorFeedback()
        total = sparsync.compressed_allreduce(x, comp, memory=mem, name="big", average=False)
        asy = sparsync.compressed_allreduce(x, comp, memory=amem, name="big", average=False, async_op=True).wait()
        mean = sparsync.compressed_allreduce(x, comp, name="big")
        ref = torch.empty(CAST_N)
        for a, b in chunks(CAST_N):
            h = x[a:b].to(comp.wire_dtype)
            dist.all_reduce(h)
            ref[a:b] = h.float()
        out[comp.name] = {
            "sum": total.numpy(),
            "reference": ref.numpy(),
            "async_equal": bool(torch.equal(asy, total)),
            "mean": mean.numpy(),
            "residual": _residual(mem).numpy(),
            "residuals_equal": bool(torch.equal(_residual(mem), _residual(amem))),
            "input_untouched": bool(torch.equal(x, cast_input(rank))),
        }
    return out


# Error feedback on a real group: the lossy compressors, one case per place compressed_allreduce fills the
# residual (a sparsifier's selected entries, a generic decompress, QSGD's reduce-scatter sync and async,
# the chunked 16-bit cast of a large tensor). (spec, values, async_op, unit): the input's values are multiples
# of unit / 8, which fp16 cannot hold exactly when unit = 1.1 (so its residual is not zero).
EF_CASES: tuple[tuple[str, int, bool, float], ...] = (
    ("topk:ratio=0.05", 3001, False, 1.0),
    ("threshold:ratio=0.05,lifespan=2", 3001, False, 1.0),
    ("randomk:ratio=0.05", 3001, True, 1.0),
    ("blocktopk:ratio=0.1,block=16", 3001, False, 1.0),
    ("sketch:rows=3,cols=300,block=8", 3001, False, 1.0),
    ("qsgd:bits=4,bucket=64", 3001, False, 1.0),
    ("qsgd:bits=4,bucket=64", 3001, True, 1.0),
    ("qsgd:bits=4,bucket=64,aggregation=allgather", 3001, False, 1.0),
    ("fp16", 2 * CAST_CHUNK + 7, False, 1.1),
)


def ef_input(rank: int, step: int, n: int, unit: float = 1.0) -> torch.Tensor:
    """Multiples of unit / 8 up to 8·unit in magnitude, half of them zero (unit = 1: sums of a few are exact in
    float32, in any order)."""
    g = torch.Generator().manual_seed(7000 + 100 * step + rank)
    x = torch.randint(-64, 65, (n,), generator=g).float() * (unit / 8)
    return x * (torch.rand(n, generator=g) < 0.5)


def ef_worker(rank: int, steps: int) -> dict[str, Any]:
    """Per case and step, with e_old the residual before the call and e_new after it: how far ``g + e_old`` is
    from ``own + e_new``, where ``own`` is this rank's contribution decompressed by a copy of the compressor
    taken before the call (QSGD with a memory gathers at any P: no re-quantized partial sums); how far the
    group's sum of ``g + e_old - e_new`` (float64) is from the call's result (``average=False``); and the
    residual's size."""
    from copy import deepcopy

    from sparsync.compress import Context, TensorSpec

    P = dist.get_world_size()
    out: dict[str, Any] = {}
    for spec, n, async_op, unit in EF_CASES:
        key = f"{spec}|{'async' if async_op else 'sync'}"
        try:
            comp, mem, rows = from_spec(spec), ErrorFeedback(), []
            for step in range(steps):
                g = ef_input(rank, step, n, unit)
                old = mem.error("w")
                e_old = torch.zeros(n) if old is None else old.clone()
                x, ctx, mine = g + e_old, Context("w", rank, P), deepcopy(comp)
                own = mine.decompress(mine.compress(x, ctx), TensorSpec.of(x))
                res = sparsync.compressed_allreduce(
                    g, comp, memory=mem, name="w", average=False, async_op=async_op
                )
                total = res.wait() if isinstance(res, sparsync.Work) else res
                new = mem.error("w")
                assert new is not None
                e_new = new.clone()
                wire = (x.double() - e_new.double()).contiguous()
                dist.all_reduce(wire)
                rows.append(
                    {
                        "own_gap": float((x - (own + e_new)).abs().max()),
                        "wire_gap": float((wire - total.double()).abs().max()),
                        "scale": float(total.abs().max()),
                        "residual": float(e_new.abs().max()),
                    }
                )
            out[key] = rows
        except Exception:
            out[key] = traceback.format_exc()
    return out


# --- the hook's fused path for buckets of sparsifiers --------------------------------------------------------
FUSED_STEPS = 4


def _fused_model() -> torch.nn.Module:
    """Six dense parameters, one DDP bucket (DDP's default 25 MB cap)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 20), torch.nn.ReLU(), torch.nn.Linear(20, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3)
    )


def fused_hook_worker(rank: int, specs: tuple[str, ...], steps: int) -> dict[str, Any]:
    """For each spec, a few SGD steps of a DDP model through the hook with error feedback, recording each hook
    call's bucket (members' names, gradients as they came in, the reduced buffer), the hook's CommRecords and
    its residuals; then the same gradients through ``compressed_allreduce`` one parameter at a time with a
    fresh compressor and memory (the per-parameter path), its results and residuals. A spec "mixed:<spec>"
    sends the first parameter by Identity (``plan=``). Errors come back as text."""
    out: dict[str, Any] = {}
    for spec in specs:
        try:
            out[spec] = _fused_run(rank, spec, steps)
        except Exception:
            out[spec] = traceback.format_exc()
    return out


def _fused_run(rank: int, spec: str, steps: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    from sparsync.compress import Identity
    from sparsync.record import CommLog

    mixed = spec.startswith("mixed:")
    comp_spec = spec.removeprefix("mixed:")
    ddp = DistributedDataParallel(_fused_model())
    names = {id(p): n for n, p in ddp.named_parameters()}
    plan = {next(iter(names.values())): Identity()} if mixed else None
    comp, mem, log = from_spec(comp_spec), ErrorFeedback(), CommLog()
    real = compression_hook(comp, mem, module=ddp, log=log, plan=plan)
    calls: list[dict[str, Any]] = []

    def hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        row: dict[str, Any] = {
            "names": [names[id(p)] for p in bucket.parameters()],
            "grads": [g.detach().clone() for g in bucket.gradients()],
        }
        calls.append(row)

        def reduced(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            row["out"] = f.value().clone().numpy()
            return f.value()

        return real(state, bucket).then(reduced)

    hook.__annotations__ = real.__annotations__  # DDP reads them
    ddp.register_comm_hook(None, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        loss = (ddp(torch.randn(8, 6, generator=gen)) - 1).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    residuals = {n: e.numpy() for n in mem.names() if (e := mem.error(n)) is not None}
    # the per-parameter path on the same gradients
    pcomp, pmem = from_spec(comp_spec), ErrorFeedback()
    per_param = []
    for row in calls:
        res = [
            sparsync.compressed_allreduce(g, pcomp, memory=pmem, name=n).reshape(-1)
            for n, g in zip(row["names"], row["grads"], strict=True)
        ]
        per_param.append(torch.cat(res).numpy())
    return {
        "calls": [{"names": c["names"], "grads": [g.numpy() for g in c["grads"]], "out": c["out"]} for c in calls],
        "records": [(r.op, r.dim) for r in log.records],
        "residuals": residuals,
        "per_param": per_param,
        "per_param_residuals": {n: e.numpy() for n in pmem.names() if (e := pmem.error(n)) is not None},
    }


def fused_bucket_worker(rank: int, case: str) -> dict[str, Any]:
    """The hook on hand-made buckets of a two-layer model. ``swap``: rank 1's bucket lists the two weights
    in the other order (same shapes, so only the names tell); returns the error each rank's future raised.
    ``zeros``: all-zero gradients (an empty selection for Threshold, k zeros for TopK), three steps each;
    returns the buffers and the records."""
    from sparsync.compress import Threshold, TopK
    from sparsync.record import CommLog

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    w0, b0, w1, b1 = model.parameters()
    out: dict[str, Any] = {}
    if case == "swap":
        hook = compression_hook(Threshold(0.25), ErrorFeedback(), module=model)
        params = [w1, b0, w0, b1] if rank == 1 else [w0, b0, w1, b1]
        grads = [torch.full(tuple(p.shape), float(rank + 1 + i)) for i, p in enumerate(params)]
        try:
            hook(None, GradBucket(list(params), grads)).wait()
            out["error"] = ""
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {e}"
        # the group is still in step: a good bucket goes through after the refused one (a fresh hook: the first
        # one's residuals and thresholds hold what the refused call selected)
        ok = [torch.ones(tuple(p.shape)) for p in (w0, b0, w1, b1)]
        hook = compression_hook(Threshold(0.25), ErrorFeedback(), module=model)
        out["after"] = hook(None, GradBucket([w0, b0, w1, b1], ok)).wait().numpy()
        return out
    for comp in (Threshold(0.25, lifespan=2), TopK(0.25)):
        log = CommLog()
        hook = compression_hook(comp, ErrorFeedback(), module=model, log=log)
        bufs = []
        for _ in range(3):
            zeros = [torch.zeros(tuple(p.shape)) for p in (w0, b0, w1, b1)]
            bufs.append(hook(None, GradBucket([w0, b0, w1, b1], zeros)).wait().numpy())
        out[type(comp).__name__] = {"bufs": bufs, "nnz_in": [r.nnz_in for r in log.records]}
    return out
