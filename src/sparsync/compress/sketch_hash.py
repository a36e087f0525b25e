"""The S2 sketch's hashes, its insert and query kernels, and the median of r rows (``SparseSketch``).

Row j's multiply-add-shift hash of a key i is z = (a_j·i + b_j) mod 2^64, with (a_j, b_j) drawn from the seed
(the same on every rank). For keys i < 2^32 the top 32 bits of z are pairwise independent and uniform over
random (a_j, b_j) (Dietzfelbinger 1996, strongly universal multiply-add-shift), so the sign s_j(i) = bit 63 and
the bucket h_j(i) = ⌊c·(bits 32..62)/2^31⌋ are independent of each other, and the signs of two keys are pairwise
independent: E[s_j(i)s_j(k)] = 0, which is all S2 Thm. 1's unbiasedness needs. Five int64 passes per row (for a
run of positions an add replaces the multiply and add; for a run of whole blocks, one broadcast add of a
per-block base and a_j·t), over chunks of indices that stay in cache; the splitmix64 mix it replaces was two
orders of magnitude slower. The sign is applied by XOR-ing the value's sign bit; the median of r ≤ 8 rows is a
min/max sorting network (torch.median over a short dim is much slower).

A key is an element index (``hash="element"``, S2 Alg. 1 as written) or a block index (``hash="block"``: one
hash per block, its b values added to a bucket of b cells; ``insert_blocks`` / ``query_blocks``).

The four kernels run in C (``_sketch_c.c``, built by ``pip install``) where the extension is built and the
inputs are contiguous, unless ``Hasher(native=False)`` (``SparseSketch(kernels="torch")``): one pass per row
over the keys, the same sums in every table cell (added in the order ``index_add_`` adds them) and the same
medians (their speed against the torch kernels: docs/results_compress.md). The torch kernels are the reference
and the fallback.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:  # built by `pip install` (setup.py); optional: the torch kernels are the fallback
    from sparsync.compress import _sketch_c as _native
except ImportError:  # pragma: no cover - only without a C compiler
    _native = None  # type: ignore[assignment]

CHUNK = 1 << 16  # element indices per hashing pass
_MASK64 = (1 << 64) - 1


def native_available() -> bool:
    """Whether the C kernels were built (``SparseSketch(kernels="auto")`` uses them then)."""
    return _native is not None


@dataclass(frozen=True)
class RowRun:
    """The element indices of whole blocks: ``blocks[i]·width + t`` for t < width, block by block (ascending
    when ``blocks`` is): the hashes of a run cost one broadcast add per sketch row (``Hasher._z``)."""

    blocks: torch.Tensor  # int64
    width: int


Index = torch.Tensor | int | RowRun  # keys, the first of a run of consecutive keys, or whole blocks' elements


class Hasher:
    """Row hashes of one call and their scratch buffers on ``device`` (default the host), sized for ``size``
    keys (and values) per pass. The C kernels read host memory: on another device the torch kernels run."""

    def __init__(
        self,
        rows: int,
        seed: int,
        c: int,
        work: torch.dtype,
        size: int = CHUNK,
        native: bool | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.c, self.rows = c, rows
        base = splitmix_int(seed)
        self.ab = [
            (signed64(splitmix_int(base ^ (2 * j))), signed64(splitmix_int(base ^ (2 * j + 1))))
            for j in range(rows)
        ]
        if native and _native is None:
            raise RuntimeError("native sketch kernels asked for, but sparsync.compress._sketch_c is not built")
        d = self.device = torch.device("cpu") if device is None else torch.device(device)
        # the C kernels: by default where built (module doc), on host memory; they take at most 64 rows
        self.native = (_native is not None if native is None else native) and rows <= 64 and d.type == "cpu"
        self.ab_tensor = torch.tensor(self.ab, dtype=torch.int64, device="cpu").reshape(-1)  # read by C only
        self.itype = torch.int64 if work == torch.float64 else torch.int32  # the value's bits, for the sign
        self.z = torch.empty(size, dtype=torch.int64, device=d)
        self.base = torch.empty(size, dtype=torch.int64, device=d)  # a RowRun's per-block a_j·w·block + b_j
        self.sign = torch.empty(size, dtype=self.itype, device=d)
        self.signed = torch.empty(size, dtype=self.itype, device=d)
        self.est = torch.empty(rows, size, dtype=work, device=d)
        self._steps: list[torch.Tensor] = []

    def _z(self, idx: Index, k: int, j: int) -> torch.Tensor:
        """z = a_j·i + b_j mod 2^64 (int64 arithmetic wraps) for the keys ``idx``, for start + 0..k-1, or for
        a run of whole blocks: a_j·(block·w + t) + b_j = (a_j·w·block + b_j) + a_j·t."""
        a, b = self.ab[j]
        z = self.z[:k]
        if isinstance(idx, torch.Tensor):
            return torch.mul(idx, a, out=z).add_(b)
        if not self._steps:  # a_j·0..size-1, once per call: a chunk of positions then costs one add
            steps = torch.arange(self.z.numel(), dtype=torch.int64, device=self.device)
            self._steps = [steps.mul(aj) for aj, _ in self.ab]
        if isinstance(idx, RowRun):
            m, w = idx.blocks.numel(), idx.width
            base = torch.mul(idx.blocks, signed64(a * w), out=self.base[:m]).add_(b)
            torch.add(base.unsqueeze(1), self._steps[j][:w], out=z.view(m, w))
            return z
        return torch.add(self._steps[j][:k], signed64(a * idx + b), out=z)

    def row(self, idx: Index, k: int, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(h_j(i) ∈ [0, c), sign mask: the value type's sign bit where s_j(i) = -1) for k keys. Both are
        views of this hasher's buffers, overwritten by the next call."""
        z = self._z(idx, k, j).bitwise_right_shift_(32)  # the top 32 bits, sign-extended
        sign = self.sign[:k]
        if self.itype == torch.int64:
            torch.bitwise_and(z, -(2**63), out=sign)  # bit 63
        else:
            sign.copy_(z).bitwise_and_(-(2**31))  # bits 32..63 as int32: its sign bit is bit 63
        return z.bitwise_and_(0x7FFF_FFFF).mul_(self.c).bitwise_right_shift_(31), sign

    def insert(self, table: torch.Tensor, idx: Index, vals: torch.Tensor) -> None:
        """table[j, h_j(i)] += s_j(i)·v(i) for every row j (S2 Alg. 1 line 5). ``idx``: the element indices of
        ``vals``, the first of a run of consecutive ones, or a run of whole blocks."""
        k = vals.numel()
        if self._c_keys("insert", table, idx, vals):
            return
        bits = vals.view(self.itype)
        for j in range(self.rows):
            h, sign = self.row(idx, k, j)
            signed = torch.bitwise_xor(bits, sign, out=self.signed[:k])
            table[j].index_add_(0, h, signed.view(table.dtype))

    def query(self, table: torch.Tensor, idx: Index, out: torch.Tensor) -> None:
        """out(i) = median over rows of s_j(i)·table[j, h_j(i)] (S2 Alg. 1 lines 11-14)."""
        k = out.numel()
        if self._c_keys("query", table, idx, out):
            return
        est = self.est[:, :k]
        for j in range(self.rows):
            h, sign = self.row(idx, k, j)
            torch.index_select(table[j], 0, h, out=est[j])
            est[j].view(self.itype).bitwise_xor_(sign)
        median_rows(est, out)

    def insert_blocks(self, table: torch.Tensor, blocks: torch.Tensor, vals: torch.Tensor) -> None:
        """Block hashing: table[j, h_j(B)·b + t] += s_j(B)·v(B, t) for each block B of ``blocks`` and its
        values ``vals`` (m, b): one hash per block, the table read as c buckets of b cells."""
        m, b = vals.shape
        if self._c_blocks("insert_blocks", table, blocks, vals):
            return
        bits = vals.view(self.itype)
        for j in range(self.rows):
            h, sign = self.row(blocks, m, j)
            signed = torch.bitwise_xor(bits, sign.unsqueeze(1), out=self.signed[: m * b].view(m, b))
            table[j].view(-1, b).index_add_(0, h, signed.view(table.dtype))

    def query_blocks(self, table: torch.Tensor, blocks: torch.Tensor, out: torch.Tensor) -> None:
        """out(B, t) = median over rows of s_j(B)·table[j, h_j(B)·b + t] for ``out`` of shape (m, b)."""
        m, b = out.shape
        if self._c_blocks("query_blocks", table, blocks, out):
            return
        est = self.est[:, : m * b].view(self.rows, m, b)
        for j in range(self.rows):
            h, sign = self.row(blocks, m, j)
            torch.index_select(table[j].view(-1, b), 0, h, out=est[j])
            est[j].view(self.itype).bitwise_xor_(sign.unsqueeze(1))
        median_rows(est.view(self.rows, m * b), out.view(-1))

    def _c_keys(self, kernel: str, table: torch.Tensor, idx: Index, buf: torch.Tensor) -> bool:
        """Run ``_sketch_c``'s ``insert`` or ``query`` (``kernel``) for the keys ``idx`` and the values ``buf``
        (read or written) if the C kernels take the call; whether they did."""
        k = buf.numel()
        if not (self._c_ok(table, buf, self.rows * self.c) and _covers(idx, k)):
            return False
        mode, keys, start, width = _keys(idx)
        getattr(_native, kernel)(
            table.data_ptr(), self.rows, self.c, self.ab_tensor.data_ptr(),
            mode, keys.data_ptr(), start, width, buf.data_ptr(), k, int(table.dtype == torch.float64),
        )  # fmt: skip
        return True

    def _c_blocks(self, kernel: str, table: torch.Tensor, blocks: torch.Tensor, buf: torch.Tensor) -> bool:
        """Run ``insert_blocks`` or ``query_blocks`` for ``blocks`` and their (m, b) values ``buf`` if the C
        kernels take the call; whether they did."""
        m, b = buf.shape
        ok = blocks.dtype == torch.int64 and blocks.is_contiguous() and blocks.numel() >= m
        if not (ok and self._c_ok(table, buf, self.rows * self.c * b)):
            return False
        getattr(_native, kernel)(
            table.data_ptr(), self.rows, self.c, self.ab_tensor.data_ptr(), blocks.data_ptr(), m, b,
            buf.data_ptr(), int(table.dtype == torch.float64),
        )  # fmt: skip
        return True

    def _c_ok(self, table: torch.Tensor, vals: torch.Tensor, cells: int) -> bool:
        """Whether the C kernels take this call: built, chosen, and buffers as they assume them (contiguous, the
        table's dtype, ``cells`` = rows x c cells, times the block for the block kernels): the C side indexes
        the table by the hash alone."""
        return (
            self.native
            and table.is_contiguous()
            and vals.is_contiguous()
            and vals.dtype == table.dtype
            and table.dtype in (torch.float32, torch.float64)
            and table.numel() == cells
        )


