"""Adapters against PEFT 0.21 (a test-only reference): the same transformers checkpoint, the same adapter values;
step 0 is the base bit for bit, the logits, one step's gradients and the step after it agree with PEFT's within
the rounding bound (Llama, Qwen2, and Qwen3-MoE's attention), PEFT loads the folder we write and gives our logits,
a folder PEFT wrote is a starting point with PEFT's logits, and the merged model we write loads in transformers with
the logits of base + adapters."""

import dataclasses

import pytest
import torch
from hf_families import random_hf_model
from numerics import assert_close, llama_terms

from torchtune_ac.checkpoint import write_hf_files
from torchtune_ac.checkpoint.peft import write_adapter_files
from torchtune_ac.errors import UserError
from torchtune_ac.lora.config import AdapterConfig, AdapterKind
from torchtune_ac.lora.export import adapter_files, merged_model_files
from torchtune_ac.lora.mechanism import adapted_linears, apply_adapters, initialize_adapters_
from torchtune_ac.lora.peft_names import peft_tensors
from torchtune_ac.lora.weights import check_adapter_start, load_or_initialize_adapters_
from torchtune_ac.models import load_hf

peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOKENS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
LABELS = torch.roll(TOKENS, -1, dims=1)
# Qwen3-MoE (a dense layer, then a sparse one): attention's linears. On a mixture of experts PEFT 0.21 takes the MLP's
# names for the experts' stacked tensors, which take no adapters here (docs/lora.md).
CASES = [(family, kind) for family in ("llama", "qwen2") for kind in AdapterKind] + [("qwen3_moe", AdapterKind.LORA)]
TARGETS_OF = {"qwen3_moe": ["q_proj", "k_proj", "v_proj", "o_proj"]}
IDS = [f"{family}-{kind.value}" for family, kind in CASES]


def adapted_pair(tmp_path, family, kind, *, output=False):
    """Our model with adapters and PEFT's on the same transformers checkpoint; B and DoRA's magnitude moved off
    their initial values (so the update is not zero), the same values copied into PEFT's."""
    base = random_hf_model(family, seed=1)
    base.save_pretrained(tmp_path / "base")
    targets = TARGETS_OF.get(family, TARGETS)
    config = AdapterConfig(kind=kind, rank=4, alpha=8.0, targets=targets, output=output)
    ours = load_hf(tmp_path / "base")
    apply_adapters(ours, config)
    initialize_adapters_(ours, seed=0)
    with torch.no_grad():
        logits_base = ours(TOKENS)
        generator = torch.Generator().manual_seed(2)
        for _, linear in adapted_linears(ours):
            linear.lora_b.weight.copy_(0.1 * torch.randn(linear.lora_b.weight.shape, generator=generator))
            if linear.lora_magnitude is not None:
                linear.lora_magnitude.mul_(1 + 0.1 * torch.rand(linear.lora_magnitude.shape, generator=generator))
    theirs = peft.get_peft_model(random_hf_model(family, seed=1), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=targets + (["lm_head"] if output else []), use_dora=kind is AdapterKind.DORA))
    result = peft.set_peft_model_state_dict(theirs, {k: v.detach().clone() for k, v in peft_tensors(ours).items()})
    assert not result.unexpected_keys
    return ours, theirs, config, logits_base, base


