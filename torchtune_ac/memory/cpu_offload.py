"""CPU offload, a memory feature (``FEATURE``): FSDP2 keeps the parameters' shards, their gradients and the
optimizer state in pinned host memory, copies each block's parameters to the GPU when it gathers them, and the
optimizer steps on the CPU. The mechanism is FSDP2's ``CPUOffloadPolicy``, passed to every ``fully_shard`` call
(``shard_options``); a single process shards its model on a world of one to get it.

    fsdp:
      cpu_offload: false | true            # torchtune's fsdp_cpu_offload

A CUDA feature: refused with ``device: cpu``, and on a machine without CUDA (``check_device``). The planner moves
the parameters, gradients and optimizer state it counted on the device to the host, and adds back what FSDP2
gathers on the device: the root's and two blocks' parameters, and the root's gradients until backward ends.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
from torch.distributed.fsdp import CPUOffloadPolicy

from torchtune_ac.errors import UnavailableError, UserError
from torchtune_ac.memory.feature import Alternative, Feature, FeatureCost, ModelSizes, ResolveInputs

WHAT = "keeps parameters, gradients and optimizer state in host memory while a CUDA device computes"


def shard_options(setting: bool) -> Mapping[str, Any]:
    """The ``fully_shard`` keyword arguments of the setting (any makes a single process shard its model too)."""
    return {"offload_policy": CPUOffloadPolicy(pin_memory=True)} if setting else {}


def _resolve(inputs: ResolveInputs) -> bool:
    if inputs.fsdp.cpu_offload and inputs.device == "cpu":
        raise UserError(f"fsdp.cpu_offload=true with device=cpu: it {WHAT}; on a CPU they are in host memory "
                        "already: set fsdp.cpu_offload: false")
    return inputs.fsdp.cpu_offload


def _check_device(setting: bool, device: torch.device) -> None:
    if setting and device.type != "cuda":
        raise UnavailableError(f"fsdp.cpu_offload=true: it {WHAT}, and this run is on {device.type} (no CUDA "
                               "here): set fsdp.cpu_offload: false")


def _describe(setting: bool, vocab_size: Optional[int]) -> str:
    if not setting:
        return "off"
    return ("parameters, gradients and optimizer state in pinned host memory, the optimizer stepping on the CPU "
            "(FSDP2 CPUOffloadPolicy)")


def _planner_cost(setting: bool, sizes: ModelSizes) -> FeatureCost:
    if not setting:
        return FeatureCost()
    so_far = sizes.so_far
    shard = sizes.parameters // sizes.world_size
    # The root's gradients are reduced (and offloaded) only when backward ends: whole on the device until then.
    gradients_left = min(so_far["gradients"], sizes.root_parameters)
    return FeatureCost(
        device={
            "parameters": -so_far["parameters"],
            "optimizer": -so_far["optimizer"],
            "gradients": gradients_left - so_far["gradients"],
            # The gathered copies are whole on the device: the estimate counted the resident shard's share.
            "transient": sizes.gathered_parameters // sizes.world_size,
        },
        # Gradients as many as the step has at once (all of them before an optimizer step after backward).
        host={"parameters": shard, "optimizer": so_far["optimizer"], "gradients": sizes.max_gradients},
    )


def _alternatives(setting: bool) -> list[Alternative]:
    return [] if setting else [Alternative("fsdp.cpu_offload=true", True)]


FEATURE = Feature(name="cpu_offload", label="CPU offload", off=False, resolve=_resolve, describe=_describe,
                  check_device=_check_device, planner_cost=_planner_cost, alternatives=_alternatives)
