"""The DDP communication hooks' old home: they live in ``sparsync.compress.hooks`` now; this name stays for
existing scripts (``sparsync.hooks.compression_hook``)."""

from sparsync.compress.hooks import Hook, compression_hook

__all__ = ["Hook", "compression_hook"]
