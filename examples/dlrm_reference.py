"""Run facebookresearch/dlrm's own ``dlrm_s_pytorch.py``, as published, with sparsync's DDP hook.

    git clone https://github.com/facebookresearch/dlrm /path/to/dlrm      # plus: pip install tqdm scikit-learn
    torchrun --nproc-per-node 4 examples/dlrm_reference.py /path/to/dlrm --hook threshold -- \\
        --arch-embedding-size 100000-100000-100000-100000 --arch-sparse-feature-size 16 \\
        --arch-mlp-bot 13-512-256-64-16 --arch-mlp-top 512-256-1 --data-generation random \\
        --mini-batch-size 512 --num-batches 40 --dist-backend gloo --print-time --print-freq 10

In DLRM's distributed mode the embedding tables are model-parallel (an alltoall) and the two MLPs are wrapped
in ``DistributedDataParallel`` (``extend_distributed.DDP``). The integration is the two lines a user would add
after those two wraps; this runner adds them by wrapping ``extend_distributed.DDP`` instead of editing DLRM's
file::

    dct = dict(compressor=Threshold(0.01, lifespan=10), memory=ErrorFeedback())
    dlrm.bot_l.register_comm_hook(None, compression_hook(**dct, module=dlrm.bot_l))
    dlrm.top_l.register_comm_hook(None, compression_hook(**dct, module=dlrm.top_l))

That is DCT-DP on the data-parallel MLPs (DCT §3.1, Threshold with life-span L); ``--hook identity`` runs the
hook without compression (DDP's result, through sparsync); ``--hook none`` runs DLRM untouched;
``--hook none-own-group`` (a diagnostic) gives DDP's own allreduce a process group apart from the alltoall's.
DLRM's own ``SummaryWriter`` is replaced by a no-op (no tensorboard needed). At exit every rank prints the bytes
sparsync's hook sent and the algorithms it ran (its ``CommLog``).
"""

from __future__ import annotations

import argparse
import atexit
import sys
import types
from pathlib import Path
from typing import Any

import torch.distributed as dist

from sparsync.compress import ErrorFeedback, Identity, Threshold
from sparsync.compress.hooks import compression_hook
from sparsync.record import CommLog


class _NoWriter:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dlrm_dir", type=Path, help="a checkout of facebookresearch/dlrm")
    ap.add_argument("--hook", choices=("none", "none-own-group", "identity", "threshold"), default="threshold")
    ap.add_argument("--ratio", type=float, default=0.01, help="DCT-DP's η")
    ap.add_argument("--lifespan", type=int, default=10, help="DCT-DP's L")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:cut])  # after "--": dlrm_s_pytorch.py's own arguments
    sys.path.insert(0, str(a.dlrm_dir.resolve()))
    tb = types.ModuleType("torch.utils.tensorboard")
    tb.SummaryWriter = _NoWriter  # type: ignore[attr-defined]
    sys.modules["torch.utils.tensorboard"] = tb

    import extend_distributed as ext_dist  # DLRM's module, from its checkout

    log = CommLog()
    if a.hook == "none-own-group":  # diagnostic: DDP's own allreduce, on a group apart from the alltoall's
        plain = ext_dist.DDP

        def ddp_own_group(module: Any, **kwargs: Any) -> Any:
            return plain(module, process_group=dist.new_group(), **kwargs)

        ext_dist.DDP = ddp_own_group
    elif a.hook != "none":
        wrap = ext_dist.DDP

        def ddp_with_hook(module: Any, **kwargs: Any) -> Any:
            ddp = wrap(module, **kwargs)
            lossy = a.hook == "threshold"
            comp = Threshold(a.ratio, lifespan=a.lifespan) if lossy else Identity()
            ddp.register_comm_hook(None, compression_hook(comp, ErrorFeedback() if lossy else None, module=ddp,
                                                          log=log))  # fmt: skip
            return ddp

        ext_dist.DDP = ddp_with_hook

    def report() -> None:
        if a.hook in ("identity", "threshold") and dist.is_initialized():
            calls = len(log.records)
            sent = sum(r.bytes_sent for r in log.records)
            algs = sorted({r.algorithm for r in log.records})
            print(f"sparsync hook ({a.hook}) on rank {dist.get_rank()}: {calls} reductions, {sent / 1e6:.2f} MB "
                  f"sent, algorithms {algs}")  # fmt: skip

    atexit.register(report)
    import dlrm_s_pytorch

    sys.argv = ["dlrm_s_pytorch.py", *argv[cut + 1 :]]
    dlrm_s_pytorch.run()


if __name__ == "__main__":
    main()
