"""The optimizer-state switch: the layout of each optimizer counts the bytes it really allocates (torchao's 8-bit,
4-bit and bf16 AdamW, torch's AdamW), the planner counts it for torchao (whose compiled step it does not
simulate), tune validate prints it, bf16 stochastic rounding on fp32 weights is refused, and the first step of a
compiling optimizer is announced once."""

from __future__ import annotations

import logging

import pytest
import torch
import torchao.optim as torchao

from torchtune_ac.errors import UserError
from torchtune_ac.memory.feature import OptimizerSpec
from torchtune_ac.memory.optimizer_state import announce_first_step, layout_of, state_bytes
from torchtune_ac.memory.plan import MemoryConfig, resolve_memory_plan
from torchtune_ac.memory.planner import Workload, choose_plan, estimate_memory
from torchtune_ac.models import LlamaArgs
from torchtune_ac.models.llama import Llama
from torchtune_ac.activation_checkpointing.config import ACConfig
from torchtune_ac.activation_checkpointing.mechanism import ACMode
from torchtune_ac.runtime.parallelism import Parallelism

# Parameters of 6,144 (96 x 64), 4,096 (64 x 64) and 10,240 (160 x 64) elements, quantized in blocks of 128, 256
# or 2,048 but only the 4,096 one in blocks of 4,096; and too small to quantize: 2,048 (32 x 64) and 64 (norms).
ARGS = LlamaArgs(vocab_size=96, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, intermediate_dim=160, max_seq_len=32)
BF16 = {"bf16_stochastic_round": True}
CASES = {
    # name: (optimizer path, its arguments, parameter dtype)
    "8-bit": ("torchao.optim.AdamW8bit", {}, torch.float32),
    "8-bit, blocks of 2048": ("torchao.optim.AdamW8bit", {"block_size": 2048}, torch.float32),  # 6,144 % 2,048 == 0
    "8-bit, blocks of 4096": ("torchao.optim.AdamW8bit", {"block_size": 4096}, torch.float32),  # 6,144: not quantized
    "4-bit": ("torchao.optim.AdamW4bit", {}, torch.float32),
    "bf16 stochastic rounding": ("torchao.optim._AdamW", BF16, torch.bfloat16),
    "fp32 AdamW": ("torch.optim.AdamW", {}, torch.float32),
    "fp32 AdamW, amsgrad": ("torch.optim.AdamW", {"amsgrad": True}, torch.float32),
}


def _allocated_state_bytes(path: str, kwargs: dict, dtype: torch.dtype) -> int:
    """Bytes of the state the real optimizer allocates at its first step (torchao's run uncompiled: same state)."""
    model = Llama(ARGS).to(dtype)
    module, name = path.rsplit(".", 1)
    optimizer = getattr(torchao if module == "torchao.optim" else torch.optim, name)(model.parameters(), **kwargs)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    with torch.compiler.set_stance("force_eager"):
        optimizer.step()
    total = 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if key == "step":
                continue
            parts = (value.codes, value.scale, value.qmap) if hasattr(value, "codes") else (value,)
            total += sum(t.untyped_storage().nbytes() for t in parts)
    return total


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_layout_counts_what_the_optimizer_allocates(case):
    path, kwargs, dtype = CASES[case]
    shapes = [tuple(p.shape) for p in Llama(ARGS).parameters()]
    assert state_bytes(layout_of(path, kwargs), shapes, dtype) == _allocated_state_bytes(path, kwargs, dtype)


def _plan(path: str, kwargs: dict, dtype: torch.dtype = torch.float32, clip: float | None = None):
    return resolve_memory_plan(ACConfig(ac_mode=ACMode.FULL), MemoryConfig(), Llama(ARGS), clip_grad_norm=clip,
                               optimizer=OptimizerSpec(path, kwargs), dtype=dtype, device="cpu")


