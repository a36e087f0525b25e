"""Table groups, the layout of fbgemm's table-batched embedding (TBE: one weight, ``weights_offsets``): the
sharded tables of one width and dtype held as one flat tensor per rank, each table's shard a slice of it, so a
step reads, sends and sums the rows of all the group's tables in one op each, however many tables there are;
and the optimizers that update a group's rows in place at the end of backward (``Fused``, last below).

The key space. Table t of the group gets the keys ``base_t + id`` for its ids, ``base_t = P · first_t``
with ``first_t`` the sum of ``ceil(R_s / P)`` over the tables s before it. A key's owner is then
``key mod P`` = ``id mod P`` (the table's own stride ownership, ``Ownership``) and its row in the owner's flat
tensor ``key div P`` = ``first_t + id div P``: the group is one stride-owned table of ``P · Σ ceil(R_t / P)``
rows, and one modulo and one division route every key of every table. A rank that owns fewer than
``ceil(R_t / P)`` rows of table t holds one row past its last (zero, never looked up: the ids are checked
against ``R_t``, so no key reaches it). A replicated group (``replicated``: the tables placed ``"replicated"``,
with a fused optimizer) is a group of one part: every rank holds it whole.

The tables' parameters stay the modules' own (``nn.Parameter`` per table, named and saved as unsharded): each is a
view of its slice of the flat tensor (``param_view``), so an optimizer's update of a table, ``load_state_dict``
and the exchange's reads all see the same storage. ``aliased`` says whether that still holds: a conversion that
replaces a parameter's storage (``model.double()`` after ``sparsync.shard``) breaks it, and the exchange then
refuses rather than read stale rows.

Ownership (``Ownership``): the stride partition, row r of a table on rank r mod P at local row r div P.
Why stride and not contiguous ranges: a recommender's or a language model's ids are Zipf-skewed, and the hot
ids of most vocabularies sit at the low end (ids assigned by frequency, or by first appearance, which favours
frequent ids). Ranges would give rank 0 nearly every hot row, and with them most of every step's requests,
rows and gradient rows: its links and its optimizer would bound the step. Stride puts consecutive ids on
different ranks, so the hot head is dealt round-robin; a hashed or permuted vocabulary is spread by the
permutation itself. It is the partition the split allreduce algorithms already use for row-sparse streams, for
the same reason (``collectives/partition.py``; Zen, OSDI'25), and it needs no table of its own: any rank maps any
id to its owner with one modulo, so the routing of a lookup costs no metadata.

The shard of rank j holds ``counts()[j]`` rows (ceil or floor of R/P): the ranks' shards differ by at most one
row. Whole tables move between the ranks' shards and one full table (initialisation from rank 0, checkpoints)
through ``to_blocks`` / ``from_blocks``: P equal blocks of ``chunk`` rows, the last rows of short shards
padded, as gloo's scatter and gather want them.

Whole tables in and out of the ranks' shards (``scatter_rows``, ``gather_rows``): rank 0's table dealt to its
owners (``sparsync.shard`` initialises every shard from it, so training starts where the replicated path would),
and the shards gathered back into one table on rank 0 (``state_dict``). Each moves the table once over the
group (a scatter, a gather), never P copies of it.

A table too large for one rank is built on the meta device (``nn.EmbeddingBag(rows, D, device="meta")``): no
rank ever holds it whole; each makes its own rows (``init_rows``) from a seed, the same rows whatever P is.

The optimizers applied to a group's rows at the end of backward, as fbgemm's table-batched embedding does (its
backward fused with the update; torchrec's ``fused_params``): ``sparsync.shard(model, optimizer=SGD(lr=0.1))``.
The owner sums each row's gradient over the ranks once per group (``rows._owner_sum``: one sort); the update
then runs on the group's flat tensor in place, a few ops for all of the group's tables, and no gradient is left
on the tables' parameters (``.grad`` stays None, so the optimizer of the rest of the model skips them:
``modules.dense_parameters(model)`` leaves them out). The gradient is the mean over the ranks (the sum divided
by P), as ``DistributedOptimizer``'s default ``op="mean"`` gives a replicated table, so an update equals the one
torch's optimizer makes from that gradient:

- ``SGD(lr)``: ``w_r -= lr · g_r`` (``torch.optim.SGD`` without momentum, which sparse gradients do not take);
- ``Adagrad(lr, eps)``: ``s_r += g_r²``, ``w_r -= lr · g_r / (sqrt(s_r) + eps)`` (``torch.optim.Adagrad``'s
  sparse path, ``lr_decay`` 0, ``initial_accumulator_value`` 0);
- ``RowwiseAdagrad(lr, eps)``: one accumulator per row, ``m_r += mean(g_r²)``,
  ``w_r -= lr · g_r / (sqrt(m_r) + eps)`` (fbgemm's exact row-wise Adagrad: D times less state);
- ``Adam(lr, betas, eps)``: lazy Adam, ``torch.optim.SparseAdam``: the moments of the rows in the step only, the
  bias corrections by each table's step count (a table counts the steps it was looked up in).

Only the rows a step looked up (on any rank) change; the state lives beside the group's flat tensor, per row
(``Fused.state``), as fbgemm's TBE keeps its momentum beside its weights. The row reads and writes and the
SGD/Adagrad steps run in C where built (``kernels``), with the same bits as the torch ops (``index_put_`` with
accumulate, each element ``t + v``, as torch's optimizers' sparse ``add_`` computes it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from sparsync.collectives.partition import Partition
from sparsync.sharding import kernels as native


@dataclass(frozen=True)
class Ownership:
    """The stride partition of ``rows`` rows over ``parts`` ranks (module doc)."""

    rows: int
    parts: int

    def __post_init__(self) -> None:
        if self.rows < 0 or self.parts < 1:
            raise ValueError(
                f"an ownership needs rows >= 0 and parts >= 1, got rows={self.rows}, parts={self.parts}"
            )

    @property
    def partition(self) -> Partition:
        return Partition("stride", self.rows, self.parts)

    def counts(self) -> list[int]:
        """Rows owned by each rank."""
        return self.partition.counts()

    @property
    def chunk(self) -> int:
        """Rows of the largest shard: the block size of ``to_blocks`` / ``from_blocks``."""
        return -(-self.rows // self.parts)

    def owner(self, ids: torch.Tensor) -> torch.Tensor:
        """The owning rank of each id (int64)."""
        return ids % self.parts

    def local(self, ids: torch.Tensor) -> torch.Tensor:
        """Each id's row in its owner's shard (int64)."""
        return ids // self.parts

    def global_rows(self, rank: int) -> torch.Tensor:
        """The table rows rank ``rank`` owns, in its shard's order."""
        return torch.arange(min(rank, self.rows), self.rows, self.parts, dtype=torch.int64)  # none past the end

    def held(self, rank: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(local rows, table rows) of the rows of ``[lo, hi)`` that rank ``rank`` owns, ascending."""
        P = self.parts
        first, last = -(-(lo - rank) // P), -(-(min(hi, self.rows) - rank) // P)
        pos = torch.arange(max(first, 0), max(last, 0), dtype=torch.int64)
        return pos, pos * P + rank

    def to_blocks(self, table: torch.Tensor) -> torch.Tensor:
        """A whole table ``[rows, D]`` as ``[parts, chunk, D]``: block j holds rank j's shard, zero-padded."""
        P, c = self.parts, self.chunk
        padded = torch.zeros(c * P, *table.shape[1:], dtype=table.dtype, device=table.device)
        padded[: self.rows] = table
        # row m·P + j is rank j's local row m: [chunk, P, D] transposed
        return padded.view(c, P, *table.shape[1:]).transpose(0, 1).contiguous()

    def from_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        """The whole table ``[rows, D]`` from the ranks' padded shards ``[parts, chunk, D]`` (``to_blocks``'s
        inverse)."""
        P, c = self.parts, self.chunk
        return blocks.transpose(0, 1).reshape(c * P, *blocks.shape[2:])[: self.rows].clone()


@dataclass(frozen=True)
class Slot:
    """Table t's place in its group (module doc)."""

    index: int  # t, the table's position in the group
    base: int  # its first key, P · first
    first: int  # its first row in each rank's flat tensor
    rows: int  # R_t, the table's rows
    owned: int  # the rows of it this rank owns


class TableGroup:
    """The flat tensor of a group of sharded tables (module doc): ``rows[t]`` rows in table t, ``dim`` columns,
    ``dtype``, over ``parts`` ranks, as rank ``rank`` holds it."""

    def __init__(self, rows: Sequence[int], dim: int, dtype: torch.dtype, parts: int, rank: int) -> None:
        chunks = [-(-int(r) // parts) for r in rows]
        firsts = [sum(chunks[:t]) for t in range(len(rows))]
        self.dim, self.dtype, self.parts, self.rank = dim, dtype, parts, rank
        self.slots = tuple(
            Slot(t, parts * f, f, int(r), Ownership(int(r), parts).counts()[rank])
            for t, (f, r) in enumerate(zip(firsts, rows, strict=True))
        )
        self.ownership = Ownership(parts * sum(chunks), parts)  # the key space's: owner = key mod P
        self.flat = torch.zeros(sum(chunks), dim, dtype=dtype)
        self.params: list[nn.Parameter] = []
        self.padding_rows = torch.empty(0, dtype=torch.int64)  # the tables' padding rows this rank holds
        self.fused: Fused | None = None  # the optimizer applied in backward (``Fused``), if the tables have one
        self.ranks = parts  # the ranks whose gradients the owners' sums add up (``Fused``'s scale is 1/ranks)
        # a replicated group's sum of its gradient rows over the ranks that hold it (``replicated``), None for a
        # sharded one: (rows, values) -> (rows, values), both ascending rows
        self.across: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None

    def param_view(self, slot: Slot, rows: torch.Tensor, requires_grad: bool, padding: int | None) -> nn.Parameter:
        """Table ``slot``'s parameter: ``rows`` (its shard, ``[owned, dim]``) copied into its slice of the flat
        tensor, and a parameter viewing that slice; ``padding``: the table's padding_idx. Mutates the flat tensor;
        records the parameter and the padding row."""
        view = self.flat[slot.first : slot.first + slot.owned]
        view.copy_(rows)
        if padding is not None and padding % self.parts == self.rank:
            row = torch.tensor([slot.first + padding // self.parts])
            self.padding_rows = torch.cat([self.padding_rows, row])
        param = nn.Parameter(view, requires_grad=requires_grad)
        self.params.append(param)
        return param

    def aliased(self) -> str | None:
        """None while every table's parameter views its slice of the flat tensor; else which does not (the
        addresses compared as numbers: no tensor op)."""
        start, row = self.flat.data_ptr(), self.flat.stride(0) * self.flat.element_size()
        for slot, p in zip(self.slots, self.params, strict=True):
            if slot.owned and p.data_ptr() != start + slot.first * row:
                return (
                    f"table {slot.index} of the group of {len(self.slots)} {self.placed} tables of width "
                    f"{self.dim}: its weight no longer views the group's storage (its parameter was replaced "
                    "after sparsync.shard, e.g. by model.to(dtype) or .data = ...); convert the model before "
                    "sharding it"
                )
        return None

    @property
    def placed(self) -> str:
        """``"replicated"`` for a replicated group (``across`` set), else ``"sharded"``."""
        return "sharded" if self.across is None else "replicated"

    def local_rows(self, slot: Slot) -> slice:
        """Table ``slot``'s rows in the flat tensor."""
        return slice(slot.first, slot.first + slot.owned)


def group_key(dim: int, dtype: torch.dtype) -> tuple[int, str]:
    """The tables that share a group: one width, one dtype."""
    return dim, str(dtype)


def scatter_rows(table: torch.Tensor, ownership: Ownership, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's rows of group rank 0's ``table`` ``[rows, D]`` (the other ranks' ``table`` gives only the shape
    and dtype). Collective over ``group``."""
    rank, P = dist.get_rank(group), dist.get_world_size(group)
    if P == 1:
        return table.detach().clone()
    D = table.shape[1:]
    mine = torch.empty(ownership.chunk, *D, dtype=table.dtype)
    blocks = list(ownership.to_blocks(table.detach()).unbind(0)) if rank == 0 else None
    dist.scatter(mine, blocks, group=group, group_src=0)
    return mine[: ownership.counts()[rank]].clone()


def gather_rows(shard: torch.Tensor, ownership: Ownership, group: dist.ProcessGroup) -> torch.Tensor | None:
    """The whole table ``[rows, D]`` from every rank's ``shard``, on group rank 0; None on the others.
    Collective over ``group``."""
    rank, P = dist.get_rank(group), dist.get_world_size(group)
    if P == 1:
        return shard.detach().clone()
    padded = torch.zeros(ownership.chunk, *shard.shape[1:], dtype=shard.dtype)
    padded[: shard.shape[0]] = shard.detach()
    parts = [torch.empty_like(padded) for _ in range(P)] if rank == 0 else None
    dist.gather(padded, parts, group=group, group_dst=0)
    return ownership.from_blocks(torch.stack(parts)) if parts is not None else None


INIT_BLOCK = 1 << 16  # rows drawn per generator seed by ``init_rows``


def init_rows(
    ownership: Ownership, rank: int, dim: int, dtype: torch.dtype, seed: int, padding: int | None
) -> torch.Tensor:
    """This rank's rows of a table that exists nowhere whole: N(0, 1), as ``nn.Embedding`` and
    ``nn.EmbeddingBag`` initialise theirs (the distribution, not torch's bits), ``padding``'s row zero. Row r is
    drawn in block r div ``INIT_BLOCK``, from a generator seeded by (``seed``, block), so a table's values depend
    on the seed alone, not on P: a checkpoint of it loads at any other P, and one process that calls this with
    P = 1 makes the whole table (the reference the tests compare with). Each rank draws every block and keeps
    its rows (stride ownership), so memory stays one block beside the shard; time is that of drawing the whole
    table once."""
    P = ownership.parts
    out = torch.empty(ownership.counts()[rank], dim, dtype=dtype)
    g = torch.Generator()
    for block, start in enumerate(range(0, ownership.rows, INIT_BLOCK)):
        n = min(INIT_BLOCK, ownership.rows - start)
        g.manual_seed(seed * 1_000_003 + block)
        values = torch.randn(n, dim, generator=g, dtype=torch.float32).to(dtype)
        first = (rank - start) % P  # the first row of the block that this rank owns, within the block
        mine = values[first::P]
        at = (start + first) // P  # its local row
        out[at : at + mine.shape[0]] = mine
    if padding is not None and int(ownership.owner(torch.tensor(padding))) == rank:
        out[int(ownership.local(torch.tensor(padding)))] = 0
    return out


@dataclass
class Fused:
    """What the fused optimizers share: the learning rate, and the divisor of the owners' sums (P: the mean)."""

    lr: float
    # the update's kernels: "auto" (C where built, else torch), "c" (raise if not built), "torch"; the same bits
    kernels: str = field(default="auto", kw_only=True)
    scale: float = field(default=1.0, init=False)  # 1/P, set by ``sparsync.shard``
    state: dict[str, torch.Tensor] = field(default_factory=dict, init=False)
    per_table: ClassVar[tuple[str, ...]] = ()  # the state held per table (one entry per slot), not per row

    def __post_init__(self) -> None:
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"{type(self).__name__}: lr must be a positive finite number, got {self.lr}")
        native.check(type(self).__name__, self.kernels)

    def bind(self, group: TableGroup) -> Fused:
        """A copy of this optimizer for ``group``, its state made (zeros) and its scale 1/P (``group.ranks``)."""
        out = type(self)(**{k: getattr(self, k) for k in self._params()}, kernels=self.kernels)
        out.scale = 1.0 / group.ranks
        out.init(group)
        return out

    def _params(self) -> Iterator[str]:
        """The hyperparameters (``kernels`` is not one: it does not change the result)."""
        return (f.name for f in fields(self) if f.init and f.name != "kernels")

    def init(self, group: TableGroup) -> None:
        """Make the per-row state."""

    def table_state(self, slot: Slot) -> dict[str, torch.Tensor]:
        """Views of table ``slot``'s state: each per-row tensor's rows of the table (``[owned, ...]``, in the
        shard's order) and each per-table entry (0-dim). Writing into them writes the state."""
        return {k: v[slot.index] if k in self.per_table else v[slot.first : slot.first + slot.owned]
                for k, v in self.state.items()}  # fmt: skip

    def hyperparameters(self) -> dict[str, Any]:
        """The hyperparameters by name (``lr``, ``eps``, ``betas``: what the constructor takes but ``kernels``)."""
        return {k: getattr(self, k) for k in self._params()}

    def set_hyperparameters(self, params: dict[str, Any]) -> None:
        """Set the hyperparameters ``params`` (``hyperparameters()``'s). Mutates this optimizer."""
        for k, value in params.items():
            setattr(self, k, tuple(value) if isinstance(value, list) else value)

    def state_dict(self) -> dict[str, Any]:
        """This rank's state (copies, as the group's flat tensor lays it out), the hyperparameters and the kind
        (the class name)."""
        return {"kind": type(self).__name__, "params": self.hyperparameters(),
                "state": {k: v.clone() for k, v in self.state.items()}}  # fmt: skip

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict`` (``state_dict()`` of the same group at the same P) into the state in place and the
        hyperparameters; ValueError naming another kind of optimizer, or a missing or misshapen entry. Mutates
        the state."""
        kind = state_dict.get("kind", type(self).__name__)
        if kind != type(self).__name__:
            raise ValueError(f"{type(self).__name__}: the state dict is of another optimizer, {kind}")
        state = state_dict["state"]
        for k, v in self.state.items():
            if k not in state or tuple(state[k].shape) != tuple(v.shape):
                got = tuple(state[k].shape) if k in state else "nothing"
                raise ValueError(f"{type(self).__name__}: state {k!r} must have shape {tuple(v.shape)}, got {got}")
        for k, v in self.state.items():
            v.copy_(state[k])
        self.set_hyperparameters(state_dict["params"])

    def apply(self, group: TableGroup, rows: torch.Tensor, values: torch.Tensor, slots: list[Slot]) -> None:
        """Update ``group``'s rows ``rows`` (distinct, ascending) with the summed gradient rows ``values``; the
        tables ``slots`` were looked up this step. Mutates the group's flat tensor and the state."""
        with torch.no_grad():
            self.update(group, rows, values * self.scale if self.scale != 1.0 else values, slots)

    def update(self, group: TableGroup, rows: torch.Tensor, g: torch.Tensor, slots: list[Slot]) -> None:
        raise NotImplementedError


@dataclass
class SGD(Fused):
    """``w_r -= lr · g_r`` (module doc)."""

    def update(self, group: TableGroup, rows: torch.Tensor, g: torch.Tensor, slots: list[Slot]) -> None:
        native.step_rows(group.flat, rows, g, self.lr, kernels=self.kernels)


@dataclass
class Adagrad(Fused):
    """``torch.optim.Adagrad``'s sparse update, per element (module doc)."""

    eps: float = 1e-10

    def init(self, group: TableGroup) -> None:
        self.state["sum"] = torch.zeros_like(group.flat)

    def update(self, group: TableGroup, rows: torch.Tensor, g: torch.Tensor, slots: list[Slot]) -> None:
        total = self.state["sum"]
        native.add_rows(total, rows, g, self.kernels, squares=True)
        std = native.gather(total, rows, self.kernels).sqrt_().add_(self.eps)
        native.step_rows(group.flat, rows, g, self.lr, std, self.kernels)


@dataclass
class RowwiseAdagrad(Fused):
    """One accumulator per row (module doc)."""

    eps: float = 1e-10

    def init(self, group: TableGroup) -> None:
        self.state["sum"] = torch.zeros(group.flat.shape[0], dtype=group.flat.dtype)

    def update(self, group: TableGroup, rows: torch.Tensor, g: torch.Tensor, slots: list[Slot]) -> None:
        total = self.state["sum"]
        native.add_rows(total, rows, g.pow(2).mean(1), self.kernels)
        std = total.index_select(0, rows).sqrt_().add_(self.eps)
        native.step_rows(group.flat, rows, g, self.lr, std, self.kernels)


@dataclass
class Adam(Fused):
    """``torch.optim.SparseAdam`` (module doc)."""

    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    per_table: ClassVar[tuple[str, ...]] = ("step",)

    def init(self, group: TableGroup) -> None:
        self.state["exp_avg"] = torch.zeros_like(group.flat)
        self.state["exp_avg_sq"] = torch.zeros_like(group.flat)
        self.state["step"] = torch.zeros(len(group.slots), dtype=torch.int64)

    def update(self, group: TableGroup, rows: torch.Tensor, g: torch.Tensor, slots: list[Slot]) -> None:
        b1, b2 = self.betas
        avg, avg_sq, step = self.state["exp_avg"], self.state["exp_avg_sq"], self.state["step"]
        step[[s.index for s in slots]] += 1
        old = native.gather(avg, rows, self.kernels)
        avg_update = g.sub(old).mul_(1 - b1)
        native.add_rows(avg, rows, avg_update, self.kernels)
        old_sq = native.gather(avg_sq, rows, self.kernels)
        sq_update = g.pow(2).sub_(old_sq).mul_(1 - b2)
        native.add_rows(avg_sq, rows, sq_update, self.kernels)
        numer = avg_update.add_(old)
        denom = sq_update.add_(old_sq).sqrt_().add_(self.eps)
        sizes = torch.tensor([self._step_size(int(n)) for n in step.tolist()], dtype=g.dtype)
        per_row = sizes[_table_of(group, rows)]
        native.add_rows(group.flat, rows, numer.div_(denom) * (-per_row).unsqueeze(1), self.kernels)

    def _step_size(self, n: int) -> float:
        if n == 0:
            return 0.0
        b1, b2 = self.betas
        return self.lr * math.sqrt(1 - b2**n) / (1 - b1**n)


def _table_of(group: TableGroup, rows: torch.Tensor) -> torch.Tensor:
    """The table (slot index) of each of the group's flat rows."""
    firsts = torch.tensor([s.first for s in group.slots], dtype=rows.dtype)
    return torch.searchsorted(firsts, rows, right=True) - 1


OPTIMIZERS = (SGD, Adagrad, RowwiseAdagrad, Adam)
