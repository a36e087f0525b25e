"""One DCP checkpoint of a model and its optimizer (``dcp``): ``save(path, model, optimizer)`` on every rank,
``load(path, model, optimizer)`` on every rank of any world size, or in one process into the unsharded model.

What it holds: ``model``: the model's state dict, each sharded table in row blocks (``ShardedTable``'s
``"sharded"`` layout); ``optimizer.rows.<table>.<name>``: each table's per-row optimizer state (a tensor of
the table's local shape: Adagrad's sums, Adam's moments, SGD's momentum, written dense), in row blocks too for a
sharded table, whole for a table of the unsharded model; ``optimizer.rest``: the rest of
``optimizer.state_dict()`` (steps, hyperparameters, the state of the dense parameters, a
``DistributedOptimizer``'s bucket layout), one object. A table is an ``nn.Embedding`` / ``nn.EmbeddingBag`` or
a sharded one, named by its weight's name in the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from sparsync.sharding import dcp
from sparsync.sharding.modules import ShardedTable

ROWS = "optimizer.rows."


@contextmanager
def _layout(model: nn.Module, layout: str, block_rows: int = dcp.BLOCK_ROWS) -> Iterator[None]:
    """Every sharded table of ``model`` saves in ``layout``, and moves rows in windows of ``block_rows`` per
    rank, inside the block."""
    tables = [m for m in model.modules() if isinstance(m, ShardedTable)]
    before = [(m.state_dict_layout, m.dcp_block_rows) for m in tables]
    for m in tables:
        m.state_dict_layout, m.dcp_block_rows = layout, block_rows
    try:
        yield
    finally:
        for m, (b, rows) in zip(tables, before, strict=True):
            m.state_dict_layout, m.dcp_block_rows = b, rows


def _tables(model: nn.Module) -> dict[str, nn.Module]:
    """weight name -> table module, for every (sharded or unsharded) embedding table of ``model``."""
    kinds = (ShardedTable, nn.Embedding, nn.EmbeddingBag)
    return {f"{n}.weight" if n else "weight": m for n, m in model.named_modules() if isinstance(m, kinds)}


def _indices(opt: Any, model: nn.Module) -> dict[int, str]:
    """Index of each table's weight in the optimizer's state dict -> its name."""
    inner = getattr(opt, "optimizer", opt)
    names = {id(m.weight): n for n, m in _tables(model).items()}
    params = [p for g in inner.param_groups for p in g["params"]]
    return {i: names[id(p)] for i, p in enumerate(params) if id(p) in names}


def _as_checkpoint(value: torch.Tensor, table: nn.Module) -> torch.Tensor:
    dense = value.to_dense() if value.is_sparse else value
    if isinstance(table, ShardedTable):
        group = table.exchanger.link.group
        return dcp.to_dtensor(dense, table.num_embeddings, group, block_rows=table.dcp_block_rows)
    return dense


def _optimizer_state(opt: Any, model: nn.Module) -> dict[str, Any]:
    """The optimizer's part of the checkpoint (module doc). Collective over the tables' groups."""
    sd = opt.state_dict()
    tables = _tables(model)
    rows: dict[str, dict[str, torch.Tensor]] = {}
    state = dict(sd["state"])
    for i, name in sorted(_indices(opt, model).items()):
        if i not in state:
            continue
        weight = tables[name].weight
        entry = state[i] = dict(state[i])
        for key in sorted(entry):
            value = entry[key]
            if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape == weight.shape:
                rows.setdefault(name, {})[key] = _as_checkpoint(value, tables[name])
                entry[key] = None  # filled from rows at load
    return {"rows": rows, "rest": ({**sd, "state": state},)}  # a tuple: DCP writes it as one object


def save(path: str, model: nn.Module, optimizer: Any = None, *, block_rows: int = dcp.BLOCK_ROWS) -> None:
    """Write ``model``'s state (its sharded tables in row blocks) and ``optimizer``'s (a torch optimizer or a
    ``DistributedOptimizer`` over ``model``'s parameters, or None) to the DCP checkpoint directory ``path``
    (module doc); stored chunks of at most ``block_rows`` rows. Collective: every rank calls it."""
    with _layout(model, "sharded", block_rows):
        state: dict[str, Any] = {"model": model.state_dict()}
        if optimizer is not None:
            state["optimizer"] = _optimizer_state(optimizer, model)
    dcp_save(state, checkpoint_id=path, planner=dcp.BlockSavePlanner(block_rows))


def _check(meta: Metadata, tables: dict[str, nn.Module]) -> None:
    """ValueError naming the first table whose saved shape or dtype differs from the model's."""
    for name, table in tables.items():
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


def _target(table: nn.Module, size: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor of the checkpoint's ``size`` in ``table``'s layout, for ``dcp.load`` to fill."""
    if isinstance(table, ShardedTable):
        return dcp.empty_dtensor(size[0], size[1], dtype, table.exchanger.link.group)
    return torch.empty(size, dtype=dtype)


def _targets(meta: Metadata, model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """What ``dcp.load`` fills: the model's tensors (its sharded tables as row blocks) and, with ``optimizer``,
    every per-row state the checkpoint holds and the rest."""
    tables = _tables(model)
    with _layout(model, "local"):
        model_sd = model.state_dict()
    for name, table in tables.items():
        if isinstance(table, ShardedTable):
            size = torch.Size([table.num_embeddings, table.embedding_dim])
            model_sd[name] = _target(table, size, table.weight.dtype)
    state: dict[str, Any] = {"model": model_sd}
    if optimizer is None:
        return state
    rows: dict[str, dict[str, torch.Tensor]] = {}
    for key, md in meta.state_dict_metadata.items():
        for name, table in tables.items():
            prefix = ROWS + name + "."
            if key.startswith(prefix) and "." not in key[len(prefix) :] and isinstance(md, TensorStorageMetadata):
                rows.setdefault(name, {})[key[len(prefix) :]] = _target(table, md.size, md.properties.dtype)
    state["optimizer"] = {"rows": rows, "rest": None}
    return state


def _load_optimizer(optimizer: Any, model: nn.Module, loaded: dict[str, Any]) -> None:
    """Put each table's per-row state, dealt to this rank's rows, back into the saved state dict and load it.
    Collective over the tables' groups. Mutates ``optimizer``."""
    tables = _tables(model)
    sd = loaded["rest"][0]
    state = {i: dict(s) for i, s in sd["state"].items()}
    for i, name in sorted(_indices(optimizer, model).items()):
        for key, value in sorted(loaded["rows"].get(name, {}).items()):
            table = tables[name]
            if isinstance(table, ShardedTable):
                out = torch.empty(table.weight.shape, dtype=value.dtype)
                group = table.exchanger.link.group
                dcp.into_shard(value, out, table.num_embeddings, group, block_rows=table.dcp_block_rows)
                value = out
            state.setdefault(i, {})[key] = value
    optimizer.load_state_dict({**sd, "state": state})


def load(path: str, model: nn.Module, optimizer: Any = None, *, block_rows: int = dcp.BLOCK_ROWS) -> None:
    """Load the DCP checkpoint ``path`` (``save``, at any world size, or of the unsharded model) into ``model``
    and, if given, ``optimizer`` (the kind that saved it). Raises ValueError naming a table whose saved shape or
    dtype differs from the model's, before reading any rows. Rows move to their owners in windows of
    ``block_rows`` per rank. Collective: every rank calls it.
    Mutates ``model`` and ``optimizer``."""
    meta = FileSystemReader(path).read_metadata()
    _check(meta, _tables(model))
    state = _targets(meta, model, optimizer)
    dcp_load(state, checkpoint_id=path)
    with _layout(model, "sharded", block_rows):
        model.load_state_dict(state["model"])
        if optimizer is not None:
            _load_optimizer(optimizer, model, state["optimizer"])
