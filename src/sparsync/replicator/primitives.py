"""Cross-replica primitives on nested structures of tensors (TF-Replicator §3.4): all_reduce, all_gather,
broadcast, and their gradients.

Every call starts with the foundation's metadata exchange (``collectives/meta.py``; its row is
``PRIMITIVE_ROW``: ``collectives/row.py``'s frame, then our own named columns) over the data-parallel group,
sharing the group's call counter with the sparse collectives. Every replica checks the whole table, so a call
issued in a different order, or with a different structure, shape or dtype, raises the same ``ValueError`` on
every replica instead of hanging. Leaves of one dtype travel in one flat buffer (one torch collective per dtype,
like DDP's buckets).

``all_reduce(op="sum"|"mean")``, ``all_gather`` and ``broadcast`` are differentiable: with y_r = Σ_q x_q on
every replica r and a training objective Σ_r L_r, ∂/∂x_r = Σ_q ∂L_q/∂y_q, so the backward of a sum is again an
all-sum (of the gradients). That is what makes cross-replica batch norm written with ``all_sum`` (§3.4) train
exactly like batch norm on the full batch.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from sparsync.collectives.comm import Comm
from sparsync.collectives.fifo import submit
from sparsync.collectives.group import next_call
from sparsync.collectives.meta import CHECK_NAN, NAME_KEY, allgather_rows, first_nonfinite, name_key, nonfinite_at
from sparsync.collectives.ops import op_code
from sparsync.collectives.row import Agree, Column, Disagreement, Facts, meta_row, register_row
from sparsync.collectives.site import CallSite, call_site
from sparsync.record import CommLog

REDUCE_OPS = ("sum", "mean", "max", "min")
_TORCH_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def _call_mismatch(d: Disagreement) -> BaseException:
    calls = f"replica 0 called {d.shown(0)}, replica {d.rank} called {d.shown(d.rank)}"
    return ValueError(
        f"{d.column.what} mismatch across replicas: {calls} (seen on replica {d.facts.me}, in {d.facts.op}); "
        "every replica must issue the same primitives in the same order with the same arguments"
    )


def _structure_mismatch(d: Disagreement) -> BaseException:
    # Hashes do not say what differs: ``detail`` names both structures (a second exchange every replica takes part
    # in, since everyone saw the same table).
    return ValueError(f"{d.facts.op}: mismatched structure/shape/dtype across replicas: {d.facts.detail()}")


def _structure(name: str, doc: str) -> Column:
    return Column(name, Agree.SAME, describe=_structure_mismatch, doc=doc)


# The primitives' metadata row, checked in this order after the frame's refusal, op and call number. name_key: the
# caller's ``name=`` (or, unnamed, its call site), which tells apart calls of one structure (two all_sums of one
# shape in another order on one replica were summed with each other).
PRIMITIVE_ROW = meta_row(
    Column("arg", Agree.SAME, "argument", doc="the reduce op's index in REDUCE_OPS, or the broadcast source"),
    _structure("numel", "elements over all leaves"),
    _structure("dtypes", "crc32 of each leaf's dtype and requires_grad"),
    _structure("leaves", "number of leaves"),
    _structure("structure", "crc32 of the pytree spec"),
    _structure("shapes", "crc32 of the leaves' shapes"),
    NAME_KEY,
    CHECK_NAN,
    Column("nonfinite", Agree.UNSET, default=-1, doc="the first leaf holding NaN or ±Inf (-1: none, or unchecked)",
           describe=nonfinite_at("in leaf", "pass check_nan=False to sum non-finite values as IEEE 754 does")),
    mismatch=_call_mismatch,
)  # fmt: skip
# The primitives' codes in the metadata row's "op" column (collectives/ops.py), so that a primitive on one
# replica against another primitive or a sparse collective on another is a "collective mismatch" on every replica.
OP_CODES = tuple(
    register_row(name, PRIMITIVE_ROW)
    for name in ("all_reduce", "all_gather", "broadcast", "all_reduce_grad", "all_gather_grad", "broadcast_grad")
)


@dataclass(frozen=True)
class Env:
    """Where a primitive runs: the data-parallel group of this process, and what to do with its records."""

    group: dist.ProcessGroup
    timeout: float | None = None
    log: CommLog | None = None

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def index(self) -> int:
        return dist.get_rank(self.group)


def _crc(text: str) -> int:
    return zlib.crc32(text.encode())


def flatten(value: Any, *, skip: type | tuple[type, ...] = ()) -> tuple[list[Any], pytree.TreeSpec]:
    """Leaves of a nested structure; each must be a tensor (or an instance of ``skip``, passed through)."""
    leaves, spec = pytree.tree_flatten(value)
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor) and not (skip and isinstance(leaf, skip)):
            raise TypeError(f"leaf {i} of the structure is a {type(leaf).__name__}, not a torch.Tensor")
        if isinstance(leaf, torch.Tensor) and leaf.layout != torch.strided:
            raise ValueError(f"leaf {i} has layout {leaf.layout}; primitives take dense tensors")
    return leaves, spec


def _describe(tensors: list[torch.Tensor], spec: pytree.TreeSpec) -> str:
    return f"{spec}: " + ", ".join(f"{tuple(t.shape)}/{str(t.dtype).removeprefix('torch.')}" for t in tensors)


def device_of(tensors: list[torch.Tensor]) -> torch.device:
    """Where a primitive's payload lives: its leaves' device (the host for none)."""
    return tensors[0].device if tensors else torch.device("cpu")


def first_nonfinite_leaf(tensors: list[torch.Tensor]) -> int:
    """Index of the first leaf holding NaN or ±Inf, or -1."""
    return next((i for i, t in enumerate(tensors) if first_nonfinite(t) >= 0), -1)


def agree(
    env: Env,
    op: str,
    tensors: list[torch.Tensor],
    spec: pytree.TreeSpec,
    arg: int,
    comm: Comm,
    seq: int,
    check_nan: bool = False,
    label: str | None = None,
    site: CallSite | None = None,
) -> None:
    """The metadata exchange (``PRIMITIVE_ROW`` in the sparse collectives' round): raise the same ValueError on
    every replica unless all issued the same call (with the same ``label``, the caller's ``name=``, and the same
    ``check_nan``), and, with ``check_nan``, when any replica holds NaN or ±Inf (a sum silently gave NaN
    everywhere)."""
    words = PRIMITIVE_ROW.pack(
        seq=seq,
        op=op_code(op),
        numel=sum(t.numel() for t in tensors),
        dtypes=_crc(",".join(f"{t.dtype}/{t.requires_grad}" for t in tensors)),
        leaves=len(tensors),
        structure=_crc(str(spec)),
        shapes=_crc(";".join(str(tuple(t.shape)) for t in tensors)),
        arg=arg,
        nonfinite=first_nonfinite_leaf(tensors) if check_nan else -1,
        check_nan=int(check_nan),
        name_key=name_key(label, site),
    )
    table, blocks = allgather_rows(comm, words)

    def both() -> str:  # every replica's structure in words, gathered on the host side (NCCL)
        descr: list[Any] = [None] * comm.size
        dist.all_gather_object(descr, _describe(tensors, spec), group=comm.meta.group)
        r = next(i for i in range(comm.size) if descr[i] != descr[0])
        return f"replica 0 has [{descr[0]}], replica {r} has [{descr[r]}]"

    facts = Facts(comm.rank, who="replica", op=op, name=label, site=site, blocks=blocks, detail=both)
    PRIMITIVE_ROW.check(table, facts)


def _facts(tensors: list[torch.Tensor], env: Env) -> dict[str, object]:
    """A primitive's size as the profiler and the timeline show it."""
    return {"bytes": sum(t.numel() * t.element_size() for t in tensors), "leaves": len(tensors), "P": env.size}


def _record(env: Env, op: str, comm: Comm, numel: int, t0: float) -> None:
    if env.log is not None:
        env.log.append(comm.record(op, "gloo", t0, dim=numel, nnz_in=numel, nnz_out=numel))


def _buckets(tensors: list[torch.Tensor]) -> dict[torch.dtype, list[int]]:
    out: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        out.setdefault(t.dtype, []).append(i)
    return out


def _unflat(buf: torch.Tensor, tensors: list[torch.Tensor], idx: list[int], out: list[Any]) -> None:
    off = 0
    for i in idx:
        n = tensors[i].numel()
        out[i] = buf[off : off + n].view(tensors[i].shape)
        off += n


def check_reduce(tensors: list[torch.Tensor], op: str) -> None:
    """The checks of a reduction's arguments that need no other replica."""
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduction {op!r}; valid: {', '.join(REDUCE_OPS)}")
    if op == "mean":
        bad = [t.dtype for t in tensors if not t.is_floating_point()]
        if bad:
            raise ValueError(f"all_reduce(op='mean') needs floating tensors, got {bad[0]}")


# What a raw call does with one flat buffer of one dtype (the leaves ``idx`` of ``tensors``): its collective,
# its byte count, the leaves' results put in ``out``.
PerBuffer = Callable[[Comm, torch.Tensor, list[int], list[Any]], None]


def _raw_call(
    env: Env,
    tensors: list[torch.Tensor],
    spec: pytree.TreeSpec,
    name: str,
    arg: int,
    label: str | None,
    per_buffer: PerBuffer,
    check_nan: bool = False,
) -> list[Any]:
    """The skeleton of the raw primitives, on the group's queue: the agreement round (``agree``, with the
    primitive's own ``arg``: reduce op or broadcast source), then ``per_buffer`` for each dtype's flat buffer,
    then the record. ``name``: the primitive ("all_reduce", "all_reduce_grad", ...)."""
    seq = next_call(env.group)
    site = call_site() if label is None else None  # in the caller's thread

    def run() -> list[Any]:
        t0 = time.perf_counter()
        comm = Comm(env.group, env.timeout, device_of(tensors))
        comm.op = name
        agree(env, name, tensors, spec, arg, comm, seq, check_nan, label, site=site)
        out: list[Any] = [None] * len(tensors)
        for _dtype, idx in _buckets(tensors).items():
            per_buffer(comm, torch.cat([tensors[i].detach().reshape(-1) for i in idx]), idx, out)
        _record(env, name, comm, sum(t.numel() for t in tensors), t0)
        return out

    return submit(env.group, run, False, label=f"{name}:gloo", facts=lambda: _facts(tensors, env))  # type: ignore[return-value]


def raw_all_reduce(
    env: Env,
    tensors: list[torch.Tensor],
    spec: pytree.TreeSpec,
    op: str,
    name: str,
    check_nan: bool = False,
    label: str | None = None,
) -> list[Any]:
    """Reduce (sum/max/min; mean = sum / size) of every leaf over the group; no autograd. ``name``: the
    primitive ("all_reduce", "all_reduce_grad", ...); ``check_nan``: refuse NaN and ±Inf on any replica (the
    same ValueError everywhere); ``label``: the caller's ``name=``, compared across replicas."""
    check_reduce(tensors, op)

    def reduce(comm: Comm, buf: torch.Tensor, idx: list[int], out: list[Any]) -> None:
        with comm.phase("all_reduce"):
            comm.run_collective("all_reduce", dist.all_reduce, buf, op=_TORCH_OPS[op])
        comm.count_ring_allreduce(buf.numel() * buf.element_size())
        if op == "mean":
            buf /= comm.size
        _unflat(buf, tensors, idx, out)

    return _raw_call(env, tensors, spec, name, REDUCE_OPS.index(op), label, reduce, check_nan)


def raw_all_gather(
    env: Env, tensors: list[torch.Tensor], spec: pytree.TreeSpec, name: str, label: str | None = None
) -> list[Any]:
    """Every replica's leaves stacked along a new leading dimension of size ``num_replicas``; no autograd.
    ``label``: the caller's ``name=``."""

    def gather(comm: Comm, buf: torch.Tensor, idx: list[int], out: list[Any]) -> None:
        P = comm.size
        parts = [torch.empty_like(buf) for _ in range(P)]
        with comm.phase("all_gather"):
            comm.all_gather_equal("all_gather", parts, buf)
        comm.count_ring_allgather(buf.numel() * buf.element_size())
        stacked = torch.stack(parts)
        off = 0
        for i in idx:
            n = tensors[i].numel()
            out[i] = stacked[:, off : off + n].reshape(P, *tensors[i].shape)
            off += n

    return _raw_call(env, tensors, spec, name, 0, label, gather)


def raw_broadcast(
    env: Env, tensors: list[torch.Tensor], spec: pytree.TreeSpec, source: int, name: str, label: str | None = None
) -> list[Any]:
    """Replica ``source``'s leaves on every replica; no autograd. ``label``: the caller's ``name=``."""
    if not 0 <= source < env.size:
        raise ValueError(f"unknown replica id {source} as broadcast source; valid: 0..{env.size - 1}")

    def broadcast(comm: Comm, buf: torch.Tensor, idx: list[int], out: list[Any]) -> None:
        with comm.phase("broadcast"):
            comm.run_collective("broadcast", dist.broadcast, buf, group_src=source)
        comm.count_broadcast(buf.numel() * buf.element_size(), source)
        _unflat(buf, tensors, idx, out)

    return _raw_call(env, tensors, spec, name, source, label, broadcast)


# --- autograd ----------------------------------------------------------------------------------------------
# The backward of a labelled call carries the same label (its op, "*_grad", already tells it from forwards).
class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        env: Env,
        op: str,
        spec: pytree.TreeSpec,
        check_nan: bool,
        label: str | None,
        *tensors: torch.Tensor,
    ) -> Any:
        ctx.env, ctx.op, ctx.spec, ctx.label = env, op, spec, label
        return tuple(raw_all_reduce(env, list(tensors), spec, op, "all_reduce", check_nan, label))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        g = raw_all_reduce(
            ctx.env, [x.contiguous() for x in grads], ctx.spec, ctx.op, "all_reduce_grad", label=ctx.label
        )
        return (None, None, None, None, None, *g)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, env: Env, spec: pytree.TreeSpec, label: str | None, *tensors: torch.Tensor) -> Any:
        ctx.env, ctx.spec, ctx.label = env, spec, label
        return tuple(raw_all_gather(env, list(tensors), spec, "all_gather", label))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        # y_q = stack_r x_r on every replica q: ∂/∂x_r = Σ_q g_q[r].
        g = raw_all_reduce(
            ctx.env, [x.contiguous() for x in grads], ctx.spec, "sum", "all_gather_grad", label=ctx.label
        )
        me = ctx.env.index
        return (None, None, None, *(x[me] for x in g))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, env: Env, spec: pytree.TreeSpec, source: int, label: str | None, *tensors: torch.Tensor
    ) -> Any:
        ctx.env, ctx.spec, ctx.source, ctx.label = env, spec, source, label
        return tuple(raw_broadcast(env, list(tensors), spec, source, "broadcast", label))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        g = raw_all_reduce(
            ctx.env, [x.contiguous() for x in grads], ctx.spec, "sum", "broadcast_grad", label=ctx.label
        )
        if ctx.env.index != ctx.source:
            g = [torch.zeros_like(x) for x in g]
        return (None, None, None, None, *g)


