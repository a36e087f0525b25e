"""Where the user issued a collective: the call site compared across ranks when a call has no ``name=``.

Two calls of one signature (collective, shape, dtype, options) are told apart in the metadata round by their
names; unnamed, by the first frame outside sparsync that issued them: the file's base name, the function's
qualified name and first line, and the bytecode offset of the call (which tells apart two calls on one line).
So rank 2 skipping ``sparse_allreduce(a)`` on line X and calling ``sparse_allreduce(b)`` on line Y raises on
every rank instead of summing A with B. Calls from one line in a loop stay indistinguishable: those need
``name=``. The base name, not the path, so that hosts with the same script at different paths agree.
Measured cost: docs/reliability.md ("call sites").
"""

from __future__ import annotations

import os
import sys
import zlib
from dataclasses import dataclass
from types import FrameType

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


@dataclass(frozen=True)
class CallSite:
    key: int  # 62-bit key compared across ranks (0: unknown, e.g. a hook called from C++ with no Python caller)
    file: str = ""  # base name
    line: int = 0
    function: str = ""

    @property
    def known(self) -> bool:
        return self.key != 0

    @property
    def where(self) -> str:
        """ "file.py:line in function", for messages (built only when one is raised)."""
        return f"{self.file}:{self.line} in {self.function}" if self.known else "an unknown place"


UNKNOWN = CallSite(0)


def call_site() -> CallSite:
    """The first frame outside the sparsync package on this thread's stack (call it in the caller's thread, at
    issue time: an async call runs on the queue thread)."""
    f: FrameType | None = sys._getframe(1)
    while f is not None and f.f_code.co_filename.startswith(_PACKAGE):
        f = f.f_back
    if f is None:
        return UNKNOWN
    code = f.f_code
    base = os.path.basename(code.co_filename)
    # crc32, not text_key's blake2b: this runs on every unnamed call (a few µs saved per call); the bytecode
    # offset goes into the low bits whole, so two calls of one function never collide
    func = zlib.crc32(f"{base}:{code.co_qualname}:{code.co_firstlineno}".encode())
    key = ((func << 28) | (f.f_lasti & ((1 << 28) - 1))) & ((1 << 62) - 1) | (1 << 61)
    return CallSite(key, base, f.f_lineno, code.co_qualname)
