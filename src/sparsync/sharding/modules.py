"""The sharded modules that stand in for ``nn.Embedding`` and ``nn.EmbeddingBag``: each rank holds the rows it
owns (``weight``: ``[rows owned, D]``, a parameter marked ``Sharded``, a view of its slice of the table group's
flat tensor, ``group``), and a forward registers its call with the model's ``Exchanger`` and returns a
``LazyLookup`` (``exchange``), pooled by torch's own functional on the rows gathered for it (``rows.pool``).
What they share with the replicated tables in groups (``replicated``) is ``GroupedTable``'s; the forwards are
``EmbeddingLookup``'s and ``BagLookup``'s.

A call's arguments are checked here, in Python, on the rank that makes it, and a bad call is not raised here but
handed to the exchange as a refusal, so that every rank raises it at once (``ids``): a negative id, an id beyond
the table, a tensor of the wrong dtype, and, for a bag, what torch's ``embedding_bag`` refuses (the input's
dimensions, offsets that do not start at 0, decrease or run past the input, ``per_sample_weights`` of another
shape or dtype or outside mode ``sum``), with the same words.

``state_dict()``: with ``state_dict="full"`` (the default) the whole table under ``<name>.weight`` on rank 0,
gathered (so every rank must call it, as FSDP's full state dict asks), nothing on the others; ``"local"``: each
rank its own shard; ``"sharded"``: each table as a ``DTensor`` of contiguous row blocks, for
``torch.distributed.checkpoint`` (``dcp``; collective). ``load_state_dict`` takes any of them: a whole table
``[rows, D]`` (saved at any number of ranks, or by the unsharded model) gives each rank its rows, a ``DTensor``
of row blocks (``dcp``, at this P) too; anything else loads as this rank's shard. Both copy into
the parameter in place, so it keeps viewing the group's flat tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from sparsync.placement import Placement
from sparsync.placement.sharded import mark
from sparsync.sharding import dcp
from sparsync.sharding.exchange import EAGER, Exchanger, LazyLookup
from sparsync.sharding.group import Ownership, Slot, TableGroup, gather_rows, init_rows, scatter_rows
from sparsync.sharding.rows import Call

STATE_DICT_LAYOUTS = ("full", "local", "sharded")
ID_DTYPES = (torch.int64, torch.int32)  # what torch's embeddings take


class GroupedTable(nn.Module):
    """What every table in a group shares, sharded (``ShardedTable``) or whole on every rank
    (``replicated.ReplicatedTable``): its rows a view of its group's flat tensor, its calls registered with its
    exchanger. Built by ``sparsync.shard`` from an unsharded module: collective, every rank at once. ``group``:
    the index of its group among ``exchanger.groups``; ``slot``: its place in it; ``placement``: marked on the
    weight (None: no mark)."""

    kind = "table"
    placed: ClassVar[str]  # the placement its description names

    def __init__(
        self,
        name: str,
        source: nn.Embedding | nn.EmbeddingBag,
        exchanger: Exchanger,
        at: tuple[int, Slot],
        placement: Placement | None,
        state_dict_layout: str,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if state_dict_layout not in STATE_DICT_LAYOUTS:
            raise ValueError(f"state_dict must be one of {STATE_DICT_LAYOUTS}, got {state_dict_layout!r}")
        self.table_name = name
        self.options_of(source)
        self.num_embeddings = int(source.num_embeddings)
        self.embedding_dim = int(source.embedding_dim)
        self.padding_idx: int | None = source.padding_idx
        self.exchanger = exchanger
        self.group_index, self.slot = at
        self.state_dict_layout = state_dict_layout
        self.dcp_block_rows = dcp.BLOCK_ROWS  # the "sharded" layout's window share (``dcp``)
        link = exchanger.link
        self.ownership = Ownership(self.num_embeddings, link.size)
        if source.weight.device.type == "meta":  # too large for one rank: each makes its own rows
            rows = init_rows(self.ownership, link.rank, self.embedding_dim, source.weight.dtype, seed,
                             self.padding_idx)  # fmt: skip
        else:
            rows = self.first_rows(source.weight)
        self.weight = self.group.param_view(self.slot, rows, source.weight.requires_grad, self.padding_idx)
        if placement is not None:
            mark(self.weight, placement)
        self._padding_key = None if self.padding_idx is None else self.slot.base + self.padding_idx
        self._description = (
            f"{self.table_name!r} ({self.placed} {self.kind}({self.num_embeddings}, {self.embedding_dim}, "
            f"{self.options()}), {self.weight.dtype})"
        )

    def first_rows(self, table: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``table``, the source module's weight, to start from."""
        raise NotImplementedError

    @property
    def group(self) -> TableGroup:
        return self.exchanger.groups[self.group_index]

    # --- its description ----------------------------------------------------------------------------------------
    def options_of(self, source: nn.Embedding | nn.EmbeddingBag) -> None:
        """Take the options of ``source`` a subclass keeps beside ``padding_idx`` (its description names them)."""
        del source

    def options(self) -> str:
        return f"padding_idx={self.padding_idx}"

    def describe(self) -> str:
        return self._description

    # --- one call -----------------------------------------------------------------------------------------------
    def checked_ids(self, input: Any) -> tuple[torch.Tensor, str | None]:
        """(the call's ids, flat int64 (the exchange adds the table's base in its group to all calls' ids at
        once, ``exchange``), or an empty tensor when refused; why it is refused, or None). The ids' range is
        checked for all of an exchange's calls at once (``exchange.out_of_range``), with the words this check
        would use."""
        if not isinstance(input, torch.Tensor):
            why = f"{self.describe()}: the input must be a tensor of ids, got {type(input).__name__}"
            return torch.empty(0, dtype=torch.int64), why
        if input.dtype not in ID_DTYPES:
            why = f"{self.describe()}: ids must be int64 or int32, got {input.dtype}"
            return torch.empty(0, dtype=torch.int64), why
        ids = input.reshape(-1)  # ids: no autograd (nothing to detach); the range: ``exchange``
        return (ids if input.dtype == torch.int64 else ids.to(torch.int64)), None

    def _call(self, input: Any, refusal: str | None, keys: torch.Tensor, **how: Any) -> LazyLookup:
        """Register this call with the exchanger: its keys, and how to pool it (``rows.Call``)."""
        shape = input.shape if refusal is None else torch.Size([0])
        call = Call(self.group_index, self.slot, self._description, refusal, keys, shape,
                    padding=self._padding_key, version=keys._version, **how)  # fmt: skip
        return self.exchanger.register(call)


