"""Workers for test_lightning.py (module-level: ``launch`` pickles them). Each case trains one small
LightningModule (a sparse-gradient table, a sparse-gradient bag, a dense layer) twice from the same seed on the
same samples: once by ``Trainer(strategy=SparsyncStrategy(...))`` and once by the hand-written loop that the
case's path stands for (``DistributedOptimizer``, ``sparsync.shard``, DDP with ``compression_hook``), and returns
both runs' parameters."""

from __future__ import annotations

import traceback
from collections import defaultdict
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import sparsync
from sparsync import sharding
from sparsync.compress import ErrorFeedback, TopK
from sparsync.compress.hooks import compression_hook
from sparsync.integrations.lightning import SparsyncStrategy

SAMPLES, BATCH, EPOCHS = 24, 4, 2
SHARD_PLAN = {"emb": "sharded", "bag": "sharded"}


class Net(pl.LightningModule):
    """A sparse-gradient table, a sparse-gradient bag and a linear layer over both; Adagrad (it takes sparse
    gradients). ``optimizer``: what ``configure_optimizers`` returns instead, for the misuse cases; ``seed``:
    of the initial parameters."""

    def __init__(self, optimizer: Callable[[nn.Module], Any] | None = None, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(40, 4, sparse=True)
        self.bag = nn.EmbeddingBag(24, 4, mode="sum", sparse=True)
        self.fc = nn.Linear(8, 1)
        self._optimizer = optimizer

    def forward(self, a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        looked = [self.emb(a), self.bag(c)]  # both looked up before either is used: one exchange when sharded
        return self.fc(torch.cat([looked[0].sum(1), looked[1]], 1)).squeeze(1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        a, c, y = batch
        return (self(a, c) - y).square().mean()

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.training_step(batch, batch_idx), sync_dist=True)

    def configure_optimizers(self) -> Any:
        if self._optimizer is not None:
            return self._optimizer(self)
        return torch.optim.Adagrad(self.parameters(), lr=0.1)


class Deterministic(pl.Callback):
    """``sparsync.set_deterministic()`` in the ``setup`` hook: the first point of a fit where the group exists
    when Lightning launches the ranks and makes it."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        sparsync.set_deterministic()


def dataset() -> TensorDataset:
    """The same samples on every rank; each rank trains on its DistributedSampler's share."""
    g = torch.Generator().manual_seed(7)
    a = torch.randint(0, 40, (SAMPLES, 3), generator=g)
    c = torch.randint(0, 24, (SAMPLES, 2), generator=g)
    return TensorDataset(a, c, torch.randn(SAMPLES, generator=g))


def _trainer(strategy: SparsyncStrategy, **kwargs: Any) -> pl.Trainer:
    options = {"devices": 1, "max_epochs": EPOCHS, "enable_checkpointing": False, **kwargs}
    return pl.Trainer(
        strategy=strategy, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        **options,
    )  # fmt: skip


def _params(model: nn.Module) -> dict[str, np.ndarray]:
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def lightning_run(case: str, accumulate: int, precision: str, **trainer_options: Any) -> dict[str, np.ndarray]:
    """``fit`` under ``SparsyncStrategy``; Lightning puts its DistributedSampler on the loader.
    ``trainer_options``: more of the Trainer's (``gradient_clip_val``, ``devices``)."""
    module = Net()
    if case == "hook":
        hook = compression_hook(TopK(0.5), ErrorFeedback(), module=module)
        strategy = SparsyncStrategy(comm_hook=hook)
    else:
        strategy = SparsyncStrategy(shard_plan=SHARD_PLAN if case == "shard" else None)
    trainer = _trainer(strategy, accumulate_grad_batches=accumulate, precision=precision, **trainer_options)
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH))
    return _params(module)


