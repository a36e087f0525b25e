"""Sharded tables in ``torch.distributed.checkpoint`` (DCP) checkpoints: each rank writes only rows it holds, and
a checkpoint written at P loads at any P' (and into the unsharded model, and from it).

The checkpoint holds each table as the ``[rows, D]`` tensor the unsharded model has, as a ``DTensor`` sharded
by contiguous row blocks (``Shard(0)``: block k holds rows ``[k·c, (k+1)·c)``, ``c = ceil(rows / P)``), which is
what DCP describes with one chunk per rank and what any reader (another P, one process, ``dcp_to_torch_save``)
reads. The stride ownership (``ownership``: row r on rank r mod P, which spreads the hot head) is not a set of
chunks: rank j's rows would be ``rows / P`` chunks of one row each. So the rows are re-blocked on the way out
(``to_dtensor``: an all-to-all from the stride shards to the blocks) and back on the way in
(``into_shard``), in windows of ``block_rows`` rows of every block, so a rank holds its shard, its block and
one window's rows (``block_rows`` each way) at a time, and every rank sends and receives in every window.
``BlockSavePlanner`` writes each block as chunks of at most ``block_rows`` rows, so a reader, which loads a
stored chunk whole, holds one such chunk at a time.

Why not change the ownership to block-cyclic (row r on rank (r div b) mod P) so that each rank's rows are
chunks DCP could write as they lie: the b hottest ids would sit on one rank, and b small enough to spread a
Zipf head over the ranks means ``rows / (b·P)`` chunks per rank in the checkpoint's metadata, which rank 0
gathers and plans whole. Re-blocking costs one all-to-all of the table per save or load, off the training step.

``checkpoint`` saves and loads a model and its optimizer with these.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

__all__ = ["BLOCK_ROWS", "BlockSavePlanner", "DTensor", "empty_dtensor", "into_shard", "mesh_of", "to_dtensor"]

BLOCK_ROWS = 1 << 16  # rows per window share and per stored chunk


@dataclass(frozen=True)
class _Stride:
    """Row g on rank g mod P at local row g div P (``ownership``)."""

    rows: int
    parts: int

    def owner(self, g: torch.Tensor) -> torch.Tensor:
        return g % self.parts

    def local(self, rank: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(local positions, global rows) of ``rank``'s rows in ``[lo, hi)``, ascending."""
        P = self.parts
        first, last = -(-(lo - rank) // P), -(-(min(hi, self.rows) - rank) // P)
        pos = torch.arange(max(first, 0), max(last, 0), dtype=torch.int64)
        return pos, pos * P + rank


@dataclass(frozen=True)
class _Blocks:
    """Rows ``[k·c, (k+1)·c)`` on rank k, ``c = ceil(rows / P)``: ``torch.chunk``'s and ``Shard(0)``'s split."""

    rows: int
    parts: int

    @property
    def chunk(self) -> int:
        return max(1, -(-self.rows // self.parts))

    def span(self, rank: int) -> tuple[int, int]:
        start = min(rank * self.chunk, self.rows)
        return start, min(start + self.chunk, self.rows)

    def owner(self, g: torch.Tensor) -> torch.Tensor:
        return g // self.chunk

    def local(self, rank: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self.span(rank)
        a, b = max(lo, start), min(hi, end)
        g = torch.arange(a, max(a, b), dtype=torch.int64)
        return g - start, g


def _local(layout: _Stride | _Blocks, rank: int, ranges: list[tuple[int, int]]) -> tuple[torch.Tensor, ...]:
    """(local positions, global rows) of ``rank``'s rows in ``ranges`` (ascending, disjoint), ascending."""
    parts = [layout.local(rank, lo, hi) for lo, hi in ranges]
    return torch.cat([p for p, _ in parts]), torch.cat([g for _, g in parts])


def _move(
    src: torch.Tensor, src_layout: _Stride | _Blocks, dst: torch.Tensor, dst_layout: _Stride | _Blocks,
    group: dist.ProcessGroup, block_rows: int,
) -> None:  # fmt: skip
    """Copy each row of the table that ``src`` holds in ``src_layout`` to its place in ``dst`` (``dst_layout``),
    one of them ``_Blocks``, by one all-to-all per window: rows ``[a, a + block_rows)`` of every block, so that
    in each window every rank receives and sends at most ``block_rows`` rows of the blocks (and about as many of
    its stride shard). Mutates ``dst``. Collective over ``group``."""
    rank, P = dist.get_rank(group), dist.get_world_size(group)
    blocks = _Blocks(src_layout.rows, P)
    for a in range(0, blocks.chunk, block_rows):
        window = [(min(k * blocks.chunk + a, blocks.span(k)[1]), min(k * blocks.chunk + a + block_rows,
                   blocks.span(k)[1])) for k in range(P)]  # fmt: skip
        s_pos, s_rows = _local(src_layout, rank, window)
        to = dst_layout.owner(s_rows)
        order = torch.argsort(to, stable=True)  # by destination, each destination's rows ascending
        send = src.index_select(0, s_pos[order])
        d_pos, d_rows = _local(dst_layout, rank, window)
        came = src_layout.owner(d_rows)
        r_order = torch.argsort(came, stable=True)  # the order the sources send them in
        recv = torch.empty(d_rows.numel(), *src.shape[1:], dtype=src.dtype)
        if P == 1:
            recv.copy_(send)
        else:
            dist.all_to_all_single(recv, send, torch.bincount(came, minlength=P).tolist(),
                                   torch.bincount(to, minlength=P).tolist(), group=group)  # fmt: skip
        dst.index_copy_(0, d_pos[r_order], recv)


def mesh_of(group: dist.ProcessGroup) -> DeviceMesh:
    """The one-dimensional CPU mesh of ``group``'s ranks, for the blocks' ``DTensor``."""
    return DeviceMesh.from_group(group, "cpu")


def to_dtensor(
    shard: torch.Tensor, rows: int, group: dist.ProcessGroup, *, block_rows: int = BLOCK_ROWS
) -> DTensor:
    """The table of ``rows`` rows whose stride shard on this rank is ``shard`` (``[owned, ...]``), as a
    ``DTensor`` of contiguous row blocks (``Shard(0)``) on ``group``'s ranks (module doc). A new tensor: the
    shard is not changed. Collective over ``group``."""
    P = dist.get_world_size(group)
    blocks = _Blocks(rows, P)
    start, end = blocks.span(dist.get_rank(group))
    block = torch.empty(end - start, *shard.shape[1:], dtype=shard.dtype)
    _move(shard.detach(), _Stride(rows, P), block, blocks, group, block_rows)
    shape = torch.Size([rows, *shard.shape[1:]])
    return DTensor.from_local(block, mesh_of(group), [Shard(0)], run_check=False, shape=shape,
                              stride=_contiguous_stride(shape))  # fmt: skip


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def empty_dtensor(rows: int, dim: int, dtype: torch.dtype, group: dist.ProcessGroup) -> DTensor:
    """An uninitialised table ``[rows, dim]`` in row blocks on ``group``'s ranks: what ``dcp.load`` fills."""
    start, end = _Blocks(rows, dist.get_world_size(group)).span(dist.get_rank(group))
    shape = torch.Size([rows, dim])
    return DTensor.from_local(torch.empty(end - start, dim, dtype=dtype), mesh_of(group), [Shard(0)],
                              run_check=False, shape=shape, stride=(dim, 1))  # fmt: skip


def into_shard(
    value: torch.Tensor, out: torch.Tensor, rows: int, group: dist.ProcessGroup, *, block_rows: int = BLOCK_ROWS
) -> None:
    """Copy this rank's stride rows of the table ``value`` into ``out`` (``[owned, ...]``, this rank's shard):
    ``value`` is a ``DTensor`` of row blocks on ``group`` (``to_dtensor``; collective over ``group``) or the
    whole table (no communication). Mutates ``out``."""
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    with torch.no_grad():
        if isinstance(value, DTensor):
            _move(value.to_local(), _Blocks(rows, P), out, _Stride(rows, P), group, block_rows)
        else:
            out.copy_(value[rank::P])


class BlockSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` that writes each chunk of a tensor larger than ``block_rows`` rows as chunks of at
    most ``block_rows`` rows (contiguous row ranges of it), so that a reader, which loads a stored chunk whole,
    holds one such piece at a time."""

    def __init__(self, block_rows: int = BLOCK_ROWS) -> None:
        super().__init__()
        if block_rows < 1:
            raise ValueError(f"block_rows must be >= 1, got {block_rows}")
        self.block_rows = block_rows
        self._origin: dict[str, int] = {}  # a split tensor's first local row in its global tensor

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = [piece for item in plan.items for piece in self._pieces(item)]
        self.plan = replace(plan, items=items)
        return self.plan

    def _pieces(self, item: WriteItem) -> list[WriteItem]:
        data = item.tensor_data
        if data is None or len(data.chunk.sizes) == 0 or data.chunk.sizes[0] <= self.block_rows:
            return [item]
        out = []
        first, n = data.chunk.offsets[0], data.chunk.sizes[0]
        self._origin[item.index.fqn] = first
        for at in range(0, n, self.block_rows):
            offsets = torch.Size([first + at, *data.chunk.offsets[1:]])
            sizes = torch.Size([min(self.block_rows, n - at), *data.chunk.sizes[1:]])
            chunk = ChunkStorageMetadata(offsets=offsets, sizes=sizes)
            # a piece of a whole tensor is a shard of it too: DCP keeps one writer per piece (its index)
            out.append(replace(item, index=MetadataIndex(item.index.fqn, offsets), type=WriteItemType.SHARD,
                               tensor_data=replace(data, chunk=chunk)))  # fmt: skip
        return out

    def resolve_data(self, write_item: WriteItem) -> Any:
        fqn = write_item.index.fqn
        if fqn not in self._origin or write_item.tensor_data is None:
            return super().resolve_data(write_item)
        obj = self.state_dict[fqn]
        local = obj.to_local() if isinstance(obj, DTensor) else obj
        chunk = write_item.tensor_data.chunk
        return local.detach().narrow(0, chunk.offsets[0] - self._origin[fqn], chunk.sizes[0])