@pytest.mark.parametrize("path, bits", [("torchao.optim.AdamW8bit", 8), ("torchao.optim.AdamW4bit", 4)])
def test_the_planner_counts_torchaos_state_by_its_layout_and_simulates_a_stand_in(path, bits):
    plan = _plan(path, {})
    setting = plan.settings.optimizer_state
    assert setting.layout.bits == bits
    workload = Workload(batch_size=1, seq_len=16).with_settings(plan.settings)
    built = []

    def must_not_be_simulated(params):
        built.append(params)
        raise AssertionError("the planner built the torchao optimizer under fake tensors")

    estimate, = estimate_memory(lambda: Llama(ARGS), must_not_be_simulated, workload, [plan.ac])
    assert built == []
    shapes = [tuple(p.shape) for p in Llama(ARGS).parameters()]
    assert estimate.optimizer == state_bytes(setting.layout, shapes, torch.float32)
    fp32, = estimate_memory(lambda: Llama(ARGS), lambda p: torch.optim.AdamW(p),
                            Workload(batch_size=1, seq_len=16).with_settings(_plan("torch.optim.AdamW", {}).settings),
                            [plan.ac])
    assert estimate.optimizer < fp32.optimizer  # this model's small tensors stay fp32: the ratio is the layout's
    # Two processes: rank 0's shard of each parameter, by torchao's rule on the shard.
    sharded, = estimate_memory(lambda: Llama(ARGS), must_not_be_simulated, workload.with_settings({}, parallelism=Parallelism(2)),
                               [plan.ac])
    assert sharded.optimizer == state_bytes(setting.layout, shapes, torch.float32, world_size=2)


def test_when_nothing_fits_fp32_adamw_suggests_8_bit():
    plan = _plan("torch.optim.AdamW", {})
    workload = Workload(batch_size=1, seq_len=16).with_settings(plan.settings)
    with pytest.raises(UserError, match=r"optimizer\._component_=torchao\.optim\.AdamW8bit \(the ao extra\) [0-9.]+ GiB"):
        choose_plan(lambda: Llama(ARGS), lambda p: torch.optim.AdamW(p), workload, 1e-6, ARGS.n_layers)


def test_bf16_stochastic_rounding_of_fp32_weights_is_refused():
    with pytest.raises(UserError, match=r"^optimizer\.bf16_stochastic_round=true with dtype=fp32: .*set dtype: bf16"):
        _plan("torchao.optim._AdamW", BF16, torch.float32)
    assert _plan("torchao.optim._AdamW", BF16, torch.bfloat16).settings.optimizer_state.layout.stochastic_rounding


def test_the_plan_describes_the_layout_and_a_quantized_one_is_kept_on_resume():
    lines = dict(_plan("torchao.optim.AdamW8bit", {}).describe())
    assert lines["optimizer state"].startswith("8-bit (torchao.optim.AdamW8bit: 2 states in 8 bits with an fp32 scale "
                                               "per 256 elements")
    assert "its first step compiles" in lines["optimizer state"]
    assert _plan("torchao.optim.AdamW8bit", {}).resume_record() == {"optimizer_state": "8-bit"}
    assert _plan("torch.optim.AdamW", {}).resume_record() == {}
    assert dict(_plan("torch.optim.AdamW", {}).describe())["optimizer state"].startswith(
        "fp32 (torch.optim.AdamW: 2 states in fp32): 8.00 bytes per parameter")


def test_a_compiling_optimizer_announces_its_first_step_once(caplog):
    plan = _plan("torchao.optim.AdamW8bit", {})
    # The switch wraps the factory; SGD stands in for torchao here, so nothing compiles.
    make = plan.wrap_optimizer(lambda params: torch.optim.SGD(params, lr=0.1))
    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(3)]
    optimizers = [make([p]) for p in params]  # per-parameter optimizers, as in backward
    for p in params:
        p.grad = torch.ones(2)
    with caplog.at_level(logging.INFO, logger="torchtune_ac.memory"):
        for _ in range(2):
            for optimizer in optimizers:
                optimizer.step()
    assert [r.getMessage() for r in caplog.records] == [
        "torchao.optim.AdamW8bit: compiling its update for each parameter shape (tens of seconds on a CPU, once per "
        "process) before the first step"]
    plain = _plan("torch.optim.AdamW", {}).wrap_optimizer(announce_first_step)
    assert plain is announce_first_step  # nothing compiles: the factory is left alone
