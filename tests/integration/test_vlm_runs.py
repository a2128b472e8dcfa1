"""Vision-language fine-tuning through the real CLI on ``tiny/vlm`` (a tiny random Qwen2.5-VL, the embedded
coloured-shapes task): the loss falls; the export loads in transformers with our logits; 2 processes (FSDP2 over
both towers, one process's batches without an image, the loss in chunks) train as 1 with the whole loss; a resume is
exact; a frozen tower keeps its weights. Refused in one line, exit 2, before any weight loads, nothing written: a
text-only model given images, an image that does not open, more or fewer image placeholders than images, an image
over the processor's pixel limit (by tune validate too), a checkpoint whose vision_config is not the model's
tower."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from finetune_runs import (
    check_success,
    final_checkpoint,
    load_weights,
    resume_from_the_checkpoint_before_last,
    run_tune_in_process,
    run_tune_subprocess,
)
from PIL import Image
from numerics import assert_close, assert_steps_alike, assert_weights_trained_alike, llama_terms
from transformers import Qwen2_5_VLForConditionalGeneration

from torchtune_ac.data.embedded import EMBEDDED_VLM_DIR, EMBEDDED_VLM_MAX_PIXELS
from torchtune_ac.data.vision import load_vision_processor
from torchtune_ac.embedded import ensure_embedded_vlm_checkpoint
from torchtune_ac.models import load_hf
from torchtune_ac.models.families.qwen2_5_vl import QWEN2_5_VL_TINY
from torchtune_ac.observability.metrics import read_metrics

STEPS = 6
RUN = ("max_seq_len=64", "batch_size=8", "epochs=1", f"max_steps_per_epoch={STEPS}")
# A step: 8 rows of up to 64 tokens through both towers (the tower's reductions are shorter than the decoder's).
TERMS = 2 * llama_terms(QWEN2_5_VL_TINY, 64, 8 * 64)


def _argv(output_dir: Path, *overrides: str, nproc: int = 1) -> list[str]:
    launcher = ["--nproc_per_node", str(nproc)] if nproc > 1 else []
    return ["run", *launcher, "full_finetune", "--config", "tiny/vlm", *RUN, f"output_dir={output_dir}", *overrides]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    output_dir = tmp_path_factory.mktemp("vlm") / "run"
    check_success(run_tune_in_process(_argv(output_dir, "save_every_n_steps=3")))
    return output_dir, read_metrics(output_dir)


def test_the_loss_falls(tiny_run):
    _, records = tiny_run
    losses = [r["loss"] for r in records]
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.5, losses


@pytest.mark.numerics
def test_the_export_loads_in_transformers_with_our_logits(tiny_run):
    checkpoint = final_checkpoint(tiny_run[0])
    theirs = Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint, attn_implementation="eager").eval()
    ours = load_hf(checkpoint).eval()
    assert load_vision_processor(str(checkpoint)).image_processor.patch_size == 14  # the processor travels with it
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 512, (1, 16), generator=g)
    tokens[0, 3:7] = QWEN2_5_VL_TINY.image_token_id  # one 56 x 56 image: 4 x 4 patches, 4 tokens
    images = dict(pixel_values=torch.randn(16, 3 * 2 * 14 * 14, generator=g), image_grid_thw=torch.tensor([[1, 4, 4]]))
    with torch.no_grad():
        expected = theirs(input_ids=tokens, mm_token_type_ids=(tokens == 516).int(), **images).logits
        assert_close(ours(tokens, **images), expected, terms=TERMS, what="logits")


def test_a_resume_is_exact(tiny_run, tmp_path):
    resumed_dir = tmp_path / "resumed"
    resume_from_the_checkpoint_before_last(tiny_run[0], resumed_dir, _argv(resumed_dir, "save_every_n_steps=3"))


def _mixed_task(path: Path) -> Path:
    """The embedded task with every other record's image dropped: a global batch of 2 gives one process a batch
    without an image, whose tower then runs on a blank one (FSDP2 gathers and reduces it on both processes)."""
    lines = (Path(EMBEDDED_VLM_DIR) / "train.jsonl").read_text().splitlines()[:2 * STEPS]
    records = []
    for index, line in enumerate(map(json.loads, lines)):
        if index % 2:
            user = line["messages"][0]
            user["content"] = [part for part in user["content"] if part["type"] != "image"]
            del line["images"]
        else:
            line["images"] = [str(Path(EMBEDDED_VLM_DIR) / name) for name in line["images"]]
        records.append(json.dumps(line))
    path.write_text("\n".join(records) + "\n")
    return path


def test_two_processes_with_a_chunked_loss_train_as_one_with_a_batch_without_images(tmp_path):
    task = _mixed_task(tmp_path / "mixed.jsonl")
    common = (f"dataset.source={task}", "shuffle=false", "save_every_n_steps=null")
    one, two = tmp_path / "one", tmp_path / "two"
    check_success(run_tune_in_process(_argv(one, *common, "batch_size=2")))
    # and the loss in 4 chunks of the sequence (the head gets the image-conditioned hidden states), against whole
    check_success(run_tune_subprocess(_argv(two, *common, "batch_size=1", "loss_chunks=4", nproc=2)))
    records_one, records_two = read_metrics(one), read_metrics(two)
    assert len(records_two) == STEPS
    for name in ("loss", "grad_norm"):
        assert_steps_alike([r[name] for r in records_two], [r[name] for r in records_one], terms=TERMS, what=name)
    assert_weights_trained_alike(load_weights(final_checkpoint(two)), load_weights(final_checkpoint(one)),
                                 lrs=[r["lr"] for r in records_one], terms=TERMS)


def test_a_text_only_model_given_images_is_refused_before_loading(tmp_path):
    # Qwen2.5 0.5B (text-only; its vocabulary covers the tokenizer) from scratch: no checkpoint of another model to
    # refuse first; the VLM's tokenizer and processor
    result = run_tune_in_process(_argv(tmp_path / "out", "model._component_=torchtune_ac.models.qwen2_5_0_5b",
                                       "~model.freeze_vision_tower", "~model.freeze_projector", "checkpoint_dir=null",
                                       "tokenizer.path=${embedded_vlm_checkpoint:}"))
    _assert_refused_in_one_line(result, tmp_path / "out",
                                "dataset: its samples hold images, but the model (qwen2) is text-only")


def _assert_refused_in_one_line(result, output_dir: Path, message: str) -> None:
    """Exit 2, the one line of ``message`` and no traceback, and nothing in ``output_dir``."""
    lines = [line for line in result.stderr.splitlines() if line.startswith("tune: error:")]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    assert message in lines[0] and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert not output_dir.exists()


def _question(images: int) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": "Colour?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "red"}]}]


BAD_RECORDS = {
    "an_image_that_does_not_open": ({"images": ["broken.png"], "messages": _question(1)},
                                    "image {folder}/broken.png does not open"),
    "more_placeholders_than_images": ({"images": ["ok.png"], "messages": _question(2)},
                                      "2 image placeholders but 1 image;"),
    "fewer_placeholders_than_images": ({"images": ["ok.png", "ok.png"], "messages": _question(1)},
                                       "1 image placeholder but 2 images;"),
    "an_image_over_the_processors_limit": ({"images": ["big.png"], "messages": _question(1)},
                                           f"image big.png is 200x200 = 40,000 pixels, over the processor's limit of "
                                           f"{EMBEDDED_VLM_MAX_PIXELS:,} (max_pixels); set resize_images: true"),
}


@pytest.mark.parametrize("name", BAD_RECORDS)
def test_a_bad_image_record_is_refused_in_one_line_before_loading(name, tmp_path):
    (tmp_path / "broken.png").write_bytes(b"not a png")
    Image.new("RGB", (56, 56)).save(tmp_path / "ok.png")
    Image.new("RGB", (200, 200)).save(tmp_path / "big.png")
    record, message = BAD_RECORDS[name]
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"images": ["ok.png"], "messages": _question(1)}) + "\n" + json.dumps(record) + "\n")
    output_dir = tmp_path / "out"
    expected = f"{data}:2: " + message.format(folder=tmp_path)
    result = run_tune_in_process(_argv(output_dir, f"dataset.source={data}"))
    _assert_refused_in_one_line(result, output_dir, expected)
    # and tune validate reads the records as the run does (the checkpoint's processor is in the cache by now)
    validate = run_tune_in_process(["validate", "--config", "tiny/vlm", f"dataset.source={data}",
                                    f"output_dir={output_dir}"])
    _assert_refused_in_one_line(validate, output_dir, expected)


def test_a_checkpoint_whose_tower_is_not_the_models_is_refused_before_loading(tmp_path):
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(ensure_embedded_vlm_checkpoint(), checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    config["vision_config"]["depth"] += 1
    (checkpoint / "config.json").write_text(json.dumps(config))
    output_dir = tmp_path / "out"
    result = run_tune_in_process(_argv(output_dir, f"checkpoint_dir={checkpoint}"))
    _assert_refused_in_one_line(result, output_dir, f"{checkpoint}/config.json: describes a different model than "
                                                    "`model`: vision_config.depth=3, model has 2")


def test_a_frozen_tower_keeps_its_weights_and_the_rest_trains(tmp_path):
    check_success(run_tune_in_process(_argv(tmp_path, "max_steps_per_epoch=2", "model.freeze_vision_tower=true")))
    start = load_weights(ensure_embedded_vlm_checkpoint())  # the checkpoint the run started from
    trained = load_weights(final_checkpoint(tmp_path))
    tower = [name for name in start if name.startswith("model.visual.") and ".merger." not in name]
    assert tower and all(torch.equal(trained[name], start[name]) for name in tower)
    assert not torch.equal(trained["model.visual.merger.mlp.0.weight"], start["model.visual.merger.mlp.0.weight"])
