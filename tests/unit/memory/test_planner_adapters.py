"""The planner with adapters (``lora_finetune``, ``lora_dpo``): gradients and optimizer state for the adapters alone,
QLoRA's base by torchao's NF4 layout, LoRA DPO's reference as the policy itself (no second model), and
``ac_mode: auto`` choosing from the adapters' estimates."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torchao.quantization import to_nf4

from torchtune_ac.lora.config import AdapterConfig, QuantizeBase
from torchtune_ac.lora.mechanism import apply_adapters, quantize_base_
from torchtune_ac.memory.planner import PreferenceStep, Workload, candidate_plans, choose_plan, estimate_memory
from torchtune_ac.memory.planner.simulation import _nbytes
from torchtune_ac.models.families.llama import LLAMA_TINY as TINY
from torchtune_ac.models.llama import Llama

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
QLORA_TARGETS = ["q_proj", "o_proj"]
# Two blocks: simulated whole, once per estimate (the extrapolation to depth is test_planner.py's).
LLAMA_TINY = dataclasses.replace(TINY, n_layers=2)
WORKLOAD = Workload(batch_size=2, seq_len=64)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


def build(adapter: AdapterConfig | None):
    def model():
        built = Llama(LLAMA_TINY)
        if adapter is not None:
            apply_adapters(built, adapter)
            if adapter.quantize_base is QuantizeBase.NF4:
                quantize_base_(built)
        return built
    return model


FULL_AC = candidate_plans(LLAMA_TINY.n_layers)[-1]


@pytest.fixture(scope="module")
def estimates():
    """Full AC on the tiny Llama: full fine-tuning, LoRA (rank 8 on every linear of the blocks), and LoRA and QLoRA
    on the linears whose sizes NF4's blocks divide (q_proj, o_proj: 128 x 128)."""
    adapters = {"full": None, "lora": AdapterConfig(rank=8, targets=TARGETS),
                "lora_qo": AdapterConfig(rank=8, targets=QLORA_TARGETS),
                "qlora_qo": AdapterConfig(rank=8, targets=QLORA_TARGETS, quantize_base=QuantizeBase.NF4)}
    return {name: estimate_memory(build(adapter), adamw, WORKLOAD, [FULL_AC])[0] for name, adapter in adapters.items()}


def adapter_and_base_bytes(targets=TARGETS) -> tuple[int, int, int]:
    """The tiny Llama with LoRA on ``targets``: its adapters' bytes, its other parameters' bytes, and the bytes of
    the adapted linears' weights (what QLoRA stores in NF4)."""
    model = Llama(LLAMA_TINY)
    adapted = apply_adapters(model, AdapterConfig(rank=8, targets=targets))
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    linears = sum(linear.weight.numel() * linear.weight.element_size() for linear in adapted.values())
    return trainable, frozen, linears


def test_state_and_gradients_only_for_the_adapters(estimates):
    trainable, frozen, _ = adapter_and_base_bytes()
    lora, full = estimates["lora"], estimates["full"]
    assert lora.parameters == trainable + frozen == full.parameters + trainable
    # AdamW: two fp32 moments per trainable parameter and a step counter (one fp32 scalar) per trainable tensor.
    n_tensors = 2 * 7 * LLAMA_TINY.n_layers
    assert lora.optimizer == 2 * trainable + 4 * n_tensors
    assert lora.gradients <= trainable < full.gradients
    assert lora.device < full.device


def test_nf4_bytes_follow_torchaos_layout():
    """0.5 byte a weight, an int8 scale per block of 64, a factor (dtype) per 256 scales, the scales' mean and the
    16 code values: 0.516 bytes a weight in bf16, counted by the planner from the tensor's inner storages."""
    weight = torch.randn(256, 512, dtype=torch.bfloat16)
    n = weight.numel()
    expected = n // 2 + n // 64 + n // (64 * 256) * 2 + 2 + 16 * 2
    assert _nbytes([to_nf4(weight, 64, 256)]) == expected == 67_634
    with FakeTensorMode():  # the planner's model: the same layout on fake tensors
        assert _nbytes([to_nf4(torch.randn(256, 512, dtype=torch.bfloat16), 64, 256)]) == expected


