"""Reduction during backward for ``DistributedOptimizer``, as DDP's reducer does it (Li et al., VLDB 2020,
§3.2.3): each bucket's reduction starts as soon as backward has accumulated its last gradient
(post-accumulate-grad hooks), in the same bucket order on every rank: a fast bucket's allreduce issued from the
hook on a group of its own (``jobs.Issued``), any other bucket on the group's queue thread; the end of backward
waits for what is still in flight and puts the reduced gradients in ``.grad``, so ``loss.backward()`` returns with
the mean (or sum) in every ``.grad``, as under DDP.

A *round* is one backward pass outside ``no_sync()`` (or, on a rank that ran none since the last ``step()``,
``step()`` itself, so that every rank reduces the same buckets). The first round ever reduces every gradient at
once by ``ReplicatedOptimizer.aggregate`` (one agreement round, then the placements: the reduction ``step()``
runs without overlap) and records the order backward produced them in; right after it every rank agrees the
bucket layout once (``buckets.lay_out`` from rank 0's order, and every parameter's name,
shape, dtype and placement compared across ranks). Later rounds need no agreement round: what it checked travels
in each bucket's own payload (``optim.jobs``).

Two backward passes without ``step()`` and outside ``no_sync()`` reduce twice, as DDP does: the second round's
gradients are reduced on their own and added to the first round's result (kept aside by a tensor hook that
runs before autograd accumulates), so the sum is right for ``op="sum"`` as well as for the mean.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from sparsync.collectives.background import background_group, side_group
from sparsync.collectives.comm import Comm
from sparsync.collectives.fifo import submit
from sparsync.collectives.meta import NonFiniteError
from sparsync.collectives.ops import text_key
from sparsync.collectives.timeline import tracer
from sparsync.optim import jobs
from sparsync.optim.buckets import Bucket, default_order, lay_out
from sparsync.optim.weak import indexed_hook
from sparsync.placement import NamedParam, Placement, ReduceEnv
from sparsync.placement.bucketing import CAP_BYTES
from sparsync.record import AGREE
from sparsync.replicator.optimizer import ReplicatedOptimizer

# the autograd engine's end-of-backward callbacks (DDP's reducer queues its finalisation the same way)
_queue_callback: Callable[[Callable[[], None]], None] = torch.autograd.Variable._execution_engine.queue_callback


class OverlapReducer:
    """The hooks and rounds of one ``DistributedOptimizer`` (module doc). Collective like the optimizer: every
    rank builds one over the same parameters."""

    def __init__(
        self,
        replicated: ReplicatedOptimizer,
        *,
        cap_bytes: int = CAP_BYTES,
        on_accumulate: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        """``on_accumulate(param)`` runs first in each parameter's post-accumulate-grad hook, also inside
        ``no_sync()`` (one hook per parameter instead of two: each costs a call from autograd's C++)."""
        self.rep = replicated
        self.params = replicated.params
        self.cap_bytes = cap_bytes
        env = replicated.env
        self.round_env = jobs.RoundEnv(
            env.group,
            ReduceEnv(background_group(env.group), env.num_replicas, env.timeout, env.log, env.check_nan),
            replicated.op == "mean",
            tuple(p.name for p in self.params),
            tuple(p.param.shape for p in self.params),
        )
        self.divisor = self.round_env.divisor  # what a fast bucket's members are divided by as they are put in
        self.buckets: list[Bucket] | None = None
        self.layouts: list[int] = []
        self.order: list[int] = []
        self.loaded: tuple[list[int], list[int]] | None = None  # (order, layouts) from a checkpoint
        self.first_order: list[int] = []  # the first round's order of readiness on this rank
        self.lock = threading.RLock()  # hooks may run on autograd's device threads
        self.syncing = True  # False inside no_sync()
        self.rounds = 0  # rounds since the last step()
        self.steps = 0  # step() calls: with ``rounds``, the order check in every bucket
        self.in_round = False
        self.round_start = 0.0
        self.fired: list[bool] = []  # this round's ready parameters
        self.pending: list[int] = []  # per bucket, its members not ready yet this round: launched at zero
        self.launched = 0
        self.works: list[tuple[Bucket, jobs.Pending]] = []
        # A NaN or ±Inf some rank contributed since the last step() (the same error on every rank): the
        # gradients hold non-finite values; step() raises it unless they were replaced since (GradScaler skips)
        self.nonfinite: NonFiniteError | None = None
        # The tensor each parameter's .grad was set to at the last round's end (a reduced gradient), and the one
        # moved aside when another backward starts accumulating before step().
        self.installed: dict[int, torch.Tensor] = {}
        self.carry: dict[int, torch.Tensor] = {}
        self.buffers: dict[int, jobs.Flat] = {}  # the fast buckets' flat buffers, by bucket index
        self.round_flat: dict[int, jobs.Flat] = {}  # this round's, as members are copied in
        self.copied: set[int] = set()  # parameters already in this round's buffers
        self.bucket_of: dict[int, Bucket] = {}
        self.member_of: dict[int, int] = {}  # a parameter's position in its bucket
        self.on_accumulate = on_accumulate
        for i, p in enumerate(self.params):
            param: Any = p.param  # torch's hook registration is untyped
            if param.requires_grad:
                param.register_hook(indexed_hook(self, OverlapReducer._before_accumulate, i))
                param.register_post_accumulate_grad_hook(indexed_hook(self, OverlapReducer._after_accumulate, i))

    # --- the hooks (held weakly: ``optim.weak``) ---------------------------------------------------------------
    def _before_accumulate(self, i: int, grad: torch.Tensor) -> None:
        del grad
        p = self.params[i].param
        if p.grad is not None and p.grad is self.installed.get(i):
            # a reduced gradient: keep it aside, so this backward's local gradient is reduced alone
            self.carry[i] = self.installed.pop(i)
            p.grad = None

    def _after_accumulate(self, i: int, param: torch.Tensor) -> None:
        if self.on_accumulate is not None:
            self.on_accumulate(param)
        if not self.syncing:
            return
        with self.lock:
            if not self.in_round:
                self._begin_round()
                _queue_callback(self._end_of_backward)
                if self.buckets is None and self.loaded is not None:
                    self._agree_layout(*self.loaded)
            first = not self.fired[i]
            self.fired[i] = True
            if self.buckets is None:
                self.first_order.append(i)
                return
            self._copy_early(i)
            if first:
                self._ready(i)

    # --- rounds -------------------------------------------------------------------------------------------------
    def _begin_round(self) -> None:
        self.in_round = True
        self.round_start = time.perf_counter()
        self.fired = [False] * len(self.params)
        self._reset_pending()
        self.launched = 0
        self.works = []
        self.round_flat = {}
        self.copied = set()

    def _reset_pending(self) -> None:
        self.pending = [len(b.members) for b in self.buckets or ()]

    def _ready(self, i: int) -> None:
        """Parameter ``i``'s gradient is ready: one member less for its bucket; then launch, in bucket order,
        every bucket with none pending (a bucket waits for those before it, as every rank launches alike)."""
        assert self.buckets is not None
        self.pending[self.bucket_of[i].index] -= 1
        while self.launched < len(self.buckets) and self.pending[self.launched] == 0:
            self._launch(self.buckets[self.launched])

    def _copy_early(self, i: int) -> None:
        """Put a fast bucket member's gradient in the round's buffer now, while backward goes on, so that the
        bucket's launch (at its last member) copies one gradient, not all of them."""
        b = self.bucket_of[i]
        g = self.params[i].param.grad
        if not b.fast or g is None or g.is_sparse:
            return
        flat = self.round_flat.get(b.index) or self._round_buffer(b, g.device)
        jobs.put(flat.views[self.member_of[i]], g, self.divisor)
        self.copied.add(i)

    def _round_buffer(self, b: Bucket, device: torch.device | None) -> jobs.Flat:
        """This round's flat buffer of a fast bucket: the last round's when no gradient views it any more (DDP
        keeps its buckets too: a fresh 25 MiB buffer costs its page faults every step), else a new one."""
        flat = self.round_flat.get(b.index)
        if flat is not None:
            return flat
        for i in b.members:  # a result of an earlier round still in .grad (no zero_grad) keeps its buffer
            self._forget_replaced(i)
        old = self.buffers.get(b.index)
        free = not any(i in self.carry or i in self.installed for i in b.members)
        if old is not None and free and (device is None or old.data.device == device):
            flat = old
        else:
            flat = jobs.buffer_of(b, device or torch.device("cpu"), jobs.shapes_of(b, self.round_env))
        self.round_flat[b.index] = flat
        return flat

    def _forget_replaced(self, i: int) -> None:
        """After zero_grad() (or the user's own .grad), an earlier round's result is no one's gradient now."""
        if i in self.installed and self.params[i].param.grad is not self.installed[i]:
            del self.installed[i]

    def _launch(self, b: Bucket) -> None:
        grads = []
        for i in b.members:
            self._forget_replaced(i)
            g = self.params[i].param.grad
            if g is not None and g is self.installed.get(i):
                # reduced in an earlier round and not touched since: nothing new from this rank
                self.carry[i] = self.installed.pop(i)
                g = None
            grads.append(g)
        mine = jobs.contribution(b, grads, self.layouts, jobs.round_code(self.steps, self.rounds))
        flat: jobs.Flat | None = None
        copied = frozenset[int]()
        if b.fast:
            flat = self._round_buffer(b, next((g.device for g in grads if g is not None), None))
            copied = frozenset(k for k, i in enumerate(b.members) if i in self.copied)
        work = jobs.start(b, mine, self.round_env, self.params, flat, copied)
        self.works.append((b, work))
        self.launched += 1

    def _end_of_backward(self) -> None:
        with self.lock:
            t = tracer()
            if t is not None:
                t.complete("backward", "backward", self.round_start, time.perf_counter())
            self._finish_round()

    def _finish_round(self) -> None:
        """Launch what is left, wait, put the results in ``.grad``; the first round reduces by
        ``ReplicatedOptimizer.aggregate`` and lays the buckets out."""
        try:
            if self.buckets is None:
                codes, nonfinite = self.rep.aggregate_deferred()
                self.nonfinite = self.nonfinite or nonfinite
                for i, p in enumerate(self.params):
                    if p.param.grad is not None:
                        self.installed[i] = p.param.grad
                self._agree_layout(default_order(self.first_order, len(self.params)), codes)
                return
            while self.launched < len(self.buckets):
                self._launch(self.buckets[self.launched])
            self._install()
        finally:
            self.in_round = False
            self.rounds += 1

    def _install(self) -> None:
        error: BaseException | None = None
        for b, work in self.works:
            try:
                reduced = work.wait()
            except BaseException as e:  # wait for every bucket (the queue stays in step), then raise the first
                error = error or e
                continue
            out = reduced.grads
            self.nonfinite = self.nonfinite or reduced.nonfinite
            if reduced.buffer is not None and any(r is not None for r in out):
                self.buffers[b.index] = reduced.buffer  # the results view it: reused once no gradient holds them
            for i, r in zip(b.members, out, strict=True):
                kept = self.carry.pop(i, None)
                g = r if kept is None else kept if r is None else kept + r
                self.params[i].param.grad = g
                if g is not None:
                    self.installed[i] = g
        self.works = []
        self.carry.clear()
        if error is not None:
            raise error

    def finish(self) -> None:
        """Before ``step()``/``synchronize()``: a rank that ran no backward round since the last step runs one
        now (with what its gradients hold, e.g. ``no_sync()`` accumulations), so every rank reduces alike."""
        with self.lock:
            if self.rounds == 0:
                self._begin_round()
                if self.buckets is None and self.loaded is not None:
                    self._agree_layout(*self.loaded)
                self._finish_round()

    def stepped(self) -> None:
        self.rounds = 0
        self.steps += 1

    def layout_state(self) -> dict[str, list[int]] | None:
        """The agreed layout, for a checkpoint: a run resumed from it reduces in the same buckets from its
        first step, so it gives the same bits as the run it resumes (a first round laid out afresh would sum in
        another order). Loaded from a checkpoint and not yet used: the loaded layout, so that a checkpoint saved
        before the first round keeps it."""
        if self.buckets is None:
            if self.loaded is None:
                return None
            order, layouts = self.loaded
            return {"order": list(order), "layouts": list(layouts)}
        return {"order": list(self.order), "layouts": list(self.layouts)}

    def load_layout(self, state: dict[str, list[int]]) -> None:
        n = len(self.params)
        order, layouts = list(state["order"]), list(state["layouts"])
        if sorted(order) != list(range(n)) or len(layouts) != n:
            raise ValueError(
                f"the checkpoint's bucket layout is for {len(layouts)} parameters, this optimizer has {n}"
            )
        self.loaded = (order, layouts)

    # --- the layout, agreed once --------------------------------------------------------------------------------
    def _agree_layout(self, first: list[int], codes: list[int]) -> None:
        """Rank 0's order (``first``: its first round's, or its checkpoint's) and a fingerprint of every
        parameter (name, shape, dtype, placement kind), compared across ranks; then the buckets. Collective, in
        the caller's group order; one record in the log (op ``AGREE``, phases "order" and "fingerprints")."""
        env = self.rep.env
        order = torch.tensor(first, dtype=torch.int64)
        keys = torch.tensor([_fingerprint(p, self.rep.plan[p.name]) for p in self.params], dtype=torch.int64)
        P = dist.get_world_size(env.group)
        table = [torch.empty_like(keys) for _ in range(P)]

        def agree() -> None:
            t0 = time.perf_counter()
            meta = Comm(env.group, env.timeout).meta
            meta.op = "DistributedOptimizer: bucket layout"
            with meta.phase("order"):
                meta.run_collective("bucket order", dist.broadcast, order, group_src=0)
            meta.count_broadcast(order.numel() * order.element_size(), 0)
            with meta.phase("fingerprints"):
                meta.all_gather_equal("parameter fingerprints", table, keys)
            meta.count_ring_allgather(keys.numel() * keys.element_size())
            if env.log is not None:
                n = order.numel() + keys.numel()
                env.log.append(meta.record(AGREE, "gloo", t0, dim=n, nnz_in=n, nnz_out=n))

        submit(env.group, agree, False)
        stacked = torch.stack(table)
        differ = torch.nonzero((stacked != stacked[0]).any(0))
        if differ.numel():
            j = int(differ[0])
            r = int(torch.nonzero(stacked[:, j] != stacked[0, j])[0])
            raise ValueError(
                f"DistributedOptimizer: the ranks wrap different parameters: parameter {j} (in param_groups "
                f"order) differs between rank 0 and rank {r} in its name, shape, dtype or placement; every rank "
                "must wrap the same parameters in the same order"
            )
        self.layouts, self.order = codes, order.tolist()
        self.buckets = lay_out(self.params, self.rep.plan, codes, self.order, cap_bytes=self.cap_bytes)
        self.bucket_of = {i: b for b in self.buckets for i in b.members}
        self.member_of = {i: k for b in self.buckets for k, i in enumerate(b.members)}
        self._reset_pending()
        red = self.round_env.reduce
        if any(b.grouped for b in self.buckets) and any(b.fast for b in self.buckets):
            # the sparse lane's two groups: every rank lays out the same buckets, so every rank makes them
            lane = (side_group(env.group), dataclasses.replace(red, group=side_group(env.group)))
            self.round_env = dataclasses.replace(self.round_env, sparse_lane=lane)
        if any(b.fast and not b.local for b in self.buckets):  # the fast buckets' own group (jobs.RoundEnv)
            direct = dataclasses.replace(red, group=side_group(env.group))
            self.round_env = dataclasses.replace(self.round_env, direct=direct)


def _fingerprint(p: NamedParam, placement: Placement) -> int:
    """A parameter's name, shape, dtype and placement kind, as the ranks compare them (a shard's shape differs
    across ranks by design: not compared)."""
    shape = tuple(p.param.shape) if placement.replicated else "shard"
    return text_key(f"{p.name}|{shape}|{p.param.dtype}|{placement.kind}")
