"""One bucket's reduction in one backward round, run while backward goes on (``optim.overlap``): a fast bucket's
allreduce issued on backward's thread (``Issued``), any other bucket on a queue thread.

The first collective of a fast bucket and of a generic one sums the round fields [status, c, c²]
(``_round_fields``): status counts the ranks that refused (a gradient whose layout changed since the layout was
agreed); c = ``round_code`` on each rank, and all c are equal exactly when P·Σc² = (Σc)² (their variance is
zero), so a rank in another backward round is caught without a round of its own (``_check_round``). Only a
failed check costs one more round: every rank allgathers its own row so that all raise the same error naming
the rank.

**Fast path** (dense gradients under a plain dense allreduce): one torch allreduce of a flat buffer holding the
members' gradients and a tail, so no metadata round precedes it:

    [ gradients ... | status, c, c², present_0 ... present_k-1 ]

Summed over the ranks, ``present_j`` says how many ranks had member j's gradient (0: nobody, so the member keeps
none, as ``ReplicatedOptimizer.aggregate`` leaves it). NaN and ±Inf propagate through a sum, so the check for
them reads the result, once, where it was just written, instead of every input in backward's thread; a
non-finite result sends every rank back to its own gradients, which ``.grad`` still holds, to name the rank
(finite inputs whose sum overflows pass, as IEEE 754 sums them). A NaN or ±Inf is not raised here but returned
with the sums (``Reduced``): ``DistributedOptimizer.step()`` raises it, and a ``GradScaler`` that sees the
non-finite sums skips the step. The shapes, dtypes and names of the members are agreed once, with the layout
(``overlap``). The members go in and come out as ``DenseAllreduce``'s do (``placement.collective``'s
``dense_flat`` and ``flat_views``).

**The default's sparse gradients**: one ``grouped_allreduce`` per row width, the call ``Grouped`` makes
(``placement.collective.grouped_sum``), with one dense tensor more: 1 where this rank has the gradient, 0 where
it contributes an empty one, so the sum says who had each (0: nobody, no gradient). Its own metadata round, which
the sizes of a sparse exchange need anyway, checks the rest: shapes and layouts, NaN, the call's order and name.

**Other buckets** (compressors, sketches, custom reductions, per-tensor sparse allreduce): one header allreduce of
[status, c, c², dense_0.., sparse_0..] agrees which members exist and in which layout (what
``fill_missing_grads`` agrees for ``ReplicatedOptimizer.aggregate``; a record of op ``AGREE``, phase "header", in
the log), then the placement's own ``aggregate``, with its own metadata round (the sizes a sparse exchange
needs, NaN, shapes and names per call).

Each returns the members' sums (divided by P for ``op="mean"``) without touching the parameters: the caller
installs them when the round ends.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar, cast

import torch
import torch.distributed as dist

from sparsync.collectives.comm import Comm
from sparsync.collectives.failure import on_failure
from sparsync.collectives.fifo import submit
from sparsync.collectives.meta import NonFiniteError, first_nonfinite
from sparsync.collectives.timeline import tracer
from sparsync.handle import Work
from sparsync.optim.buckets import Bucket
from sparsync.placement import ByLayout, NamedParam, ReduceEnv, SparseAllreduce
from sparsync.placement.base import nan_grad, zero_grad
from sparsync.placement.collective import dense_flat, flat_views, grouped_sum
from sparsync.record import AGREE
from sparsync.replicator.optimizer import DENSE

# c = 4·(steps mod 16) + (backward rounds since the step, at most 3) + 1, in [1, 64]: P·c² stays an exact
# integer in float32 up to P = 4,096. A rank with one more backward round in a step than the others differs.
SEQ_MOD = 64
FIXED = 3  # status, c, c²
LAYOUT_CHANGED = 1

Result = list[torch.Tensor | None]
T = TypeVar("T")


@dataclass(frozen=True)
class Flat:
    """A fast bucket's flat buffer (``data``: the gradients, then the tail) and its members' views into it, shaped
    as the parameters: made once per buffer, so that putting a gradient in and reading its sum out make no view
    per round (the buffer is reused round after round, ``overlap``)."""

    data: torch.Tensor
    views: tuple[torch.Tensor, ...]
    tail: torch.Tensor  # the view of data after the gradients


@dataclass(frozen=True)
class Reduced:
    """A bucket's members' reduced gradients (None: no rank had one), and the error of a NaN or ±Inf that some
    rank contributed (``check_nan``), the same on every rank. With one, the members hold non-finite values on
    every rank (the IEEE 754 sums, or NaN where the placement refused before sending): ``DistributedOptimizer``
    raises the error at ``step()``, which a ``GradScaler`` skips. A fast bucket's: the buffer its sums view."""

    grads: Result
    nonfinite: NonFiniteError | None = None
    buffer: Flat | None = None