def plain_run(
    case: str, accumulate: int, precision: str, rank: int, world: int, clip: tuple[str, float] | None = None
) -> dict[str, np.ndarray]:
    """The loop a sparsync user writes by hand, on the same samples (the sampler Lightning inserts in
    training: shuffled, seed 0), with Lightning's accumulation: the loss divided by ``accumulate``, a step every
    ``accumulate`` batches and at the epoch's last batch, the micro-batches before a step inside
    ``no_sync()``; Lightning's precision: "64-true" the module and the float inputs in float64, "bf16-mixed"
    the forward and the loss under ``torch.autocast("cpu", torch.bfloat16)``, backward outside it; ``clip``:
    (algorithm, value) of ``DistributedOptimizer.clip_grad_norm_`` / ``clip_grad_value_`` before each step."""
    model = Net().double() if precision == "64-true" else Net()
    if case == "hook":
        call: nn.Module = nn.parallel.DistributedDataParallel(model)
        call.register_comm_hook(None, compression_hook(TopK(0.5), ErrorFeedback(), module=model))
        opt: Any = torch.optim.Adagrad(model.parameters(), lr=0.1)
    else:
        if case == "shard":
            sparsync.shard(model, plan=SHARD_PLAN)
        call = model
        opt = sparsync.DistributedOptimizer(torch.optim.Adagrad(model.parameters(), lr=0.1), model)
    sampler = DistributedSampler(dataset(), num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset(), batch_size=BATCH, sampler=sampler)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for i, (a, c, y) in enumerate(loader):
            stepping = (i + 1) % accumulate == 0 or i + 1 == len(loader)
            y = y.double() if precision == "64-true" else y
            with nullcontext() if stepping else call.no_sync() if case == "hook" else opt.no_sync():
                with torch.autocast("cpu", torch.bfloat16) if precision == "bf16-mixed" else nullcontext():
                    loss = (call(a, c) - y).square().mean()
                (loss / accumulate).backward()
            if stepping:
                if clip is not None:
                    (opt.clip_grad_norm_ if clip[0] == "norm" else opt.clip_grad_value_)(clip[1])
                opt.step()
                opt.zero_grad()
    return _params(model)


def compare_worker(rank: int, cases: tuple[tuple[str, int, str], ...]) -> dict[str, Any]:
    """Per (case, accumulate_grad_batches, precision): Lightning's parameters and the plain loop's, and the
    first parameters (to check that training moved them)."""
    sparsync.set_deterministic()
    world = torch.distributed.get_world_size()
    out: dict[str, Any] = {"start": _params(Net())}
    for case, accumulate, precision in cases:
        out[f"{case}/{accumulate}/{precision}"] = {
            "lightning": lightning_run(case, accumulate, precision),
            "plain": plain_run(case, accumulate, precision, rank, world),
        }
    return out


def validate_worker(rank: int) -> dict[str, Any]:
    """``trainer.validate`` of a module whose ranks start apart (seeded by rank), with both tables sharded: the
    strategy shards the tables (each rank's rows from rank 0's table) and broadcasts rank 0's linear layer.
    Returns the parameters after, rank 0's module as it was, the logged loss and rank 0's module's loss on
    the whole data set, in one process."""
    module = Net(seed=rank)
    trainer = _trainer(SparsyncStrategy(shard_plan=SHARD_PLAN))
    metrics = trainer.validate(module, DataLoader(dataset(), batch_size=BATCH), verbose=False)
    a, c, y = dataset().tensors
    whole = float((Net(seed=0)(a, c) - y).square().mean())  # every sample once: 24 of them, 12 a rank at P = 2
    return {"after": _params(module), "rank0": _params(Net(seed=0)), "val_loss": metrics[0]["val_loss"],
            "whole": whole}  # fmt: skip


def hook_calls(strategy: type[DDPStrategy]) -> int:
    """How often DDP called a comm hook during a fit under ``strategy(<the hook>)`` (Lightning's ``DDPStrategy``
    takes it as ``ddp_comm_hook``, ``SparsyncStrategy`` as ``comm_hook``)."""
    calls = []

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP refuses string annotations (future import)
        calls.append(bucket.index())
        return default_hooks.allreduce_hook(None, bucket)

    kwargs = {"comm_hook" if strategy is SparsyncStrategy else "ddp_comm_hook": hook}
    _trainer(strategy(**kwargs)).fit(Net(), DataLoader(dataset(), batch_size=BATCH))
    return len(calls)


def _fit_wrapped() -> str:
    """configure_optimizers returning a DistributedOptimizer of its own: the trainer's optimizer is that one."""
    made = []

    def wrapped(m: nn.Module) -> sparsync.DistributedOptimizer:
        made.append(sparsync.DistributedOptimizer(torch.optim.Adagrad(m.parameters(), lr=0.1), m))
        return made[0]

    trainer = _trainer(SparsyncStrategy())
    trainer.fit(Net(optimizer=wrapped), DataLoader(dataset(), batch_size=BATCH))
    return f"the same: {trainer.optimizers == made}"


def _fit_twice() -> None:
    module = Net()
    for _ in range(2):
        _trainer(SparsyncStrategy()).fit(module, DataLoader(dataset(), batch_size=BATCH))


