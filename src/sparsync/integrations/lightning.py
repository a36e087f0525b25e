"""``SparsyncStrategy``: PyTorch Lightning's ``Trainer`` (the ``lightning`` package, ``lightning.pytorch``)
training a ``LightningModule`` through sparsync.

    trainer = lightning.pytorch.Trainer(strategy=SparsyncStrategy(), accelerator="cpu", max_epochs=1)
    trainer.fit(module)   # configure_optimizers' torch optimizer, wrapped in DistributedOptimizer

Two paths, chosen by ``comm_hook``:

- ``comm_hook=None`` (the default): the module is not wrapped; each optimizer that ``configure_optimizers``
  returns is wrapped in ``sparsync.DistributedOptimizer(optimizer, module, **optimizer_options)``, which reduces
  the gradients during backward (sparse tables row-sparse, dense layers in buckets, a ``plan=`` of placements
  compressing any of them). ``shard_plan``: ``sparsync.shard(module, plan=shard_plan, **shard_options)`` runs
  first, before ``configure_optimizers``, so the optimizers hold the shards (``{}`` shards every table, as
  ``sparsync.shard``'s default does). Gradient accumulation (``accumulate_grad_batches``) runs the
  optimizers' ``no_sync()``, as DDPStrategy runs DDP's.
- ``comm_hook=hook``: DDPStrategy's path (the module wrapped in ``DistributedDataParallel(**ddp_options)``), with
  ``ddp.register_comm_hook(comm_state, hook)`` on every device, CPU included (Lightning's own ``DDPStrategy``
  registers a hook on CUDA only), e.g. ``sparsync.compress.hooks.compression_hook(TopK(0.01), ErrorFeedback(),
  module=module)``.

Inside ranks that exist already (``sparsync.launch``, or a script that called ``init_process_group``) the
strategy takes their group (``ProcessGroupEnvironment``) and Lightning starts no processes; otherwise Lightning's
own environments and launcher apply, as for ``DDPStrategy`` with its default ``start_method="popen"``
(``Trainer(devices=N)`` runs the script again in N - 1 processes).

``gradient_clip_val`` (and ``LightningModule.clip_gradients``) clips the aggregated gradients, sparse ones
included, through ``DistributedOptimizer.clip_grad_norm_`` / ``clip_grad_value_`` (``AggregatedClipping``).
Checkpoints (``ModelCheckpoint``, ``trainer.save_checkpoint``, ``fit(ckpt_path=...)``): sharded tables are
saved whole (``shard``'s ``state_dict="full"``, gathered on rank 0, which writes the file) with their optimizer
state (``sharding.optimizer_state_dict``), and dealt back to the rows' owners on loading.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Generator, Mapping
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.optimizer import _optimizer_to_device, _optimizers_to_device
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.constants import default_pg_timeout
from torch.nn.parallel import DistributedDataParallel

from sparsync import DistributedOptimizer, shard
from sparsync.placement import Sharded, placement_of
from sparsync.sharding import SGD, ShardedTable, load_optimizer_state_dict, optimizer_state_dict

# Lightning's precision flags under which the two paths are tested (tests/integrations/test_lightning.py); the
# others (half-precision weights "16-true"/"bf16-true", "16-mixed"'s GradScaler, quantised and FP8 plugins) are
# refused rather than run untested.
PRECISIONS = ("32-true", "64-true", "bf16-mixed")
_FITTED = "_sparsync_fitted"  # set on a module that a fit wrapped in DistributedOptimizer (``_mark_fitted``)


class ProcessGroupEnvironment(ClusterEnvironment):
    """Lightning's view of a torch.distributed default group that is initialised already: the group's ranks and
    size, and processes that exist (Lightning launches none). ``LOCAL_RANK`` and ``NODE_RANK`` (or torchrun's
    ``GROUP_RANK``) are read from the environment where set, else the global rank and 0."""

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        return int(os.environ.get("MASTER_PORT", "0"))

    @staticmethod
    def detect() -> bool:
        return dist.is_available() and dist.is_initialized()

    def world_size(self) -> int:
        return dist.get_world_size()

    def set_world_size(self, size: int) -> None:
        """The group's size is fixed: Lightning's count (nodes x devices per node) is not used."""

    def global_rank(self) -> int:
        return dist.get_rank()

    def set_global_rank(self, rank: int) -> None:
        """The group's rank is fixed: Lightning's count is not used."""

    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", dist.get_rank()))

    def node_rank(self) -> int:
        return int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", "0")))


class SparsyncStrategy(DDPStrategy):
    """Lightning's data-parallel strategy with sparsync's reductions (module doc).

    ``optimizer_options``: keyword arguments of ``DistributedOptimizer`` (``plan``, ``op``, ``overlap``,
    ``log``, ...). ``shard_plan``: ``sparsync.shard``'s ``plan``, or None (no table sharded); ``shard_options``:
    its other keyword arguments (``log``, ``rows``, ``state_dict``, ``sample``). ``comm_hook``/``comm_state``:
    a DDP communication hook and its state: the module is then wrapped in DDP, with ``ddp_options``
    (DDP's keyword arguments), and none of the three sparsync options above applies. ``cluster_environment``:
    default ``ProcessGroupEnvironment`` when torch.distributed is initialised, else Lightning's choice.
    Raises ValueError for options of the other path, or a ``precision`` outside ``PRECISIONS`` (at ``fit``),
    clipping it cannot do exactly (``AggregatedClipping``) and checkpoints that could not resume the sharded
    tables exactly (``_check_checkpointable``: at ``fit`` with a checkpoint callback, and at each save).
    """

    def __init__(
        self,
        *,
        optimizer_options: Mapping[str, Any] | None = None,
        shard_plan: Mapping[str, str] | str | None = None,
        shard_options: Mapping[str, Any] | None = None,
        comm_hook: Callable[..., Any] | None = None,
        comm_state: object = None,
        ddp_options: Mapping[str, Any] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        _check_paths(comm_hook, optimizer_options, shard_plan, shard_options, ddp_options)
        if cluster_environment is None and ProcessGroupEnvironment.detect():
            cluster_environment = ProcessGroupEnvironment()
        super().__init__(
            cluster_environment=cluster_environment, ddp_comm_state=comm_state, ddp_comm_hook=comm_hook,
            process_group_backend=process_group_backend, timeout=timeout,
            **dict(ddp_options or {}),
        )  # fmt: skip
        self._optimizer_options = dict(optimizer_options or {})
        self._shard_plan = shard_plan
        self._shard_options = dict(shard_options or {})

    @property
    def wraps_in_ddp(self) -> bool:
        """True on the DDP path (``comm_hook`` given), False on ``DistributedOptimizer``'s."""
        return self._ddp_comm_hook is not None

    @property
    def root_device(self) -> torch.device:
        """In an existing group: this process's device (the current CUDA device, which ``sparsync.launch`` and
        torchrun's scripts choose per rank), not Lightning's list indexed by local rank."""
        if not isinstance(self.cluster_environment, ProcessGroupEnvironment):
            return super().root_device
        device = (self.parallel_devices or [torch.device("cpu")])[0]
        return torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" else device

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def setup(self, trainer: pl.Trainer) -> None:
        _check_precision(self.precision_plugin.precision)
        self.precision_plugin = with_aggregated_clipping(self.precision_plugin)
        if self.wraps_in_ddp:
            super().setup(trainer)
            return
        assert self.accelerator is not None and self.model is not None  # set by the Trainer before setup
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync is not None:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting and trainer.checkpoint_callbacks:  # refused now rather than at the first checkpoint
            _check_checkpointable(self.model, self._applied_shard_options)
        self._shard()
        if fitting:
            _mark_fitted(self.lightning_module)
            self.setup_optimizers(trainer)
        else:  # no optimizer to broadcast rank 0's parameters, as DDPStrategy syncs the module there
            broadcast_replicated(self.model)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _shard(self) -> None:
        """``sparsync.shard`` the module once (a second ``fit`` or ``validate`` finds its shards in place)."""
        module = self.lightning_module
        assert module is not None
        if self._shard_plan is None or any(isinstance(placement_of(p), Sharded) for p in module.parameters()):
            return
        shard(module, plan=self._shard_plan, **self._shard_options)

    @property
    def _applied_shard_options(self) -> dict[str, Any]:
        """``shard_options``, where a ``shard_plan`` applies them."""
        return self._shard_options if self._shard_plan is not None else {}

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Lightning's optimizers and schedulers, then (off the DDP path) each optimizer in a
        ``DistributedOptimizer``; the schedulers keep the wrapped optimizer, whose ``param_groups`` the wrapper
        shares."""
        super().setup_optimizers(trainer)
        if not self.wraps_in_ddp:
            self.optimizers = [self._distributed(opt) for opt in self.optimizers]

    def _distributed(self, optimizer: Any) -> DistributedOptimizer:
        if isinstance(optimizer, DistributedOptimizer):
            return optimizer  # configure_optimizers wrapped it itself
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"SparsyncStrategy: configure_optimizers returned a {type(optimizer).__qualname__}, not a "
                "torch.optim.Optimizer; DistributedOptimizer wraps torch optimizers only (it shares their "
                "param_groups and state)"
            )
        return DistributedOptimizer(optimizer, self.lightning_module, **self._optimizer_options)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state dict, each sharded table whole (on rank 0, which writes the checkpoint: every rank
        calls this, as Lightning's ``dump_checkpoint`` does). ValueError where a checkpoint cannot hold the
        tables (``_check_checkpointable``)."""
        module = self.lightning_module
        assert module is not None
        _check_checkpointable(module, self._applied_shard_options)
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """``optimizer``'s state dict; with sharded tables, their per-row state gathered whole on rank 0
        (``sharding.optimizer_state_dict``; ``{}`` on the other ranks, which write nothing). Collective."""
        module = self.lightning_module
        if module is None or not _shards(module):
            return super().optimizer_state(optimizer)
        return optimizer_state_dict(_unwrapped(optimizer), module) or {}

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """The checkpoint's optimizer states; a sharded table's per-row state (saved whole) dealt to the rows'
        owners (``sharding.load_optimizer_state_dict``, at any P). Mutates the optimizers."""
        module = self.lightning_module
        if module is None or not _shards(module):
            super().load_optimizer_state_dict(checkpoint)
            return
        for opt, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            load_optimizer_state_dict(opt, module, state)
            _optimizer_to_device(opt, self.root_device)

    def _register_ddp_hooks(self) -> None:
        """The hook on every device: DDP runs comm hooks on gloo and CPU tensors too."""
        if self._ddp_comm_hook is not None:
            assert isinstance(self.model, DistributedDataParallel)
            self.model.register_comm_hook(self._ddp_comm_state, self._ddp_comm_hook)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation's micro-batches: DDP's ``no_sync()`` on the DDP path, else every
        ``DistributedOptimizer``'s ``no_sync()`` (the next backward outside it reduces what accumulated)."""
        if self.wraps_in_ddp:
            with super().block_backward_sync():
                yield
            return
        with contextlib.ExitStack() as stack:
            for opt in self.optimizers:
                if isinstance(opt, DistributedOptimizer):
                    stack.enter_context(opt.no_sync())
            yield


class AggregatedClipping(Precision):
    """A precision plugin's gradient clipping (``gradient_clip_val``, ``LightningModule.clip_gradients``) over
    the aggregated gradients: a ``DistributedOptimizer``'s through its ``clip_grad_norm_`` / ``clip_grad_value_``
    (the gradients aggregated first where backward did not, sparse ones included, one norm the same on every
    rank, sharded tables' rows of every rank in it); another optimizer's (the
    DDP path, whose reducer aggregated in backward) through torch's, which takes dense gradients only:
    ValueError naming the setting for a sparse one."""

    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        self._clip(optimizer, "norm", clip_val)

    def clip_grad_by_value(self, optimizer: Any, clip_val: int | float) -> None:
        self._clip(optimizer, "value", clip_val)

    def _clip(self, optimizer: Any, algorithm: str, clip_val: int | float) -> None:
        optimizer = _unwrapped(optimizer)
        if isinstance(optimizer, DistributedOptimizer):
            (optimizer.clip_grad_norm_ if algorithm == "norm" else optimizer.clip_grad_value_)(clip_val)
            return
        _refuse_sparse_clipping(optimizer, algorithm, clip_val)
        if algorithm == "norm":
            super().clip_grad_by_norm(optimizer, clip_val)
        else:
            super().clip_grad_by_value(optimizer, clip_val)


def _unwrapped(optimizer: Any) -> Any:
    """The optimizer a ``LightningOptimizer`` (``self.optimizers()`` in manual optimisation) wraps. The wrapper
    passes ``isinstance`` for the wrapped class and reads its attributes, but what a method sets lands on the
    wrapper: ``clip_grad_norm_`` would mark the wrapper synchronized, and ``step()`` reduce once more."""
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def with_aggregated_clipping(plugin: Precision) -> Precision:
    """``plugin`` with ``AggregatedClipping``'s two methods ahead of its own class's (the rest of its class,
    e.g. ``MixedPrecision``'s autocast, as it is). Mutates ``plugin``'s class; returns it."""
    if not isinstance(plugin, AggregatedClipping):
        plugin.__class__ = type(f"Aggregated{type(plugin).__name__}", (AggregatedClipping, type(plugin)), {})
    return plugin


def _refuse_sparse_clipping(optimizer: Any, algorithm: str, clip_val: int | float) -> None:
    sparse = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None and p.grad.is_sparse]
    if sparse:
        raise ValueError(
            f"SparsyncStrategy: gradient_clip_val={clip_val} (gradient_clip_algorithm={algorithm!r}) with "
            f"comm_hook=: {len(sparse)} sparse gradient(s), which torch's clip_grad_{algorithm}_ does not take; "
            "the default path (no comm_hook) clips them through DistributedOptimizer"
        )


