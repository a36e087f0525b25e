"""Gradient compressors with error feedback: S2 sparse sketch, DCT threshold, top-k, QSGD, PowerSGD, ...

Three axes: a ``Compressor`` turns a tensor into a typed ``Payload`` and names the ``Aggregator`` that combines
the ranks' payloads, a ``Memory`` (``ErrorFeedback``) keeps residuals per name, and ``compressed_allreduce``
joins them. See
README, "Compressed reduction", and docs/architecture.md.
"""

from sparsync.compress.base import (
    Aggregator,
    Compressor,
    Context,
    DensePayload,
    Encoding,
    Payload,
    QuantizedPayload,
    ReduceCall,
    SketchPayload,
    SparsePayload,
    TensorSpec,
)
from sparsync.compress.blocktopk import BlockTopK
from sparsync.compress.bucket_powersgd import powersgd_allreduce
from sparsync.compress.cast import BF16, FP16
from sparsync.compress.hooks import compression_hook
from sparsync.compress.identity import Identity
from sparsync.compress.memory import ErrorFeedback, Memory, MomentumCorrection
from sparsync.compress.powersgd import LowRankPayload, PowerSGD
from sparsync.compress.qsgd import QSGD
from sparsync.compress.randomk import RandomK
from sparsync.compress.reduce import compressed_allreduce
from sparsync.compress.registry import COMPRESSORS, REGISTRY, compressor_class, from_spec, make, register
from sparsync.compress.sketch import SparseSketch
from sparsync.compress.sparsifier import Sparsifier
from sparsync.compress.threshold import Threshold
from sparsync.compress.topk import TopK

__all__ = [
    "BF16",
    "COMPRESSORS",
    "FP16",
    "QSGD",
    "REGISTRY",
    "Aggregator",
    "BlockTopK",
    "Compressor",
    "Context",
    "DensePayload",
    "Encoding",
    "ErrorFeedback",
    "Identity",
    "LowRankPayload",
    "Memory",
    "MomentumCorrection",
    "Payload",
    "PowerSGD",
    "QuantizedPayload",
    "RandomK",
    "ReduceCall",
    "SketchPayload",
    "SparsePayload",
    "SparseSketch",
    "Sparsifier",
    "TensorSpec",
    "Threshold",
    "TopK",
    "compressed_allreduce",
    "compression_hook",
    "compressor_class",
    "from_spec",
    "make",
    "powersgd_allreduce",
    "register",
]
