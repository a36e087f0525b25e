"""The DDP hook's path for a dense bucket whose gradients all go by ``PowerSGD``: two allreduces per bucket.

``compression_hook`` sends a bucket here when every gradient in it goes by a ``PowerSGD``. The local half stays
per parameter, under its name, on the autograd thread: the memory's residual of that name is added
(``Memory.compensate``), and the compressor counts the call and picks the name's warm-start Q
(``PowerSGD.factor``). The exchange is batched (PowerSGD Algorithm 1, as the paper's code and torch's hook batch
it): one allreduce of every matrix's P and every vector (sent whole) of the bucket, the Ps orthogonalized, one
allreduce of every Q (``lowrank.exchange``). The bucket's buffer receives the sums, divided by the world size
with ``average``, written by the last product straight into it (no copy, no division pass); each parameter's
residual (``x - P̂ Q_i^T``, one ``addmm``) and warm-start Q are stored under its name.

Why it cannot hang with many buckets in flight (torch's ``powerSGD_hook`` does on gloo with more than one
bucket): torch issues each bucket's second and third allreduce from a callback of the previous one's future, so
two buckets' collectives interleave in whatever order their callbacks run, which differs per rank; here the
whole exchange of a bucket is one job on sparsync's queue for the hook's group, and the queue runs jobs in issue
order, which DDP makes the same on every rank (it launches buckets in index order).

``powersgd_allreduce`` runs the same exchange, not async, for a list of tensors: ``DistributedOptimizer``'s
``Compressed(PowerSGD(...))`` placement sends each bucket's dense gradients of a dtype through it, two
allreduces in all instead of two per gradient.

The bucket's metadata round (``aggregate.collective``) compares the bucket's members (its name is theirs, in
order), its size and payload bytes across ranks, and refuses a NaN or ±Inf from any rank, on every rank.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from sparsync.collectives.allreduce import comm_group, refuse
from sparsync.compress.aggregate import collective, record
from sparsync.compress.base import Compressor, Context, Encoding, ReduceCall, TensorSpec
from sparsync.compress.hook_future import BucketRoute, bucket_name
from sparsync.compress.lowrank import Factor, exchange, payload_nbytes, traffic
from sparsync.compress.memory import Memory
from sparsync.compress.powersgd import PowerSGD
from sparsync.compress.reduce import check_input
from sparsync.record import CommLog


def low_rank(buffer: torch.Tensor, comps: Sequence[Compressor]) -> bool:
    """Whether a bucket goes by ``BucketPowerSGD``: a dense buffer whose gradients all go by PowerSGD."""
    return not buffer.is_sparse and bool(comps) and all(isinstance(c, PowerSGD) for c in comps)


def powersgd_allreduce(
    todo: Sequence[tuple[str, torch.Tensor]],
    compressor: PowerSGD,
    memory: Memory | None = None,
    *,
    group: dist.ProcessGroup,
    log: CommLog | None = None,
    timeout: float | None = None,
    check_nan: bool = True,
) -> list[torch.Tensor]:
    """The sums over ``group`` of the dense tensors ``todo`` (name, tensor; one dtype) through ``compressor``,
    in one exchange of two allreduces in all behind one metadata round (``BucketPowerSGD``, not async), each
    compensated and its residual kept under its own name. Returns new tensors of the inputs' shapes, in order.

    Mutates ``memory`` and ``compressor``'s state of each name; never the inputs. Collective: every rank of
    ``group`` calls it with the same names, shapes and dtype in the same order."""
    flat = torch.cat([t.detach().reshape(-1) for _, t in todo])
    views = [
        v.view(t.shape) for v, (_, t) in zip(torch.split(flat, [t.numel() for _, t in todo]), todo, strict=True)
    ]
    route = BucketPowerSGD(group, memory=memory, average=False, async_op=False, log=log, timeout=timeout,
                           check_nan=check_nan)  # fmt: skip
    route(flat, [(n, v) for (n, _), v in zip(todo, views, strict=True)], [compressor] * len(todo)).wait()
    return views


class BucketPowerSGD(BucketRoute):
    """``(bucket, gradients, compressors) -> Future`` for dense buckets of PowerSGD gradients (the settings are
    ``BucketRoute``'s)."""

    def __call__(
        self, buffer: torch.Tensor, todo: Sequence[tuple[str, torch.Tensor]], comps: Sequence[Compressor]
    ) -> torch.futures.Future[torch.Tensor]:
        """Compensate and plan each ``(name, gradient)`` of ``todo`` (views of ``buffer``, in its order) with its
        PowerSGD, queue the bucket's exchange and return the future of ``buffer``, which holds the result when it
        completes. Mutates the memory's residuals and the compressors' state of each name: the call counts here,
        the residuals and warm-start Qs when the exchange completes."""
        flat = buffer.view(-1)
        try:
            xs, factors = self._prepare(flat, todo, comps)
        except (TypeError, ValueError) as e:  # every rank raises it, not only this one
            refuse(self.group, "reduce", e, self.timeout, self.async_op)
        names = [n for n, _ in todo]
        call = self._call(flat, comps[0], bucket_name(names))

        def run() -> torch.Tensor:
            self._exchange(call, flat, names, xs, factors, comps)
            return buffer

        res = collective(call, "powersgd", payload_nbytes(factors), run)
        return self.future(buffer, res, lambda out: out)

    def _prepare(
        self, flat: torch.Tensor, todo: Sequence[tuple[str, torch.Tensor]], comps: Sequence[Compressor]
    ) -> tuple[list[torch.Tensor], list[Factor]]:
        """Each gradient compensated under its name (``xs``) and as its PowerSGD sends it this call."""
        xs: list[torch.Tensor] = []
        factors: list[Factor] = []
        offset = 0
        for (name, grad), c in zip(todo, comps, strict=True):
            check_input(grad, c, self.memory, name, inplace=False)
            assert isinstance(c, PowerSGD)  # low_rank() chose this route
            x = self.memory.compensate(name, grad) if self.memory is not None else grad
            xs.append(x)
            factors.append(c.factor(name, x))
            offset += grad.numel()
        if offset != flat.numel():
            raise ValueError(f"a bucket of {flat.numel()} values holds gradients of {offset} values in all")
        if len({f.x.dtype for f in factors}) > 1:
            raise ValueError(f"a PowerSGD bucket mixes dtypes {sorted({str(f.x.dtype) for f in factors})}")
        return xs, factors

    def _call(self, flat: torch.Tensor, comp: Compressor, name: str) -> ReduceCall:
        """The bucket as one call of the metadata round: its flat buffer's shape, dtype and NaN check, its name."""
        spec = TensorSpec.of(flat)
        enc = Encoding(comp, flat, flat, spec, Context(name, self.rank, self.size), async_op=self.async_op,
                       feedback=self.memory is not None)  # fmt: skip
        layout = f"hook/powersgd-bucket/{flat.dtype}/{flat.device.type}"
        comm = comm_group(self.group, self.async_op)  # where compressed_allreduce(group=group) would send
        return ReduceCall(enc, spec, self.group, comm, layout, average=self.average, timeout=self.timeout,
                          check_nan=self.check_nan, log=self.log, t0=time.perf_counter())  # fmt: skip

    def _exchange(
        self,
        call: ReduceCall,
        flat: torch.Tensor,
        names: Sequence[str],
        xs: Sequence[torch.Tensor],
        factors: Sequence[Factor],
        comps: Sequence[Compressor],
    ) -> None:
        """The queued half: the two allreduces, the sums (divided by P with ``average``) into ``flat``, each name's
        residual and warm start."""
        memory = self.memory
        divisor = self.size if self.average else 1
        pieces = list(torch.split(flat, [x.numel() for x in xs]))
        direct = all(f.x.dtype == flat.dtype for f in factors)  # the work dtype: the totals go straight in
        results = exchange(factors, call.comm, residual=memory is not None, divisor=divisor,
                           into=pieces if direct else None)  # fmt: skip
        for name, x, out, c in zip(names, xs, results, comps, strict=True):
            assert isinstance(c, PowerSGD)
            c.settle(name, out)
            if memory is not None and out.residual is not None:
                memory.update_residual(name, x, out.residual.to(x.dtype))
        if not direct:
            for piece, out in zip(pieces, results, strict=True):
                piece.copy_(out.total.reshape(-1))
        record(call, "powersgd", *traffic(factors, self.size), device=flat.device)