class NotATorchOptimizer:
    """An optimizer of its own that Lightning accepts from configure_optimizers (its ``Optimizable``
    protocol: param_groups, defaults, state, step, zero_grad, state_dict, load_state_dict)."""

    def __init__(self, params: Any) -> None:
        self.param_groups = [{"params": list(params)}]
        self.defaults: dict[str, Any] = {}
        self.state: defaultdict[torch.Tensor, Any] = defaultdict(dict)

    def step(self, closure: Any = None) -> None: ...

    def zero_grad(self) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def _fit(strategy: SparsyncStrategy, module: Net | None = None, **trainer_options: Any) -> None:
    _trainer(strategy, **trainer_options).fit(module or Net(), DataLoader(dataset(), batch_size=BATCH))


def misuse_worker(rank: int) -> dict[str, Any]:
    """The error each misuse raises (or "no error"), and how often each strategy's comm hook ran."""
    cases: dict[str, Callable[[], Any]] = {
        "not_torch_optimizer": lambda: _trainer(SparsyncStrategy()).fit(
            Net(optimizer=lambda m: NotATorchOptimizer(m.parameters())), DataLoader(dataset(), batch_size=BATCH)
        ),
        "precision": lambda: _trainer(SparsyncStrategy(), precision="16-true").fit(
            Net(), DataLoader(dataset(), batch_size=BATCH)
        ),
        "already_wrapped": _fit_wrapped,
        "fit_twice": _fit_twice,
        "hook_and_shard": lambda: SparsyncStrategy(comm_hook=lambda s, b: None, shard_plan={}),
        "two_automatic": lambda: _fit(SparsyncStrategy(), Net(optimizer=two_optimizers)),
        "clip_sparse_hook": lambda: _fit(
            SparsyncStrategy(comm_hook=default_hooks.allreduce_hook), gradient_clip_val=0.05
        ),
        "checkpoint_local": lambda: _fit(
            SparsyncStrategy(shard_plan=SHARD_PLAN, shard_options={"state_dict": "local"}),
            enable_checkpointing=True,
        ),
        "checkpoint_fused": lambda: _fit(
            SparsyncStrategy(shard_plan=SHARD_PLAN, shard_options={"optimizer": sharding.Adagrad(lr=0.1)}),
            enable_checkpointing=True,
        ),
        "ddp_options_without_hook": lambda: SparsyncStrategy(ddp_options={"find_unused_parameters": True}),
    }
    out: dict[str, Any] = {"hook_calls": {s.__name__: hook_calls(s) for s in (DDPStrategy, SparsyncStrategy)}}
    for name, fn in cases.items():
        try:
            out[name] = f"no error, {fn()}"
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def clip_worker(rank: int, cases: tuple[tuple[str, str, float], ...]) -> dict[str, Any]:
    """Per (path, gradient_clip_algorithm, gradient_clip_val): ``fit`` with the Trainer's clipping, the plain loop
    clipping through ``DistributedOptimizer`` before each step, and the plain loop without clipping (to check
    that the clipping acted); and ``two_optimizers_worker``'s runs under "two_optimizers"."""
    sparsync.set_deterministic()
    world = torch.distributed.get_world_size()
    out: dict[str, Any] = {"start": _params(Net())}
    for case, algorithm, value in cases:
        out[f"{case}/{algorithm}/{value}"] = {
            "lightning": lightning_run(
                case, 1, "32-true", gradient_clip_val=value, gradient_clip_algorithm=algorithm
            ),
            "plain": plain_run(case, 1, "32-true", rank, world, clip=(algorithm, value)),
            "unclipped": plain_run(case, 1, "32-true", rank, world),
        }
    out["two_optimizers"] = two_optimizers_worker(rank)
    return out


class TwoOptimizers(Net):
    """Manual optimisation (Lightning's way to several optimizers): Adagrad on the tables, SGD with momentum on
    the linear layer; ``clip_gradients`` clips the tables' (sparse) gradients by norm and the linear layer's by
    value before the steps."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        tables, top = self.optimizers()  # type: ignore[attr-defined]  # a list: configure_optimizers gave two
        loss = super().training_step(batch, batch_idx)
        tables.zero_grad()
        top.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(tables, gradient_clip_val=CLIPS[0], gradient_clip_algorithm="norm")  # type: ignore[arg-type]
        self.clip_gradients(top, gradient_clip_val=CLIPS[1], gradient_clip_algorithm="value")  # type: ignore[arg-type]
        tables.step()
        top.step()
        return loss

    def configure_optimizers(self) -> Any:
        return two_optimizers(self)


CLIPS = (0.05, 0.01)  # TwoOptimizers' clipping: the tables' gradient norm, the linear layer's values
# the gradients reduced in step() or in the clipping, whichever comes first, and summed: reduced a second time
# (a clipping that ran on a copy of the optimizer's attributes, as a LightningOptimizer holds), they double
OPTIONS_OF_TWO = {"overlap": False, "op": "sum"}


def two_optimizers(m: Any) -> list[torch.optim.Optimizer]:
    """Adagrad on ``m``'s tables, SGD with momentum on its linear layer."""
    tables = [*m.emb.parameters(), *m.bag.parameters()]
    return [torch.optim.Adagrad(tables, lr=0.1), torch.optim.SGD(m.fc.parameters(), lr=0.05, momentum=0.9)]


