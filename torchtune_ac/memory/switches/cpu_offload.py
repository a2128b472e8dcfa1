"""CPU offload as a memory switch: FSDP2 keeps the parameters' shards, their gradients and the optimizer state in
pinned host memory, copies each block's parameters to the GPU when it gathers them, and the optimizer steps on the
CPU (mechanism: FSDP2's ``CPUOffloadPolicy``, through ``fully_shard``; a single process shards on a world of one).

    fsdp:
      cpu_offload: false | true            # torchtune's fsdp_cpu_offload

A CUDA feature: refused with ``device: cpu``, and on a machine without CUDA (``check_device``). The planner moves
the parameters, gradients and optimizer state it counted on the device to the host, and adds back what FSDP2
gathers on the device: the root's and two blocks' parameters, and the root's gradients until backward ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch
from torch.distributed.fsdp import CPUOffloadPolicy

from torchtune_ac.errors import UnavailableError, UserError
from torchtune_ac.memory.switch import Alternative, ModelSizes, SwitchContext, SwitchCost, SwitchDefaults


@dataclass(frozen=True)
class CPUOffloadConfig:
    # Keep parameters, gradients and optimizer state in host memory (FSDP2's CPUOffloadPolicy); CUDA only.
    cpu_offload: bool = field(default=False, metadata={"torchtune": "fsdp_cpu_offload"})


WHAT = "keeps parameters, gradients and optimizer state in host memory while a CUDA device computes"


class CPUOffloadSwitch(SwitchDefaults):
    name = "cpu_offload"
    label = "CPU offload"
    off = False
    order = 40
    group = "fsdp"
    config_class = CPUOffloadConfig

    def resolve(self, config: CPUOffloadConfig, ctx: SwitchContext) -> bool:
        if config.cpu_offload and ctx.device == "cpu":
            raise UserError(f"fsdp.cpu_offload=true with device=cpu: it {WHAT}; on a CPU they are in host memory "
                            "already: set fsdp.cpu_offload: false")
        return config.cpu_offload

    def check_device(self, setting: bool, device: torch.device) -> None:
        if setting and device.type != "cuda":
            raise UnavailableError(f"fsdp.cpu_offload=true: it {WHAT}, and this run is on {device.type} (no CUDA "
                                   "here): set fsdp.cpu_offload: false")

    def describe(self, setting: bool, vocab_size: Optional[int]) -> str:
        if not setting:
            return "off"
        return ("parameters, gradients and optimizer state in pinned host memory, the optimizer stepping on the CPU "
                "(FSDP2 CPUOffloadPolicy)")

    def shard_options(self, setting: bool) -> Mapping[str, Any]:
        return {"offload_policy": CPUOffloadPolicy(pin_memory=True)} if setting else {}

    def planner_cost(self, setting: bool, sizes: ModelSizes) -> SwitchCost:
        if not setting:
            return SwitchCost()
        so_far = sizes.so_far
        shard = sizes.parameters // sizes.world_size
        # The root's gradients are reduced (and offloaded) only when backward ends: whole on the device until then.
        gradients_left = min(so_far["gradients"], sizes.root_parameters)
        return SwitchCost(
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

    def alternatives(self, setting: bool) -> list[Alternative]:
        return [] if setting else [Alternative("fsdp.cpu_offload=true", True)]


SWITCH = CPUOffloadSwitch()
