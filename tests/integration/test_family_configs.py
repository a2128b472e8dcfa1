"""The shipped configs of the families added on the shared decoder, and the adapter configs of the popular ones:
`tune validate` prints the published parameter count (built on the meta device), the chunked loss these
vocabularies get by default and the adapters found on the model, and `tune plan` answers for one config of each
family."""

from __future__ import annotations

import re

import pytest

from torchtune_ac.cli import main

# config -> (parameters, vocabulary)
CONFIGS = {
    "gemma2/2B_full": ("2,614,341,888", "256,000"),
    "gemma3/1B_full": ("999,885,952", "262,144"),
    "gemma3/4B_full": ("3,880,263,168", "262,208"),
    "phi3/mini_full": ("3,821,079,552", "32,064"),
    "phi4/14B_full": ("14,659,507,200", "100,352"),
    "qwen3/0.6B_full": ("596,049,920", "151,936"),
    "qwen3/8B_full": ("8,190,735,360", "151,936"),
    "qwen2_5_vl/3B_full": ("3,754,622,976", "151,936"),
    "qwen2_5_vl/7B_full": ("8,292,166,656", "152,064"),
    "qwen3_vl/8B_full": ("8,767,123,696", "151,936"),
    "gemma3/4B_vision_full": ("4,300,079,472", "262,208"),
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_validate_prints_the_published_parameter_count_and_a_chunked_loss(config, capsys):
    parameters, vocabulary = CONFIGS[config]
    assert main(["validate", "--config", config]) == 0
    out = capsys.readouterr().out
    assert f": {parameters} parameters, " in out
    assert f"loss                      8 chunks (vocabulary {vocabulary})" in out


# One config of each family for the plan (each plan traces every AC setting: seconds): the family's other sizes
# differ only in their shapes, which validate checks above.
PLANNED = ("gemma2/2B_full", "gemma3/1B_full", "phi3/mini_full", "qwen3/0.6B_full")


@pytest.mark.parametrize("config", PLANNED)
def test_plan_answers_for_every_ac_setting(config, capsys):
    assert main(["plan", "--config", config]) == 0
    out = capsys.readouterr().out
    assert f"{CONFIGS[config][0]} parameters; 1 process(es)" in out
    settings = [m.group(1) for m in map(re.compile(r"^(none|per-op|every \S+ block|full) +[\d.]").match,
                                       out.splitlines()) if m]
    assert settings[0] == "none" and settings[-1] == "full" and "per-op" in settings


# The adapter configs of the popular models: config -> (parameters, recipe, rank and alpha, base).
ADAPTER_CONFIGS = {
    "llama3_1/8B_lora": ("8,030,261,248", "lora_finetune", "rank 8, alpha 16", "in dtype"),
    "llama3_1/8B_qlora_single_device": ("8,030,261,248", "lora_finetune", "rank 8, alpha 16", "NF4 (QLoRA)"),
    "llama3_2/1B_lora": ("1,235,814,400", "lora_finetune", "rank 64, alpha 128", "in dtype"),
    "qwen2_5/7B_lora": ("7,615,616,512", "lora_finetune", "rank 8, alpha 16", "in dtype"),
    "qwen3/8B_lora": ("8,190,735,360", "lora_finetune", "rank 8, alpha 16", "in dtype"),
    "gemma2/9B_lora": ("9,241,705,984", "lora_finetune", "rank 8, alpha 16", "in dtype"),
    "llama3_1/8B_lora_dpo": ("8,030,261,248", "lora_dpo", "rank 8, alpha 16", "in dtype"),
}


@pytest.mark.parametrize("config", sorted(ADAPTER_CONFIGS))
def test_adapter_configs_validate_with_their_adapters_on_the_model(config, capsys):
    """torchtune's targets (q, v, o and the MLP) found on each family's model, for the recipe its launch line names
    (``test_cli.py`` validates every config; this checks what the adapter configs resolve to)."""
    parameters, recipe, rank, base = ADAPTER_CONFIGS[config]
    assert main(["validate", "--config", config]) == 0
    out = capsys.readouterr().out
    assert f"is valid for recipe {recipe}" in out and f": {parameters} parameters, " in out
    assert (f"lora {rank} on q_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; base frozen, {base}; "
            "A Kaiming-uniform, B zero") in out