class ShardedTable(GroupedTable):
    """What the two sharded modules share: the shard, its ownership, the state dict (module doc)."""

    placed = "sharded"

    def first_rows(self, table: torch.Tensor) -> torch.Tensor:
        """This rank's rows of group rank 0's ``table`` (``group.scatter_rows``). Collective."""
        return scatter_rows(table, self.ownership, self.exchanger.link.group)

    def extra_repr(self) -> str:
        rank, P = self.exchanger.link.rank, self.exchanger.link.size
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, {self.options()}, rows {rank}::{P} of the table on "
            f"rank {rank} of {P}"
        )

    # --- the state dict -----------------------------------------------------------------------------------------
    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        if self.state_dict_layout == "local":
            super()._save_to_state_dict(destination, prefix, keep_vars)
            return
        if self.state_dict_layout == "sharded":
            group = self.exchanger.link.group
            blocks = dcp.to_dtensor(self.weight, self.num_embeddings, group, block_rows=self.dcp_block_rows)
            destination[prefix + "weight"] = blocks
            return
        full = gather_rows(self.weight, self.ownership, self.exchanger.link.group)
        if full is not None:
            destination[prefix + "weight"] = full

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        key = prefix + "weight"
        given = state_dict.get(key)
        if isinstance(given, dcp.DTensor):
            self._load_blocks(given, key, error_msgs)
            return
        if isinstance(given, torch.Tensor) and tuple(given.shape) == (self.num_embeddings, self.embedding_dim):
            mine = given[self.ownership.global_rows(self.exchanger.link.rank)]
            state_dict = {**state_dict, key: mine}
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def _load_blocks(self, given: dcp.DTensor, key: str, error_msgs: list[str]) -> None:
        """Load a ``DTensor`` of row blocks (``dcp``) into the shard; a wrong shape or dtype is an error naming
        the table. Collective over the tables' group."""
        want = (self.num_embeddings, self.embedding_dim)
        if tuple(given.shape) != want or given.dtype != self.weight.dtype:
            error_msgs.append(
                f"{key}: {self.describe()} cannot load a table of shape {tuple(given.shape)} and dtype "
                f"{given.dtype}; it needs shape {want} and dtype {self.weight.dtype}"
            )
            return
        group = self.exchanger.link.group
        dcp.into_shard(given, self.weight.data, self.num_embeddings, group, block_rows=self.dcp_block_rows)


