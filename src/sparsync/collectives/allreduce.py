"""Public sparse collectives: ``sparse_allreduce``, ``sparse_allgather`` (SparCML §4) and ``allreduce``."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NoReturn, Protocol, TypedDict, TypeVar, Unpack, overload, runtime_checkable

import torch
import torch.distributed as dist

from sparsync.collectives._gather import allgather_fixed
from sparsync.collectives.allgather import gather_streams
from sparsync.collectives.background import background_group
from sparsync.collectives.calibrate import measure_link
from sparsync.collectives.comm import Comm, PeerError
from sparsync.collectives.fifo import submit
from sparsync.collectives.group import link_state, next_call, resolve_group
from sparsync.collectives.meta import (
    EAGER_LIMIT,
    PARTITION_CODES,
    BadIndex,
    Meta,
    algorithm_code,
    algorithm_name,
    auto_fingerprint,
    exchange_meta,
    report_refusal,
    update_eager,
)
from sparsync.collectives.ops import text_key
from sparsync.collectives.partition import resolve_partition
from sparsync.collectives.site import call_site
from sparsync.collectives.traffic import Traffic
from sparsync.costmodel import (
    REGISTRY,
    Decision,
    LinkModel,
    Policy,
    Problem,
    choose_fastest,
    choose_robust,
)
from sparsync.handle import Work
from sparsync.record import CALIBRATE, CommLog
from sparsync.stream import SparseStream, index_dtype_for

T = TypeVar("T")


@dataclass(frozen=True)
class DsarCall:
    """One DSAR_Split_AllGather call as a ``DenseQuantizer`` gets it: the communicator, this rank's stream,
    every rank's stored rows and format from the metadata round (``nnz``, ``dense``), the partition kind, and
    the call's name (the quantizer's noise is drawn per name and rank)."""

    comm: Comm
    stream: SparseStream
    nnz: tuple[int, ...]
    dense: tuple[bool, ...]
    partition: str
    name: str


@runtime_checkable
class DenseQuantizer(Protocol):
    """What ``sparse_allreduce(quantize=...)`` needs: a quantizer of DSAR's dense phase (``sparsync.compress.QSGD``
    is one, ``compress/dsar_quantized.py``). Defined here so that the collectives call up into a compressor
    they are handed, without importing the compressors' layer."""

    def quantize_key(self) -> str:
        """The settings every rank must share (the metadata round compares a hash of it)."""
        ...

    def dsar_allreduce(self, call: DsarCall) -> SparseStream:
        """DSAR_Split_AllGather of ``call.stream`` with its dense phase quantized. The same bits on every rank."""
        ...


def comm_group(group: dist.ProcessGroup | None, async_op: bool) -> dist.ProcessGroup:
    """The group a call communicates on: the caller's, or for ``async_op=True`` sparsync's own group over the
    same ranks (``background_group``), since async work runs on the queue thread beside the caller's own
    collectives, which would otherwise interleave with it in a different order on each rank.
    ``launch`` makes it for the world group at start; for another group it is made at the first async
    call, in the caller's thread, so that call must come at the same point of every rank's own collectives on
    the group (as any collective must); ``sparsync.background_group(group)`` makes it ahead."""
    g = resolve_group(group)
    return background_group(g) if async_op and dist.get_world_size(g) > 1 else g


def refuse(
    group: dist.ProcessGroup | None, op: str, error: Exception, timeout: float | None, async_op: bool = False
) -> NoReturn:
    """Raise ``error`` (this rank's input is invalid) after telling the other ranks in the metadata round of
    the call they are making (``meta.report_refusal``): every rank raises at once, none waits for the
    timeout. Queued behind the group's async work like any call, so it meets the call the others make."""
    if not dist.is_available() or not dist.is_initialized():
        raise error  # no group: nobody else to tell
    g = comm_group(group, async_op)  # where the others' call communicates
    seq = next_call(g)

    def run() -> None:
        comm = Comm(g, timeout)  # metadata only: the host
        comm.op = f"{op} (refused input)"
        report_refusal(comm, op, seq, error)

    try:
        submit(resolve_group(group), run, False)  # behind the caller's queued work, like the others' call
    except (TypeError, ValueError) as others:  # other ranks refused too: name them
        raise others from error
    except PeerError:  # the others are gone or elsewhere: this rank's own error is the one to report
        pass
    raise error


