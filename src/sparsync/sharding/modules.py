"""The sharded modules that stand in for ``nn.Embedding`` and ``nn.EmbeddingBag``: each rank holds the rows it
owns (``weight``: ``[rows owned, D]``, a parameter marked ``Sharded``), and a forward registers its ids with the
model's ``Exchanger`` and returns a ``LazyLookup`` (``shard.lazy``), pooled by torch's own functional on the rows
gathered for it (``shard.exchange``).

A call's ids are checked here, on the rank that makes it, and a bad call is not raised here but handed to the
exchange as a refusal, so that every rank raises it at once (``shard.header``): a negative id, an id beyond the
table, a tensor of the wrong dtype, and, for a bag, anything torch's ``embedding_bag`` itself refuses (offsets,
``per_sample_weights`` of another shape or outside mode ``sum``), found by running it on a one-column stand-in
table before the exchange.

``state_dict()``: with ``state_dict="full"`` (the default) the whole table under ``<name>.weight`` on rank 0,
gathered (so every rank must call it, as FSDP's full state dict asks), nothing on the others; ``"local"``: each
rank its own shard. ``load_state_dict`` takes either: a whole table ``[rows, D]`` (saved at any number of ranks,
or by the unsharded model) gives each rank its rows; anything else loads as this rank's shard.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from sparsync.placement import Placement
from sparsync.placement.sharded import mark
from sparsync.sharding.exchange import Exchanger
from sparsync.sharding.lazy import EAGER, LazyLookup
from sparsync.sharding.ownership import Ownership
from sparsync.sharding.transfer import gather_rows, init_rows, scatter_rows

STATE_DICT_LAYOUTS = ("full", "local")
ID_DTYPES = (torch.int64, torch.int32)  # what torch's embeddings take


class ShardedTable(nn.Module):
    """What the two sharded modules share: the shard, its ownership, the exchange, the state dict (module doc).
    Built by ``sparsync.shard`` from an unsharded module (``from_module``): collective, every rank at once."""

    kind = "table"

    def __init__(
        self,
        name: str,
        source: nn.Embedding | nn.EmbeddingBag,
        exchanger: Exchanger,
        placement: Placement,
        state_dict_layout: str,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if state_dict_layout not in STATE_DICT_LAYOUTS:
            raise ValueError(f"state_dict must be one of {STATE_DICT_LAYOUTS}, got {state_dict_layout!r}")
        self.table_name = name
        self.num_embeddings = int(source.num_embeddings)
        self.embedding_dim = int(source.embedding_dim)
        self.padding_idx: int | None = source.padding_idx
        self.exchanger = exchanger
        self.state_dict_layout = state_dict_layout
        self.ownership = Ownership(self.num_embeddings, exchanger.size)
        if source.weight.device.type == "meta":  # too large for one rank: each makes its own rows
            rows = init_rows(self.ownership, exchanger.rank, self.embedding_dim, source.weight.dtype, seed,
                             self.padding_idx)  # fmt: skip
        else:
            rows = scatter_rows(source.weight, self.ownership, exchanger.group)
        self.weight = nn.Parameter(rows, requires_grad=source.weight.requires_grad)
        mark(self.weight, placement)

    # --- what the exchanger reads (``exchange.Table``) ----------------------------------------------------------
    @property
    def shard(self) -> nn.Parameter:
        return self.weight

    @property
    def padding_row(self) -> int | None:
        return self.padding_idx

    def options(self) -> str:
        return f"padding_idx={self.padding_idx}"

    def describe(self) -> str:
        return (
            f"{self.table_name!r} (sharded {self.kind}({self.num_embeddings}, {self.embedding_dim}, "
            f"{self.options()}), {self.weight.dtype})"
        )

    def extra_repr(self) -> str:
        rank, P = self.exchanger.rank, self.exchanger.size
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, {self.options()}, rows {rank}::{P} of the table on "
            f"rank {rank} of {P}"
        )

    # --- one call -----------------------------------------------------------------------------------------------
    def checked_ids(self, input: Any) -> tuple[torch.Tensor, str | None]:
        """(the call's ids, flat int64, or an empty tensor when refused; why it is refused, or None)."""
        empty = torch.empty(0, dtype=torch.int64)
        if not isinstance(input, torch.Tensor):
            return empty, f"{self.describe()}: the input must be a tensor of ids, got {type(input).__name__}"
        if input.dtype not in ID_DTYPES:
            return empty, f"{self.describe()}: ids must be int64 or int32, got {input.dtype}"
        ids = input.detach().reshape(-1).to(torch.int64)
        if ids.numel():
            low, high = int(ids.min()), int(ids.max())
            if low < 0:
                return (
                    empty,
                    f"{self.describe()}: id {low} is negative; ids must lie in [0, {self.num_embeddings})",
                )
            if high >= self.num_embeddings:
                return empty, (
                    f"{self.describe()}: id {high} is out of range; ids must lie in [0, {self.num_embeddings})"
                )
        return ids, None

    # --- the state dict -----------------------------------------------------------------------------------------
    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        if self.state_dict_layout == "local":
            super()._save_to_state_dict(destination, prefix, keep_vars)
            return
        full = gather_rows(self.weight, self.ownership, self.exchanger.group)
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
        if isinstance(given, torch.Tensor) and tuple(given.shape) == (self.num_embeddings, self.embedding_dim):
            mine = given[self.ownership.global_rows(self.exchanger.rank)]
            state_dict = {**state_dict, key: mine}
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )


