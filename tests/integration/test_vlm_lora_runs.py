"""``tune run lora_finetune --config tiny/vlm_lora``: adapters on the language model of a tiny random Qwen2.5-VL
trained on images; PEFT loads the run's folder onto transformers' Qwen2_5_VLForConditionalGeneration with our
logits on an image; a target that names no language-model linear is refused in one line, exit 2, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from finetune_runs import check_success, final_checkpoint, hash_tree, run_tune_in_process
from numerics import assert_close, llama_terms
from safetensors.torch import load_file

from torchtune_ac.checkpoint.peft import ADAPTER_WEIGHTS_FILE
from torchtune_ac.embedded import ensure_embedded_vlm_checkpoint
from torchtune_ac.lora.config import AdapterConfig
from torchtune_ac.lora.mechanism import apply_adapters
from torchtune_ac.lora.weights import load_or_initialize_adapters_
from torchtune_ac.models import load_hf
from torchtune_ac.models.families.qwen2_5_vl import QWEN2_5_VL_TINY
from torchtune_ac.observability.metrics import read_metrics

STEPS = 4
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _argv(output_dir: Path, *overrides: str) -> list[str]:
    return ["run", "lora_finetune", "--config", "tiny/vlm_lora", "epochs=1", f"max_steps_per_epoch={STEPS}",
            f"output_dir={output_dir}", *overrides]


@pytest.fixture(scope="module")
def vlm_lora_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    output_dir = tmp_path_factory.mktemp("vlm_lora") / "run"
    check_success(run_tune_in_process(_argv(output_dir)))
    return output_dir


def test_the_adapters_are_on_the_language_model_and_learn(vlm_lora_run):
    names = list(load_file(final_checkpoint(vlm_lora_run) / ADAPTER_WEIGHTS_FILE))
    # A and B on 7 linears of each decoder block; none on the tower, whose mlp has gate/up/down_proj too
    assert len(names) == 2 * 7 * QWEN2_5_VL_TINY.n_layers, names
    assert all(name.startswith("base_model.model.model.language_model.layers.") for name in names)
    losses = [r["loss"] for r in read_metrics(vlm_lora_run)]
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.2, losses


@pytest.mark.numerics
def test_peft_loads_the_adapters_on_transformers_model_with_our_logits_on_an_image(vlm_lora_run):
    peft = pytest.importorskip("peft")
    from transformers import Qwen2_5_VLForConditionalGeneration

    base, folder = ensure_embedded_vlm_checkpoint(), final_checkpoint(vlm_lora_run)
    ours = load_hf(base)
    config = AdapterConfig(targets=TARGETS, checkpoint_dir=str(folder))
    apply_adapters(ours, config)
    load_or_initialize_adapters_(ours, config, seed=0)
    transformers_model = Qwen2_5_VLForConditionalGeneration.from_pretrained(base, attn_implementation="eager")
    theirs = peft.PeftModel.from_pretrained(transformers_model, folder).eval()
    # adapter_config.json's exclude_modules keeps PEFT off the tower's gate/up/down_proj, as we are
    adapted = [name for name, module in theirs.named_modules() if isinstance(module, peft.tuners.lora.LoraLayer)]
    assert len(adapted) == 7 * QWEN2_5_VL_TINY.n_layers and not any(".visual." in name for name in adapted)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 512, (1, 16), generator=g)
    tokens[0, 3:7] = QWEN2_5_VL_TINY.image_token_id  # one 56 x 56 image: 4 x 4 patches, 4 tokens
    images = dict(pixel_values=torch.randn(16, 3 * 2 * 14 * 14, generator=g), image_grid_thw=torch.tensor([[1, 4, 4]]))
    terms = 2 * llama_terms(QWEN2_5_VL_TINY, 16, 0, backward=False)
    with torch.no_grad():
        expected = theirs(input_ids=tokens, mm_token_type_ids=(tokens == 516).int(), **images).logits
        assert_close(ours.eval()(tokens, **images), expected, terms=terms, what="logits")
        with theirs.disable_adapter():  # the adapters count: the base alone is far from it
            base_logits = theirs(input_ids=tokens, mm_token_type_ids=(tokens == 516).int(), **images).logits
    assert (base_logits - expected).abs().max() > 1e-2


REFUSED = {
    "tower_linear": ("adapter.targets=[q_proj,qkv]", "adapter.targets: qkv name(s) only linears of the vision tower "
                     "(visual), which adapters do not reach; the language model's linears are down_proj, gate_proj"),
    "matching_nothing": ("adapter.targets=[c_attn]", "adapter.targets: c_attn match(es) no linear of this model"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_target_on_no_language_model_linear_is_refused_in_one_line(name, tmp_path):
    override, message = REFUSED[name]
    before = hash_tree(tmp_path)
    result = run_tune_in_process(_argv(tmp_path / "out", override))
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert message in lines[-1] and "Traceback" not in result.stderr, result.stderr
    assert hash_tree(tmp_path) == before