class SparseAllreduceOptions(TypedDict, total=False):
    """``sparse_allreduce``'s keyword options but ``async_op`` (its docstring says what each does)."""

    algorithm: str
    group: dist.ProcessGroup | None
    log: CommLog | None
    link: LinkModel | None
    policy: Policy
    timeout: float | None
    check_nan: bool
    partition: str
    name: str | None
    quantize: DenseQuantizer | None


@overload
def sparse_allreduce(
    stream: SparseStream, *, async_op: Literal[False] = ..., **opts: Unpack[SparseAllreduceOptions]
) -> SparseStream: ...
@overload
def sparse_allreduce(
    stream: SparseStream, *, async_op: Literal[True], **opts: Unpack[SparseAllreduceOptions]
) -> Work[SparseStream]: ...
def sparse_allreduce(
    stream: SparseStream,
    *,
    algorithm: str = "auto",
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    log: CommLog | None = None,
    link: LinkModel | None = None,
    policy: Policy = choose_robust,
    timeout: float | None = None,
    check_nan: bool = True,
    partition: str = "auto",
    name: str | None = None,
    quantize: DenseQuantizer | None = None,
) -> SparseStream | Work[SparseStream]:
    """Sum of every rank's ``stream``, on every rank (bitwise identical everywhere).

    ``algorithm``: one of ``ssar_recursive_double``, ``ssar_split_allgather``, ``dsar_split_allgather``,
    ``allgather``, ``dense`` (any in ``costmodel.REGISTRY``) or ``auto`` (chosen per call from the α-β model;
    α, β measured once per group at first use unless ``link`` is given). ``policy`` may replace the choice:
    the default ``choose_robust`` takes the simplest algorithm predicted within 10% of the fastest,
    ``choose_fastest`` the argmin.
    ``partition``: how the split algorithms assign rows to ranks: ``stride`` (row id mod P, balanced on
    Zipf-skewed rows), ``range`` (contiguous, SparCML §4.1) or ``auto`` (stride for row streams, range for
    element streams; ``collectives/partition.py``). ``log`` collects a CommRecord (bytes, time, phases,
    decision, bytes per partition). ``name``: a label compared across ranks (a skipped or reordered call of the
    same signature raises on every rank). ``quantize``: a ``QSGD`` (any ``DenseQuantizer``) for
    ``dsar_split_allgather``'s dense phase in low precision (lossy, unbiased; ``compress/dsar_quantized.py``).
    Does not modify ``stream``.
    Collective: all ranks of ``group`` call it.

    Example::

        >>> s = SparseStream(torch.tensor([rank]), torch.tensor([1.0]), dim=8)
        >>> sparse_allreduce(s).to_dense()      # on 4 ranks
        tensor([1., 1., 1., 1., 0., 0., 0., 0.])
    """
    if not isinstance(stream, SparseStream):
        err = TypeError(f"sparse_allreduce takes a SparseStream, got {type(stream).__name__} (see allreduce())")
        refuse(group, "sparse_allreduce", err, timeout, async_op)
    opts = CallOptions(algorithm, link, policy, timeout, check_nan, partition, name, quantize)
    return start_allreduce(stream, lambda comm, s: s, opts, group=group, async_op=async_op, log=log)


@dataclass(frozen=True)
class CallOptions:
    """The options of one ``sparse_allreduce`` call that every rank must agree on (``sparse_allreduce``'s doc),
    as ``start_allreduce`` takes them from the public entry points."""

    algorithm: str = "auto"
    link: LinkModel | None = None
    policy: Policy = choose_robust
    timeout: float | None = None
    check_nan: bool = True
    partition: str = "auto"
    name: str | None = None
    quantize: DenseQuantizer | None = None