def _needs_grad(tensors: list[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def all_reduce(
    env: Env,
    tensors: list[torch.Tensor],
    spec: pytree.TreeSpec,
    op: str,
    check_nan: bool = False,
    label: str | None = None,
) -> list[Any]:
    if op in ("sum", "mean") and _needs_grad(tensors):
        return list(
            _AllReduce.apply(  # type: ignore[no-untyped-call]
                env, op, spec, check_nan, label, *tensors
            )
        )
    return raw_all_reduce(env, tensors, spec, op, "all_reduce", check_nan, label)


def all_gather(
    env: Env, tensors: list[torch.Tensor], spec: pytree.TreeSpec, label: str | None = None
) -> list[Any]:
    if _needs_grad(tensors):
        return list(
            _AllGather.apply(  # type: ignore[no-untyped-call]
                env, spec, label, *tensors
            )
        )
    return raw_all_gather(env, tensors, spec, "all_gather", label)


def broadcast(
    env: Env, tensors: list[torch.Tensor], spec: pytree.TreeSpec, source: int, label: str | None = None
) -> list[Any]:
    if not 0 <= source < env.size:
        raise ValueError(f"unknown replica id {source} as broadcast source; valid: 0..{env.size - 1}")
    if _needs_grad(tensors):
        return list(
            _Broadcast.apply(  # type: ignore[no-untyped-call]
                env, spec, source, label, *tensors
            )
        )
    return raw_broadcast(env, tensors, spec, source, "broadcast", label)