class EmbeddingLookup(GroupedTable):
    """``nn.Embedding``'s forward on a table in a group: ``forward(input)`` as torch's."""

    kind = "Embedding"

    @torch.compiler.disable(reason=EAGER)  # type: ignore[no-untyped-call, untyped-decorator]
    def forward(self, input: torch.Tensor) -> LazyLookup:
        keys, refusal = self.checked_ids(input)
        return self._call(input, refusal, keys, bag=False, mode="", offsets=None, last=False, weights=None)


class BagLookup(GroupedTable):
    """``nn.EmbeddingBag``'s forward (modes ``sum`` and ``mean``) on a table in a group:
    ``forward(input, offsets=None, per_sample_weights=None)`` as torch's."""

    kind = "EmbeddingBag"

    mode: str
    include_last_offset: bool

    def options_of(self, source: nn.Embedding | nn.EmbeddingBag) -> None:
        if not isinstance(source, nn.EmbeddingBag):
            raise TypeError(f"ShardedEmbeddingBag is built from an nn.EmbeddingBag, got {type(source).__name__}")
        self.mode = source.mode
        self.include_last_offset = source.include_last_offset

    def options(self) -> str:
        return (
            f"mode={self.mode!r}, padding_idx={self.padding_idx}, include_last_offset={self.include_last_offset}"
        )

    @torch.compiler.disable(reason=EAGER)  # type: ignore[no-untyped-call, untyped-decorator]
    def forward(
        self,
        input: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> LazyLookup:
        keys, refusal = self.checked_ids(input)
        single = False
        if refusal is None:
            refusal, single = self._refused(input, offsets, per_sample_weights)
        offsets64 = offsets.to(torch.int64) if refusal is None and offsets is not None else None
        psw = per_sample_weights if refusal is None else None
        how = {"offsets": offsets64, "last": self.include_last_offset, "weights": psw, "single": single}
        return self._call(input, refusal, keys if refusal is None else keys[:0], bag=True, mode=self.mode, **how)

    def _refused(
        self, input: torch.Tensor, offsets: torch.Tensor | None, weights: torch.Tensor | None
    ) -> tuple[str | None, bool]:
        """(what torch's ``embedding_bag`` would refuse of these arguments (module doc), or None; whether every
        bag holds one id)."""
        why = _bag_arguments(input, weights, self.mode, self.weight.dtype)
        if why is None and input.dim() == 2:
            return (None if offsets is None else self._says("if input is 2D, then offsets has to be None")), (
                input.shape[1] == 1
            )
        if why is None:
            why, single = self.exchanger.offsets.verdict(offsets, input.numel(), self.include_last_offset)
            return self._says(why), single
        return self._says(why), False

    def _says(self, why: str | None) -> str | None:
        return None if why is None else f"{self.describe()}: embedding_bag refuses the arguments: {why}"


class ShardedEmbedding(ShardedTable, EmbeddingLookup):
    """``nn.Embedding``, its rows owned by the ranks (module doc). ``forward(input)`` as torch's."""


class ShardedEmbeddingBag(ShardedTable, BagLookup):
    """``nn.EmbeddingBag`` (modes ``sum`` and ``mean``), its rows owned by the ranks (module doc).
    ``forward(input, offsets=None, per_sample_weights=None)`` as torch's."""


def _bag_arguments(input: torch.Tensor, weights: torch.Tensor | None, mode: str, dtype: torch.dtype) -> str | None:
    if input.dim() not in (1, 2):
        return f"input has to be 1D or 2D Tensor, but got Tensor of dimension {input.dim()}"
    if weights is not None:
        if mode != "sum":
            return f"per_sample_weights is only supported for mode='sum' (got mode={mode!r})"
        if not isinstance(weights, torch.Tensor) or weights.shape != input.shape or weights.dtype != dtype:
            got = (tuple(weights.shape), weights.dtype) if isinstance(weights, torch.Tensor) else type(weights)
            return (
                f"per_sample_weights must have the input's shape {tuple(input.shape)} and dtype {dtype}, got {got}"
            )
    return None


def dense_parameters(model: nn.Module) -> list[nn.Parameter]:
    """``model``'s parameters but those of tables grouped with an optimizer (``sparsync.shard(optimizer=...)``:
    the sharded ones and the replicated ones), which backward updates itself: what the optimizer of the rest of
    the model takes."""
    fused = {id(m.weight) for m in model.modules() if isinstance(m, GroupedTable) and m.group.fused is not None}
    return [p for p in model.parameters() if id(p) not in fused]
