"""A model with sharded tables and its optimizer, saved at one world size and loaded at any other: as one DCP
checkpoint (``save(path, model, optimizer)`` / ``load`` on every rank, or in one process with the unsharded
model), or as full state dicts gathered on rank 0 (``optimizer_state_dict`` / ``load_optimizer_state_dict``,
beside the model's ``state_dict="full"``).

The optimizer's state has three parts: each table's per-row state (a tensor of the table's local shape in a
torch optimizer's state of the table's weight, written dense: Adagrad's sums, Adam's moments, SGD's momentum; or
the state of the table's rows in its fused optimizer, ``sparsync.shard(optimizer=...)``: ``group.Fused``'s sums and
moments, row-wise Adagrad's one value per row), Adam's per-table step counts (fused; the same on every rank), and
the rest of ``optimizer.state_dict()`` (steps, hyperparameters, the dense parameters' state, a
``DistributedOptimizer``'s bucket layout), which every rank holds alike. A table is an ``nn.Embedding`` /
``nn.EmbeddingBag`` or a sharded one, named by its weight's name in the model; a replicated table in a group
(``sparsync.shard(optimizer=...)``, ``replicated``) is saved and loaded whole, as the unsharded model's, its fused
state too.

The DCP checkpoint holds ``model`` (the model's state dict, each sharded table in row blocks: ``dcp``),
``optimizer.rows.<table>.<name>`` (a torch optimizer's per-row state, in row blocks for a sharded table, whole for
a table of the unsharded model), ``optimizer.rest`` (the rest, one object), for a model whose tables have a
fused optimizer ``fused.<table>.<name>`` (its per-row state in row blocks, its step count whole), and ``kinds``
(one object: the torch optimizer's class name, each fused table's optimizer and hyperparameters). The fused
state's names are torchrec's (``SAVED_NAMES``): ``momentum1`` (Adagrad's and row-wise Adagrad's sums, Adam's
first moment), ``momentum2`` (Adam's second moment), ``step`` (Adam's step count). The fused part goes with the
model: it is saved and loaded whether or not ``optimizer`` is given, and a fused optimizer takes the saved
hyperparameters as a torch optimizer takes its param groups. Loading into optimizers of other kinds (another
torch optimizer, another fused one, a fused one where a torch one was, or the reverse) raises ValueError naming
them before anything is read.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from sparsync.sharding import dcp
from sparsync.sharding.group import Fused, gather_rows
from sparsync.sharding.modules import GroupedTable, ShardedTable

__all__ = ["load", "load_optimizer_state_dict", "optimizer_state_dict", "save"]


@contextmanager
def _local(model: nn.Module) -> Iterator[None]:
    """Every sharded table of ``model`` gives its state dict as its shard (``"local"``)."""
    tables = [m for m in model.modules() if isinstance(m, ShardedTable)]
    before = [m.state_dict_layout for m in tables]
    for m in tables:
        m.state_dict_layout = "local"
    try:
        yield
    finally:
        for m, layout in zip(tables, before, strict=True):
            m.state_dict_layout = layout


def _tables(model: nn.Module) -> dict[str, nn.Module]:
    """weight name -> table module, for every (sharded or unsharded) embedding table of ``model``."""
    kinds = (GroupedTable, nn.Embedding, nn.EmbeddingBag)
    return {f"{n}.weight" if n else "weight": m for n, m in model.named_modules() if isinstance(m, kinds)}


def _fused_whole(table: GroupedTable, value: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor | None:
    """``table``'s fused state ``value`` whole: a step count or a replicated table's as it is, a shard's gathered
    on the group's rank 0 (None on the others). Collective for a shard."""
    if value.dim() == 0 or not isinstance(table, ShardedTable):
        return value.clone()
    return gather_rows(value, table.ownership, group)


def _is_rank0(table: GroupedTable) -> bool:
    """Whether this rank is rank 0 of ``table``'s group (a replicated table's exchanger has one local rank)."""
    return dist.get_rank(table.exchanger.group) == 0


def _fused(model: nn.Module) -> dict[str, GroupedTable]:
    """weight name -> table, for the grouped tables (sharded or replicated) that have a fused optimizer."""
    return {n: t for n, t in _tables(model).items() if isinstance(t, GroupedTable) and t.group.fused is not None}


# the fused state's names in checkpoints: torchrec's (``<table>.momentum1`` / ``momentum2`` in its fused
# optimizers' state), whatever the optimizer: Adagrad's and row-wise Adagrad's sums and Adam's first moment are
# momentum1, Adam's second moment momentum2; Adam's per-table step count keeps its name
SAVED_NAMES = {"sum": "momentum1", "exp_avg": "momentum1", "exp_avg_sq": "momentum2", "step": "step"}


