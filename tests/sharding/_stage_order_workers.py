"""Worker for test_stage_order.py (module-level: ``launch`` pickles it): one sharded step of test_shard's nine
tables (``_shard_workers.Tables``: three table groups, embeddings and bags of every kind) traced module by module
inside ``sparsync.sharding``."""

from __future__ import annotations

import sys
from pathlib import Path
from types import FrameType
from typing import Any

import _shard_workers as sw
import torch
import torch.distributed as dist
from _lookahead_workers import table_ids

import sparsync
import sparsync.sharding as package
from sparsync.sharding import SGD, Lookahead

PACKAGE = Path(package.__file__).resolve().parent


def module_of(frame: FrameType | None) -> str | None:
    """The ``sparsync.sharding`` module ``frame`` runs in (its file's stem), or None for code outside it."""
    if frame is None:
        return None
    path = Path(frame.f_code.co_filename)
    return path.stem if path.parent == PACKAGE else None


class Entries:
    """Every call that enters a module of ``sparsync.sharding`` from code outside that module, in order, as
    (caller's module or None, callee's module), while ``sys.setprofile`` holds it."""

    def __init__(self) -> None:
        self.seen: list[tuple[str | None, str]] = []

    def __call__(self, frame: FrameType, event: str, arg: object) -> None:
        del arg
        if event != "call":
            return
        callee = module_of(frame)
        if callee is None:
            return
        caller = module_of(frame.f_back)
        if caller != callee:
            self.seen.append((caller, callee))

    def trace(self, run: Any) -> list[tuple[str | None, str]]:
        """The entries while ``run()`` runs."""
        self.seen = []
        sys.setprofile(self)
        try:
            run()
        finally:
            sys.setprofile(None)
        return self.seen


def step_worker(rank: int, fused: bool, ahead: bool = False) -> dict[str, Any]:
    """Two steps of ``sw.Tables`` (the first settles the ids blocks' capacity); in the second the tables are
    called (their calls registered), then the exchange (run by the first use of a stand-in) and the backward
    are traced, each as its list of entries (``Entries``). ``fused``: the tables sharded with ``SGD``
    (``group.SGD``); ``ahead``: the batches through ``Lookahead`` (the second step's ids stage runs during the
    first)."""
    P = dist.get_world_size()
    model = sparsync.shard(sw.Tables(seed=0), optimizer=SGD(lr=0.1) if fused else None)
    batches = [sw._batch(0, rank, P), sw._batch(2, rank, P)]
    source = Lookahead(batches, model, ids=table_ids) if ahead else iter(batches)
    sw._loss(model(next(source))).backward()
    batch = next(source)
    outs = {name: model.t[name](*args) for name, args in batch.items()}  # registered, not exchanged yet
    entries = Entries()
    forward = entries.trace(lambda: torch.cat([o.reshape(-1) for o in outs.values()]))
    loss = sw._loss({k: o.wait() for k, o in outs.items()})
    backward = entries.trace(loss.backward)
    return {"forward": forward, "backward": backward}