@pytest.mark.numerics
@pytest.mark.parametrize("family, kind", CASES, ids=IDS)
def test_step_zero_is_the_base_and_a_step_matches_peft(tmp_path, family, kind):
    base = random_hf_model(family, seed=1)
    base.save_pretrained(tmp_path / "zero")
    untouched = load_hf(tmp_path / "zero")
    adapted = load_hf(tmp_path / "zero")
    apply_adapters(adapted, AdapterConfig(kind=kind, targets=TARGETS_OF.get(family, TARGETS)))
    initialize_adapters_(adapted, seed=0)
    with torch.no_grad():
        # Bit for bit: B is zero, so the update adds exact zeros (DoRA's scale is the same norm divided by itself).
        assert torch.equal(adapted(TOKENS), untouched(TOKENS))
    assert [n for n, p in adapted.named_parameters() if p.requires_grad] == [
        n for n, _ in adapted.named_parameters() if ".lora_" in n]

    ours, theirs, _, _, _ = adapted_pair(tmp_path, family, kind)
    args = ours.args
    forward = llama_terms(args, TOKENS.shape[1], 0, backward=False)
    backward = llama_terms(args, TOKENS.shape[1], TOKENS.numel())
    logits = ours(TOKENS)
    expected = theirs(input_ids=TOKENS).logits
    assert_close(logits, expected, terms=forward, what="logits")

    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), LABELS.flatten())
    loss.backward()
    torch.nn.functional.cross_entropy(expected.flatten(0, 1), LABELS.flatten()).backward()
    peft_params = dict(theirs.named_parameters())
    ours_by_peft = {key: tensor for key, tensor in peft_tensors(ours).items()}
    for key, tensor in ours_by_peft.items():
        peft_key = (key.replace("lora_A.weight", "lora_A.default.weight").replace("lora_B.weight", "lora_B.default.weight")
                    .replace("lora_magnitude_vector", "lora_magnitude_vector.default.weight"))
        grad = peft_params[peft_key].grad
        assert grad is not None and tensor.grad is not None, key
        assert_close(tensor.grad, grad, terms=backward, magnitude=float(grad.abs().max()) + 1e-30, what=key)
    assert all(p.grad is None for n, p in ours.named_parameters() if ".lora_" not in n)  # the base is frozen

    # One SGD step on both; the logits after it agree again.
    for params in ([p for p in ours.parameters() if p.requires_grad],
                   [p for p in theirs.parameters() if p.requires_grad]):
        torch.optim.SGD(params, lr=0.5).step()
    with torch.no_grad():
        assert_close(ours(TOKENS), theirs(input_ids=TOKENS).logits, terms=forward + backward, what="stepped logits")


@pytest.mark.numerics
@pytest.mark.parametrize("kind", list(AdapterKind), ids=[k.value for k in AdapterKind])
def test_peft_loads_our_folder_we_start_from_peft_s_and_the_merged_model_is_base_plus_adapters(tmp_path, kind):
    from transformers import AutoModelForCausalLM

    ours, theirs, config, _, _ = adapted_pair(tmp_path, "llama", kind, output=True)
    (tmp_path / "adapter").mkdir()
    write_adapter_files(adapter_files(ours, config, base_model=str(tmp_path / "base")), tmp_path / "adapter")
    (tmp_path / "merged").mkdir()
    write_hf_files(merged_model_files(ours), tmp_path / "merged")
    forward = llama_terms(ours.args, TOKENS.shape[1], 0, backward=False)
    with torch.no_grad():
        logits = ours(TOKENS)
        loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                                tmp_path / "adapter").eval()
        assert_close(loaded(input_ids=TOKENS).logits, logits, terms=forward, what="PEFT's logits of our folder")
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager").eval()
        assert_close(merged(input_ids=TOKENS).logits, logits, terms=forward, what="the merged model's logits")

    # PEFT's own folder (PeftModel.save_pretrained) as adapter.checkpoint_dir: with lm_head among the targets PEFT
    # saves a copy of its base weight too, refused in one line; without it, accepted by the run's check, and our
    # model started from it computes PEFT's logits.
    theirs.save_pretrained(tmp_path / "with_copy")
    started = load_hf(tmp_path / "base")
    with pytest.raises(UserError, match=r"lm_head.base_layer.weight is a copy of a base weight.*"
                                        r"save_embedding_layers=False"):
        check_adapter_start(started, dataclasses.replace(config, checkpoint_dir=str(tmp_path / "with_copy")),
                            loss_chunks=1)
    theirs.save_pretrained(tmp_path / "theirs", save_embedding_layers=False)
    start = dataclasses.replace(config, checkpoint_dir=str(tmp_path / "theirs"))
    check_adapter_start(started, start, loss_chunks=1)
    apply_adapters(started, start)
    load_or_initialize_adapters_(started, start, seed=0)
    with torch.no_grad():
        assert_close(started(TOKENS), theirs(input_ids=TOKENS).logits, terms=forward, what="started from PEFT's")