def _fused_of(table: GroupedTable) -> Fused:
    fused = table.group.fused
    if not isinstance(fused, Fused):
        raise TypeError(f"{table.describe()}: expected one of sparsync.sharding's optimizers, got {type(fused)}")
    return fused


def _fused_state(table: GroupedTable) -> dict[str, torch.Tensor]:
    """Views of ``table``'s rows in its fused optimizer's state (``Fused.table_state``), by their names in
    checkpoints (``SAVED_NAMES``)."""
    return {SAVED_NAMES[k]: v for k, v in _fused_of(table).table_state(table.slot).items()}


def _kinds(model: nn.Module, opt: Any) -> dict[str, Any]:
    """What made the optimizer state a checkpoint holds: the torch optimizer's class name (None: no optimizer)
    and, per table with a fused optimizer, its class name and hyperparameters."""
    fused = {name: {"kind": type(_fused_of(t)).__name__, "params": _fused_of(t).hyperparameters()}
             for name, t in sorted(_fused(model).items())}  # fmt: skip
    return {"optimizer": None if opt is None else type(_optimizer(opt)).__name__, "fused": fused}


def _check_kinds(saved: dict[str, Any], model: nn.Module, opt: Any) -> None:
    """ValueError when the optimizers that made the saved state (``_kinds``) are not the ones it is loaded into:
    another torch optimizer (or none saved), another fused optimizer on a table, none on a table that has one, or
    a fused one on a table that ``opt`` updates."""
    mine = _kinds(model, opt)
    if opt is not None and saved["optimizer"] != mine["optimizer"]:
        what = "no optimizer state" if saved["optimizer"] is None else f"the state of {saved['optimizer']}"
        raise ValueError(f"the checkpoint holds {what}; the optimizer given is {mine['optimizer']}")
    for name, kind in mine["fused"].items():
        got = saved["fused"].get(name, {}).get("kind")
        if got != kind["kind"]:
            what = "no fused optimizer" if got is None else f"the fused optimizer {got}"
            raise ValueError(f"the checkpoint's table {name!r} has {what}; the model's has {kind['kind']} "
                             "(sparsync.shard(optimizer=...))")  # fmt: skip
    held = set(_indices(opt, model).values()) if opt is not None else set()
    both = sorted(held & set(saved["fused"]))
    if both:
        kind = saved["fused"][both[0]]["kind"]
        raise ValueError(
            f"the checkpoint's table {both[0]!r} has the fused optimizer {kind} (sparsync.shard(optimizer=...)); "
            f"the model's is updated by the {mine['optimizer']} given"
        )


def _set_hyperparameters(saved: dict[str, Any], model: nn.Module) -> None:
    """Each fused table's optimizer takes the saved hyperparameters (as a torch optimizer's ``load_state_dict``
    takes its param groups'). Mutates the fused optimizers."""
    for name, table in _fused(model).items():
        _fused_of(table).set_hyperparameters(saved["fused"][name]["params"])


def _optimizer(opt: Any) -> torch.optim.Optimizer:
    """The torch optimizer itself (``DistributedOptimizer`` wraps one as ``.optimizer``)."""
    inner = getattr(opt, "optimizer", opt)
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"expected a torch optimizer or sparsync.DistributedOptimizer, got {type(opt).__name__}")
    return inner


def _indices(opt: Any, model: nn.Module) -> dict[int, str]:
    """Index of each table's weight in the optimizer's state dict -> its name."""
    names = {id(m.weight): n for n, m in _tables(model).items()}
    params = [p for g in _optimizer(opt).param_groups for p in g["params"]]
    return {i: names[id(p)] for i, p in enumerate(params) if id(p) in names}


