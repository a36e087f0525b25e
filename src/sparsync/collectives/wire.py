"""The wire format of a stream: its header, its payload bytes (index bytes then value bytes) and the framed,
self-delimiting block the split algorithms and the gathers send (a 24-byte ``[is_dense, rows, bytes]`` header
then the payload padded to 8 bytes).

Everything here turns streams into bytes and back; nothing communicates (``comm.py`` does).
"""

from __future__ import annotations

import torch

from sparsync.stream import SparseStream, index_dtype_for

HEADER_WORDS = 2  # [is_dense, nnz] as int64
HEADER_BYTES = HEADER_WORDS * 8


def header_of(stream: SparseStream) -> torch.Tensor:
    """[is_dense, stored rows]: what a receiver needs to size the payload (the row width is agreed beforehand)."""
    return torch.tensor([1 if stream.is_dense else 0, stream.nrows], dtype=torch.int64)


def payload_of(stream: SparseStream) -> torch.Tensor:
    """The stream as one uint8 tensor: index bytes then value bytes (values only when dense)."""
    parts = payload_parts(stream)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def payload_parts(stream: SparseStream) -> list[torch.Tensor]:
    """``payload_of``'s pieces, uncopied, for writing them straight into a larger buffer."""
    vals = _bytes_of(stream.values)
    return [vals] if stream.indices is None else [_bytes_of(stream.indices), vals]


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """uint8 view of a 1-D tensor. torch calls a tensor of 0 or 1 elements contiguous whatever its stride (an
    empty array from numpy has stride 0, ``x[i::n]`` of one element stride n), but ``view`` needs stride 1."""
    t = t.contiguous()
    if t.stride(-1) != 1:
        t = t.clone(memory_format=torch.contiguous_format)
    return t.view(torch.uint8)


def payload_nbytes(is_dense: bool, nrows: int, dim: int, dtype: torch.dtype, row: int = 1) -> int:
    """Wire bytes of a stream of ``dim`` values in rows of ``row``: ``nrows`` indices of c bytes and
    ``nrows * row`` values when sparse, ``dim`` values when dense."""
    isize = torch.empty((), dtype=dtype).element_size()
    if is_dense:
        return dim * isize
    c = torch.empty((), dtype=index_dtype_for(dim // row)).element_size()
    return nrows * (c + row * isize)


def stream_from_payload(
    payload: torch.Tensor, is_dense: bool, nrows: int, dim: int, dtype: torch.dtype, row: int = 1
) -> SparseStream:
    if is_dense:
        return SparseStream(None, _view(payload, dtype), dim, row=row, validate=False)
    itype = index_dtype_for(dim // row)
    ib = nrows * torch.empty((), dtype=itype).element_size()
    return SparseStream(_view(payload[:ib], itype), _view(payload[ib:], dtype), dim, row=row, validate=False)


FRAME_WORDS = 3  # [is_dense, nrows, payload bytes] as int64, before a framed payload
FRAME_BYTES = FRAME_WORDS * 8


def framed(stream: SparseStream | None) -> torch.Tensor:
    """A self-delimiting block: a 24-byte frame header, then the payload padded to 8 bytes (so blocks can be
    concatenated and stay aligned), in whichever format is smaller. None frames an absent block (nrows -1)."""
    if stream is None:
        return torch.tensor([0, -1, 0], dtype=torch.int64).view(torch.uint8)  # CPU: ``to`` the call's device
    dense_bytes = payload_nbytes(True, 0, stream.dim, stream.dtype, stream.row)
    if not stream.is_dense and dense_bytes <= stream.nbytes:
        # The smaller format always (SparCML §3's switch, exact): a frame of a stream of at most m stored rows
        # then never exceeds min(dense, m rows sparse), the receive size the split algorithms post.
        stream = stream.densified()
    parts = payload_parts(stream)
    n = sum(int(p.numel()) for p in parts)
    device = stream.values.device
    out = torch.zeros(FRAME_BYTES + max_framed_payload(n), dtype=torch.uint8, device=device)
    head = torch.tensor([int(stream.is_dense), stream.nrows, n], dtype=torch.int64)
    out[:FRAME_BYTES] = head.view(torch.uint8).to(device)
    off = FRAME_BYTES
    for p in parts:  # one copy of the payload, into the frame
        out[off : off + p.numel()] = p
        off += p.numel()
    return out


def max_framed_payload(nbytes: int) -> int:
    """Payload bytes a frame of ``nbytes`` occupies (padded to 8)."""
    return -(-nbytes // 8) * 8


def frame_length(buf: torch.Tensor) -> int:
    """Bytes of the frame starting at ``buf[0]`` (-1 when malformed), for ``allgather_var``."""
    if buf.numel() < FRAME_BYTES or buf.storage_offset() % 8:
        return -1
    n = int(buf[:FRAME_BYTES].view(torch.int64)[2])  # a device sync on CUDA: gloo's path only
    return FRAME_BYTES + max_framed_payload(n) if n >= 0 else -1


def unframe(buf: torch.Tensor, dim: int, dtype: torch.dtype, row: int) -> SparseStream | None:
    """The stream in a frame (None for an absent block); ValueError when the frame does not fit ``dim``."""
    if buf.numel() < FRAME_BYTES:
        raise ValueError(f"truncated frame of {buf.numel()} bytes")
    hdr = (buf[:FRAME_BYTES].clone() if buf.storage_offset() % 8 else buf[:FRAME_BYTES]).view(torch.int64)
    dense_flag, nrows, n = (int(x) for x in hdr.tolist())  # one device sync on CUDA
    is_dense = bool(dense_flag)
    if nrows < 0:
        return None
    if not 0 <= nrows <= dim // row or n != payload_nbytes(is_dense, nrows, dim, dtype, row):
        raise ValueError(f"frame of {nrows} rows / {n} bytes does not fit a stream of {dim} values")
    if FRAME_BYTES + n > buf.numel():
        raise ValueError(f"frame declares {n} payload bytes, {buf.numel() - FRAME_BYTES} arrived")
    return stream_from_payload(buf[FRAME_BYTES : FRAME_BYTES + n], is_dense, nrows, dim, dtype, row)


def _view(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret received bytes; blocks inside a gathered buffer may be misaligned, so copy those."""
    if buf.storage_offset() % torch.empty((), dtype=dtype).element_size():
        buf = buf.clone()
    return buf.view(dtype)
