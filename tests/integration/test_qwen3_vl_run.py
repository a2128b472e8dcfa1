"""A tiny Qwen3-VL fine-tuned through the real CLI on the embedded coloured-shapes task: ``tiny/vlm`` with the model
swapped for ``qwen3_vl_tiny`` and a Qwen3-VL processor made offline from the embedded one (16-pixel patches, as
Qwen3-VL's; the embedded processor's are Qwen2.5-VL's 14). The loss falls; a resume is exact; the export loads in transformers'
``Qwen3VLForConditionalGeneration`` with our logits, its processor beside it; the Qwen2.5-VL processor is refused
before anything is written (by tune validate too)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from finetune_runs import (
    check_success,
    final_checkpoint,
    read_losses,
    resume_from_the_checkpoint_before_last,
    run_tune_in_process,
)
from numerics import assert_close, llama_terms
from transformers import Qwen3VLForConditionalGeneration

from torchtune_ac.data import load_tokenizer
from torchtune_ac.data.embedded import EMBEDDED_VLM_PROCESSOR_DIR
from torchtune_ac.data.vision import load_vision_processor
from torchtune_ac.models import load_hf, save_hf
from torchtune_ac.models.families.qwen3_vl import QWEN3_VL_TINY, qwen3_vl_tiny

STEPS = 6
PATCH = 16
# A step: 8 rows of up to 64 tokens through both towers (the tower's reductions are shorter than the decoder's).
TERMS = 2 * llama_terms(QWEN3_VL_TINY, 64, 8 * 64)


def _write_start(folder: Path) -> Path:
    """A random ``qwen3_vl_tiny`` checkpoint beside a Qwen3-VL processor: the embedded processor's tokenizer, chat
    template and image processor with Qwen3-VL's patch size (a 56-pixel image is resized to 64: 4 x 4 patches, 4
    tokens) and processor class."""
    processor = folder / "processor"
    shutil.copytree(EMBEDDED_VLM_PROCESSOR_DIR, processor)
    config = json.loads((processor / "preprocessor_config.json").read_text())
    (processor / "preprocessor_config.json").write_text(json.dumps({**config, "patch_size": PATCH}))
    (processor / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen3VLProcessor"}))
    tokenizer = load_tokenizer(str(processor))
    torch.manual_seed(0)
    model = qwen3_vl_tiny()
    model.init_weights()
    start = folder / "start"
    save_hf(model, start, tokenizer_dir=processor, bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id,
            pad_token_id=tokenizer.pad_id)
    for path in processor.iterdir():
        if not (start / path.name).exists():
            shutil.copyfile(path, start / path.name)
    return start


def _argv(output_dir: Path, start: Path) -> list[str]:
    return ["run", "full_finetune", "--config", "tiny/vlm", "model._component_=torchtune_ac.models.qwen3_vl_tiny",
            f"checkpoint_dir={start}", "max_seq_len=64", "batch_size=8", "epochs=1", f"max_steps_per_epoch={STEPS}",
            "save_every_n_steps=3", f"output_dir={output_dir}"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("qwen3_vl")
    output_dir, start = folder / "run", _write_start(folder)
    check_success(run_tune_in_process(_argv(output_dir, start)))
    return output_dir, start


def test_the_loss_falls(tiny_run):
    losses = read_losses(tiny_run[0])
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.5, losses


def test_a_resume_is_exact(tiny_run, tmp_path):
    output_dir, start = tiny_run
    resumed_dir = tmp_path / "resumed"
    resume_from_the_checkpoint_before_last(output_dir, resumed_dir, _argv(resumed_dir, start))


@pytest.mark.numerics
def test_the_export_loads_in_transformers_with_our_logits(tiny_run):
    checkpoint = final_checkpoint(tiny_run[0])
    theirs = Qwen3VLForConditionalGeneration.from_pretrained(checkpoint, attn_implementation="eager").eval()
    ours = load_hf(checkpoint).eval()
    assert load_vision_processor(str(checkpoint)).image_processor.patch_size == PATCH  # it travels with the model
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 512, (1, 16), generator=g)
    tokens[0, 3:7] = QWEN3_VL_TINY.image_token_id  # one image of 4 x 4 patches: 4 tokens
    images = dict(pixel_values=torch.randn(16, 3 * 2 * PATCH * PATCH, generator=g),
                  image_grid_thw=torch.tensor([[1, 4, 4]]))
    with torch.no_grad():
        expected = theirs(input_ids=tokens, mm_token_type_ids=(tokens == QWEN3_VL_TINY.image_token_id).int(),
                          **images).logits
        assert_close(ours(tokens, **images), expected, terms=TERMS, what="logits")


def test_the_qwen2_5_vl_processor_is_refused_before_anything_is_written(tmp_path):
    # the embedded processor's 14-pixel patches for a tower of 16-pixel ones, from scratch (no checkpoint to refuse)
    argv = ["full_finetune", "--config", "tiny/vlm", "model._component_=torchtune_ac.models.qwen3_vl_tiny",
            "checkpoint_dir=null", "tokenizer.path=${embedded_vlm_checkpoint:}", f"output_dir={tmp_path / 'out'}"]
    for result in (run_tune_in_process(["run", *argv]), run_tune_in_process(["validate", *argv[1:]])):  # validate too
        assert result.returncode == 2, result.stderr
        assert ("dataset: the processor's patches hold 1176 values, the model's vision tower takes 1536 (in_channels=3 "
                "x temporal_patch_size=2 x patch_size=16^2)") in result.stderr
    assert not (tmp_path / "out").exists()