def _per_row(value: Any, weight: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape == weight.shape


# --- full state dicts --------------------------------------------------------------------------------------------
def optimizer_state_dict(opt: Any, model: nn.Module) -> dict[str, Any] | None:
    """``opt.state_dict()`` with each sharded table's per-row state gathered whole (``[rows, D]``) and, for tables
    with a fused optimizer, ``"fused"``: ``{table: {name: whole per-row state, or the step count}}`` (names:
    ``SAVED_NAMES``), and ``"kinds"``: the optimizers that made it (module doc), on the tables' group rank 0;
    None on the other ranks (a model without shards: None on every rank but the world's rank 0). ``opt``: a torch
    optimizer over ``model``'s parameters, a ``DistributedOptimizer``, or None (the fused state alone).
    Collective over the tables' group: every rank calls it."""
    # the wrapper's own state_dict: a DistributedOptimizer adds its bucket layout, without which the resumed
    # run's first round would reduce the step-time way and differ in the last bits
    sd: dict[str, Any] = {"state": {}} if opt is None else opt.state_dict()
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    tables = _tables(model)
    for i, name in sorted(_indices(opt, model).items()) if opt is not None else ():
        table = tables[name]
        if not isinstance(table, ShardedTable) or i not in sd["state"]:
            continue
        rank0 = table.exchanger.rank == 0
        # a copy: torch's state_dict() holds the optimizer's live per-parameter dicts, which must keep the shard's
        # rows (a step after saving would otherwise find the whole table, or None, in place of its state)
        state = sd["state"][i] = dict(sd["state"][i])
        for key in sorted(state):
            if _per_row(state[key], table.weight):
                # a sparse gradient's momentum (SGD) is a sparse tensor of the shard's shape: gathered dense
                dense = state[key].to_dense() if state[key].is_sparse else state[key]
                state[key] = gather_rows(dense, table.ownership, table.exchanger.group)
    fused: dict[str, dict[str, Any]] = {}
    for name, table in sorted(_fused(model).items()):
        rank0 = _is_rank0(table)
        for key, value in sorted(_fused_state(table).items()):
            fused.setdefault(name, {})[key] = _fused_whole(table, value, table.exchanger.group)
    if fused:
        sd["fused"] = fused
    sd["kinds"] = _kinds(model, opt)
    return sd if rank0 else None


def load_optimizer_state_dict(opt: Any, model: nn.Module, state_dict: dict[str, Any]) -> None:
    """Load ``state_dict`` (from ``optimizer_state_dict``, saved at any P) into ``opt`` (None: the fused state
    alone) and the tables' fused optimizers: each shard's whole per-row state ``[rows, D]`` gives this rank its
    rows; a ``DistributedOptimizer`` also takes the saved bucket layout, so the resumed run reduces in the same
    buckets from its first step; the fused optimizers take the saved hyperparameters. Every rank calls it with
    the same dict. ValueError naming a fused table whose state the dict lacks, or optimizers of other kinds than
    the dict's ``"kinds"``. Mutates ``opt`` and the fused optimizers."""
    if "kinds" in state_dict:
        _check_kinds(state_dict["kinds"], model, opt)
    sd = {k: v for k, v in state_dict.items() if k not in ("fused", "kinds")}  # the rest (bucket layout) as saved
    sd["state"] = {i: dict(s) for i, s in state_dict["state"].items()}
    tables = _tables(model)
    for i, name in _indices(opt, model).items() if opt is not None else ():
        table = tables[name]
        if not isinstance(table, ShardedTable):
            continue
        state = sd["state"].get(i, {})
        whole = (table.num_embeddings, table.embedding_dim)
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and tuple(value.shape) == whole:
                state[key] = value[table.ownership.global_rows(table.exchanger.rank)].clone()
    saved = state_dict.get("fused", {})
    for name, table in _fused(model).items():
        for key, view in _fused_state(table).items():
            value = _saved_fused(saved, name, key)
            view.copy_(value if view.dim() == 0 else value[table.ownership.global_rows(table.exchanger.rank)])
    if "kinds" in state_dict:
        _set_hyperparameters(state_dict["kinds"], model)
    if opt is not None:
        opt.load_state_dict(sd)


def _saved_fused(saved: dict[str, dict[str, torch.Tensor]], name: str, key: str) -> torch.Tensor:
    if key not in saved.get(name, {}):
        raise ValueError(
            f"the state dict holds no {key!r} of the fused optimizer of table {name!r} (saved from a model "
            "without sparsync.shard(optimizer=...), or with another one)"
        )
    return saved[name][key]


# --- one DCP checkpoint ------------------------------------------------------------------------------------------
def _written(value: torch.Tensor, table: nn.Module, block_rows: int) -> Any:
    """What the checkpoint writes for the table-shaped tensor ``value`` of ``table``: its row blocks, made window
    by window (``dcp.Strided``; a table too small for that: made whole), or the whole tensor of an unsharded
    table."""
    dense = value.to_dense() if value.is_sparse else value
    if not isinstance(table, ShardedTable):
        return dense
    group = table.exchanger.link.group
    strided = dcp.Strided(dense.detach(), table.num_embeddings, group, block_rows)
    return dcp.to_dtensor(dense, table.num_embeddings, group) if strided.blocks.empty_block() else strided


def _optimizer_state(opt: Any, model: nn.Module, block_rows: int) -> dict[str, Any]:
    """The torch optimizer's part of the checkpoint (module doc)."""
    sd = opt.state_dict()
    tables = _tables(model)
    rows: dict[str, dict[str, Any]] = {}
    state = dict(sd["state"])
    for i, name in sorted(_indices(opt, model).items()):
        if i not in state:
            continue
        entry = state[i] = dict(state[i])
        for key in sorted(entry):
            if _per_row(entry[key], tables[name].weight):
                rows.setdefault(name, {})[key] = _written(entry[key], tables[name], block_rows)
                entry[key] = None  # filled from rows at load
    return {"rows": rows, "rest": ({**sd, "state": state},)}  # a tuple: DCP writes it as one object


def save(path: str, model: nn.Module, optimizer: Any = None, *, block_rows: int = dcp.BLOCK_ROWS) -> None:
    """Write ``model``'s state (its sharded tables in row blocks, with their fused optimizers' state) and
    ``optimizer``'s (a torch optimizer or a ``DistributedOptimizer`` over ``model``'s parameters, or None) to the
    DCP checkpoint directory ``path`` (module doc); rows re-blocked in windows of ``block_rows`` per rank and
    stored in chunks of at most ``block_rows`` rows. Collective: every rank calls it."""
    _check_block_rows(block_rows)
    with _local(model):
        model_sd = model.state_dict()
    for name, table in _tables(model).items():
        if isinstance(table, ShardedTable):
            model_sd[name] = _written(table.weight, table, block_rows)
    state: dict[str, Any] = {"model": model_sd}
    if optimizer is not None:
        state["optimizer"] = _optimizer_state(optimizer, model, block_rows)
    fused = {name: {key: value if value.dim() == 0 else _written(value, table, block_rows)
                    for key, value in _fused_state(table).items()}
             for name, table in _fused(model).items()}  # fmt: skip
    if fused:
        state["fused"] = fused
    state["kinds"] = (_kinds(model, optimizer),)  # a tuple: one object
    # the writer asks for each rank's chunks in plan order, one at a time, which ``dcp.Strided`` makes collectively
    dcp_save(state, storage_writer=dcp.writer(path), planner=dcp.WindowSavePlanner(block_rows))


def _check_block_rows(block_rows: int) -> None:
    if not isinstance(block_rows, int) or block_rows < 1:
        raise ValueError(f"block_rows must be a positive int, got {block_rows!r}")


def _check(meta: Metadata, model: nn.Module) -> None:
    """ValueError naming the first table whose saved shape or dtype differs from the model's, or a fused table
    whose state the checkpoint lacks."""
    for name, table in _tables(model).items():
        md = meta.state_dict_metadata.get("model." + name)
        if not isinstance(md, TensorStorageMetadata):
            continue
        rows, dim, weight = (getattr(table, a) for a in ("num_embeddings", "embedding_dim", "weight"))
        want, dtype = (int(rows), int(dim)), weight.dtype
        if tuple(md.size) != want or md.properties.dtype != dtype:
            raise ValueError(
                f"the checkpoint's table {name!r} has shape {tuple(md.size)} and dtype {md.properties.dtype}; "
                f"the model's has shape {want} and dtype {dtype}"
            )
    for name, table in _fused(model).items():
        for key in _fused_state(table):
            if f"fused.{name}.{key}" not in meta.state_dict_metadata:
                raise ValueError(
                    f"the checkpoint holds no {key!r} of the fused optimizer of table {name!r} (saved from a "
                    "model without sparsync.shard(optimizer=...), or with another one)"
                )


def _saved_kinds(path: str, meta: Metadata) -> dict[str, Any] | None:
    """The checkpoint's ``kinds`` (``_kinds``), read alone; None in a checkpoint without it. Collective."""
    if "kinds" not in meta.state_dict_metadata:
        return None
    holder: dict[str, Any] = {"kinds": None}
    dcp_load(holder, checkpoint_id=path)
    kinds: dict[str, Any] = holder["kinds"][0]
    return kinds


def _rows_saved(meta: Metadata, name: str) -> dict[str, TensorStorageMetadata]:
    """name -> metadata of each per-row state of table ``name`` a torch optimizer saved."""
    prefix = f"optimizer.rows.{name}."
    return {key[len(prefix) :]: md for key, md in meta.state_dict_metadata.items()
            if key.startswith(prefix) and isinstance(md, TensorStorageMetadata)}  # fmt: skip


def _targets(meta: Metadata, model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """What ``dcp.load`` fills in place: the model's tensors but the sharded tables, the per-row state of the
    unsharded tables, the fused optimizers' step counts (and a replicated group's whole per-row state), and the
    rest of the optimizer's state."""
    sharded = {n for n, t in _tables(model).items() if isinstance(t, ShardedTable)}
    with _local(model):
        model_sd = {k: v for k, v in model.state_dict().items() if k not in sharded}
    state: dict[str, Any] = {"model": model_sd}
    steps = {name: {k: v for k, v in _fused_state(t).items() if v.dim() == 0 or not isinstance(t, ShardedTable)}
             for name, t in _fused(model).items()}  # fmt: skip
    if any(steps.values()):
        state["fused"] = {name: s for name, s in steps.items() if s}
    if optimizer is not None:
        rows = {name: {key: torch.empty(md.size, dtype=md.properties.dtype)
                       for key, md in _rows_saved(meta, name).items()}
                for name in _tables(model) if name not in sharded}  # fmt: skip
        state["optimizer"] = {"rows": {n: r for n, r in rows.items() if r}, "rest": None}
    return state


def _stream(path: str, meta: Metadata, model: nn.Module, optimizer: Any, block_rows: int) -> dict[str, Any]:
    """Read the sharded tables, their fused state and (with ``optimizer``) its per-row state from the checkpoint
    into the shards, window by window (``dcp.read_into_shard``): the tables and the fused state in place, the
    optimizer's per-row state as new tensors, returned (table -> name -> shard). Collective over the groups."""
    reader = FileSystemReader(path)
    reader.set_up_storage_reader(meta, not dist.is_initialized() or dist.get_rank() == 0)
    rows: dict[str, dict[str, torch.Tensor]] = {}
    for name, table in sorted(_tables(model).items()):
        if not isinstance(table, ShardedTable):
            continue
        group = table.exchanger.link.group
        dcp.read_into_shard(reader, meta, "model." + name, table.weight.data, group, block_rows=block_rows)
        if name in _fused(model):
            for key, view in sorted(_fused_state(table).items()):
                if view.dim():
                    dcp.read_into_shard(reader, meta, f"fused.{name}.{key}", view, group, block_rows=block_rows)
        for key, md in sorted(_rows_saved(meta, name).items()) if optimizer is not None else ():
            out = rows.setdefault(name, {})[key] = torch.empty(table.weight.shape, dtype=md.properties.dtype)
            dcp.read_into_shard(reader, meta, f"optimizer.rows.{name}.{key}", out, group, block_rows=block_rows)
    return rows


def _load_optimizer(optimizer: Any, model: nn.Module, loaded: dict[str, Any], rows: dict[str, Any]) -> None:
    """Put each table's per-row state (``loaded``'s whole ones, ``rows``' shards) back into the saved state dict
    and load it. Mutates ``optimizer``."""
    sd = loaded["rest"][0]
    state = {i: dict(s) for i, s in sd["state"].items()}
    every = {**loaded.get("rows", {}), **rows}
    for i, name in sorted(_indices(optimizer, model).items()):
        for key, value in sorted(every.get(name, {}).items()):
            state.setdefault(i, {})[key] = value
    optimizer.load_state_dict({**sd, "state": state})


def load(path: str, model: nn.Module, optimizer: Any = None, *, block_rows: int = dcp.BLOCK_ROWS) -> None:
    """Load the DCP checkpoint ``path`` (``save``, at any world size, or of the unsharded model) into ``model``
    (with its tables' fused optimizers' state) and, if given, ``optimizer`` (the kind that saved it). Raises
    ValueError naming a table whose saved shape or dtype differs from the model's, or a fused table whose state the
    checkpoint lacks, before reading any rows. Rows move to their owners in windows of ``block_rows`` per rank.
    Collective: every rank calls it. Mutates ``model`` and ``optimizer``."""
    _check_block_rows(block_rows)
    meta = FileSystemReader(path).read_metadata()
    kinds = _saved_kinds(path, meta)
    if kinds is not None:
        _check_kinds(kinds, model, optimizer)
    _check(meta, model)
    state = _targets(meta, model, optimizer)
    dcp_load(state, checkpoint_id=path)
    rows = _stream(path, meta, model, optimizer, block_rows)
    if kinds is not None:
        _set_hyperparameters(kinds, model)
    shards = {n: t.weight.detach() for n, t in _tables(model).items() if isinstance(t, ShardedTable)}
    with _local(model):  # dcp_load and _stream filled the tensors in place; this loads what else the modules keep
        model.load_state_dict({**state["model"], **shards})
    if optimizer is not None:
        _load_optimizer(optimizer, model, state["optimizer"], rows)
