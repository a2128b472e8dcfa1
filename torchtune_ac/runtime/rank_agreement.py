"""Refuse to start when the ranks of one run were given different configs.

With several nodes, each node's ``tune run`` loads the config and its overrides on its own. A node started with
``batch_size=8`` next to nodes started with 4 would read overlapping samples, and rank 0 would log a global batch
that is not the real one, silently. At start-up every rank hashes its resolved config (one all-gather of the
digests); only when they differ are the configs themselves gathered, to name the keys.
"""

from __future__ import annotations

import hashlib
import json
import socket
from typing import Any, Mapping

import torch.distributed as dist

from torchtune_ac.errors import UserError
from torchtune_ac.runtime.distributed import DistributedContext

_MAX_KEYS_SHOWN = 5


def flatten_config(values: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``dotted key -> JSON of its value`` for every leaf of a plain config (lists are leaves)."""
    flat = {}
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten_config(value, f"{dotted}."))
        else:
            flat[dotted] = json.dumps(value, sort_keys=True, default=str)
    return flat


def check_same_config(values: Mapping[str, Any], ctx: DistributedContext) -> None:
    """Refuse to go on unless every rank has the same resolved config (all ranks call this).

    Args:
        values: the resolved config as plain values (``metric_logging.plain_config``).
        ctx: this rank.

    Raises:
        UserError: on every rank, naming each key that differs (up to five) with its value on rank 0 and on
            the first rank that disagrees, and their hosts.
    """
    if not ctx.is_distributed:
        return
    flat = flatten_config(values)
    digest = hashlib.sha256(json.dumps(flat, sort_keys=True).encode()).hexdigest()
    digests: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(digests, digest)
    if len(set(digests)) == 1:
        return
    configs: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(configs, (flat, socket.gethostname()))
    reference, reference_host = configs[0]
    differences = []
    for key in sorted(set().union(*(set(c) for c, _ in configs))):
        for rank, (config, host) in enumerate(configs[1:], start=1):
            if config.get(key) != reference.get(key):
                differences.append(f"{key} is {reference.get(key, '(unset)')} on rank 0 (host {reference_host}) "
                                   f"but {config.get(key, '(unset)')} on rank {rank} (host {host})")
                break
    more = f"; and {len(differences) - _MAX_KEYS_SHOWN} more" if len(differences) > _MAX_KEYS_SHOWN else ""
    raise UserError(
        "the processes of this run were given different configs (every node's `tune run` needs the same config "
        "and overrides): " + "; ".join(differences[:_MAX_KEYS_SHOWN]) + more
    )
