"""The communicator every sparsync operation runs on: byte exchanges, traffic counters, the call's record, and
the exchange of a stream (its wire format: ``wire.py``).

Everything goes through torch.distributed (gloo on CPU, NCCL or gloo on CUDA): ``isend``/``irecv`` for the
exchanges we schedule ourselves (``batch_isend_irecv`` under NCCL's rules), torch collectives where torch has the
right one; a transport failure becomes a ``PeerError`` naming the operation and the peer. Payload lives on the
device of the call's input (``Comm.device``); metadata on the host, over ``Comm.meta`` (collectives/transport.py).
Per-group state (the measured link model, the call counter) lives in ``collectives/group.py``, the async queue in
``collectives/fifo.py``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from sparsync.collectives import peers, trace
from sparsync.collectives.flight import FlightEntry
from sparsync.collectives.group import group_state
from sparsync.collectives.traffic import Traffic
from sparsync.collectives.transport import transport
from sparsync.collectives.wire import HEADER_WORDS, header_of, payload_nbytes, payload_of, stream_from_payload
from sparsync.costmodel import Decision
from sparsync.record import CommRecord
from sparsync.stream import SparseStream


class PeerError(RuntimeError):
    """A peer did not answer in time, or the transport failed; names the operation and the peer."""


class Comm:
    """One rank's view of a group for the duration of one collective: peers by group rank, counters."""

    def __init__(
        self, group: dist.ProcessGroup, timeout: float | None = None, device: torch.device | None = None
    ) -> None:
        self.group = group
        state = group_state(group)
        if state.rank_size is None:  # read once per group: torch's lookups cost more than a small call
            state.rank_size = (dist.get_rank(group), dist.get_world_size(group))
        self.rank, self.size = state.rank_size
        self.traffic = Traffic()
        self.timeout = timedelta(seconds=timeout) if timeout is not None else None
        if state.published < 3:
            # gloo may connect a pair at its first use: publish again once the group's first call is over (its
            # metadata round reaches every peer), so that a peer's transport error can name this rank
            state.published += 1
            peers.publish()
        self.flight: FlightEntry | None = state.flight.begin(group.group_name, "collective", self.traffic)
        self.op = "collective"
        self.device = torch.device("cpu") if device is None else torch.device(device)
        rules = transport(group, self.device)
        self.exact = rules.exact  # receives of exactly the bytes sent, p2p in batches (NCCL)
        self.stage = rules.stage  # p2p through host memory (CUDA tensors on gloo)
        self._meta_group = group if rules.meta is None else rules.meta
        self._meta: Comm | None = None
        self._root = self  # the Comm whose phase a metadata Comm's bytes are counted in
        self._phase = ""
        self._span = trace.CURRENT.get() if trace.RANGES else None  # the traced call this Comm serves
        if self._span is not None:
            self._span.add_traffic(self.traffic)

    @property
    def op(self) -> str:
        """The operation and its options, for errors and the flight recorder."""
        return self._op

    @op.setter
    def op(self, value: str) -> None:
        self._op = value
        if self.flight is not None:
            self.flight.op = value

    @property
    def meta(self) -> Comm:
        """This call's communicator for CPU metadata (rows, sizes, headers): the same group on gloo, the CPU side
        of the group otherwise (transport.py); the same traffic counters and phases."""
        if self._meta is None:
            if self.device.type == "cpu" and self._meta_group is self.group and not self.exact:
                self._meta = self
            else:
                m = Comm.__new__(Comm)
                m.group, m.rank, m.size, m.traffic = self._meta_group, self.rank, self.size, self.traffic
                m.flight = self.flight  # the same call
                m.timeout, m.op, m.device = self.timeout, self.op, torch.device("cpu")
                m.exact, m.stage, m._meta_group, m._root, m._phase = False, False, self._meta_group, self, ""
                m._span = self._span
                m._meta = m
                self._meta = m
        self._meta.op = self.op
        return self._meta

    def empty(self, n: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A receive buffer on this call's device."""
        return torch.empty(n, dtype=dtype, device=self.device)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Named timing scope, so a benchmark can print where the time and the bytes went; a profiler range
        ``sparsync:<op>:<name>`` and a timeline event when either is active (collectives/trace.py)."""
        root = self._root
        t0, outer = time.perf_counter(), root._phase
        root._phase = name
        traced = trace.RANGES and (self._span is not None or trace.profiling())
        if root.flight is not None:
            root.flight.phase = name
        try:
            if traced:
                with self._traced(name, t0):
                    yield
            else:
                yield
        finally:
            root._phase = outer
            self.traffic.phases[name] = self.traffic.phases.get(name, 0.0) + time.perf_counter() - t0

    @contextmanager
    def _traced(self, name: str, t0: float) -> Iterator[None]:
        span = self._span
        sent0 = self.traffic.phase_bytes.get(name, 0)
        with trace.profiler_range(f"sparsync:{self.op.partition('(')[0]}:{name}"):
            yield
        if span is not None and span.tracer is not None:
            sent = self.traffic.phase_bytes.get(name, 0) - sent0
            span.tracer.complete(name, "phase", t0, time.perf_counter(), {"bytes_sent": sent})

    @contextmanager
    def running(self, algorithm: str, decision: Decision | None = None) -> Iterator[None]:
        """Scope of the algorithm that runs (after ``auto`` chose): the call's timeline event takes its name and
        ``decision``'s prediction; under a profiler, a range ``sparsync:<op>:<algorithm>`` with auto's
        choice and predicted time."""
        span = self._span
        if span is not None:
            span.algorithm, span.decision = algorithm, decision
        if not trace.profiling():
            yield
            return
        facts = ""
        if decision is not None:
            facts = trace.describe(
                auto_choice=algorithm, predicted_ms=round(decision.predictions[algorithm] * 1e3, 3)
            )
        with trace.profiler_range(f"sparsync:{self.op.partition('(')[0]}:{algorithm}", facts):
            yield

    def record(
        self,
        op: str,
        algorithm: str,
        t0: float,
        *,
        dim: int,
        nnz_in: int,
        nnz_out: int,
        decision: Decision | None = None,
        row: int = 1,
        partition: str = "",
    ) -> CommRecord:
        """This call as a ``CommRecord``: this Comm's counters (bytes each way, messages, the time and bytes of
        each named phase, the bytes sent to each partition owner) and the wall time since ``t0``
        (``time.perf_counter()`` at the call's start). Every operation's record is built here."""
        tr = self.traffic
        return CommRecord(
            op,
            algorithm,
            self.rank,
            self.size,
            dim,
            nnz_in,
            nnz_out,
            tr.bytes_sent,
            tr.bytes_recv,
            tr.messages,
            time.perf_counter() - t0,
            dict(tr.phases),
            decision,
            dict(tr.phase_bytes),
            row=row,
            partition=partition,
            partition_bytes=tuple(tr.partition_bytes),
        )

    def _sent(self, nbytes: int, messages: int = 1) -> None:
        tr = self.traffic
        tr.bytes_sent += nbytes
        tr.messages += messages
        key = self._root._phase or "other"
        tr.phase_bytes[key] = tr.phase_bytes.get(key, 0) + nbytes

    def _wait(self, works: list[Any], peers: list[int | str]) -> None:
        for w, peer in zip(works, peers, strict=True):
            try:
                if self.timeout is None:
                    w.wait()
                else:
                    w.wait(self.timeout)
            except RuntimeError as e:  # gloo reports timeouts and closed peers as RuntimeError
                raise PeerError(
                    f"{self.op}: rank {self.rank} got no answer from peer rank {peer} of the group "
                    f"(timed out or the peer died): {e}"
                ) from e

    def _post(self, fn: Any, tensor: torch.Tensor, **peer: int) -> Any:
        """Post an isend/irecv; a pair already closed by a dead or timed-out peer raises here, not in wait()."""
        try:
            return fn(tensor, group=self.group, **peer)
        except RuntimeError as e:
            who = next(iter(peer.values()))
            raise PeerError(
                f"{self.op}: rank {self.rank} cannot reach peer rank {who} of the group "
                f"(timed out or the peer died): {e}"
            ) from e

    def _transfer(self, recvs: list[tuple[int, torch.Tensor]], sends: list[tuple[int, torch.Tensor]]) -> None:
        """Post every receive, then every send (so no schedule can deadlock), then wait for all of them.
        Empty tensors are skipped: the transport needs no message for them and the peer posts none.
        Under NCCL's rules the transfers go as one ``batch_isend_irecv``; CUDA tensors on gloo through host
        memory (transport.py)."""
        recvs = [(p, t) for p, t in recvs if t.numel()]
        sends = [(p, t.contiguous()) for p, t in sends if t.numel()]
        landing = recvs
        if self.stage:  # gloo's p2p takes CPU tensors only
            landing = [(p, torch.empty(t.shape, dtype=t.dtype)) for p, t in recvs]
            sends = [(p, t.cpu()) for p, t in sends]
        peers: list[int | str] = [*(p for p, _ in landing), *(p for p, _ in sends)]
        if self.exact and peers:
            # torch's own isend/irecv: P2POp accepts no other function
            ops = [dist.P2POp(c10d.irecv, t, group=self.group, group_peer=p) for p, t in landing]
            ops += [dist.P2POp(c10d.isend, t, group=self.group, group_peer=p) for p, t in sends]
            works: list[Any] = self._post_batch(ops, peers)
            # A batch may give one work for all of its transfers (NCCL): name every peer in its error.
            peers = [", ".join(str(p) for p in sorted(set(peers), key=str))] * len(works)
        else:
            works = [self._post(dist.irecv, t, group_src=p) for p, t in landing]
            works += [self._post(dist.isend, t, group_dst=p) for p, t in sends]
        for _, t in sends:
            self._sent(t.numel() * t.element_size())
        self._wait(works, peers)
        if self.stage:
            for (_, dst), (_, src) in zip(recvs, landing, strict=True):
                dst.copy_(src)
        self.traffic.bytes_recv += sum(t.numel() * t.element_size() for _, t in recvs)

    def _post_batch(self, ops: list[Any], peers: list[int | str]) -> list[Any]:
        try:
            return list(dist.batch_isend_irecv(ops))
        except RuntimeError as e:
            raise PeerError(
                f"{self.op}: rank {self.rank} cannot reach peer rank(s) {sorted(set(peers), key=str)} of the "
                "group "
                f"(timed out or the peer died): {e}"
            ) from e

    def exchange(self, peer: int, send: torch.Tensor | None, recv: torch.Tensor | None) -> None:
        """Send ``send`` to ``peer`` and receive into ``recv`` from it, concurrently. None or empty skips."""
        self._transfer([] if recv is None else [(peer, recv)], [] if send is None else [(peer, send)])

    def alltoallv(
        self, blocks: list[torch.Tensor], recv_sizes: list[int], dtype: torch.dtype
    ) -> list[torch.Tensor]:
        """Send ``blocks[j]`` to rank j and receive ``recv_sizes[j]`` elements from each rank j, all at once.
        A peer may send fewer elements than ``recv_sizes`` says (gloo fills a prefix of the posted receive).

        SparCML §4's direct sends with non-blocking calls. (gloo's own all_to_all stalled here behind
        tc-shaped links with multi-MB blocks.)
        """
        out = [self.empty(n, dtype) for n in recv_sizes]
        out[self.rank] = blocks[self.rank]
        order = [(self.rank + i) % self.size for i in range(1, self.size)]
        self._transfer([(j, out[j]) for j in order], [(j, blocks[j]) for j in order])
        return out

    def send(self, peer: int, tensor: torch.Tensor) -> None:
        self.exchange(peer, tensor, None)

    def recv(self, peer: int, tensor: torch.Tensor) -> None:
        self.exchange(peer, None, tensor)

    def all_gather_into(self, what: str, out: torch.Tensor, local: torch.Tensor) -> None:
        """``out`` = every rank's ``local`` (same size everywhere) in rank order: torch's
        ``all_gather_into_tensor`` (gloo: through host memory for CUDA tensors, transport.py)."""
        # torch 2.13 renamed all_gather_into_tensor; keep working on older releases. (Looked up per call.)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        if self.stage:
            host = torch.empty(out.shape, dtype=out.dtype)
            self.run_collective(what, gather, host, local.cpu())
            out.copy_(host)
        else:
            self.run_collective(what, gather, out, local)

    def all_gather_equal(self, what: str, parts: list[torch.Tensor], local: torch.Tensor) -> None:
        """``parts[r]`` = rank r's ``local`` (same size everywhere): torch's ``all_gather`` (gloo: through host
        memory for CUDA tensors, transport.py)."""
        if self.stage:
            host = [torch.empty(p.shape, dtype=p.dtype) for p in parts]
            self.run_collective(what, dist.all_gather, host, local.cpu())
            for p, h in zip(parts, host, strict=True):
                p.copy_(h)
        else:
            self.run_collective(what, dist.all_gather, parts, local)

    def count_collective(self, sent: int, received: int, messages: int) -> None:
        """Account for a torch collective whose traffic we compute from its algorithm (gloo: ring)."""
        self._sent(sent, messages)
        self.traffic.bytes_recv += received

    def count_ring_allreduce(self, nbytes: int, calls: int = 1) -> None:
        """Account for torch's allreduce of ``nbytes`` (gloo's ring, in ``calls`` pieces): 2(P-1)/P of it each
        way per rank, in 2(P-1) messages per piece."""
        nb = ring_allreduce_bytes(nbytes, self.size)
        self.count_collective(nb, nb, 2 * (self.size - 1) * calls)

    def count_ring_allgather(self, nbytes: int, calls: int = 1) -> None:
        """Account for torch's allgather of ``nbytes`` per rank (gloo's ring, in ``calls`` calls): the P-1 other
        blocks each way per rank, in P-1 messages per call."""
        nb = ring_allgather_bytes(nbytes, self.size)
        self.count_collective(nb, nb, (self.size - 1) * calls)

    def count_broadcast(self, nbytes: int, root: int) -> None:
        """Account for torch's broadcast of ``nbytes`` from group rank ``root`` (gloo's binomial tree): the whole
        message to each of this rank's children, once from its parent."""
        children = broadcast_children(self.rank, self.size, root)
        self.count_collective(children * nbytes, 0 if self.rank == root else nbytes, children)

    def run_collective(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> None:
        """Run a blocking torch collective, turning transport errors into a PeerError naming ``what``."""
        self.wait_collectives(what, [self.start_collective(what, fn, *args, **kwargs)])

    def start_collective(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Start a torch collective without waiting (finish with ``wait_collectives``)."""
        try:
            return fn(*args, group=self.group, async_op=True, **kwargs)
        except RuntimeError as e:
            raise PeerError(f"{self.op}: {what} failed on rank {self.rank} (timeout or dead peer): {e}") from e

    def wait_collectives(self, what: str, works: list[Any]) -> None:
        """Wait for started collectives, in order; a transport error becomes a PeerError naming ``what``."""
        try:
            for work in works:
                if self.timeout is None:
                    work.wait()
                else:
                    work.wait(self.timeout)
        except RuntimeError as e:
            raise PeerError(f"{self.op}: {what} failed on rank {self.rank} (timeout or dead peer): {e}") from e


# --- gloo's algorithms, in bytes a rank sends ---------------------------------------------------------------
# One model of each torch collective sparsync calls on gloo, used by every record (through ``Comm.count_*``);
# tests count a run's torch.distributed calls with the same functions.
def ring_allreduce_bytes(nbytes: int, size: int) -> int:
    """Bytes one rank sends (and receives) in gloo's ring allreduce of ``nbytes``: reduce-scatter then allgather
    of P blocks, 2(P-1)/P of the buffer."""
    return 2 * (size - 1) * nbytes // size


def ring_allgather_bytes(nbytes: int, size: int) -> int:
    """Bytes one rank sends (and receives) in gloo's ring allgather of ``nbytes`` per rank: the P-1 blocks it
    passes on."""
    return (size - 1) * nbytes


def broadcast_children(rank: int, size: int, root: int) -> int:
    """Ranks that ``rank`` sends the whole message to in gloo's broadcast (``gloo/broadcast.cc``: a binomial tree
    over ranks v renumbered from ``root``; in round i < ceil(log2 P), each v < 2^i sends to v + 2^i). Every rank
    but the root receives it once, so the P ranks send P-1 messages in all, as a root sending to every rank
    would; the tree spreads them over the senders."""
    v = (rank - root) % size
    return sum(1 for i in range(v.bit_length(), (size - 1).bit_length()) if v + (1 << i) < size)


def broadcast_bytes(nbytes: int, rank: int, size: int, root: int) -> int:
    """Bytes ``rank`` sends in gloo's broadcast of ``nbytes`` from ``root`` (``broadcast_children``)."""
    return broadcast_children(rank, size, root) * nbytes


def exchange_stream(
    comm: Comm,
    peer: int,
    stream: SparseStream | None,
    expect: bool,
    dim: int,
    dtype: torch.dtype,
    row: int = 1,
) -> SparseStream | None:
    """Send ``stream`` (if any) to ``peer`` and receive one of ``dim``/``dtype`` back (if ``expect``).

    Two messages per direction: a 16-byte header with the format and nnz, then the payload, since the
    receiver cannot know the size of a partial sum in advance (the union of index sets is data dependent).
    """
    hdr_in = torch.empty(HEADER_WORDS, dtype=torch.int64) if expect else None
    comm.meta.exchange(peer, header_of(stream) if stream is not None else None, hdr_in)
    buf: torch.Tensor | None = None
    if hdr_in is not None:
        is_dense, nrows = bool(hdr_in[0]), int(hdr_in[1])
        buf = comm.empty(payload_nbytes(is_dense, nrows, dim, dtype, row))
    comm.exchange(peer, payload_of(stream) if stream is not None else None, buf)
    if hdr_in is None or buf is None:
        return None
    return stream_from_payload(buf, bool(hdr_in[0]), int(hdr_in[1]), dim, dtype, row)