def _shards(module: torch.nn.Module) -> list[ShardedTable]:
    return [m for m in module.modules() if isinstance(m, ShardedTable)]


def _check_checkpointable(module: torch.nn.Module, shard_options: Mapping[str, Any]) -> None:
    """ValueError naming the setting where a Lightning checkpoint (one file, rank 0's) could not resume the
    sharded tables exactly: a state dict layout other than ``"full"`` (rank 0 would save its own rows only), or
    a fused optimizer with per-row state (kept in the tables' group, in no state dict that Lightning saves)."""
    layouts = {table.state_dict_layout for table in _shards(module)} | {shard_options.get("state_dict", "full")}
    if layouts != {"full"}:
        raise ValueError(
            f"SparsyncStrategy: shard_options state_dict={sorted(layouts - {'full'})[0]!r} cannot go into a "
            "Lightning checkpoint (rank 0 writes the file, and would write its own rows only): use "
            "state_dict='full' (the default: each table gathered whole on rank 0), or no checkpoint "
            "(enable_checkpointing=False) and sparsync.sharding.checkpoint's save/load (DCP) outside Lightning"
        )
    fused = shard_options.get("optimizer")
    if fused is not None and not isinstance(fused, SGD):
        raise ValueError(
            f"SparsyncStrategy: shard_options optimizer={type(fused).__name__} keeps its per-row state in the "
            "tables' group, which a Lightning checkpoint does not hold (a resume would start it from zeros): use "
            "a torch optimizer from configure_optimizers (e.g. Adagrad), the stateless fused SGD, or no "
            "checkpoint (enable_checkpointing=False)"
        )


