"""CPU offload (fsdp.cpu_offload) as the planner and the plan see it: the parameters, gradients and optimizer state
it counted on the device move to the host (with 8-bit state, the 8-bit bytes), FSDP2's gathered copies stay on the
device, the switch shards a single process, and it is suggested when nothing fits. (The run itself needs CUDA:
tests/integration/test_offload.py.)"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy

from torchtune_ac.errors import UnavailableError, UserError
from torchtune_ac.memory.feature import OptimizerSpec
from torchtune_ac.memory.plan import FSDPConfig, MemoryConfig, resolve_memory_plan
from torchtune_ac.memory.planner import Workload, choose_plan, estimate_memory
from torchtune_ac.models import LlamaArgs
from torchtune_ac.models.llama import Llama
from torchtune_ac.activation_checkpointing.config import ACConfig
from torchtune_ac.activation_checkpointing.mechanism import ACMode
from torchtune_ac.runtime.parallelism import Parallelism

ARGS = LlamaArgs(vocab_size=96, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, intermediate_dim=160, max_seq_len=32)
FULL = ACConfig(ac_mode=ACMode.FULL)


def _plan(offload: bool, optimizer: str = "torch.optim.AdamW", device: str = "cuda"):
    return resolve_memory_plan(FULL, MemoryConfig(), Llama(ARGS), clip_grad_norm=None,
                               fsdp=FSDPConfig(cpu_offload=offload), optimizer=OptimizerSpec(optimizer), device=device)


def _estimate(offload: bool, optimizer: str = "torch.optim.AdamW", world_size: int = 1):
    plan = _plan(offload, optimizer)
    workload = Workload(batch_size=1, seq_len=16, parallelism=Parallelism(world_size)).with_settings(plan.settings)
    estimate, = estimate_memory(lambda: Llama(ARGS), lambda p: torch.optim.AdamW(p), workload, [plan.ac])
    return estimate


@pytest.mark.parametrize("optimizer", ["torch.optim.AdamW", "torchao.optim.AdamW8bit"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_offload_moves_parameters_gradients_and_optimizer_state_to_the_host(optimizer, world_size):
    on, off = _estimate(True, optimizer, world_size), _estimate(False, optimizer, world_size)
    model = Llama(ARGS)
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    assert on.parameters == 0 and on.optimizer == 0
    root = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if not name.startswith("layers."))
    assert on.host_parts["parameters"] == parameters // world_size and on.host_parts["optimizer"] == off.optimizer
    # Every gradient exists at the optimizer step after backward: each rank's shard of all of them on the host then
    # (the count is the most at any phase's peak: the root's whole gradients beside the blocks' shards, at most).
    assert parameters // world_size <= on.host_parts["gradients"] <= parameters // world_size + root
    assert on.gradients == min(off.gradients, root)  # the root's, until backward ends
    assert on.activations == off.activations
    assert on.transient > off.transient  # the gathered copies are whole on the device
    assert on.total < off.total


def test_with_the_step_in_backward_the_host_holds_a_few_gradients_at_once():
    plan = resolve_memory_plan(FULL, MemoryConfig(optimizer_in_bwd=True), Llama(ARGS), clip_grad_norm=None,
                               fsdp=FSDPConfig(cpu_offload=True), optimizer=OptimizerSpec("torch.optim.AdamW"),
                               device="cuda")
    workload = Workload(batch_size=1, seq_len=16).with_settings(plan.settings)
    estimate, = estimate_memory(lambda: Llama(ARGS), lambda p: torch.optim.AdamW(p), workload, [plan.ac])
    parameters = sum(p.numel() * p.element_size() for p in Llama(ARGS).parameters())
    assert 0 < estimate.host_parts["gradients"] < parameters / 2


def test_offload_shards_a_single_process_and_is_suggested_when_nothing_fits():
    plan = _plan(True)
    assert isinstance(plan.shard_options()["offload_policy"], CPUOffloadPolicy)
    assert _plan(False).shard_options() == {}
    workload = Workload(batch_size=1, seq_len=16).with_settings(_plan(False).settings)
    with pytest.raises(UserError, match=r"fsdp\.cpu_offload=true [0-9.]+ GiB"):
        choose_plan(lambda: Llama(ARGS), lambda p: torch.optim.AdamW(p), workload, 1e-6, ARGS.n_layers,
                    device=torch.device("cuda"))
    with pytest.raises(UserError) as on_a_cpu:  # a CUDA feature is not suggested for a CPU run
        choose_plan(lambda: Llama(ARGS), lambda p: torch.optim.AdamW(p), workload, 1e-6, ARGS.n_layers)
    assert "cpu_offload" not in str(on_a_cpu.value)


def test_offload_is_refused_on_a_cpu():
    with pytest.raises(UserError, match=r"^fsdp\.cpu_offload=true with device=cpu: .*set fsdp\.cpu_offload: false$"):
        _plan(True, device="cpu")
    with pytest.raises(UnavailableError, match=r"^fsdp\.cpu_offload=true: .*this run is on cpu"):
        _plan(True, device="auto").check_device(torch.device("cpu"))
    _plan(True, device="auto").check_device(torch.device("cuda", 0))
