"""Sharded tables in ``torch.distributed.checkpoint`` (DCP) checkpoints: each rank writes only rows it holds, and
a checkpoint written at P loads at any P' (and into the unsharded model, and from it).

The checkpoint holds each table as the ``[rows, D]`` tensor the unsharded model has, cut in contiguous row
blocks (block k holds rows ``[k·c, (k+1)·c)``, ``c = ceil(rows / P)``: ``Shard(0)``'s split), each block
stored as chunks of ``b`` rows (below), which any reader (another P, one process,
``dcp_to_torch_save``) reads. The stride ownership (``group.Ownership``: row r on rank r mod P, which spreads
the hot head) is not a set of chunks: rank j's rows would be ``rows / P`` chunks of one row each. So the rows are
re-blocked on the way out and back on the way in, one window at a time: window w is rows
``[k·c + w·b, k·c + (w+1)·b)`` of every block k (``b``: ``block_rows``, or ``c / WINDOWS`` if less), moved by one
all-to-all from the stride shards to the blocks' owners (or back), so every rank sends and receives about ``b``
rows per window and no rank ever holds its whole block:

- saving (``WindowSavePlanner``): DCP asks for each stored chunk in plan order, on every rank; the chunk of
  window w is made when it is asked for (``Strided.piece``: that window's all-to-all), written, and dropped;
- loading (``read_into_shard``): each window's rows of the block are read from the checkpoint with DCP's
  storage reader, then dealt to their owners.

A rank holds its shard, one window's rows (sent, received, read) and one stored chunk, which DCP's file reader
loads whole, at a time. A table so small that some rank's block is empty (``rows <= (P-1)·c``) is re-blocked
whole instead (``to_dtensor``), as the ``"sharded"`` state dict layout does.

Why not change the ownership to block-cyclic (row r on rank (r div b) mod P) so that each rank's rows are
chunks DCP could write as they lie: the b hottest ids would sit on one rank, and b small enough to spread a
Zipf head over the ranks means ``rows / (b·P)`` chunks per rank in the checkpoint's metadata, which rank 0
gathers and plans whole. Re-blocking costs one all-to-all of the table per save or load, off the training step.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from sparsync.sharding.group import Ownership

__all__ = [
    "BLOCK_ROWS",
    "DTensor",
    "Strided",
    "WindowSavePlanner",
    "into_shard",
    "read_into_shard",
    "to_dtensor",
    "writer",
]

BLOCK_ROWS = 1 << 16  # rows per window share and per stored chunk, at most
WINDOWS = 16  # windows per block, at least: a window's rows in flight stay a small part of a block


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

    def held(self, rank: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(local rows, table rows) of the rows of ``[lo, hi)`` in rank ``rank``'s block, ascending."""
        start, end = self.span(rank)
        a, b = max(lo, start), min(hi, end)
        g = torch.arange(a, max(a, b), dtype=torch.int64)
        return g - start, g

    def share(self, block_rows: int) -> int:
        """Rows of each block in one window: ``block_rows``, or fewer so that a block has ``WINDOWS`` windows."""
        return max(1, min(block_rows, -(-self.chunk // WINDOWS)))

    def windows(self, block_rows: int) -> range:
        """The first block row of each window (module doc)."""
        return range(0, self.chunk, self.share(block_rows))

    def window(self, a: int, block_rows: int) -> list[tuple[int, int]]:
        """Rows ``[k·c + a, k·c + a + share)`` of every block k, cut at each block's end."""
        b = self.share(block_rows)
        return [(min(s + a, e), min(s + a + b, e)) for s, e in map(self.span, range(self.parts))]

    def empty_block(self) -> bool:
        return self.span(self.parts - 1)[0] == self.rows and self.parts > 1


_Layout = Ownership | _Blocks  # where a table's rows lie: the ranks' stride shards or their row blocks


def _local(layout: _Layout, rank: int, ranges: list[tuple[int, int]]) -> tuple[torch.Tensor, ...]:
    """(local positions, global rows) of ``rank``'s rows in ``ranges`` (ascending, disjoint), ascending."""
    parts = [layout.held(rank, lo, hi) for lo, hi in ranges]
    return torch.cat([p for p, _ in parts]), torch.cat([g for _, g in parts])


def _window(
    src: torch.Tensor, src_layout: _Layout, dst_layout: _Layout, window: list[tuple[int, int]],
    group: dist.ProcessGroup, src_first: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(local positions in ``dst_layout``, rows) of the rows of ``window`` this rank receives, by one all-to-all
    of the rows of ``window`` that ``src`` holds in ``src_layout`` (``src``'s first row is the layout's local
    row ``src_first``). Collective over ``group``."""
    rank, P = dist.get_rank(group), dist.get_world_size(group)
    s_pos, s_rows = _local(src_layout, rank, window)
    s_pos = s_pos - src_first if src_first else s_pos
    to = dst_layout.owner(s_rows)
    order = torch.argsort(to, stable=True)  # by destination, each destination's rows ascending
    send = src.index_select(0, s_pos[order])
    d_pos, d_rows = _local(dst_layout, rank, window)
    came = src_layout.owner(d_rows)
    r_order = torch.argsort(came, stable=True)  # the order the sources send them in
    if P == 1:
        return d_pos[r_order], send
    recv = torch.empty(d_rows.numel(), *src.shape[1:], dtype=src.dtype)
    dist.all_to_all_single(recv, send, torch.bincount(came, minlength=P).tolist(),
                           torch.bincount(to, minlength=P).tolist(), group=group)  # fmt: skip
    return d_pos[r_order], recv


def _move(
    src: torch.Tensor, src_layout: _Layout, dst: torch.Tensor, dst_layout: _Layout,
    group: dist.ProcessGroup, block_rows: int,
) -> None:  # fmt: skip
    """Copy each row of the table that ``src`` holds in ``src_layout`` to its place in ``dst`` (``dst_layout``),
    one of them ``_Blocks``, window by window (module doc). Mutates ``dst``. Collective over ``group``."""
    blocks = _Blocks(src_layout.rows, dist.get_world_size(group))
    for a in blocks.windows(block_rows):
        pos, rows = _window(src, src_layout, dst_layout, blocks.window(a, block_rows), group)
        dst.index_copy_(0, pos, rows)


def mesh_of(group: dist.ProcessGroup) -> DeviceMesh:
    """The one-dimensional CPU mesh of ``group``'s ranks, for the blocks' ``DTensor``."""
    return DeviceMesh.from_group(group, "cpu")


def to_dtensor(
    shard: torch.Tensor, rows: int, group: dist.ProcessGroup, *, block_rows: int = BLOCK_ROWS
) -> DTensor:
    """The table of ``rows`` rows whose stride shard on this rank is ``shard`` (``[owned, ...]``), as a
    ``DTensor`` of contiguous row blocks (``Shard(0)``) on ``group``'s ranks, made whole on each rank. A new
    tensor: the shard is not changed. Collective over ``group``."""
    P = dist.get_world_size(group)
    blocks = _Blocks(rows, P)
    start, end = blocks.span(dist.get_rank(group))
    block = torch.empty(end - start, *shard.shape[1:], dtype=shard.dtype)
    _move(shard.detach(), Ownership(rows, P), block, blocks, group, block_rows)
    shape = torch.Size([rows, *shard.shape[1:]])
    return DTensor.from_local(block, mesh_of(group), [Shard(0)], run_check=False, shape=shape,
                              stride=_contiguous_stride(shape))  # fmt: skip


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def into_shard(
    value: torch.Tensor, out: torch.Tensor, rows: int, group: dist.ProcessGroup, *, block_rows: int = BLOCK_ROWS
) -> None:
    """Copy this rank's stride rows of the table ``value`` into ``out`` (``[owned, ...]``, this rank's shard):
    ``value`` is a ``DTensor`` of row blocks on ``group`` (``to_dtensor``; collective over ``group``) or the
    whole table (no communication). Mutates ``out``."""
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    with torch.no_grad():
        if isinstance(value, DTensor):
            _move(value.to_local(), _Blocks(rows, P), out, Ownership(rows, P), group, block_rows)
        else:
            out.copy_(value[rank::P])


@dataclass(frozen=True)
class Strided:
    """A table (or a per-row state of one) of ``rows`` rows whose stride shard on this rank is ``shard``, to be
    written in row blocks window by window (``WindowSavePlanner``)."""

    shard: torch.Tensor  # [owned, ...]
    rows: int
    group: dist.ProcessGroup
    block_rows: int

    @property
    def blocks(self) -> _Blocks:
        return _Blocks(self.rows, dist.get_world_size(self.group))

    def pieces(self) -> list[tuple[int, int]]:
        """(first global row, rows) of each stored chunk of this rank's block, one per window it has rows in."""
        blocks = self.blocks
        start, end = blocks.span(dist.get_rank(self.group))
        b = blocks.share(self.block_rows)
        return [(start + a, min(b, end - start - a)) for a in range(0, end - start, b)]

    def piece(self, n: int) -> torch.Tensor:
        """This rank's rows of window ``n`` (``pieces()[n]``), made by the window's all-to-all; the last piece
        also runs the windows after it, in which this rank receives nothing. Collective over the group: every
        rank asks for its pieces in order."""
        blocks, stride = self.blocks, Ownership(self.rows, dist.get_world_size(self.group))
        starts = blocks.windows(self.block_rows)
        shard = self.shard.detach()
        pos, rows = _window(shard, stride, blocks, blocks.window(starts[n], self.block_rows), self.group)
        out = torch.empty_like(rows)
        out.index_copy_(0, pos - starts[n], rows)
        del pos, rows
        if n == len(self.pieces()) - 1:
            for a in starts[n + 1 :]:
                _window(shard, stride, blocks, blocks.window(a, self.block_rows), self.group)
        return out

    def properties(self) -> TensorWriteData:
        shape = torch.Size([self.rows, *self.shard.shape[1:]])
        return TensorWriteData(ChunkStorageMetadata(torch.Size([0] * len(shape)), shape),
                               TensorProperties(dtype=self.shard.dtype), shape)  # fmt: skip


class WindowSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` that writes a ``Strided`` value as its block's chunks, each made when DCP asks for
    it (``Strided.piece``), and any tensor larger than ``block_rows`` rows as chunks of at most ``block_rows``
    rows (contiguous row ranges of it), so that a reader, which loads a stored chunk whole, holds one such piece
    at a time. DCP's file writer (``writer()``) asks for the chunks of a rank's file in plan order, one at a time,
    on every rank."""

    def __init__(self, block_rows: int = BLOCK_ROWS) -> None:
        super().__init__()
        if block_rows < 1:
            raise ValueError(f"block_rows must be >= 1, got {block_rows}")
        self.block_rows = block_rows
        self._origin: dict[str, int] = {}  # a split tensor's first local row in its global tensor
        self._strided: dict[str, Strided] = {}
        self._piece: dict[tuple[str, int], int] = {}  # (fqn, first row) -> the Strided piece's number
        self._last: torch.Tensor | None = None  # the piece given last, released at the next item

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = []
        for item in plan.items:
            value = self.state_dict[item.index.fqn]
            strided = isinstance(value, Strided)
            items += self._strided_pieces(item.index.fqn, value) if strided else self._pieces(item)
        self.plan = replace(plan, items=items)
        return self.plan

    def _strided_pieces(self, fqn: str, value: Strided) -> list[WriteItem]:
        self._strided[fqn] = value
        data, out = value.properties(), []
        for n, (first, rows) in enumerate(value.pieces()):
            offsets = torch.Size([first, *[0] * (len(data.size) - 1)])
            chunk = ChunkStorageMetadata(offsets, torch.Size([rows, *data.size[1:]]))
            self._piece[fqn, first] = n
            out.append(WriteItem(MetadataIndex(fqn, offsets), WriteItemType.SHARD,
                                 tensor_data=replace(data, chunk=chunk)))  # fmt: skip
        return out

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
        """The data of ``write_item``. A piece (of a ``Strided`` value or of a split tensor) is a new tensor, whose
        storage is released when the next item is asked for: the writer has written it by then (``writer()``),
        though it keeps a reference to the last piece of each tensor until the file is done."""
        if self._last is not None:
            self._last.untyped_storage().resize_(0)
            self._last = None
        fqn = write_item.index.fqn
        chunk = None if write_item.tensor_data is None else write_item.tensor_data.chunk
        if fqn in self._strided and chunk is not None:
            self._last = self._strided[fqn].piece(self._piece[fqn, chunk.offsets[0]])
            return self._last
        if fqn not in self._origin or chunk is None:
            return super().resolve_data(write_item)
        obj = self.state_dict[fqn]
        local = obj.to_local() if isinstance(obj, DTensor) else obj
        self._last = local.detach().narrow(0, chunk.offsets[0] - self._origin[fqn], chunk.sizes[0]).clone()
        return self._last


def writer(path: str) -> FileSystemWriter:
    """DCP's file writer as ``WindowSavePlanner`` needs it: one thread, one file per rank, each item asked for
    when the previous one is written (no copying ahead), in plan order."""
    return FileSystemWriter(path, single_file_per_rank=True, thread_count=1, per_thread_copy_ahead=0)


class _Into(DefaultLoadPlanner):
    """The planner DCP's storage reader calls back while it reads one chunk ``out`` of a stored tensor (its read
    items made by ``create_read_items_for_chunk_list``): each read item's destination is a view of ``out``."""

    def __init__(self, out: torch.Tensor) -> None:
        super().__init__()
        self.out = out

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise ValueError(f"expected a tensor at {read_item.dest_index.fqn!r} in the checkpoint, found an object")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        view = self.out
        for dim, (at, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            view = view.narrow(dim, at, n)
        return view

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


def read_into_shard(
    reader: FileSystemReader, meta: Metadata, fqn: str, out: torch.Tensor, group: dist.ProcessGroup,
    *, block_rows: int = BLOCK_ROWS,
) -> None:  # fmt: skip
    """Load the stored tensor ``fqn`` (``[rows, ...]``, saved at any P) into ``out``, this rank's stride shard of
    it, window by window (module doc): each window's rows of this rank's block read with ``reader`` (set up with
    ``meta``), then dealt to their owners. Mutates ``out``. Collective over ``group``."""
    md = meta.state_dict_metadata[fqn]
    if not isinstance(md, TensorStorageMetadata):
        raise ValueError(f"expected a tensor at {fqn!r} in the checkpoint, found an object")
    rows, rank, P = int(md.size[0]), dist.get_rank(group), dist.get_world_size(group)
    blocks = _Blocks(rows, P)
    start, end = blocks.span(rank)
    for a in blocks.windows(block_rows):
        lo, hi = min(start + a, end), min(start + a + blocks.share(block_rows), end)
        piece = torch.empty(hi - lo, *md.size[1:], dtype=md.properties.dtype)
        if hi > lo:
            chunk = ChunkStorageMetadata(torch.Size([lo, *[0] * (len(md.size) - 1)]), piece.shape)
            reader.read_data(LoadPlan(create_read_items_for_chunk_list(fqn, md, [chunk])), _Into(piece)).wait()
        pos, got = _window(piece, blocks, Ownership(rows, P), blocks.window(a, block_rows), group, src_first=a)
        del piece
        with torch.no_grad():
            out.index_copy_(0, pos, got)