class ShardedEmbedding(ShardedTable):
    """``nn.Embedding``, its rows owned by the ranks (module doc). ``forward(input)`` as torch's."""

    kind = "Embedding"

    @torch.compiler.disable(reason=EAGER)  # type: ignore[no-untyped-call, untyped-decorator]
    def forward(self, input: torch.Tensor) -> LazyLookup:
        ids, refusal = self.checked_ids(input)
        shape = input.shape if refusal is None else torch.Size([0])

        def pool(rows: torch.Tensor, positions: torch.Tensor, padding: int | None) -> torch.Tensor:
            return nn.functional.embedding(positions.view(shape), rows, padding)

        return self.exchanger.register(self, ids, pool, refusal)


class ShardedEmbeddingBag(ShardedTable):
    """``nn.EmbeddingBag`` (modes ``sum`` and ``mean``), its rows owned by the ranks (module doc).
    ``forward(input, offsets=None, per_sample_weights=None)`` as torch's."""

    kind = "EmbeddingBag"

    def __init__(
        self,
        name: str,
        source: nn.EmbeddingBag,
        exchanger: Exchanger,
        placement: Placement,
        state_dict_layout: str,
        seed: int = 0,
    ) -> None:
        super().__init__(name, source, exchanger, placement, state_dict_layout, seed)
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
        ids, refusal = self.checked_ids(input)
        offsets64 = offsets.to(torch.int64) if isinstance(offsets, torch.Tensor) else offsets
        if refusal is None:
            refusal = self._refused_by_torch(input, offsets64, per_sample_weights)
        shape = input.shape if refusal is None else torch.Size([0])

        def pool(rows: torch.Tensor, positions: torch.Tensor, padding: int | None) -> torch.Tensor:
            return nn.functional.embedding_bag(
                positions.view(shape), rows, offsets64, mode=self.mode, per_sample_weights=per_sample_weights,
                include_last_offset=self.include_last_offset, padding_idx=padding,
            )  # fmt: skip

        return self.exchanger.register(self, ids, pool, refusal)

    def _refused_by_torch(
        self, input: torch.Tensor, offsets: torch.Tensor | None, per_sample_weights: torch.Tensor | None
    ) -> str | None:
        """What torch's ``embedding_bag`` says of these arguments, on a one-row, one-column stand-in table
        (every position 0: the checks never depend on which rows are read)."""
        stand_in = torch.zeros(1, 1, dtype=self.weight.dtype)
        psw = per_sample_weights.detach() if isinstance(per_sample_weights, torch.Tensor) else per_sample_weights
        try:
            with torch.no_grad():
                nn.functional.embedding_bag(
                    torch.zeros(input.shape, dtype=torch.int64), stand_in, offsets, mode=self.mode,
                    per_sample_weights=psw, include_last_offset=self.include_last_offset,
                )  # fmt: skip
        except (RuntimeError, ValueError, TypeError, IndexError, NotImplementedError) as e:
            return f"{self.describe()}: torch's embedding_bag refuses the arguments: {e}"
        return None
