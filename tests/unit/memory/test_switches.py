"""The memory-switch contract: switches are found in memory/switches/, their keys make MemoryConfig, and the plan,
the step and the planner go through what each declares (nothing names a switch)."""

from __future__ import annotations

import dataclasses
import sys
import textwrap

import pytest
import torch

from torchtune_ac.memory import switches as switches_package
from torchtune_ac.memory.activation_checkpointing import ACConfig, ACMode
from torchtune_ac.memory.chunked_loss import ChunkedCrossEntropyObjective
from torchtune_ac.memory.optimizer_in_backward import InBackwardStepper
from torchtune_ac.memory.plan import SWITCHES, FSDPConfig, MemoryConfig, resolve_memory_plan
from torchtune_ac.memory.planner import Workload, estimate_memory
from torchtune_ac.memory.switch import discover_switches
from torchtune_ac.models import LlamaArgs
from torchtune_ac.models.llama import Llama
from torchtune_ac.runtime import distributed
from torchtune_ac.training.step import CROSS_ENTROPY, OptimizerStepper

ARGS = LlamaArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_dim=64, max_seq_len=32)


def test_the_switches_are_found_in_order_and_their_keys_make_memory_config_and_fsdp_config():
    assert [s.name for s in SWITCHES] == ["ac", "optimizer_state", "optimizer_in_bwd", "loss_chunks",
                                          "enable_activation_offloading", "cpu_offload"]
    top = {f.name for s in SWITCHES if s.config_class is not ACConfig and s.group is None
           for f in dataclasses.fields(s.config_class)}
    assert {f.name for f in dataclasses.fields(MemoryConfig)} == top == {"optimizer_in_bwd", "loss_chunks",
                                                                          "enable_activation_offloading"}
    assert MemoryConfig().loss_chunks is None and MemoryConfig().optimizer_in_bwd is False
    # A switch whose group is fsdp adds its keys to FSDP2's own settings: fsdp.cpu_offload.
    own = {f.name for f in dataclasses.fields(distributed.FSDPConfig)}
    assert {f.name for f in dataclasses.fields(FSDPConfig)} == own | {"cpu_offload"}
    assert issubclass(FSDPConfig, distributed.FSDPConfig) and FSDPConfig().cpu_offload is False


@pytest.mark.parametrize("in_bwd, chunks, stepper_type, objective", [
    (False, 1, OptimizerStepper, CROSS_ENTROPY),
    (True, 1, InBackwardStepper, CROSS_ENTROPY),
    (False, 3, OptimizerStepper, ChunkedCrossEntropyObjective(3)),
])
def test_the_plan_builds_the_stepper_and_objective_its_switches_declare(in_bwd, chunks, stepper_type, objective):
    model = Llama(ARGS)
    plan = resolve_memory_plan(ACConfig(ac_mode=ACMode.FULL), MemoryConfig(optimizer_in_bwd=in_bwd, loss_chunks=chunks),
                               model, clip_grad_norm=None)
    assert [label for label, _ in plan.describe()] == ["activation checkpointing", "optimizer state", "optimizer step",
                                                       "loss", "activation offloading", "CPU offload"]
    assert isinstance(plan.build_stepper(lambda p: torch.optim.SGD(p, lr=0.1), model), stepper_type)
    assert plan.objective() == objective
    assert plan.resume_record() == ({"optimizer_in_bwd": True} if in_bwd else {})


NEW_SWITCH = textwrap.dedent('''
    from dataclasses import dataclass
    from torchtune_ac.memory.switch import SwitchCost, SwitchDefaults

    @dataclass(frozen=True)
    class ParkConfig:
        park_on_host: bool = False

    class Park(SwitchDefaults):
        name, label, order, off, config_class = "park", "parking", 30, False, ParkConfig

        def resolve(self, config, ctx):
            return config.park_on_host

        def describe(self, setting, vocab_size):
            return "on the host" if setting else "off"

        def planner_cost(self, setting, sizes):
            return SwitchCost(device={"optimizer": -sizes.optimizer_state}, host={"optimizer": sizes.optimizer_state}) if setting else SwitchCost()

    SWITCH = Park()
''')