@dataclass(frozen=True)
class RoundEnv:
    """What a bucket job needs: where to communicate (sparsync's background group of the caller's group, so
    the caller's own collectives in backward never interleave with ours), the caller's group (whose queue
    orders the jobs), the mean or the sum, and the parameter names for errors."""

    caller: dist.ProcessGroup
    reduce: ReduceEnv  # its group is the background group
    mean: bool
    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    # The sparse lane: a queue (its group's) and a group to communicate on, both sparsync's own, for the
    # default's sparse buckets, so that their metadata round and allgather run beside the dense buckets'
    # allreduces instead of behind them (a round of latency costs no bandwidth). None: one lane.
    sparse_lane: tuple[dist.ProcessGroup, ReduceEnv] | None = None
    # The fast buckets' own group (``overlap`` makes it with the layout, when the layout has fast buckets): their
    # allreduces are issued on backward's thread as each bucket fills (``Issued``), not queued; nothing else
    # communicates on it, so every rank issues its transfers in bucket order.
    direct: ReduceEnv | None = None

    @property
    def divisor(self) -> int:
        """What a fast bucket's members are divided by as they are put in (``put``)."""
        return self.reduce.num_replicas if self.mean else 1


@dataclass(frozen=True)
class Contribution:
    """This rank's part of one bucket in one round: a gradient per member (None: none this round), and the
    first member whose gradient is not in the agreed layout (-1: none)."""

    grads: tuple[torch.Tensor | None, ...]
    changed: int
    seq: int


def contribution(
    bucket: Bucket, grads: Sequence[torch.Tensor | None], layouts: Sequence[int], seq: int
) -> Contribution:
    changed = -1
    if bucket.fast:
        for k, (i, g) in enumerate(zip(bucket.members, grads, strict=True)):
            if g is not None and g.is_sparse and layouts[i] == DENSE:
                changed = k
                break
    return Contribution(tuple(grads), changed, seq)