def start_allreduce(
    stream: SparseStream,
    finish: Callable[[Comm, SparseStream], T],
    opts: CallOptions,
    *,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    log: CommLog | None = None,
    bad: BadIndex | None = None,
    shape: tuple[str, tuple[int, ...]] | None = None,
) -> T | Work[T]:
    """``sparse_allreduce`` whose result goes through ``finish(comm, result)`` inside the same queued job
    (``allreduce`` of a COO tensor may need one more collective there). ``bad``: an out-of-range index on
    this rank, reported by every rank after the metadata round (``stream`` is then a
    placeholder of the right dimension). ``shape``: (layout, shape) of the caller's tensor, checked across
    ranks. ``name``: a label every rank gives the same call (e.g. the parameter's name), compared across ranks, so
    a call skipped or reordered among calls of one signature raises instead of pairing with another."""
    part = _checked_partition(stream, opts, group, async_op)
    user = resolve_group(group)
    g = comm_group(user, async_op)
    seq = next_call(g)
    # in the caller's thread: the queue thread has no user frames
    site = call_site() if opts.name is None else None

    def run() -> T:
        t0 = time.perf_counter()
        comm = Comm(g, opts.timeout, stream.device)
        comm.op = f"sparse_allreduce(algorithm={opts.algorithm!r})"
        auto = opts.algorithm == "auto"
        key = auto_fingerprint(opts.link or link_state(user).link, opts.policy) if auto else 0
        meta = exchange_meta(comm, "sparse_allreduce", stream, opts.algorithm, seq, opts.check_nan, bad=bad,
                             shape=shape, auto_key=key, partition=PARTITION_CODES.index(part), name=opts.name,
                             quantize=_quantize_key(opts.quantize), site=site)  # fmt: skip
        alg, decision = _choose(comm, stream, meta, opts, user)
        update_eager(comm, meta, alg)
        entry = REGISTRY.entry(alg)
        with comm.running(alg, decision):
            if opts.quantize is None:
                result = entry.runner(comm, stream, meta, part)
            else:
                call = DsarCall(comm, stream, meta.nnz, meta.dense, part, opts.name or "dsar")
                result = opts.quantize.dsar_allreduce(call)
        out = finish(comm, result)
        log_allreduce(log, comm, alg, t0, stream, result, decision, part)
        return out

    label = f"sparse_allreduce:{opts.algorithm}"
    return submit(user, run, async_op, label=label, facts=lambda: _facts(stream, g))


def _checked_partition(
    stream: SparseStream, opts: CallOptions, group: dist.ProcessGroup | None, async_op: bool
) -> str:
    """The call's partition kind (``resolve_partition``), once the checks of ``opts`` that need no other rank
    passed; a bad option is refused on every rank (``refuse``), not only this one."""
    try:
        if opts.algorithm != "auto" and opts.algorithm not in REGISTRY:
            raise ValueError(f"unknown algorithm {opts.algorithm!r}; valid: auto, {', '.join(REGISTRY.names)}")
        part = resolve_partition(opts.partition, stream.row)
        _check_quantize(opts.quantize, opts.algorithm)
    except (TypeError, ValueError) as e:
        refuse(group, "sparse_allreduce", e, opts.timeout, async_op)
    return part


def _choose(
    comm: Comm, stream: SparseStream, meta: Meta, opts: CallOptions, user: dist.ProcessGroup
) -> tuple[str, Decision | None]:
    """The algorithm the call runs and, for ``auto``, the policy's decision (the link measured at the group's
    first auto call; a policy outside ``PURE_POLICIES`` has its choice agreed across ranks)."""
    if opts.algorithm != "auto":
        return opts.algorithm, None
    lm = opts.link or link_state(user).link  # set_link / set_deterministic name the caller's group
    if lm is None:
        lm = link_state(user).link = _calibrate(comm)
    decision = opts.policy(problem_of(stream, meta, comm.size), lm)
    if opts.policy not in PURE_POLICIES:
        agree_algorithm(comm, decision.algorithm)
    return decision.algorithm, decision


def log_allreduce(
    log: CommLog | None,
    comm: Comm,
    algorithm: str,
    t0: float,
    stream: SparseStream,
    result: SparseStream,
    decision: Decision | None,
    partition: str,
) -> None:
    """Append a sparse allreduce's ``CommRecord`` to ``log`` (when given): ``stream`` in, ``result`` out, the
    ``partition`` kind only for an algorithm that partitions (``uses_partition`` in ``REGISTRY``)."""
    if log is None:
        return
    partitions = algorithm in REGISTRY and REGISTRY.entry(algorithm).uses_partition
    log.append(
        comm.record(
            "sparse_allreduce", algorithm, t0, dim=stream.dim, nnz_in=stream.nnz, nnz_out=result.nnz,
            decision=decision, row=stream.row, partition=partition if partitions else "",
        )
    )  # fmt: skip


def _calibrate(comm: Comm) -> LinkModel:
    """ "auto"'s first call on a group (its caller's, for sparsync's own groups) measures the link: timing traffic
    of its own, counted in the call's record under phase ``CALIBRATE`` (``record.workload_bytes`` leaves it out
    of a step's bytes)."""
    with comm.phase(CALIBRATE):
        tally = Traffic()
        lm = measure_link(comm.group, traffic=tally)
        comm.count_collective(tally.bytes_sent, tally.bytes_recv, tally.messages)
    return lm


