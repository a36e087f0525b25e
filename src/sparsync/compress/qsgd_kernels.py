"""QSGD's kernels (``Workspace``): encode (per-bucket scale, stochastic rounding, packing) and decode-sum, in
C where the extension ``_qsgd_c`` is built (``pip install`` compiles it; ``QSGD(kernels=...)`` chooses) and in
vectorized torch otherwise. The two give the same bits for finite inputs (tested); the torch kernels are the
reference and the fallback where no compiler was found.

Torch: passes over chunks of 512K values (``CHUNK``: a chunk's passes stay in L2/L3 and no tensor-sized
temporary is allocated, a fresh 100 MB buffer costing more in page faults than the arithmetic on it; 128K chunks
paid 20% more in per-op dispatch). Codes are packed with integer shifts on int32 / int64 views of int16 codes
(little-endian layout, as on every platform torch runs on) and decoded by one ``index_select`` per byte from a
256-entry table of that byte's ``8 // bits`` levels. C (``_qsgd_c.c``): one fused pass per bucket, the same
float32 operations in the same order (compiled without multiply-add contraction), with an AVX2 clone where
the CPU has it (its speed against the torch kernels: docs/results_compress.md).

Rounding noise: 16 bits per value, value i of an encode call (one chunk) taking bits 16·(i mod 4) .. +15 of
splitmix64's output function of seed + (⌊i/4⌋ + 1)·γ, γ = 0x9E3779B97F4A7C15, the seed one 64-bit draw from the
call's generator. A counter-based stream, so C computes it word by word where it is used, and torch with int64
tensor arithmetic (``noise_words``). The rounding is unbiased up to 2^-17 of a quantization step (module doc of
qsgd.py).
"""

from __future__ import annotations

from typing import Any

import torch

from sparsync.compress.base import native_for

try:  # built by `pip install` (setup.py); optional: the torch kernels are the fallback
    from sparsync.compress import _qsgd_c as _native
except ImportError:  # pragma: no cover - only without a C compiler
    _native = None  # type: ignore[assignment]

CHUNK = 1 << 19  # values per noise chunk, and per kernel pass on the host (module doc)
PASS = 1 << 25  # values per kernel pass on another device (a GPU): whole noise chunks (module doc)
_GAMMA = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_MASK64 = (1 << 64) - 1


def native_available() -> bool:
    """Whether the C kernels were built (``QSGD(kernels="auto")`` uses them then)."""
    return _native is not None


