"""One rank of ``bench dlrm``'s torchrec rows, run in torchrec's own environment (``.venv-torchrec``, made by
``scripts/torchrec_env.sh``) as a subprocess of the bench's rank (``torchrec_baseline``), so that it shares
that rank's network namespace: ``python -m sparsync_bench.torchrec_runner SPEC.json``.

The model is ``sparsync_bench.dlrm.DLRM``'s, built from the same seed, so its MLPs and tables start from the
same weights as the other methods': the 26 tables move into one torchrec ``EmbeddingBagCollection`` (weights
copied), sharded by ``DistributedModelParallel`` table-wise or row-wise (the planner's choice of shard
placement under that constraint), the embeddings' SGD fused into the backward (fbgemm's CPU kernel), the MLPs
wrapped by DDP (DMP's default) with the same SGD. The rank's samples are the bench's own shard (a file the
bench writes). Imports torch, torchrec and ``sparsync_bench``'s model and nothing of ``sparsync``.

Bytes per rank per step: what the rank's collectives put on the wire, counted as torchrec calls them
(``torch.distributed``'s all_to_all_single, reduce_scatter and all_gather: the chunks for other ranks), plus
DDP's dense allreduce at the ring's 2(P-1)/P of the MLPs' bytes (the count ``bench dlrm`` uses for DDP).
CPU per step: the ranks' mean of their median process CPU (``cpu_s``), rank 0's median main-thread CPU (``main_s``)
and the ranks' mean CPU per step by kind of thread after the warm-up (``thread_cpu_s``, ``thread_cpu.KINDS``), each
step from its ``zero_grad`` to its optimizer step (the batch's ``KeyedJaggedTensor`` built before).
Prints one line ``TORCHREC_ROW {json}`` on rank 0, or ``TORCHREC_UNAVAILABLE reason`` on every rank where this
torchrec offers no such sharding on CPU (1.8's sharder offers row-wise on CUDA only).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sparsync_bench import thread_cpu
from sparsync_bench.dlrm import DLRM
from sparsync_bench.op_profile import step_profiler

SHARDING = {"table_wise": "TABLE_WISE", "row_wise": "ROW_WISE"}


class _WireCount:
    """Bytes this rank sends through the ``torch.distributed`` collectives torchrec calls, wrapped in place
    (torchrec looks them up on the module at each call)."""

    def __init__(self, rank: int, P: int) -> None:
        self.rank, self.P, self.sent = rank, P, 0

    def install(self) -> None:
        def nbytes(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        def a2a(output: Any, input: Any, output_split_sizes: Any = None, input_split_sizes: Any = None) -> int:
            if input_split_sizes:
                row = nbytes(input) // max(input.shape[0], 1)
                return int(row * (sum(input_split_sizes) - input_split_sizes[self.rank]))
            return nbytes(input) * (self.P - 1) // self.P

        def rs_tensor(output: Any, input: Any, *a: Any, **k: Any) -> int:
            return nbytes(input) - nbytes(output)

        def rs_list(output: Any, input_list: Any, *a: Any, **k: Any) -> int:
            return sum(nbytes(t) for i, t in enumerate(input_list) if i != self.rank)

        def ag(output: Any, input: Any, *a: Any, **k: Any) -> int:
            return nbytes(input) * (self.P - 1)

        counts: dict[str, Callable[..., int]] = {
            "all_to_all_single": a2a,
            "reduce_scatter_tensor": rs_tensor,
            "reduce_scatter": rs_list,
            "all_gather_into_tensor": ag,
            "all_gather": lambda out, t, *a, **k: nbytes(t) * (self.P - 1),
        }
        for name, count in counts.items():
            setattr(dist, name, self._wrap(getattr(dist, name), count))

    def _wrap(self, fn: Callable[..., Any], count: Callable[..., int]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.sent += count(*args, **{k: v for k, v in kwargs.items() if k not in ("group", "async_op")})
            return fn(*args, **kwargs)

        return call


class TorchrecDLRM(nn.Module):
    """``ref``'s MLPs and interaction, its tables as one ``EmbeddingBagCollection`` (weights copied)."""

    def __init__(self, ref: DLRM) -> None:
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType

        super().__init__()
        self.bottom, self.top, self.pairs = ref.bottom, ref.top, ref.pairs
        self.keys = [f"f{j}" for j in range(len(ref.tables))]
        configs = []
        for j, t in enumerate(ref.tables):
            w = t.weight
            assert isinstance(w, torch.Tensor)
            configs.append(EmbeddingBagConfig(name=f"t{j}", embedding_dim=w.shape[1], num_embeddings=w.shape[0],
                                              feature_names=[self.keys[j]], pooling=PoolingType.SUM))  # fmt: skip
        self.ebc = EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
        with torch.no_grad():
            for j, t in enumerate(ref.tables):
                self.ebc.embedding_bags[f"t{j}"].weight.copy_(t.weight)

    def forward(self, dense: torch.Tensor, kjt: Any) -> torch.Tensor:
        x = self.bottom(dense)
        pooled = self.ebc(kjt).to_dict()
        z = torch.stack([x, *(pooled[k] for k in self.keys)], 1)  # the order DLRM.forward stacks them in
        dots = torch.bmm(z, z.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        out: torch.Tensor = self.top(torch.cat([x, dots], 1))
        return out.squeeze(1)


def _kjt(keys: list[str], cats: torch.Tensor) -> Any:
    from torchrec import KeyedJaggedTensor

    n, T = cats.shape
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=cats.t().contiguous().reshape(-1), lengths=torch.ones(T * n, dtype=torch.int32)
    )


