"""Fresh result buffers that are cheap to write the first time (a decode into a fresh 100 MB result,
or the scatter of a sparse result into one, spent more time in page faults than in its own work).

Large ones are anonymous mappings on transparent huge pages, and a mapping no tensor holds any more is reused
by the next request of its size (``_Pool``) instead of going back to the kernel: on a virtual machine that
reports free memory to its host (virtio-balloon free page reporting), a huge page faulted in after the host
took it back costs an order of magnitude more than a reused one, and a collective whose result is dropped every
call (a benchmark's loop, or a gradient replaced every step) paid that at random (measured:
docs/results_compress.md).
"""

from __future__ import annotations

import contextlib
import mmap

import torch
from torch.multiprocessing.reductions import StorageWeakRef

HUGE_PAGE = 2 << 20  # bytes of a transparent huge page on x86-64 and most arm64 kernels
HUGE_MIN = 8 * HUGE_PAGE  # results from 16 MB up go on huge pages
POOL_BYTES = 1 << 30  # free mappings kept for reuse, at most (the least recently made go first)


def fresh(
    n: int, dtype: torch.dtype = torch.float32, zeros: bool = False, *, device: torch.device | None = None
) -> torch.Tensor:
    """A new 1-D tensor of ``n`` values for a result, zero-filled if ``zeros`` (else uninitialized), on
    ``device`` (default the host).

    From ``HUGE_MIN`` bytes up it is an anonymous mapping advised onto transparent huge pages, where the kernel
    grants them (``madvise`` mode, the default on most Linux distributions): the first write of fresh memory
    then costs several times less than with 4 KiB pages (docs/results_design.md), and a fresh mapping is
    zero already. A mapping of the same size that no tensor holds any more is reused first (module doc).
    Elsewhere, or smaller, ``torch.zeros``/``torch.empty``. The tensor (and any view of it) holds the mapping
    alive. On another device: ``torch.zeros``/``torch.empty`` there (its allocator caches blocks already)."""
    if device is not None and torch.device(device).type != "cpu":
        return torch.zeros(n, dtype=dtype, device=device) if zeros else torch.empty(n, dtype=dtype, device=device)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    nbytes = n * itemsize
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < HUGE_MIN or advise is None:
        cpu = torch.device("cpu")  # named: a caller's default device (``with torch.device(...)``) is not ours
        return torch.zeros(n, dtype=dtype, device=cpu) if zeros else torch.empty(n, dtype=dtype, device=cpu)
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    m = _POOL.take(size)
    if m is None:
        m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        with contextlib.suppress(OSError):  # a kernel without transparent huge pages: 4 KiB pages, as torch's
            m.madvise(advise)
        zeros = False  # a new mapping is zero already
    out = torch.frombuffer(m, dtype=dtype, count=n)
    _POOL.hand_out(m, out)
    return out.zero_() if zeros else out


class _Pool:
    """The mappings ``fresh`` made, the least recently handed out first, each with a weak reference to the
    storage of the tensor it was handed out as (``torch.frombuffer``'s: any view of it shares that storage).
    A mapping whose storage has expired is held by no tensor and is free; free ones beyond ``limit`` bytes are
    dropped (unmapped)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.maps: list[tuple[mmap.mmap, StorageWeakRef]] = []

    def take(self, size: int) -> mmap.mmap | None:
        """A free mapping of exactly ``size`` bytes (removed from the pool until ``hand_out``), or None."""
        for i, (m, ref) in enumerate(self.maps):
            if len(m) == size and _expired(ref):
                del self.maps[i]
                return m
        return None

    def hand_out(self, m: mmap.mmap, out: torch.Tensor) -> None:
        """Track ``m``, now the storage of ``out``; drop the oldest free mappings beyond the limit."""
        self.maps.append((m, StorageWeakRef(out.untyped_storage())))  # type: ignore[no-untyped-call]
        free = [entry for entry in self.maps if _expired(entry[1])]
        excess = sum(len(e[0]) for e in free) - self.limit
        for entry in free:  # oldest first
            if excess <= 0:
                break
            self.maps.remove(entry)
            excess -= len(entry[0])


def _expired(ref: StorageWeakRef) -> bool:
    return bool(ref.expired())  # type: ignore[no-untyped-call]


_POOL = _Pool(POOL_BYTES)  # per process: a cache of free mappings, like torch's own caching allocators