def test_a_new_switch_is_one_module_and_the_planner_counts_its_declared_cost(tmp_path, monkeypatch):
    (tmp_path / "park.py").write_text(NEW_SWITCH)
    monkeypatch.setattr(switches_package, "__path__", [*switches_package.__path__, str(tmp_path)])
    discover_switches.cache_clear()
    try:
        found = discover_switches()
        assert [s.name for s in found] == ["ac", "optimizer_state", "optimizer_in_bwd", "loss_chunks",
                                           "enable_activation_offloading", "park", "cpu_offload"]
        workload = Workload(batch_size=1, seq_len=16)
        plans = [ACConfig(ac_mode=ACMode.FULL).resolve(ARGS.n_layers)]
        off, = estimate_memory(lambda: Llama(ARGS), lambda p: torch.optim.AdamW(p), workload, plans)
        on, = estimate_memory(lambda: Llama(ARGS), lambda p: torch.optim.AdamW(p),
                              workload.with_settings({"park": True}), plans)
        assert off.host == 0 and off.optimizer > 0
        assert on.host == off.optimizer and on.optimizer == 0 and on.host_parts == {"optimizer": off.optimizer}
        assert on.total == off.total - off.optimizer
    finally:
        discover_switches.cache_clear()
        sys.modules.pop("torchtune_ac.memory.switches.park", None)


WATCH_SWITCH = textwrap.dedent('''
    from dataclasses import dataclass
    from torchtune_ac.memory.switch import SwitchDefaults

    @dataclass(frozen=True)
    class WatchConfig:
        pass

    class Watch(SwitchDefaults):
        name, label, order, off, config_class = "watch", "watching", 31, None, WatchConfig
        seen = []

        def resolve(self, config, ctx):
            return None

        def describe(self, setting, vocab_size):
            return ""

        def planner_cost(self, setting, sizes):
            self.seen.append((dict(sizes.so_far), sizes.shapes, sizes.dtype, sizes.checkpointed_blocks,
                              sizes.block_input))
            return super().planner_cost(setting, sizes)

    SWITCH = Watch()
''')


def test_planner_costs_come_in_order_each_seeing_the_estimate_so_far_and_the_model_s_sizes(tmp_path, monkeypatch):
    (tmp_path / "park.py").write_text(NEW_SWITCH)
    (tmp_path / "watch.py").write_text(WATCH_SWITCH)
    monkeypatch.setattr(switches_package, "__path__", [*switches_package.__path__, str(tmp_path)])
    discover_switches.cache_clear()
    try:
        watch = next(s for s in discover_switches() if s.name == "watch")
        plans = [ACConfig(ac_mode=ACMode.FULL).resolve(ARGS.n_layers)]
        estimate, = estimate_memory(lambda: Llama(ARGS), lambda p: torch.optim.AdamW(p),
                                    Workload(batch_size=1, seq_len=16, settings=(("park", True),)), plans)
        so_far, shapes, dtype, checkpointed, block_input = watch.seen[-1]  # full AC (the first: no AC, the baseline)
        assert so_far["optimizer"] == 0 and so_far["parameters"] == estimate.parameters  # after park moved it
        model = Llama(ARGS)
        assert sorted(shapes) == sorted(tuple(p.shape) for p in model.parameters()) and dtype == torch.float32
        assert checkpointed == ARGS.n_layers and block_input == 1 * 16 * ARGS.dim * 4  # batch x seq x dim, fp32
    finally:
        discover_switches.cache_clear()
        for name in ("park", "watch"):
            sys.modules.pop(f"torchtune_ac.memory.switches.{name}", None)
