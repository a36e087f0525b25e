"""Fresh result buffers that are cheap to write the first time (a decode into a fresh 100 MB result,
or the scatter of a sparse result into one, spent more time in page faults than in its own work)."""

from __future__ import annotations

import contextlib
import mmap

import torch

HUGE_PAGE = 2 << 20  # bytes of a transparent huge page on x86-64 and most arm64 kernels
HUGE_MIN = 8 * HUGE_PAGE  # results from 16 MB up go on huge pages


def fresh(n: int, dtype: torch.dtype = torch.float32, zeros: bool = False) -> torch.Tensor:
    """A new 1-D CPU tensor of ``n`` values for a result, zero-filled if ``zeros`` (else uninitialized).

    From ``HUGE_MIN`` bytes up it is an anonymous mapping advised onto transparent huge pages, where the kernel
    grants them (``madvise`` mode, the default on most Linux distributions): the first write of fresh memory
    then costs several times less than with 4 KiB pages (docs/results_design.md), and a fresh mapping is
    zero already, so ``zeros`` costs nothing more. Elsewhere, or
    smaller, ``torch.zeros``/``torch.empty``. The tensor (and any view of it) holds the mapping alive."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    nbytes = n * itemsize
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < HUGE_MIN or advise is None:
        return torch.zeros(n, dtype=dtype) if zeros else torch.empty(n, dtype=dtype)
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # a kernel without transparent huge pages: 4 KiB pages, as torch's
        m.madvise(advise)
    return torch.frombuffer(m, dtype=dtype, count=n)