def _facts(stream: SparseStream, g: dist.ProcessGroup) -> dict[str, object]:
    """A call's size as its profiler range and timeline event show it: input bytes, stored rows, P."""
    return {"bytes": stream.nbytes, "rows": stream.nrows, "dim": stream.dim, "P": dist.get_world_size(g)}


# Policies whose choice is a function of the metadata round's table and the agreed link model alone, so every
# rank chooses the same. Any other ``policy=`` may hold per-rank state (a closure, a counter): its choice is
# agreed in one more round, since ranks running different algorithms hang or sum wrongly.
PURE_POLICIES: tuple[Policy, ...] = (choose_robust, choose_fastest)


def agree_algorithm(comm: Comm, alg: str) -> None:
    """Raise the same ValueError on every rank unless every rank's policy chose ``alg`` (one allgather of one
    int64 on the host)."""
    mine = torch.tensor([algorithm_code(alg)], dtype=torch.int64)
    with comm.phase("agree_algorithm"):
        table = allgather_fixed(comm.meta, mine)[:, 0]
    differ = [r for r in range(comm.size) if int(table[r]) != int(table[0])]
    if differ:
        r = differ[0]
        raise ValueError(
            f"auto chose different algorithms across ranks: rank 0 chose {algorithm_name(int(table[0]))}, rank "
            f"{r} chose {algorithm_name(int(table[r]))} (seen on rank {comm.rank}); a policy= must choose from "
            "its inputs alone (no per-rank state), as every rank must run the same algorithm"
        )


def _check_quantize(quantize: object, algorithm: str) -> None:
    if quantize is None:
        return
    if not isinstance(quantize, DenseQuantizer):
        raise TypeError(f"quantize must be a sparsync.compress.QSGD or None, got {type(quantize).__name__}")
    if algorithm != "dsar_split_allgather":
        raise ValueError(f"quantize= needs algorithm='dsar_split_allgather', got algorithm={algorithm!r}")


def _quantize_key(quantize: DenseQuantizer | None) -> int:
    return 0 if quantize is None else text_key(quantize.quantize_key())


def problem_of(stream: SparseStream, meta: Meta, world_size: int) -> Problem:
    """The cost model's view of one call: rows as entries, a row's values as one entry's value bytes."""
    isz = stream.values.element_size()
    c = torch.empty((), dtype=index_dtype_for(stream.num_rows)).element_size()
    return Problem(
        world_size,
        stream.num_rows,
        meta.nnz,
        isz * stream.row,
        c,
        eager=meta.eager is not None,
        eager_limit=EAGER_LIMIT,
        row=stream.row,
        unions=meta.unions,
    )


def sparse_allgather(
    stream: SparseStream,
    *,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    log: CommLog | None = None,
    timeout: float | None = None,
    check_nan: bool = True,
) -> list[SparseStream] | Work[list[SparseStream]]:
    """Every rank's ``stream`` (sizes may differ), in rank order, on every rank.

    Sizes travel in the metadata exchange, then the payloads by recursive doubling (SparCML §4).

    Example::

        >>> parts = sparse_allgather(SparseStream(torch.tensor([rank]), torch.tensor([float(rank)]), dim=8))
        >>> [p.nnz for p in parts]               # on 3 ranks
        [1, 1, 1]
    """
    if not isinstance(stream, SparseStream):
        refuse(group, "sparse_allgather", TypeError(f"sparse_allgather takes a SparseStream, got "
                                                    f"{type(stream).__name__}"), timeout, async_op)  # fmt: skip
    user = resolve_group(group)
    g = comm_group(user, async_op)
    seq = next_call(g)
    site = call_site()

    def run() -> list[SparseStream]:
        t0 = time.perf_counter()
        comm = Comm(g, timeout, stream.device)
        comm.op = "sparse_allgather"
        meta = exchange_meta(comm, "sparse_allgather", stream, "-", seq, check_nan, site=site)
        update_eager(comm, meta, "allgather")
        out = gather_streams(comm, stream, meta)
        if log is not None:
            nnz_out = sum(s.nnz for s in out)
            log.append(
                comm.record(
                    "sparse_allgather", "recursive_double", t0, dim=stream.dim, nnz_in=stream.nnz, nnz_out=nnz_out
                )
            )
        return out

    return submit(user, run, async_op, label="sparse_allgather:recursive_double", facts=lambda: _facts(stream, g))