def test_qlora_s_base_is_counted_in_nf4(estimates):
    _, _, linears = adapter_and_base_bytes(QLORA_TARGETS)
    # torchao's own NF4 tensor of a 128 x 128 fp32 weight, its inner tensors' storages (one block of 256 scales:
    # its factor stays a view of the 256 it was computed from, as torchao leaves it).
    inner = to_nf4(torch.randn(128, 128), 64, 256)
    per_linear = sum(getattr(inner, name).untyped_storage().nbytes() for name in inner.__tensor_flatten__()[0])
    assert per_linear == 8192 + 256 + 256 * 4 + 4 + 16 * 4
    nf4 = per_linear * len(QLORA_TARGETS) * LLAMA_TINY.n_layers
    assert estimates["lora_qo"].parameters - estimates["qlora_qo"].parameters == linears - nf4
    assert estimates["qlora_qo"].optimizer == estimates["lora_qo"].optimizer


def test_lora_dpo_keeps_no_second_model():
    lora = build(AdapterConfig(rank=8, targets=TARGETS))
    policy_as_reference = Workload(batch_size=2, seq_len=128,
                                   preference=PreferenceStep(resident_reference=False, reference_is_policy=True))
    resident = Workload(batch_size=2, seq_len=128, preference=PreferenceStep(resident_reference=True))
    ours, = estimate_memory(lora, adamw, policy_as_reference, [FULL_AC])
    full_dpo, = estimate_memory(build(None), adamw, resident, [FULL_AC])
    assert ours.reference == 0 and full_dpo.reference == full_dpo.parameters
    assert ours.device < full_dpo.device


def test_auto_chooses_from_the_adapters_estimates():
    """A budget just under full fine-tuning's estimate without AC: LoRA's is under it, and auto runs it without AC
    (with the base's estimate it would have needed some)."""
    lora = build(AdapterConfig(rank=8, targets=TARGETS))
    none = candidate_plans(LLAMA_TINY.n_layers)[0]
    lora_none, = estimate_memory(lora, adamw, WORKLOAD, [none])
    full_none, = estimate_memory(build(None), adamw, WORKLOAD, [none])
    budget = (full_none.device - 1) / 2**30
    assert lora_none.device < full_none.device
    assert choose_plan(lora, adamw, WORKLOAD, budget, LLAMA_TINY.n_layers).plan == none


def test_low_bit_state_is_counted_for_the_adapters_alone():
    """torchao's 8-bit AdamW, whose state the planner counts from shapes (its step cannot be simulated): the shapes
    of the parameters that train, not the frozen base's."""
    from torchtune_ac.memory.features import MemorySettings
    from torchtune_ac.memory.optimizer_state import EIGHT_BIT, OptimizerState, layout_of, state_bytes

    layout = layout_of(EIGHT_BIT, {})
    workload = dataclasses.replace(WORKLOAD, settings=MemorySettings(optimizer_state=OptimizerState(layout, EIGHT_BIT)))
    model = Llama(LLAMA_TINY)
    apply_adapters(model, AdapterConfig(rank=8, targets=TARGETS))
    trained = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    lora, = estimate_memory(build(AdapterConfig(rank=8, targets=TARGETS)), adamw, workload, [FULL_AC])
    assert lora.optimizer == state_bytes(layout, trained, torch.float32) > 0


def test_per_op_ac_keeps_the_adapters_rank_sized_products_not_their_full_width_ones():
    """Per-op AC saves each matmul's output but an adapter's B (A x) ([b, s, out] from rank r): it keeps A x and
    recomputes B (A x), so with adapters it keeps less than no AC (keeping B (A x) too, it kept more)."""
    lora = build(AdapterConfig(rank=8, targets=TARGETS))
    none, per_op = candidate_plans(LLAMA_TINY.n_layers)[:2]
    assert "op" in str(per_op), per_op
    without, selective = estimate_memory(lora, adamw, WORKLOAD, [none, per_op])
    assert selective.activations < without.activations