def chunk_values(bucket: int, unit: int) -> int:
    """Values per kernel pass: whole buckets, a whole number of aligned units (codes start on a byte)."""
    return max(unit, CHUNK // bucket // unit * unit) * bucket


def chunks_per_pass(device: torch.device) -> int:
    """Noise chunks that one pass of the torch kernels covers on ``device``: one on the host (a chunk's passes
    stay in cache), ``PASS // CHUNK`` elsewhere: a GPU's kernels are bound by launches, not cache (measured:
    docs/gpu.md). The bits are the same: each noise chunk keeps
    its own draw."""
    return 1 if device.type == "cpu" else max(1, PASS // CHUNK)


def noise_words(seed: int, words: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The call's ``words`` 64-bit noise words (int64; the module doc's stream), by int64 tensor arithmetic
    (multiplication wraps mod 2^64; logical shifts as arithmetic shifts and a mask), on ``out``'s device (the
    host without ``out``): a counter-based stream, the same words on every device."""
    device = out.device if out is not None else torch.device("cpu")
    z = torch.arange(1, words + 1, dtype=torch.int64, out=out, device=device)
    return _mix(z.mul_(_signed(_GAMMA)).add_(_signed(seed)))


def chunked_noise_words(seeds: list[int], chunk_words: int, words: int, out: torch.Tensor) -> torch.Tensor:
    """``noise_words`` of consecutive noise chunks of ``chunk_words`` words each (the last may be shorter),
    chunk i drawn with ``seeds[i]``, in one pass: the words of one ``noise_words`` call per chunk."""
    z = torch.arange(words, dtype=torch.int64, out=out[:words])
    chunk = torch.div(z, chunk_words, rounding_mode="floor")
    offsets = torch.tensor([_signed(s) for s in seeds], dtype=torch.int64).to(z.device)
    z.sub_(chunk * chunk_words).add_(1).mul_(_signed(_GAMMA)).add_(offsets[chunk])
    return _mix(z)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function, in place on int64 words."""
    for shift, mult in ((30, _M1), (27, _M2), (31, None)):
        z.bitwise_xor_(torch.bitwise_right_shift(z, shift).bitwise_and_((1 << (64 - shift)) - 1))
        if mult is not None:
            z.mul_(_signed(mult))
    return z


def _signed(u: int) -> int:
    u &= _MASK64
    return u - (1 << 64) if u >= 1 << 63 else u


class Workspace:
    """Scratch buffers of one call of ``q`` (a QSGD; typed Any: qsgd.py imports this module) on ``device``
    (default the host), sized for one chunk and reused by every chunk. The C kernels serve CPU tensors; on
    another device the torch kernels run (``kernels="c"`` raises)."""

    def __init__(self, q: Any, n: int, device: torch.device | None = None) -> None:
        self.bits, self.bucket, self.s, self.l2 = q.bits, q.bucket, q.levels, q.scale == "l2"
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.step = chunk_values(q.bucket, q.unit())  # values per noise chunk (one draw each)
        self.pass_values = self.step * chunks_per_pass(self.device)  # values per pass of the kernels
        self.chunk = min(n, self.pass_values)  # the scratch's size
        self.native = native_for("QSGD", q.kernels, _native is not None, self.device)
        host = torch.device("cpu")
        self.tmp = torch.empty(self.chunk if self.native else 0, dtype=torch.uint8, device=host)  # C's codes
        self._torch: _TorchBuffers | None = None
        # The generator is a CPU one on every device (the same noise seeds as on the host): one 64-bit draw per
        # chunk, read on the host.
        self._draw = torch.empty(1, dtype=torch.int64, device=host)

    def quantize(self, x: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor, gen: torch.Generator) -> None:
        """Scales (one per bucket) and packed codes of the pass ``x`` (whole noise chunks, the last one may be
        short): one 64-bit draw from ``gen`` per noise chunk."""
        k = x.numel()
        seeds = [
            int(self._draw.random_(-(2**63), None, generator=gen)[0]) & _MASK64 for _ in range(-(-k // self.step))
        ]
        if self.native and not self.l2:
            xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()
            _check(scales, torch.float32, -(-k // self.bucket))
            _check(codes, torch.uint8, -(-k * self.bits // 8))
            assert _native is not None
            for i, seed in enumerate(seeds):  # one chunk per call (a host pass is one chunk)
                a, m = i * self.step, min(self.step, k - i * self.step)
                _native.encode(
                    xf.data_ptr() + 4 * a, m, self.bucket, self.bits, seed,
                    scales.data_ptr() + 4 * (a // self.bucket), codes.data_ptr() + a * self.bits // 8,
                    self.tmp.data_ptr(),
                )  # fmt: skip
            return
        t = self._buffers()
        t.encode(self, x, scales, seeds)
        t.pack(self.bits, k, codes)

    def decode_into(
        self,
        payloads: list[Any],
        a: int,
        b: int,
        out: torch.Tensor,
        first: torch.Tensor | None = None,
    ) -> None:
        """out = first + Σ_p decode(p)[a:b] (float32; ``first``, if given: values [a, b) of an exact term, added
        first); [a, b) a chunk of ``QSGD._chunks``, payloads ``QuantizedPayload``s of the whole tensor."""
        B, bits, k = self.bucket, self.bits, b - a
        nb = -(-k // B)
        codes = [p.codes[a * bits // 8 : -(-b * bits // 8)] for p in payloads]
        scales = [p.scales[a // B : a // B + nb] for p in payloads]
        if self.native and out.is_contiguous() and out.dtype == torch.float32 and out.numel() >= k:
            if first is not None and (first.dtype != torch.float32 or not first.is_contiguous()):
                first = first.to(torch.float32).contiguous()
            if first is not None:
                _check(first, torch.float32, k)
            for c, s in zip(codes, scales, strict=True):
                _check(c, torch.uint8, -(-k * bits // 8))
                _check(s, torch.float32, nb)
            assert _native is not None
            _native.decode_sum(
                [c.data_ptr() for c in codes], [s.data_ptr() for s in scales],
                0 if first is None else first.data_ptr(), k, B, bits, out.data_ptr(),
            )  # fmt: skip
            return
        self._buffers().decode_into(self, codes, scales, k, out, first)

    def _buffers(self) -> _TorchBuffers:
        if self._torch is None:
            self._torch = _TorchBuffers(self.bits, self.s, self.chunk, self.device)
        return self._torch


def _check(t: torch.Tensor, dtype: torch.dtype, numel: int) -> None:
    """What the C kernels assume of a buffer they are handed a pointer to."""
    if t.dtype != dtype or not t.is_contiguous() or t.numel() < numel:
        raise ValueError(f"QSGD kernel buffer: want {numel} contiguous {dtype}, got {t.numel()} of {t.dtype}")


class _TorchBuffers:
    """The torch kernels' scratch (module doc)."""

    def __init__(self, bits: int, s: int, chunk: int, device: torch.device) -> None:
        words = -(-chunk // 4)
        d = device
        self.noise = torch.empty(words, dtype=torch.int64, device=d)  # 4 x 16 random bits per word
        self._words: torch.Tensor | None = None  # one chunk's words, when chunks do not start on a word
        self.codes = torch.empty(words * 4, dtype=torch.int16, device=d)  # room to pad a chunk to int64 words
        self.f = torch.empty(chunk, dtype=torch.float32, device=d)
        self.prod = torch.empty(chunk, dtype=torch.float32, device=d)
        self.wide = torch.empty(words * 2, dtype=torch.int64, device=d)
        per = 8 // bits  # decode: the levels of every byte value, per codes a byte (first in the low bits)
        byte = torch.arange(256, dtype=torch.int32, device=d).unsqueeze(1)
        codes = byte.bitwise_right_shift(torch.arange(per, dtype=torch.int32, device=d) * bits) & ((1 << bits) - 1)
        lut = (codes - s).to(torch.float32)  # (256, per)
        self.lut = lut.view(256) if per == 1 else lut
        self.idx = torch.empty(-(-chunk * bits // 8), dtype=torch.int32, device=d)
        self.lvl = torch.empty(self.idx.numel() * per, dtype=torch.float32, device=d)

    def encode(self, ws: Workspace, x: torch.Tensor, scales: torch.Tensor, seeds: list[int]) -> None:
        """Codes q + s of the pass ``x`` into ``self.codes`` and its bucket scales into ``scales``; noise chunk
        i (``ws.step`` values) rounded with the words of ``seeds[i]``."""
        k, B = x.numel(), ws.bucket
        noise = self._noise(ws.step, k, seeds)
        full = k // B * B
        if full:
            self._round(ws, x[:full].view(-1, B), scales[: full // B], self.codes[:full].view(-1, B), noise[:full])
        if full < k:  # the tensor's last, partial bucket
            self._round(
                ws, x[full:].view(1, -1), scales[full // B :], self.codes[full:k].view(1, -1), noise[full:k]
            )

    def _noise(self, step: int, k: int, seeds: list[int]) -> torch.Tensor:
        """16 noise bits (int16) for each of the pass's ``k`` values: value j of noise chunk i takes the bits of
        the module doc's stream of ``seeds[i]`` at position j."""
        words = -(-k // 4)
        if len(seeds) == 1:
            return noise_words(seeds[0], words, out=self.noise[:words]).view(torch.int16)
        if step % 4 == 0:  # every chunk starts on a word: all chunks' words in one pass
            return chunked_noise_words(seeds, step // 4, words, self.noise).view(torch.int16)
        bits = self.noise.view(torch.int16)
        for i, seed in enumerate(seeds):  # a chunk starting inside a word: one chunk at a time
            a, m = i * step, min(step, k - i * step)
            own = noise_words(seed, -(-m // 4), out=self.scratch_words(-(-m // 4)))
            bits[a : a + m] = own.view(torch.int16)[:m]
        return bits

    def scratch_words(self, words: int) -> torch.Tensor:
        if self._words is None or self._words.numel() < words:
            self._words = torch.empty(words, dtype=torch.int64, device=self.noise.device)
        return self._words[:words]

    def _round(
        self, ws: Workspace, x: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor, noise: torch.Tensor
    ) -> None:
        xf = x if x.dtype == torch.float32 else x.to(torch.float32)
        s = ws.s
        k = xf.numel()
        t = self.f[:k].view_as(xf)  # scratch: |x| here, then the rounded levels (no fresh chunk-sized temporary)
        S = torch.linalg.vector_norm(xf, dim=1) if ws.l2 else torch.abs(xf, out=t).amax(1)
        scales.copy_(S)
        inv = torch.where(S > 0, s / S, torch.zeros_like(S)).unsqueeze(1)  # a zero bucket: code s, value 0
        # code = floor(v·s/S + s + u) with u = (r + 32768.5) / 2^16 ∈ (0, 1), r a uniform int16: rounds up
        # with probability frac(v·s/S) ± 2^-17. t ≥ 0, so the float -> int16 conversion's truncation floors.
        t.copy_(noise.view_as(xf)).mul_(2.0**-16).add_(s + 0.5 + 2.0**-17)
        prod = torch.mul(xf, inv, out=self.prod[:k].view_as(xf))  # not addcmul_: its tail may fuse (C's bits)
        t.add_(prod).clamp_(0, 2 * s)  # clamp: float rounding at ±S must not leave [0, 2s]
        codes.copy_(t)

    def pack(self, bits: int, k: int, out: torch.Tensor) -> None:
        """Pack the first ``k`` codes of ``self.codes``, ``8 // bits`` to a byte (first in the low bits)."""
        per = 8 // bits
        if per == 1:
            out[:k].copy_(self.codes[:k])
            return
        m = -(-k // per)
        self.codes[k : m * per] = 0
        # An int32 (int64) word holds 2 (4) int16 codes c_j at bit 16j; shifting it right by j·(16 - bits)
        # brings c_j to bit j·bits. OR the shifted copies; the narrowing to uint8 keeps the low byte.
        word = self.codes[: m * per].view(torch.int32 if per == 2 else torch.int64)
        tmp = self.wide[:m] if per == 4 else self.wide.view(torch.int32)[:m]
        for j in range(1, per):
            word.bitwise_or_(torch.bitwise_right_shift(word, j * (16 - bits), out=tmp))
        out[:m].copy_(word)

    def levels(self, bits: int, packed: torch.Tensor, k: int, dst: torch.Tensor) -> None:
        """dst (float32, k values) = the levels q = code - s of ``packed`` bytes, exact small integers: one
        table lookup per byte (``index_select`` of the byte's ``8 // bits`` levels, read as one 4-, 8- or
        16-byte word), the inverse of ``pack``."""
        per, m = 8 // bits, packed.numel()
        idx = self.idx[:m]
        idx.copy_(packed)
        aligned = k == m * per and dst.storage_offset() % per == 0  # dst viewed as words of per levels
        lvl = dst if aligned else self.lvl[: m * per]
        if per == 1:
            torch.index_select(self.lut, 0, idx, out=lvl)
        elif per == 2:
            torch.index_select(self.lut.view(torch.int64).view(-1), 0, idx, out=lvl.view(torch.int64))
        else:
            torch.index_select(self.lut.view(torch.int64), 0, idx, out=lvl.view(torch.int64).view(m, 2))
        if not aligned:
            dst.copy_(lvl[:k])

    def decode_into(
        self,
        ws: Workspace,
        codes: list[torch.Tensor],
        scales: list[torch.Tensor],
        k: int,
        out: torch.Tensor,
        first: torch.Tensor | None,
    ) -> None:
        B = ws.bucket
        full = k // B * B
        if first is not None:
            out.copy_(first)
        for i, (c, sc) in enumerate(zip(codes, scales, strict=True)):
            # a tensor divisor: CUDA divides by a Python scalar as a multiply by its reciprocal (other bits)
            step = sc / torch.full_like(sc, ws.s)
            dst = out if i == 0 and first is None else self.f[:k]
            self.levels(ws.bits, c, k, dst)  # exact q; one rounding: q·(S/s)
            if full:
                dst[:full].view(-1, B).mul_(step[: full // B].unsqueeze(1))
            if full < k:
                dst[full:].mul_(step[-1])
            if dst is not out:
                out.add_(dst)
