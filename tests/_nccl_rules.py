"""NCCL's rules on a gloo group: the proof, without a GPU, that sparsync asks nothing of NCCL that it refuses.

``NcclRules(group)`` (a context manager, in every rank of a worker) tells sparsync to run ``group``'s payload
under NCCL's rules (``sparsync.collectives.transport.use_nccl_rules``, metadata on a gloo side group) and patches
``torch.distributed`` in this process so that every call on ``group`` is recorded and refused (RuntimeError
naming the rule) when NCCL would refuse it:
- sparse tensors anywhere;
- reductions NCCL lacks (BOR, BAND, BXOR; NCCL has SUM, PRODUCT, MIN, MAX, AVG, PREMUL_SUM);
- gathers of unequal sizes (``all_gather`` lists, ``all_gather_into_tensor``, ``reduce_scatter_tensor``);
- object collectives (pickles through host memory: never on the payload path);
- a receive posted for other than the exact bytes its matching send carries (NCCL's send/recv must match:
  gloo fills a prefix of a longer receive, NCCL does not), checked through the rendezvous store: each send
  announces its size under a key numbered per (sender, receiver) pair, the matching receive reads it;
- ``isend``/``irecv`` outside ``batch_isend_irecv`` (on NCCL a receive posted alone blocks the send behind it
  on the pair's stream: exchanges must be batched).
Calls on other groups (the metadata side group) pass through unchecked.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from _dist_patch import DistPatch
from torch.distributed import distributed_c10d as c10d

from sparsync.collectives.group import group_state
from sparsync.collectives.transport import use_nccl_rules

NCCL_OPS = {dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX, dist.ReduceOp.AVG}
OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "scatter_object_list", "gather_object")
CHECKED = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
    "reduce_scatter_single", "all_to_all_single", "all_to_all", "broadcast", "reduce", "gather", "scatter",
    "barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv", *OBJECT_COLLECTIVES,
)  # fmt: skip


class RefusedError(RuntimeError):
    """A call NCCL would refuse."""


class NcclRules(DistPatch):
    def __init__(self, group: dist.ProcessGroup | None = None, *, wait: float = 60.0) -> None:
        super().__init__()
        world = dist.group.WORLD
        assert isinstance(world, dist.ProcessGroup)
        self.group = group if group is not None else world
        self.wait = timedelta(seconds=wait)
        self.calls: Counter[str] = Counter()
        self.refused: list[str] = []
        self.store = c10d._get_default_store()
        self.rank = dist.get_rank()
        self.sent: Counter[int] = Counter()  # messages sent to each global rank on the group
        self.received: Counter[int] = Counter()
        # The metadata side group: gloo, the same ranks (collective: every rank constructs NcclRules).
        ranks = dist.get_process_group_ranks(self.group)
        self.meta = dist.new_group(ranks, backend="gloo")
        # sparsync's background group of ``group`` (``launch`` makes the world's at start) under the same rules,
        # its metadata on a side group of its own
        self.background = group_state(self.group).background
        self.background_meta = dist.new_group(ranks, backend="gloo") if self.background is not None else None

    # --- installation ---------------------------------------------------------------------------------------
    def __enter__(self) -> NcclRules:
        use_nccl_rules(self.group, self.meta)
        if self.background is not None and self.background_meta is not None:
            use_nccl_rules(self.background, self.background_meta)
        self._patch(CHECKED)
        return self

    def summary(self) -> dict[str, Any]:
        return {"calls": dict(self.calls), "refused": list(self.refused)}

    # --- checks ---------------------------------------------------------------------------------------------
    def _ours(self, group: object) -> bool:
        g = group if group is not None else dist.group.WORLD
        return g is self.group or g is group_state(self.group).background

    def _refuse(self, name: str, why: str) -> None:
        msg = f"NCCL would refuse {name}: {why}"
        self.refused.append(msg)
        raise RefusedError(msg)

    def _tensors(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor):
                out.append(a)
            elif isinstance(a, list | tuple):
                out.extend(x for x in a if isinstance(x, torch.Tensor))
        return out

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def checked(*args: Any, **kwargs: Any) -> Any:
            if name == "batch_isend_irecv":
                ops = args[0] if args else kwargs["p2p_op_list"]
                if ops and self._ours(ops[0].group):
                    self.calls[name] += 1
                    self._check_batch(ops)
                return fn(*args, **kwargs)
            if not self._ours(kwargs.get("group")):
                return fn(*args, **kwargs)
            self.calls[name] += 1
            self._check(name, args, kwargs)
            if name in ("send", "recv"):
                tensor = args[0] if args else kwargs["tensor"]
                self._match_sizes([(name == "send", tensor, self._peer(name, kwargs))])
            return fn(*args, **kwargs)

        return checked

    def _check(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        for t in self._tensors(args, kwargs):
            if t.is_sparse:
                self._refuse(name, f"a sparse tensor of shape {tuple(t.shape)}")
        if name in OBJECT_COLLECTIVES:
            self._refuse(name, "an object collective on the payload group")
        if name in ("isend", "irecv"):
            self._refuse(name, "a p2p transfer outside batch_isend_irecv")
        if name == "all_reduce":
            op = kwargs.get("op", args[1] if len(args) > 1 else dist.ReduceOp.SUM)
            if op not in NCCL_OPS:
                self._refuse(name, f"reduction {op}")
        if name == "all_gather":
            outs, inp = args[0], args[1]
            sizes = sorted({t.numel() for t in outs} | {inp.numel()})
            if len(sizes) > 1:
                self._refuse(name, f"unequal sizes {sizes}")
        if name in ("all_gather_into_tensor", "all_gather_single"):
            out, inp = args[0], args[1]
            if out.numel() != inp.numel() * dist.get_world_size(self.group):
                self._refuse(name, f"output of {out.numel()} for inputs of {inp.numel()}")
        if name in ("reduce_scatter_tensor", "reduce_scatter_single"):
            out, inp = args[0], args[1]
            if inp.numel() != out.numel() * dist.get_world_size(self.group):
                self._refuse(name, f"input of {inp.numel()} for outputs of {out.numel()}")

    def _peer(self, name: str, kwargs: dict[str, Any]) -> int:
        key = "group_dst" if name == "send" else "group_src"
        if key in kwargs:
            return dist.get_global_rank(self.group, kwargs[key])
        peer = kwargs.get("dst" if name == "send" else "src")
        if peer is None:
            self._refuse(name, "a receive from any source")
        return int(peer)

    def _check_batch(self, ops: list[Any]) -> None:
        transfers = []
        for op in ops:
            if op.tensor.is_sparse:
                self._refuse("batch_isend_irecv", "a sparse tensor")
            transfers.append((op.op is c10d.isend, op.tensor, int(op.peer)))
        self._match_sizes(transfers)

    def _match_sizes(self, transfers: list[tuple[bool, torch.Tensor, int]]) -> None:
        """Announce every send's size, then read every receive's: all announcements first, so that two ranks
        exchanging in one batch never wait for each other."""
        gid = self.group.group_name
        for is_send, t, peer in transfers:
            if is_send:
                k = self.sent[peer]
                self.sent[peer] += 1
                self.store.set(f"nccl_rules/{gid}/{self.rank}->{peer}/{k}", str(t.numel() * t.element_size()))
        for is_send, t, peer in transfers:
            if is_send:
                continue
            k = self.received[peer]
            self.received[peer] += 1
            key = f"nccl_rules/{gid}/{peer}->{self.rank}/{k}"
            try:
                self.store.wait([key], self.wait)
            except RuntimeError:
                self._refuse("recv", f"no send from rank {peer} matches receive {k} ({t.numel()} elements)")
            sent = int(self.store.get(key))
            self.store.delete_key(key)
            posted = t.numel() * t.element_size()
            if sent != posted:
                self._refuse("recv", f"a receive of {posted} bytes for a send of {sent} from rank {peer}")


def merged_under_nccl_rules(rank: int, worker: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """``worker(rank, *args)``'s dict with the world group under NCCL's rules, the rules' summary added under
    "nccl_rules" (a ``launch`` target, for workers that return a dict of results)."""
    with NcclRules() as rules:
        out = worker(rank, *args)
    out["nccl_rules"] = rules.summary()
    return out


def check_run(results: list[dict[str, Any]], at_least: dict[str | tuple[str, ...], int]) -> None:
    """The ranks' results of a ``merged_under_nccl_rules`` run: no call NCCL would refuse and, beyond one rank,
    each call of ``at_least`` made more than the given number of times (a tuple: those calls together)."""
    for rank, r in enumerate(results):
        rules = r["nccl_rules"]
        assert rules["refused"] == [], f"rank {rank}: {rules['refused'][:5]}"
        if len(results) > 1:
            calls = rules["calls"]
            for names, n in at_least.items():
                made = sum(calls.get(c, 0) for c in ((names,) if isinstance(names, str) else names))
                assert made > n, (names, calls)


def under_nccl_rules(rank: int, worker: Callable[..., Any], *args: Any) -> dict[str, Any]:
    """``worker(rank, *args)`` with the world group under NCCL's rules (a ``launch`` target: pass the worker and
    its arguments). Returns ``{"result": ..., "nccl_rules": {"calls": ..., "refused": [...]}}``."""
    with NcclRules() as rules:
        out = worker(rank, *args)
    return {"result": out, "nccl_rules": rules.summary()}


def check_clean(summaries: list[dict[str, Any]], *, min_batches: int = 1) -> None:
    """Assert that no rank made a call NCCL would refuse and that (beyond one rank) the payload did travel
    under the rules (``min_batches`` batched p2p transfers at least, or collectives)."""
    for rank, s in enumerate(summaries):
        assert s["refused"] == [], f"rank {rank}: {s['refused'][:5]}"
    if len(summaries) > 1:
        assert all(sum(s["calls"].values()) >= min_batches for s in summaries), [s["calls"] for s in summaries]
