"""Workers of tests/test_commlog.py (module-level: ``launch`` pickles them), and ``Wire``: the torch.distributed
calls of this process, counted where they are made.

``Wire`` patches ``torch.distributed`` so that each call is counted before it runs: the bytes this rank sends,
from what the call is given and gloo's algorithm for it (the models of ``sparsync.collectives.comm``, so that the
comparison is about which calls are recorded, not about the model), on every group. A call it has no model
for is listed under ``unmodelled``, never guessed.
"""

from __future__ import annotations

import functools
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _dist_patch import DistPatch
from torch.distributed import distributed_c10d as c10d

import sparsync
from sparsync.collectives.comm import broadcast_bytes, ring_allgather_bytes, ring_allreduce_bytes
from sparsync.compress import ErrorFeedback, TopK
from sparsync.placement import Compressed
from sparsync.record import CALIBRATE, CommLog

MODELLED = (
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single", "send", "isend",
    "recv", "irecv", "batch_isend_irecv", "barrier",
)  # fmt: skip
OTHERS = (
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list", "gather", "scatter",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all",
    "all_to_all_single", "monitored_barrier",
)  # fmt: skip


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Wire(DistPatch):
    """Bytes this rank sends through torch.distributed while installed (a context manager), per call name."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.unmodelled: list[str] = []
        self._lock = threading.Lock()  # sparsync's queue threads call too

    def __enter__(self) -> Wire:
        self._patch((*MODELLED, *OTHERS))
        return self

    @property
    def total(self) -> int:
        return sum(self.sent.values())

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            nbytes = self._sends(name, args, kwargs)
            with self._lock:
                self.calls[name] += 1
                if nbytes is None:
                    self.unmodelled.append(name)
                else:
                    self.sent[name] += nbytes
            return fn(*args, **kwargs)

        return counted

    def _sends(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
        """Bytes this rank sends in the call, by gloo's algorithm for it (None: no model)."""
        if name == "batch_isend_irecv":
            ops = args[0] if args else kwargs["p2p_op_list"]
            return sum(_nbytes(op.tensor) for op in ops if op.op is c10d.isend)
        if name in ("send", "isend"):
            return _nbytes(args[0] if args else kwargs["tensor"])
        if name in ("recv", "irecv", "barrier"):
            return 0  # gloo's barrier: notifications without payload
        group = kwargs.get("group")
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if name == "all_reduce":
            return ring_allreduce_bytes(_nbytes(args[0] if args else kwargs["tensor"]), size)
        if name == "broadcast":
            root = kwargs.get("group_src")
            if root is None:
                src = kwargs.get("src", args[1] if len(args) > 1 else None)
                root = dist.get_group_rank(group if group is not None else dist.group.WORLD, src)
            return broadcast_bytes(_nbytes(args[0] if args else kwargs["tensor"]), rank, size, root)
        if name == "all_gather":
            return ring_allgather_bytes(_nbytes(args[1] if len(args) > 1 else kwargs["tensor"]), size)
        if name in ("all_gather_into_tensor", "all_gather_single"):
            return ring_allgather_bytes(_nbytes(args[1] if len(args) > 1 else kwargs["input_tensor"]), size)
        return None


class Mixed(torch.nn.Module):
    """A sparse table (sparse gradients), an MLP, a layer only even ranks use and one nobody uses."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.emb = torch.nn.EmbeddingBag(300, width, mode="sum", sparse=True)
        self.fc1 = torch.nn.Linear(width, width)
        self.fc2 = torch.nn.Linear(width, width)
        self.odd = torch.nn.Linear(width, 1)
        self.unused = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, even: bool) -> torch.Tensor:
        h = torch.relu(self.fc1(self.emb(x)))
        out = self.fc2(h).square().sum()
        return out + self.odd(h).sum() if even else out


RUNS = ("overlap", "compressed", "step")  # default plan in backward; a compressed weight; reduction in step()


def log_worker(rank: int, steps: int = 3) -> dict[str, Any]:
    """Each of ``RUNS``: construct ``DistributedOptimizer(log=...)`` and train ``steps`` steps under ``Wire`` (the
    first "auto" call on each group measures the link: counted too). Returns per run the log's records (op,
    phases, bytes sent) and the wire's count per call name."""
    out: dict[str, Any] = {}
    for run in RUNS:
        torch.manual_seed(rank)  # different initial weights: the broadcast at construction has work to do
        model = Mixed()
        plan = {"fc1.weight": Compressed(TopK(0.3), ErrorFeedback())} if run == "compressed" else None
        log = CommLog()
        with Wire() as wire:
            opt = sparsync.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.05), model, plan=plan, log=log, overlap=run != "step"
            )
            for step in range(steps):
                g = torch.Generator().manual_seed(100 * step + rank)
                opt.zero_grad()
                model((torch.rand(8, 3, generator=g) ** 2 * 300).long(), rank % 2 == 0).backward()
                opt.step()
        out[run] = {
            "records": [(r.op, sorted(r.phases), r.bytes_sent) for r in log.records],
            "log_bytes": log.total_bytes_sent(),
            "wire": dict(wire.sent),
            "wire_bytes": wire.total,
            "calls": dict(wire.calls),
            "unmodelled": wire.unmodelled,
            "weights": model.fc2.weight.detach().numpy().copy(),
            "calibrations": sum(CALIBRATE in r.phases for r in log.records),
        }
    return out


def deterministic_worker(rank: int) -> int:
    """``set_deterministic()`` on the world group, then the default optimizer (its buckets run on sparsync's own
    groups): how many calls measured the link (none should: the side groups use the caller's link model)."""
    sparsync.set_deterministic()
    torch.manual_seed(0)
    model = Mixed()
    log = CommLog()
    opt = sparsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model, log=log)
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        opt.zero_grad()
        model((torch.rand(8, 3, generator=g) ** 2 * 300).long(), rank % 2 == 0).backward()
        opt.step()
    return sum(CALIBRATE in r.phases for r in log.records)