def broadcast_replicated(module: torch.nn.Module) -> None:
    """Rank 0's parameters and buffers to every rank, but a shard's rows (each rank's own). Collective.
    Mutates: the module's parameters and buffers."""
    with torch.no_grad():
        for p in module.parameters():
            if not isinstance(placement_of(p), Sharded):
                dist.broadcast(p.data, src=0)
        for b in module.buffers():
            dist.broadcast(b, src=0)


def _mark_fitted(module: Any) -> None:
    """Refuse a second ``fit`` of one module on the ``DistributedOptimizer`` path, with the reason."""
    if getattr(module, _FITTED, False):
        raise ValueError(
            f"SparsyncStrategy: this {type(module).__qualname__} was fitted under SparsyncStrategy already: the "
            "first fit's DistributedOptimizer keeps its reduction hooks on the parameters, so a second one "
            "would reduce every gradient twice; fit a new module (loading the first one's checkpoint into it)"
        )
    setattr(module, _FITTED, True)


def _check_paths(
    comm_hook: Callable[..., Any] | None,
    optimizer_options: Mapping[str, Any] | None,
    shard_plan: Mapping[str, str] | str | None,
    shard_options: Mapping[str, Any] | None,
    ddp_options: Mapping[str, Any] | None,
) -> None:
    """ValueError naming the options that the chosen path (module doc) would ignore."""
    if comm_hook is not None:
        given = {"optimizer_options": optimizer_options, "shard_plan": shard_plan, "shard_options": shard_options}
        ignored = [k for k, v in given.items() if v is not None]
        if ignored:
            raise ValueError(
                f"SparsyncStrategy: {ignored} apply to the DistributedOptimizer path, not with comm_hook= (the "
                "module wrapped in DDP, its optimizers as they are; DDP checks that every rank's parameters "
                "have the same shapes, so sharded tables cannot go this way): drop comm_hook= or these"
            )
    elif ddp_options:
        raise ValueError(
            f"SparsyncStrategy: ddp_options {sorted(ddp_options)} apply only with comm_hook= (the module is "
            "wrapped in DDP only there)"
        )


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(
            f"SparsyncStrategy: precision={precision!r} is not supported; tested: {list(PRECISIONS)} "
            "(docs/integrations.md)"
        )
