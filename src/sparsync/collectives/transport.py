"""Which rules a group's transport imposes on the payload of one device, and where the metadata travels.

gloo (CPU) accepts a message shorter than the receive posted for it, which the metadata round and the split
phase rely on (receives posted for the largest block a peer may send, ``meta.py``). NCCL does not: every
receive must be posted for exactly the bytes sent, p2p transfers between two ranks must be posted together
(``batch_isend_irecv``: a receive posted alone on NCCL's per-pair stream blocks the send behind it), and its
reductions are SUM, PROD, MIN, MAX and AVG only (no BOR). gloo takes CUDA tensors only in ``all_reduce`` and
``broadcast``: its p2p transfers and gathers of CUDA tensors go through host memory ("staging").

Metadata (int64 rows, sizes, headers) always travels as CPU tensors on a group that carries CPU tensors: the
group itself when its backend has a CPU part (``gloo``, or torch's ``"cpu:gloo,cuda:nccl"`` convention, which
``sparsync.launch(backend="nccl")`` uses), else a gloo side group over the same ranks made at first use. Every
metadata value is needed on the host anyway (sizes of receives, auto's choice), so sending it from the host
saves the device-to-host copy of its result; payload stays on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from sparsync.collectives.background import new_group_like
from sparsync.collectives.group import group_state


@dataclass(frozen=True)
class Transport:
    """How one group carries payload tensors of one device (module doc)."""

    exact: bool  # receives posted for exactly the bytes sent; p2p posted in batches (NCCL's rules)
    stage: bool  # p2p transfers and gathers copy through host memory (CUDA tensors on gloo)
    # the group CPU metadata travels on; None: the payload's group itself (so that a group's cached rules, kept
    # as long as the group lives, do not keep it alive for good: ``GroupState`` is held by a weak key)
    meta: dist.ProcessGroup | None


def backends(group: dist.ProcessGroup) -> dict[str, str]:
    """Device type -> backend name of ``group`` (``{"cpu": "gloo", "cuda": "gloo"}`` for a gloo group,
    ``{"cuda": "nccl"}`` for an NCCL one, ``{"cpu": "gloo", "cuda": "nccl"}`` for ``"cpu:gloo,cuda:nccl"``).
    Parsed once per group: every call's ``Comm`` asks."""
    state = group_state(group)
    if state.backends is None:
        state.backends = _parse_backends(dist.get_backend_config(group))
    return state.backends


def _parse_backends(config: str) -> dict[str, str]:
    if ":" not in config:  # a bare backend name: torch's capability table says which devices it serves
        name = config.lower()
        return dict.fromkeys(dist.Backend.backend_capability.get(name, ["cpu", "cuda"]), name)
    out: dict[str, str] = {}
    for pair in config.lower().split(","):
        device, _, name = pair.partition(":")
        out[device.strip()] = name.strip()
    return out


def transport(group: dist.ProcessGroup, device: torch.device) -> Transport:
    """The rules for payload on ``device`` over ``group`` (module doc); ``use_nccl_rules`` overrides them. Worked
    out once per group and device (``GroupState.transports``)."""
    state = group_state(group)
    rules: Transport | None = state.transports.get(device)
    if rules is None:
        rules = state.transports[device] = _rules(group, device)
    return rules


def _rules(group: dist.ProcessGroup, device: torch.device) -> Transport:
    state = group_state(group)
    if state.nccl_rules is not None:  # a gloo group told to behave as NCCL (tests, use_nccl_rules)
        return Transport(exact=True, stage=False, meta=_other_meta(group))
    served = backends(group)
    payload = served.get(device.type)
    if payload is None and device.type == "cpu":
        # a pure NCCL group: a Comm for metadata only (a refusal's round, a record) goes through ``meta``; a
        # host payload would fail in NCCL's own check ("Tensors must be CUDA")
        return Transport(exact=True, stage=False, meta=_other_meta(group))
    if payload is None:
        raise ValueError(
            f"the process group's backend ({dist.get_backend_config(group)}) does not serve {device.type} "
            f"tensors; init torch.distributed with a backend for {device.type} (e.g. 'cpu:gloo,cuda:nccl')"
        )
    return Transport(
        exact=payload == "nccl",
        stage=device.type != "cpu" and payload == "gloo",
        meta=_other_meta(group),
    )


def _other_meta(group: dist.ProcessGroup) -> dist.ProcessGroup | None:
    """``meta_group(group)``, or None when that is ``group`` itself (``Transport.meta``)."""
    meta = meta_group(group)
    return None if meta is group else meta


def meta_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """The group CPU metadata (and any other host object: object collectives, input pipelines) of ``group``'s
    calls travels on (module doc). Collective on the first call for a pure NCCL group (every rank of ``group``
    gets here at its first sparsync call on it, in the same order)."""
    state = group_state(group)
    if state.nccl_rules is not None:
        return state.nccl_rules
    if "cpu" in backends(group):
        return group
    if state.meta is None:
        state.meta = new_group_like(group, backend="gloo")
    return state.meta


def use_nccl_rules(group: dist.ProcessGroup, meta: dist.ProcessGroup) -> None:
    """Run ``group``'s payload under NCCL's rules (exact receive sizes, batched p2p, no BOR) and its metadata on
    ``meta``, whatever ``group``'s backend: how the test suite proves on gloo, without a GPU, that the
    algorithms ask nothing of NCCL that it refuses (tests/_nccl_rules.py records and refuses the calls).
    Call it on every rank, before the group's first sparsync call."""
    if dist.get_process_group_ranks(meta) != dist.get_process_group_ranks(group):
        raise ValueError("use_nccl_rules: the metadata group must span the same ranks as the group")
    state = group_state(group)
    state.nccl_rules = meta
    state.transports.clear()