def _copy_tables(model: nn.Module, ref: DLRM) -> None:
    """The sharded tables' local shards set from ``ref``'s weights (the sharder allocates its own)."""
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor

    state = model.state_dict()
    with torch.no_grad():
        for j, t in enumerate(ref.tables):
            w = t.weight
            assert isinstance(w, torch.Tensor)
            key = next(k for k in state if k.endswith(f"embedding_bags.t{j}.weight"))
            st = state[key]
            if not isinstance(st, ShardedTensor):
                st.copy_(w)
                continue
            for shard in st.local_shards():
                (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                shard.tensor.copy_(w[r0 : r0 + nr, c0 : c0 + nc])


class UnavailableError(Exception):
    """This torchrec cannot run the row asked for here (printed as ``TORCHREC_UNAVAILABLE reason``)."""


def _offered_kind(sharding: str, sharder: Any) -> str:
    """torchrec's name of ``sharding`` (a key of SHARDING); ``UnavailableError`` where ``sharder`` offers it not
    on CPU (decided before the group forms, the same on every rank)."""
    from torchrec.distributed.types import ShardingType

    kind: str = getattr(ShardingType, SHARDING[sharding]).value
    offered = sharder.sharding_types("cpu")
    if kind not in offered:
        import torchrec

        raise UnavailableError(f"torchrec {getattr(torchrec, '__version__', '?')}'s EmbeddingBagCollectionSharder "
                          f"offers no {kind} sharding on cpu (only {', '.join(offered)})")  # fmt: skip
    return kind


@dataclass
class _Sharded:
    """The bench's DLRM (``ref``), its torchrec twin (``model``), the twin sharded by DMP (``dmp``) with its
    plan, and the optimizer over both: the tables' SGD fused into backward, the MLPs' plain SGD."""

    ref: DLRM
    model: TorchrecDLRM
    dmp: Any
    plan: Any
    opt: Any


def _shard_model(spec: dict[str, Any], kind: str, sharders: list[Any]) -> _Sharded:
    """``spec``'s DLRM from its seed, its tables sharded ``kind`` by DMP and their weights copied in."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    P, lr = spec["world_size"], spec["lr"]
    torch.manual_seed(spec["seed"])
    ref = DLRM(spec["table_rows"], spec["dim"], bottom=spec["bottom"], top=spec["top"], sparse=True)
    model = TorchrecDLRM(ref)
    # The sharded tables' gradients are the sum of every rank's (the pooled gradients come back by
    # all_to_all), DDP's MLP gradients the mean: lr / P on the tables takes the step the other methods take.
    apply_optimizer_in_backward(torch.optim.SGD, model.ebc.parameters(), {"lr": lr / P})
    constraints = {f"t{j}": ParameterConstraints(sharding_types=[kind],
                                                 compute_kernels=[EmbeddingComputeKernel.FUSED.value])
                   for j in range(len(spec["table_rows"]))}  # fmt: skip
    topology = Topology(world_size=P, compute_device="cpu")
    planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints)
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    _copy_tables(dmp, ref)
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.SGD(params, lr=lr))  # fmt: skip
    return _Sharded(ref, model, dmp, plan, CombinedOptimizer([dmp.fused_optimizer, dense]))


@dataclass
class _Timed:
    """Per step: wall seconds, process CPU seconds, the main thread's CPU seconds and the loss; and the CPU
    seconds per step after the warm-up by kind of thread (``thread_cpu.KINDS``)."""

    times: list[float]
    cpu: list[float]
    main: list[float]
    losses: list[float]
    threads: list[float]


def _run_steps(spec: dict[str, Any], m: _Sharded, shard: dict[str, torch.Tensor]) -> _Timed:
    """``spec``'s steps on this rank's ``shard``, each timed from a barrier."""
    steps, batch, warmup = spec["steps"], spec["batch"], spec["warmup"]
    out = _Timed([], [], [], [], [])
    before: thread_cpu.Reading = {}
    profile = step_profiler(spec["method"], spec["rank"], warmup, steps)
    for s in range(steps):
        if s == warmup:
            before = thread_cpu.reading()
        sl = slice(s * batch, (s + 1) * batch)
        kjt = _kjt(m.model.keys, shard["sparse"][sl])
        dist.barrier()
        t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
        m.opt.zero_grad()
        loss = nn.functional.binary_cross_entropy_with_logits(m.dmp(shard["dense"][sl], kjt), shard["label"][sl])
        loss.backward()  # type: ignore[no-untyped-call]
        m.opt.step()
        out.losses.append(loss.item())
        out.times.append(time.perf_counter() - t0)
        out.cpu.append(time.process_time() - c0)
        out.main.append(time.thread_time() - m0)
        if profile is not None:
            profile.step()
    if profile is not None:
        profile.stop()
    out.threads = thread_cpu.per_step(before, thread_cpu.reading(), steps - warmup)
    return out


def train(spec: dict[str, Any]) -> dict[str, Any] | None:
    """One rank's run of ``spec`` (written by ``torchrec_baseline``); rank 0's row, None elsewhere."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    rank, P = spec["rank"], spec["world_size"]
    sharders: list[Any] = [EmbeddingBagCollectionSharder()]
    kind = _offered_kind(spec["sharding"], sharders[0])
    torch.set_num_threads(spec["threads"])
    dist.init_process_group("gloo", rank=rank, world_size=P, timeout=timedelta(seconds=spec["timeout"]))
    shard = torch.load(spec["shard"])
    m = _shard_model(spec, kind, sharders)
    mlp_bytes = sum(p.numel() * p.element_size() for p in (*m.ref.bottom.parameters(), *m.ref.top.parameters()))
    wire = _WireCount(rank, P)
    wire.install()
    run = _run_steps(spec, m, shard)
    warmup, losses = spec["warmup"], run.losses
    t = torch.tensor([statistics.median(run.times[warmup:])], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    cpu_s = torch.tensor([statistics.median(run.cpu[warmup:]), *run.threads], dtype=torch.float64)
    dist.all_reduce(cpu_s)  # the ranks' means: CPU per step, then by kind of thread
    mean_tail = torch.tensor([statistics.fmean(losses[-spec["tail"] :])], dtype=torch.float64)
    dist.all_reduce(mean_tail)
    sent = wire.sent / spec["steps"] + 2 * (P - 1) / P * mlp_bytes
    shards = sorted({str(ps.sharding_type) for mod in m.plan.plan.values() for ps in mod.values()})
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return None
    import torchrec

    means = (cpu_s / P).tolist()
    return {"step_s": float(t), "cpu_s": means[0], "bytes_per_step": sent, "loss": float(mean_tail) / P,
            "first_loss": losses[0], "main_s": statistics.median(run.main[warmup:]),
            "thread_cpu_s": dict(zip(thread_cpu.KINDS, means[1:], strict=True)),
            "sharding": shards, "torchrec": getattr(torchrec, "__version__", "?"),
            "torch": torch.__version__}  # fmt: skip


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m sparsync_bench.torchrec_runner SPEC.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    os.environ.update(MASTER_ADDR=spec["master_addr"], MASTER_PORT=str(spec["master_port"]))
    try:
        row = train(spec)
    except UnavailableError as e:
        print(f"TORCHREC_UNAVAILABLE {e}", flush=True)
        return 0
    if row is not None:
        print("TORCHREC_ROW " + json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