_EMPTY = torch.zeros(1, dtype=torch.int64)


def _covers(idx: Index, k: int) -> bool:
    """Whether ``idx`` names at least ``k`` keys (what the C kernels read)."""
    if isinstance(idx, RowRun):
        return idx.blocks.numel() * idx.width >= k
    return not isinstance(idx, torch.Tensor) or idx.numel() >= k


def _keys(idx: Index) -> tuple[int, torch.Tensor, int, int]:
    """(mode, keys, start, width) of ``_sketch_c``: explicit keys (0), a run from ``start`` (1), whole blocks of
    ``width`` (2)."""
    if isinstance(idx, RowRun):
        return 2, idx.blocks.to(torch.int64).contiguous(), 0, idx.width
    if isinstance(idx, torch.Tensor):
        return 0, idx.to(torch.int64).contiguous(), 0, 1
    return 1, _EMPTY, idx, 1


def median_rows(est: torch.Tensor, out: torch.Tensor) -> None:
    """Median over dim 0 of a (r, k) tensor into ``out``; for an even r the mean of the two middle values.
    Destroys ``est``. r ≤ 8: odd-even transposition sort by min/max (in place, vectorized over k)."""
    r = est.shape[0]
    if r == 1:
        out.copy_(est[0])
    elif r == 3:  # the default: the middle of three in four passes
        e0, e1, e2 = est
        lo = torch.minimum(e0, e1)
        torch.maximum(e0, e1, out=out)
        torch.minimum(out, e2, out=out)
        torch.maximum(lo, out, out=out)
    elif r <= 8:
        tmp = torch.empty_like(est[0])
        for rnd in range(r):
            for i in range(rnd % 2, r - 1, 2):
                torch.minimum(est[i], est[i + 1], out=tmp)
                torch.maximum(est[i], est[i + 1], out=est[i + 1])
                est[i].copy_(tmp)
        _middle(est, out)
    else:
        _middle(est.sort(0).values, out)


def _middle(srt: torch.Tensor, out: torch.Tensor) -> None:
    r = srt.shape[0]
    if r % 2:
        out.copy_(srt[r // 2])
    else:
        torch.add(srt[r // 2 - 1], srt[r // 2], out=out).mul_(0.5)


def signed64(x: int) -> int:
    """``x`` mod 2^64 as a signed int64."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def splitmix_int(x: int) -> int:
    """splitmix64 finaliser on a Python int: derives each row's (a, b) from the seed."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)