def round_code(steps: int, rounds: int) -> int:
    """The order check of a round (``SEQ_MOD``): the step, and the backward round within it."""
    return 4 * (steps % (SEQ_MOD // 4)) + min(rounds, 3) + 1


class Pending(Protocol):
    """A bucket's reduction under way: ``wait`` gives its result (on the caller's thread)."""

    def wait(self) -> Reduced: ...


def start(
    bucket: Bucket,
    mine: Contribution,
    env: RoundEnv,
    params: Sequence[NamedParam],
    flat: Flat | None = None,
    copied: frozenset[int] = frozenset(),
) -> Pending:
    """Start ``bucket``'s reduction: a fast bucket's allreduce issued now on ``env.direct`` (``Issued``), any
    other bucket queued on its queue (FIFO: every rank runs its buckets in launch order). Fast path:
    ``flat`` is the round's buffer (``buffer_of``), where the members at positions ``copied`` were put as
    backward produced them (DDP copies each gradient into its bucket as it is ready too)."""
    if bucket.local:  # summed in backward already: nothing to send
        P = env.reduce.num_replicas
        return Work.done(Reduced([None if g is None else g / P if env.mean else g for g in mine.grads]))
    if bucket.fast:
        assert env.direct is not None  # made with any layout that has a fast bucket
        return Issued(bucket, mine, _pack(bucket, mine, flat, copied, env), env, env.direct)
    queue, run, facts = _job(bucket, mine, env, params)
    work = submit(queue, run, True, label=f"bucket:{bucket.index}", facts=lambda: facts)
    assert isinstance(work, Work)  # async_op=True
    return work


def _job(
    bucket: Bucket, mine: Contribution, env: RoundEnv, params: Sequence[NamedParam]
) -> tuple[dist.ProcessGroup, Callable[[], Reduced], dict[str, object]]:
    """The queue a bucket that is not fast runs on, its reduction, and the facts its queue entry reports (a
    generic bucket's sizes come out of the placement's own call)."""
    if bucket.grouped:
        queue, red = env.sparse_lane or (env.caller, env.reduce)
        return queue, lambda: _grouped(bucket, mine, env, red, params), {"params": len(mine.grads)}
    return env.caller, lambda: _generic(bucket, mine, env, params), {"params": len(bucket.members)}


def buffer_of(bucket: Bucket, device: torch.device, shapes: Sequence[torch.Size]) -> Flat:
    """The fast path's flat buffer of ``bucket`` (gradients, then the tail), with its members' views (``shapes``:
    the members' parameter shapes)."""
    data = torch.empty(bucket.numel + FIXED + len(bucket.members), dtype=bucket.dtype, device=device)
    return Flat(data, tuple(flat_views(data, shapes)), data[bucket.numel :])


def shapes_of(bucket: Bucket, env: RoundEnv) -> list[torch.Size]:
    """The parameter shapes of ``bucket``'s members."""
    return [env.shapes[i] for i in bucket.members]


def put(piece: torch.Tensor, grad: torch.Tensor, divisor: int) -> None:
    """A gradient into its slot of a fast bucket (``piece``: its view, of the gradient's shape), divided by
    ``divisor`` (P for the mean, 1 for the sum) in the same pass: the mean's division costs no pass over the
    reduced bucket (DDP divides its bucket before the allreduce too). Each rank's share is g / P, so the bucket
    holds Σ g_i / P rounded per term."""
    if divisor == 1:
        piece.copy_(grad)
    else:
        torch.div(grad, divisor, out=piece)


def _pack(bucket: Bucket, mine: Contribution, flat: Flat | None, copied: frozenset[int], env: RoundEnv) -> Flat:
    """The flat buffer, completed in the caller's thread (backward goes on accumulating into other gradients):
    the members not copied yet (divided by ``env.divisor``), zeros for a missing one, the tail."""
    if flat is None:
        ref = next((g for g in mine.grads if g is not None), None)
        flat = buffer_of(bucket, ref.device if ref is not None else torch.device("cpu"), shapes_of(bucket, env))
    divisor = env.divisor
    for k, g in enumerate(mine.grads):
        if k in copied and g is not None and not g.is_sparse:
            continue
        piece = flat.views[k]
        if g is None:
            piece.zero_()
        else:
            put(piece, g.to_dense() if g.is_sparse else g, divisor)
    present = [0.0 if g is None else 1.0 for g in mine.grads]
    flat.tail.copy_(torch.tensor([*_round_fields(mine), *present], dtype=bucket.dtype))
    return flat


def _first_nonfinite(bucket: Bucket, mine: Contribution) -> int:
    """Flat position in the bucket of this rank's first NaN or ±Inf (its own gradients), or -1."""
    for k, g in enumerate(mine.grads):
        if g is not None:
            pos = first_nonfinite(dense_flat(g))
            if pos >= 0:
                return int(bucket.slots[k].start) + pos
    return -1


class Issued:
    """A fast bucket's allreduce, issued on the caller's thread when made (on ``red``'s group, which nothing
    else uses: ``RoundEnv.direct``); ``wait`` waits for it and reads the result there (``_fast_result``). No
    queue: no thread hand-off per bucket (DDP's reducer issues its allreduces from backward's thread too). Its
    flight entry closes when waited for, done or failed."""

    def __init__(self, bucket: Bucket, mine: Contribution, flat: Flat, env: RoundEnv, red: ReduceEnv):
        self.bucket, self.mine, self.flat, self.env, self.red = bucket, mine, flat, env, red
        self.t0 = time.perf_counter()
        self.comm = Comm(red.group, red.timeout, flat.data.device)
        self.comm.op = f"DistributedOptimizer bucket {bucket.index} allreduce"
        self.result: Reduced | None = None
        self.work = self._closing(
            lambda: self.comm.start_collective("bucket all_reduce", dist.all_reduce, flat.data)
        )

    def _closing(self, fn: Callable[[], T]) -> T:
        """``fn()``; on an error its flight entry closes as failed and ``on_failure`` reports it (``guard``)."""
        entry = self.comm.flight
        try:
            return fn()
        except (RuntimeError, ValueError, TypeError) as e:
            if entry is not None:
                entry.close("failed", e)
            on_failure(e, dump_calls=entry is not None)
            raise

    def wait(self) -> Reduced:
        if self.result is not None:
            return self.result
        self.result = self._closing(self._finish)
        if self.comm.flight is not None:
            self.comm.flight.close("done", None)
        t = tracer()
        if t is not None:
            t.complete(f"bucket:{self.bucket.index}", "call", self.t0, time.perf_counter())
        return self.result

    def _finish(self) -> Reduced:
        with self.comm.phase("dense_allreduce"):
            self.comm.wait_collectives("bucket all_reduce", [self.work])
        return _fast_result(self.bucket, self.mine, self.flat, self.env, self.red, self.comm, self.t0)


def _fast_result(
    bucket: Bucket, mine: Contribution, buffer: Flat, env: RoundEnv, red: ReduceEnv, comm: Comm, t0: float
) -> Reduced:
    """A fast bucket's result from its reduced ``buffer`` (summed over ``red``'s group): the round check, the NaN
    check, the members' views."""
    flat = buffer.data
    n, k = bucket.numel, len(bucket.members)
    comm.count_ring_allreduce(flat.numel() * flat.element_size())
    tail = buffer.tail.tolist()
    _check_round(comm, bucket, mine, env, tail[:FIXED])
    nonfinite = None
    if red.check_nan and first_nonfinite(flat[:n]) >= 0:  # some rank's input, or an overflowing sum
        try:
            _name_the_rank(comm, bucket, mine, _first_nonfinite(bucket, mine), env)
        except NonFiniteError as e:  # the IEEE 754 sums stay in the result: non-finite on every rank
            nonfinite = e
    # already the mean: each rank put g / P into the bucket
    present = tail[FIXED : FIXED + k]
    out: Result = [v if count else None for v, count in zip(buffer.views, present, strict=True)]
    if red.log is not None:
        red.log.append(comm.record("bucket_allreduce", "dense", t0, dim=n, nnz_in=n, nnz_out=n))
    return Reduced(out, nonfinite, buffer)


def _round_fields(mine: Contribution) -> list[float]:
    """The fields every bucket's first collective sums: [status, c, c²] (``SEQ_MOD``)."""
    return [float(mine.changed >= 0), float(mine.seq), float(mine.seq**2)]


def _check_round(comm: Comm, bucket: Bucket, mine: Contribution, env: RoundEnv, summed: Sequence[float]) -> None:
    """The round-order check of ``_round_fields`` summed over the ranks: when some rank refused (status) or the
    c differ (P·Σc² ≠ (Σc)²), the same error on every rank."""
    status, c, c2 = summed
    if status or comm.size * c2 != c * c:
        _name_the_rank(comm, bucket, mine, -1, env)


def _name_the_rank(comm: Comm, bucket: Bucket, mine: Contribution, nonfinite: int, env: RoundEnv) -> None:
    """Every rank's own checks, gathered, and the same ValueError raised on every rank (none when every rank
    passes them all: a finite sum that overflowed)."""
    row = torch.tensor([mine.changed, nonfinite, mine.seq], dtype=torch.int64)
    table = [torch.empty_like(row) for _ in range(comm.size)]
    with comm.phase("check"):
        comm.meta.all_gather_equal("bucket check", table, row)
    raise_disagreement(torch.stack(table), bucket, env.names, comm.rank)


def raise_disagreement(table: torch.Tensor, bucket: Bucket, names: Sequence[str], me: int) -> None:
    """The error every rank raises for the gathered rows [changed member, non-finite position, c]."""
    for r in range(table.shape[0]):
        changed = int(table[r, 0])
        if changed >= 0:
            name = names[bucket.members[changed]]
            raise ValueError(
                f"rank {r}'s gradient of {name!r} is sparse, but it was dense in the first step, when the "
                f"buckets were laid out (seen on rank {me}); a parameter's gradient layout must not change"
            )
    seqs = table[:, 2]
    if bool((seqs != seqs[0]).any()):
        r = int(torch.nonzero(seqs != seqs[0])[0])
        raise ValueError(
            f"rank {r} reduces another backward round than rank 0 (step {(int(seqs[r]) - 1) // 4} round "
            f"{(int(seqs[r]) - 1) % 4} against step {(int(seqs[0]) - 1) // 4} round {(int(seqs[0]) - 1) % 4}, "
            f"steps mod {SEQ_MOD // 4}; seen on rank {me}): every rank runs as many backward passes outside "
            "opt.no_sync() per step (accumulate under opt.no_sync())"
        )
    for r in range(table.shape[0]):
        pos = int(table[r, 1])
        if pos >= 0:
            at, member = pos, 0
            while at >= bucket.sizes[member]:
                at -= bucket.sizes[member]
                member += 1
            name = names[bucket.members[member]]
            raise NonFiniteError(
                f"rank {r} contributed NaN or ±Inf (at flat index {at} of the gradient of {name!r}; seen on "
                f"rank {me}); refusing to step on a non-finite value (a GradScaler skips such a step; pass "
                "check_nan=False to step on the IEEE 754 sums)"
            )


def _grouped(
    bucket: Bucket, mine: Contribution, env: RoundEnv, red: ReduceEnv, params: Sequence[NamedParam]
) -> Reduced:
    placement = bucket.placement
    assert isinstance(placement, ByLayout) and isinstance(placement.sparse, SparseAllreduce)  # buckets.is_grouped
    groups: dict[tuple[int, torch.dtype], list[int]] = {}  # member positions by (row width, dtype)
    for j, i in enumerate(bucket.members):
        p = params[i].param
        groups.setdefault((math.prod(p.shape[1:]), p.dtype), []).append(j)
    out: Result = [None] * len(bucket.members)
    nonfinite = None
    for (_, dtype), js in groups.items():
        tensors = []
        for j in js:
            g, p = mine.grads[j], params[bucket.members[j]].param
            tensors.append(g if g is not None else zero_grad(p, sparse=True))
        ref = tensors[0]
        present = torch.tensor([float(mine.grads[j] is not None) for j in js], dtype=dtype, device=ref.device)
        names = [env.names[bucket.members[j]] for j in js]
        try:
            got = grouped_sum([*tensors, present], names, placement.sparse.algorithm, red)
        except NonFiniteError as e:
            # refused in its metadata round, on every rank, before any row moved; the row-sparse sum has no
            # state, so the same call again gives the IEEE 754 sums, non-finite on every rank
            nonfinite = nonfinite or e
            got = grouped_sum([*tensors, present], names, placement.sparse.algorithm, red, check_nan=False)
        counts = got[-1].tolist()
        for j, g, count in zip(js, got[:-1], counts, strict=True):
            out[j] = None if not count else g / red.num_replicas if env.mean else g
    return Reduced(out, nonfinite)


def _generic(bucket: Bucket, mine: Contribution, env: RoundEnv, params: Sequence[NamedParam]) -> Reduced:
    t0 = time.perf_counter()
    red = env.reduce
    k = len(bucket.members)
    comm = Comm(red.group, red.timeout)
    comm.op = f"DistributedOptimizer bucket {bucket.index} header"
    dense = [float(g is not None and not g.is_sparse) for g in mine.grads]
    sparse = [float(g is not None and g.is_sparse) for g in mine.grads]
    header = torch.tensor([*_round_fields(mine), *dense, *sparse], dtype=torch.float64)
    meta = comm.meta
    with comm.phase("header"):
        meta.run_collective("bucket header", dist.all_reduce, header)
    meta.count_ring_allreduce(header.numel() * header.element_size())
    got = header.tolist()
    _check_round(comm, bucket, mine, env, got[:FIXED])
    ndense, nsparse = got[FIXED : FIXED + k], got[FIXED + k :]
    mixed = [j for j in range(k) if ndense[j] and nsparse[j]]
    if mixed:
        name = env.names[bucket.members[mixed[0]]]
        raise ValueError(
            f"{name!r} has a sparse gradient on {int(nsparse[mixed[0]])} rank(s) and a dense one on "
            f"{int(ndense[mixed[0]])} (seen on rank {comm.rank}); every rank's gradient must have one layout"
        )
    if red.log is not None:
        n = header.numel()
        red.log.append(meta.record(AGREE, "gloo", t0, dim=n, nnz_in=n, nnz_out=n))
    proxies: list[NamedParam] = []
    at: list[int] = []
    for j, (i, g) in enumerate(zip(bucket.members, mine.grads, strict=True)):
        if not (ndense[j] or nsparse[j]):
            continue  # no rank has it: it keeps no gradient, as ReplicatedOptimizer.aggregate leaves it
        p = params[i]
        proxy = cast(torch.nn.Parameter, p.param.detach())  # the worker never touches the parameter itself
        proxy.grad = g if g is not None else zero_grad(p.param, sparse=bool(nsparse[j]))
        proxies.append(NamedParam(p.name, proxy))
        at.append(j)
    nonfinite = None
    if proxies:
        try:
            bucket.placement.aggregate(proxies, red)
        except NonFiniteError as e:
            # refused in the placement's metadata round on every rank; a compressor's state (error feedback)
            # must not take the non-finite values in, so no second call: NaN on every rank instead of the sums
            nonfinite = e
            for named in proxies:
                named.param.grad = nan_grad(named.param, named.param.grad)
    out: Result = [None] * k
    for j, named in zip(at, proxies, strict=True):
        g = named.param.grad
        assert g is not None
        out[j] = g / red.num_replicas if env.mean else g
    return Reduced(out, nonfinite)
