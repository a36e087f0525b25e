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
hook without compression (DDP's result, through sparsync); ``--hook none`` runs DLRM's DDP untouched;
``--hook none-own-group`` (a diagnostic) gives DDP's own allreduce a process group apart from the alltoall's.
DLRM's own ``SummaryWriter`` is replaced by a no-op (no tensorboard needed). At exit every rank prints the bytes
sparsync's hook sent and the algorithms it ran (its ``CommLog``).

``--shard``: the tables sharded by ``sparsync.shard`` instead of DLRM's model-parallel all-to-all
(docs/sharding.md). Every rank builds every table with the weights DLRM's own path gives it
(``DLRM_Net.create_emb`` once per rank's slice of the tables, each from numpy's state at its start, as that rank
would; numpy's state is then left where this rank's own slice leaves it, so the MLPs and the data are DLRM's
too), ``sparsync.shard`` keeps each rank's rows, and ``DLRM_Net.distributed_forward`` is replaced by the
data-parallel forward: each rank takes its slice of the global batch (DLRM's ``get_my_slice``, as its own path
does for the MLPs and the labels), looks its ids up in the sharded tables (one exchange), and runs the MLPs and
the interaction on its slice. The MLPs stay under DDP (and ``--hook``); the tables' gradient is the sum over the
ranks, as DLRM's own all-to-all backward gives it. At exit every rank prints the exchanges' bytes.

``--shard-fused``: as ``--shard``, with the tables' SGD applied in their backward (``sparsync.shard(...,
optimizer=sparsync.sharding.SGD(lr=P · DLRM's --learning-rate))``: the fused update takes the mean over the
ranks, DLRM's all-to-all the sum, so P times the rate gives DLRM's update). The tables then get no ``.grad``;
DLRM's own optimizer still lists their parameters (its first group, built from ``dlrm.emb_l`` inside ``run()``),
but ``torch.optim.SGD`` skips a parameter without a gradient, so it updates
``sparsync.sharding.dense_parameters(model)`` only. Refused unless DLRM's ``--optimizer`` is ``sgd`` with a
constant rate (no ``--lr-num-warmup-steps``, ``--lr-num-decay-steps``): its scheduler does not reach the fused
rate.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import sparsync
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
    ap.add_argument("--shard", action="store_true", help="the tables sharded by sparsync.shard (see above)")
    ap.add_argument("--shard-fused", action="store_true", help="--shard, the tables' SGD in backward (see above)")
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

    dlrm_argv = argv[cut + 1 :]
    sharded = None
    if a.shard or a.shard_fused:
        sharded = _shard_tables(dlrm_s_pytorch, ext_dist, log, _fused_lr(dlrm_argv) if a.shard_fused else None)

    sys.argv = ["dlrm_s_pytorch.py", *dlrm_argv]
    dlrm_s_pytorch.run()
    report()
    atexit.unregister(report)
    if sharded is not None:
        sharded()
    # DLRM's script leaves its process groups to the interpreter's exit, where gloo may abort the process
    # ("terminate called without an active exception"): its model freed, then the groups destroyed here instead
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def _fused_lr(dlrm_argv: list[str]) -> float:
    """DLRM's constant SGD rate from its arguments, for ``--shard-fused``; an error naming what it cannot take."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--optimizer", default="sgd")
    ap.add_argument("--learning-rate", type=float, default=0.01)  # DLRM's defaults
    ap.add_argument("--lr-num-warmup-steps", type=int, default=0)
    ap.add_argument("--lr-num-decay-steps", type=int, default=0)
    d, _ = ap.parse_known_args(dlrm_argv)
    if d.optimizer != "sgd":
        raise SystemExit(f"--shard-fused applies SGD to the tables; DLRM's --optimizer is {d.optimizer!r}")
    if d.lr_num_warmup_steps or d.lr_num_decay_steps:
        raise SystemExit(
            f"--shard-fused takes a constant rate; DLRM's --lr-num-warmup-steps {d.lr_num_warmup_steps}, "
            f"--lr-num-decay-steps {d.lr_num_decay_steps} schedule it"
        )
    return float(d.learning_rate)


def _tables_as_dlrm(self: Any, create: Any, m: Any, ln: Any, weighted_pooling: Any, P: int, rank: int) -> Any:
    """Every table, each made by ``create`` as its rank in DLRM's model-parallel path makes it: from numpy's state
    at the start, over that rank's slice of the tables; numpy's state left where ``rank``'s own slice leaves it."""
    start = np.random.get_state()
    k, extra = divmod(len(ln), P)
    emb_l, v_w_l, after_mine = [], [], start
    for q in range(P):
        np.random.set_state(start)
        self.local_emb_indices = list(range(q * k + min(q, extra), (q + 1) * k + min(q + 1, extra)))
        e, w = create(self, m, ln, weighted_pooling)
        emb_l.extend(e)
        v_w_l.extend(w)
        if q == rank:
            after_mine = np.random.get_state()
    np.random.set_state(after_mine)
    self.local_emb_indices = list(range(len(ln)))
    return torch.nn.ModuleList(emb_l), v_w_l


def _shard_tables(dlrm_s_pytorch: Any, ext_dist: Any, log: CommLog, fused_lr: float | None) -> Callable[[], None]:
    """Patch DLRM's net (module doc, ``--shard``): every table built, then sharded (with the fused SGD when
    ``fused_lr`` is given); the data-parallel forward. Returns what prints the exchanges' count and bytes."""
    net = dlrm_s_pytorch.DLRM_Net
    create = net.create_emb

    def create_sharded(self: Any, m: Any, ln: Any, weighted_pooling: Any = None) -> Any:
        P, rank = ext_dist.my_size, ext_dist.my_rank
        emb_l, v_w_l = _tables_as_dlrm(self, create, m, ln, weighted_pooling, P, rank)
        opt = None if fused_lr is None else sparsync.sharding.SGD(lr=fused_lr * P)  # the mean's P back: DLRM's sum
        return sparsync.shard(emb_l, log=log, optimizer=opt), v_w_l

    def forward_sharded(self: Any, dense_x: Any, lS_o: Any, lS_i: Any) -> Any:
        mine = ext_dist.get_my_slice(dense_x.size(0))
        offsets, ids = [], []
        for o, i in zip(lS_o, lS_i, strict=True):  # this rank's samples of each table's bags
            start = int(o[mine.start])
            end = int(o[mine.stop]) if mine.stop < o.numel() else i.numel()
            offsets.append(o[mine] - start)
            ids.append(i[start:end])
        x = self.apply_mlp(dense_x[mine], self.bot_l)
        ly = self.apply_emb(offsets, ids, self.emb_l, self.v_W_l)  # stand-ins: one exchange at their first use
        p = self.apply_mlp(self.interact_features(x, ly), self.top_l)
        if 0.0 < self.loss_threshold < 1.0:
            return torch.clamp(p, min=self.loss_threshold, max=1.0 - self.loss_threshold)
        return p

    def report() -> None:
        if dist.is_initialized():
            sent = sum(r.bytes_sent for r in log.records if r.op in ("shard_lookup", "shard_grad"))
            n = len(log.records)
            print(f"sparsync.shard on rank {dist.get_rank()}: {n} exchanges, {sent / 1e6:.2f} MB sent")

    net.create_emb = create_sharded
    net.distributed_forward = forward_sharded
    return report


if __name__ == "__main__":
    main()
