"""Gemma 3 with images through the real CLI: ``tiny/vlm`` with ``gemma3_vision_tiny`` and a Gemma 3 processor built
here from transformers' own classes (the embedded tokenizer plus Gemma 3's turn and image tokens, 56-pixel images,
4 tokens each), on the embedded coloured-shapes task. Each image is a fixed run of tokens wrapped in its begin and
end tokens, the loss is on the assistant's text only, the loss falls, a resume is exact, and the export loads in transformers with our
logits; a processor whose image size is not the tower's is refused before any weight loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from finetune_runs import (
    check_success,
    final_checkpoint,
    resume_from_the_checkpoint_before_last,
    run_tune_in_process,
)
from numerics import assert_close, llama_terms
from tokenizers import AddedToken, Tokenizer
from transformers import Gemma3ForConditionalGeneration, PreTrainedTokenizerFast
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

from torchtune_ac.data import embedded
from torchtune_ac.data.samples import IGNORE_INDEX
from torchtune_ac.data.vision import build_vision_dataset, load_vision_processor
from torchtune_ac.models import GEMMA3_VISION, load_hf_weights_, save_hf
from torchtune_ac.models.families.gemma3_vision import GEMMA3_VISION_TINY, gemma3_vision_tiny
from torchtune_ac.observability.metrics import read_metrics

STEPS = 6
IMAGE, BOI, EOI = 516, 514, 515  # the processor's <image_soft_token>, <start_of_image>, <end_of_image>
# Gemma 3's turn layout; an image part is its begin token, which the processor expands.
CHAT_TEMPLATE = (
    "{{ bos_token }}{%- for message in messages %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{- '<start_of_turn>' + role + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<start_of_image>' }}{%- elif part['type'] == 'text' %}{{- part['text'] }}"
    "{%- endif %}{%- endfor %}{%- endif %}{{- '<end_of_turn>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)


def write_processor(folder: Path, image_size: int = 56) -> None:
    backend = Tokenizer.from_file(str(Path(embedded.EMBEDDED_TOKENIZER_DIR) / "tokenizer.json"))
    special = ["<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in special])
    PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token="<end_of_turn>", pad_token="<|pad|>",
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"}, model_max_length=2048,
    ).save_pretrained(str(folder))
    Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size}).save_pretrained(str(folder))
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": "Gemma3Processor",
                                                              "image_seq_length": 4}))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gemma3_vision") / "checkpoint"
    torch.manual_seed(0)
    model = gemma3_vision_tiny()
    model.init_weights()
    save_hf(model, folder, bos_token_id=0, eos_token_id=513, pad_token_id=2)
    write_processor(folder)
    return folder


def _argv(output_dir: Path, checkpoint: Path, *overrides: str) -> list[str]:
    return ["run", "full_finetune", "--config", "tiny/vlm", "model._component_=torchtune_ac.models.gemma3_vision_tiny",
            f"checkpoint_dir={checkpoint}", "max_seq_len=64", "batch_size=8", "epochs=1",
            f"max_steps_per_epoch={STEPS}", "save_every_n_steps=3", f"output_dir={output_dir}", *overrides]


def test_each_image_is_a_fixed_run_of_tokens_and_the_loss_is_on_the_answer_only(checkpoint):
    processor = load_vision_processor(str(checkpoint))
    dataset = build_vision_dataset(embedded.EMBEDDED_VLM_TRAIN_PATH, processor, max_seq_len=64)
    records = [json.loads(line) for line in Path(embedded.EMBEDDED_VLM_TRAIN_PATH).read_text().splitlines()]
    assert len(dataset) == len(records)
    for sample, record in zip(dataset, records):
        tokens = sample["tokens"]
        start = tokens.index(BOI)
        assert tokens[start:start + 6] == [BOI, IMAGE, IMAGE, IMAGE, IMAGE, EOI] and tokens.count(IMAGE) == 4
        assert sample["token_type_ids"] == [int(token == IMAGE) for token in tokens]
        assert tuple(sample["pixel_values"].shape) == (1, 3, 56, 56)
        answer = record["messages"][1]["content"][0]["text"] + "<end_of_turn>\n"
        targets = [label for label in sample["labels"] if label != IGNORE_INDEX]
        assert processor.tokenizer.decode(targets) == answer


@pytest.fixture(scope="module")
def tiny_run(checkpoint, tmp_path_factory) -> Path:
    output_dir = tmp_path_factory.mktemp("gemma3_vision_run") / "run"
    check_success(run_tune_in_process(_argv(output_dir, checkpoint)))
    return output_dir


def test_the_loss_falls(tiny_run):
    losses = [r["loss"] for r in read_metrics(tiny_run)]
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.5, losses


def test_a_resume_is_exact(tiny_run, checkpoint, tmp_path):
    resumed_dir = tmp_path / "resumed"
    resume_from_the_checkpoint_before_last(tiny_run, resumed_dir, _argv(resumed_dir, checkpoint))


@pytest.mark.numerics
def test_the_export_loads_in_transformers_with_our_logits(tiny_run):
    exported = final_checkpoint(tiny_run)
    theirs = Gemma3ForConditionalGeneration.from_pretrained(exported, attn_implementation="eager").eval()
    assert load_vision_processor(str(exported)).image_seq_length == 4  # the processor travels with it
    ours = GEMMA3_VISION.build(GEMMA3_VISION_TINY)
    load_hf_weights_(ours, exported)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 512, (1, 16), generator=g)
    tokens[0, 3:9] = torch.tensor([BOI, IMAGE, IMAGE, IMAGE, IMAGE, EOI])
    pixels = torch.randn(1, 3, 56, 56, generator=g)
    with torch.no_grad():
        expected = theirs(input_ids=tokens, pixel_values=pixels, token_type_ids=(tokens == IMAGE).long()).logits
        vision = GEMMA3_VISION_TINY.vision
        tower = vision.depth * (6 * vision.dim + vision.intermediate_dim + 16) + 3 * 14 * 14 + 2 * vision.dim
        assert_close(ours.eval()(tokens, pixel_values=pixels), expected,
                     terms=llama_terms(GEMMA3_VISION_TINY, 16, 0, backward=False) + tower, what="logits")


def test_a_processor_of_another_image_size_is_refused_before_weights_load(checkpoint, tmp_path):
    other = tmp_path / "processor"
    other.mkdir()
    write_processor(other, image_size=28)
    result = run_tune_in_process(_argv(tmp_path / "run", checkpoint, f"dataset.processor={other}"))
    assert result.returncode == 2, result.stderr[-2000:]
    assert ("dataset: the processor's images are [3, 28, 28] (channels, height, width), the model's vision tower "
            "takes [3, 56, 56]") in result.stderr
    assert not (tmp_path / "run").exists()