def two_optimizers_worker(rank: int) -> dict[str, Any]:
    """``fit`` of ``TwoOptimizers`` (each optimizer wrapped in a ``DistributedOptimizer`` of its own) and the
    plain loop with two ``DistributedOptimizer``s stepping in the same order, on the same samples; both with
    ``OPTIONS_OF_TWO``."""
    sparsync.set_deterministic()
    module = TwoOptimizers()
    trainer = _trainer(SparsyncStrategy(optimizer_options=OPTIONS_OF_TWO))
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH))
    kinds = [type(o).__name__ for o in trainer.optimizers]
    model = Net()
    opts = [sparsync.DistributedOptimizer(o, model, **OPTIONS_OF_TWO) for o in two_optimizers(model)]
    world = torch.distributed.get_world_size()
    sampler: DistributedSampler[Any] = DistributedSampler(dataset(), num_replicas=world, rank=rank, seed=0)
    loader = DataLoader(dataset(), batch_size=BATCH, sampler=sampler)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for a, c, y in loader:
            for opt in opts:
                opt.zero_grad()
            (model(a, c) - y).square().mean().backward()
            opts[0].clip_grad_norm_(CLIPS[0])
            opts[1].clip_grad_value_(CLIPS[1])
            for opt in opts:
                opt.step()
    return {"start": _params(Net()), "lightning": _params(module), "plain": _params(model), "kinds": kinds}


def checkpoint_worker(rank: int, root: str, cases: tuple[str, ...]) -> dict[str, Any]:
    """Per path: a ``fit`` of ``EPOCHS`` epochs with ``ModelCheckpoint`` saving after each, and a ``fit`` of a
    module from another seed resumed (``ckpt_path``) from the first epoch's checkpoint to the same end; their
    parameters, and (rank 0) the shapes of the first checkpoint's tables and their Adagrad sums."""
    sparsync.set_deterministic()
    out: dict[str, Any] = {}
    for case in cases:
        shard_plan = SHARD_PLAN if case == "shard" else None
        saves = ModelCheckpoint(dirpath=f"{root}/{case}", filename="{epoch}", save_top_k=-1)
        module = Net()
        trainer = _trainer(SparsyncStrategy(shard_plan=shard_plan), enable_checkpointing=True, callbacks=[saves])
        trainer.fit(module, DataLoader(dataset(), batch_size=BATCH))
        resumed = Net(seed=5)
        first = f"{root}/{case}/epoch=0.ckpt"
        saves = ModelCheckpoint(dirpath=f"{root}/{case}/resumed")
        trainer = _trainer(SparsyncStrategy(shard_plan=shard_plan), enable_checkpointing=True, callbacks=[saves])
        trainer.fit(resumed, DataLoader(dataset(), batch_size=BATCH), ckpt_path=first)
        saved = torch.load(first, weights_only=False) if rank == 0 else None
        shapes = {}
        if saved is not None:
            sums = [s["sum"] for s in saved["optimizer_states"][0]["state"].values()]
            shapes = {
                "emb.weight": tuple(saved["state_dict"]["emb.weight"].shape),
                "sums": [tuple(t.shape) for t in sums],
            }
        out[case] = {"uninterrupted": _params(module), "resumed": _params(resumed), "saved": shapes}
    out["start"] = _params(Net())
    return out


def parts_worker(rank: int, parts: dict[str, tuple[str, tuple[Any, ...]]]) -> dict[str, Any]:
    """Several of this module's workers one after another in one launch (a launch's ranks import Lightning
    anew): ``parts`` maps a label to (a worker's name, its arguments after ``rank``). Each label's result, or
    its error as text (the others still run)."""
    out: dict[str, Any] = {}
    for label, (name, args) in parts.items():
        try:
            out[label] = globals()[name](rank, *args)
        except Exception as e:
            out[label] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    return out
