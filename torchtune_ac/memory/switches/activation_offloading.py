"""Activation offloading as a memory switch: what checkpointed blocks keep for backward waits in pinned host
memory, copied on a side stream and prefetched in backward (mechanism: ``memory/activation_offloading.py``).

    enable_activation_offloading: false | true     # torchtune's key

A CUDA feature: refused with ``device: cpu``, and on a machine without CUDA (``check_device``); and refused with no
activation checkpointing at all (``ac_mode: none``), which leaves nothing it moves. The planner moves the inputs of
the checkpointed blocks from the device's activations to the host, keeping two on the device (the one a block's
backward is using and the one being prefetched).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from torchtune_ac.errors import UnavailableError, UserError
from torchtune_ac.memory.activation_offloading import apply_activation_offloading
from torchtune_ac.memory.switch import Alternative, ModelSizes, SwitchContext, SwitchCost, SwitchDefaults


@dataclass(frozen=True)
class ActivationOffloadingConfig:
    # Keep what checkpointed blocks save for backward in pinned host memory (CUDA only).
    enable_activation_offloading: bool = False


WHAT = "moves what checkpointed blocks keep for backward from a CUDA device to pinned host memory"
IN_FLIGHT = 2  # block inputs on the device at once in backward: the one in use and the one prefetched


class ActivationOffloadingSwitch(SwitchDefaults):
    name = "enable_activation_offloading"
    label = "activation offloading"
    off = False
    order = 30
    config_class = ActivationOffloadingConfig

    def resolve(self, config: ActivationOffloadingConfig, ctx: SwitchContext) -> bool:
        if not config.enable_activation_offloading:
            return False
        if ctx.device == "cpu":
            raise UserError(f"enable_activation_offloading=true with device=cpu: it {WHAT}; on a CPU they are in host "
                            "memory already: set enable_activation_offloading: false")
        ac = ctx.settings.get("ac")
        if ac is not None and not ac.checkpointed_blocks:
            raise UserError(f"enable_activation_offloading=true with no activation checkpointing: it {WHAT}, and no "
                            "block is checkpointed; set enable_activation_checkpointing: true (or an ac_mode)")
        return True

    def check_device(self, setting: bool, device: torch.device) -> None:
        if setting and device.type != "cuda":
            raise UnavailableError(f"enable_activation_offloading=true: it {WHAT}, and this run is on {device.type} "
                                   "(no CUDA here): set enable_activation_offloading: false")

    def describe(self, setting: bool, vocab_size: Optional[int]) -> str:
        if not setting:
            return "off"
        return ("the inputs checkpointed blocks keep, in pinned host memory: copied on a side stream in forward, "
                "prefetched a block ahead in backward")

    def apply_to_model(self, model: nn.Module, setting: bool) -> None:
        if setting:
            apply_activation_offloading(model)

    def planner_cost(self, setting: bool, sizes: ModelSizes) -> SwitchCost:
        if not setting or not sizes.checkpointed_blocks:
            return SwitchCost()
        kept = sizes.checkpointed_blocks * sizes.block_input
        moved = max(0, min(sizes.so_far["activations"], kept) - min(IN_FLIGHT, sizes.checkpointed_blocks) * sizes.block_input)
        return SwitchCost(device={"activations": -moved}, host={"activations": kept})

    def alternatives(self, setting: bool) -> list[Alternative]:
        return [] if setting else [Alternative("enable_activation_offloading=true", True)]


SWITCH = ActivationOffloadingSwitch()
