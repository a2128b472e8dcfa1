"""Image-text data: the processor's own output, assistant-only labels, TRL's collator, packing, refusals."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from torchtune_ac.data.embedded import (  # noqa: E402
    EMBEDDED_VLM_DIR, EMBEDDED_VLM_IMAGE_SIZE, EMBEDDED_VLM_MAX_PIXELS, EMBEDDED_VLM_PROCESSOR_DIR,
    EMBEDDED_VLM_TRAIN_PATH)
from torchtune_ac.data.records import Record  # noqa: E402
from torchtune_ac.data.samples import IGNORE_INDEX  # noqa: E402
from torchtune_ac.data.vision import (  # noqa: E402
    build_vision_dataset, collate_vision_batch, load_vision_processor, pack_vision_samples, process_vision_record)
from torchtune_ac.errors import UserError  # noqa: E402

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def processor():
    return load_vision_processor(EMBEDDED_VLM_PROCESSOR_DIR)


def image(colour=(200, 20, 20), size=EMBEDDED_VLM_IMAGE_SIZE):
    return Image.new("RGB", (size, size), colour)


def png_bytes(img):
    buffer = io.BytesIO()
    img.save(buffer, format="PNG")
    return buffer.getvalue()


def conversation(*turns):
    """Alternating user/assistant turns; a user turn may be (text, n_images)."""
    messages = []
    for index, turn in enumerate(turns):
        role = "user" if index % 2 == 0 else "assistant"
        text, n_images = turn if isinstance(turn, tuple) else (turn, 0)
        messages.append({"role": role, "content": [{"type": "image"}] * n_images + [{"type": "text", "text": text}]})
    return messages


def process(processor, value, tmp_path=Path("."), **kwargs):
    return process_vision_record(Record("data.jsonl:1", value), processor, base_dir=tmp_path, **kwargs)


def test_sample_is_the_processors_own_output_in_every_layout(processor, tmp_path):
    red, blue = image(), image((20, 20, 200))
    red.save(tmp_path / "red.png")
    messages = conversation(("Colour?", 1), "red", ("And this one?", 1), "blue")
    layouts = [
        {"messages": messages, "images": ["red.png", png_bytes(blue)]},  # TRL's: a path and bytes
        {"messages": messages, "images": [{"bytes": None, "path": str(tmp_path / "red.png")}, blue]},  # datasets cell
        {"messages": [{"role": "user", "content": "<image>Colour?"}, {"role": "assistant", "content": "red"},
                      {"role": "user", "content": "<image>And this one?"}, {"role": "assistant", "content": "blue"}],
         "images": [red, blue]},
    ]
    text = processor.apply_chat_template(messages, tokenize=False)
    expected = processor(text=[text], images=[red, blue], return_tensors="pt")
    for layout in layouts:
        sample = process(processor, layout, tmp_path)
        assert sample["tokens"] == expected["input_ids"][0].tolist()
        assert torch.equal(sample["pixel_values"], expected["pixel_values"])
        assert sample["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 4]]
        assert sample["tokens"].count(processor.image_token_id) == 8  # 16 patches merged 2 x 2, per image


def test_labels_are_the_assistant_turns_only(processor):
    sample = process(processor, {"messages": conversation(("Colour?", 1), "red", "Sure?", "yes red"),
                                 "images": [image()]})
    decode = processor.tokenizer.decode
    assert len(sample["labels"]) == len(sample["tokens"]) and sample["labels"][-1] == IGNORE_INDEX
    targets = [label for label in sample["labels"] if label != IGNORE_INDEX]
    assert decode(targets) == "red<|im_end|>\nyes red<|im_end|>\n"
    for label, next_token in zip(sample["labels"], sample["tokens"][1:]):  # shifted: the label is the next token
        assert label in (IGNORE_INDEX, next_token)


def test_labels_equal_trls_vision_collator(processor):
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    example = {"messages": conversation(("What shape?", 1), "a circle", "Colour?", "red"), "images": [image()]}
    ours = process(processor, {"messages": example["messages"], "images": list(example["images"])})
    collator = DataCollatorForVisionLanguageModeling(processor=processor, assistant_only_loss=True)
    theirs = collator([example])
    assert ours["tokens"] == theirs["input_ids"][0].tolist()
    assert ours["labels"] == theirs["labels"][0].tolist()[1:] + [IGNORE_INDEX]  # ours are shifted
    assert torch.equal(ours["pixel_values"], theirs["pixel_values"])


def test_packing_keeps_documents_apart_and_collates(processor):
    samples = [process(processor, {"messages": conversation(("Colour?", n), "red"), "images": [image()] * n})
               for n in (1, 0, 2)]
    lengths = [len(sample["tokens"]) for sample in samples]
    rows = pack_vision_samples(samples, max_seq_len=lengths[0] + lengths[1] + 3, pad_id=0)
    assert len(rows) == 2
    first = rows[0]
    assert first["document_ids"] == [0] * lengths[0] + [1] * lengths[1] + [2] * 3
    assert first["tokens"][:lengths[0] + lengths[1]] == samples[0]["tokens"] + samples[1]["tokens"]
    assert first["labels"][lengths[0] - 1] == IGNORE_INDEX  # a document never targets the next one's first token
    assert torch.equal(first["pixel_values"], samples[0]["pixel_values"])
    assert torch.equal(rows[1]["image_grid_thw"], samples[2]["image_grid_thw"])
    batch = collate_vision_batch(rows, pad_id=0)
    assert batch["tokens"].shape == batch["mm_token_type_ids"].shape == (2, len(first["tokens"]))
    assert batch["pixel_values"].shape[0] == 16 * 3 and batch["image_grid_thw"].shape == (3, 3)
    assert batch["mm_token_type_ids"].sum() == 4 * 3  # one image's 4 tokens, three images


def test_embedded_task_builds_and_drops_long_samples_with_a_count(processor):
    dataset = build_vision_dataset(EMBEDDED_VLM_TRAIN_PATH, processor, max_seq_len=64)
    assert len(dataset) == 48 and dataset.report is None
    lengths = sorted(len(sample["tokens"]) for sample in dataset)
    short = build_vision_dataset(EMBEDDED_VLM_TRAIN_PATH, processor, max_seq_len=lengths[-1] - 1)
    dropped = sum(length > lengths[-1] - 1 for length in lengths)
    assert len(short) == 48 - dropped
    assert short.report.startswith(f"data {EMBEDDED_VLM_TRAIN_PATH}: {dropped} of 48 records are longer than")


def bad_records(tmp_path):
    (tmp_path / "broken.png").write_bytes(b"not a png")
    image(size=200).save(tmp_path / "big.png")
    image().save(tmp_path / "ok.png")
    one = conversation(("Colour?", 1), "red")
    return [
        ({"messages": one, "images": ["broken.png"]}, "image .*broken.png does not open"),
        ({"messages": one, "images": ["missing.png"]}, "image .*missing.png does not open"),
        ({"messages": conversation(("Colour?", 2), "red"), "images": ["ok.png"]},
         "2 image placeholders but 1 image;"),
        ({"messages": one, "images": ["ok.png", "ok.png"]}, "1 image placeholder but 2 images;"),
        ({"messages": one, "images": ["big.png"]},
         f"image big.png is 200x200 = 40,000 pixels, over the processor's limit of {EMBEDDED_VLM_MAX_PIXELS:,} "
         ".*resize_images"),
    ]


def test_bad_records_are_refused_naming_the_row(processor, tmp_path):
    for value, message in bad_records(tmp_path):
        path = tmp_path / "data.jsonl"
        path.write_text(json.dumps({"messages": conversation("hi", "yo")}) + "\n" + json.dumps(value) + "\n")
        with pytest.raises(UserError, match=f"^{path}:2: {message}"):
            build_vision_dataset(str(path), processor, max_seq_len=512)


def test_resize_allowed_scales_a_large_image_down(processor, tmp_path):
    sample = process(processor, {"messages": conversation(("Colour?", 1), "red"), "images": [image(size=200)]},
                     resize_images=True)
    t, h, w = sample["image_grid_thw"][0].tolist()
    assert h * w * 14 * 14 <= EMBEDDED_VLM_MAX_PIXELS


def test_a_sample_that_cannot_fit_is_refused_without_dropping(processor):
    with pytest.raises(UserError, match=r"train.jsonl:1: the sample is \d+ tokens .*max_seq_len=8"):
        build_vision_dataset(EMBEDDED_VLM_TRAIN_PATH, processor, max_seq_len=8, drop_long_samples=False)
    with pytest.raises(UserError, match="no sample left to train on .*48 of 48 records are longer"):
        build_vision_dataset(EMBEDDED_VLM_TRAIN_PATH, processor, max_seq_len=8)


def test_generator_reproduces_the_committed_files(tmp_path):
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_embedded_vlm.py"), "--out-dir", str(tmp_path)],
                   check=True, capture_output=True)
    committed = sorted(p.relative_to(EMBEDDED_VLM_DIR) for p in Path(EMBEDDED_VLM_DIR).rglob("*") if p.is_file())
    assert committed == sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    for name in committed:
        assert (tmp_path / name).read_bytes() == (Path(EMBEDDED_VLM_DIR) / name).read_bytes(), name


def test_packed_and_padding_free_together_are_refused():
    from torchtune_ac.data.vision import vision_dataset

    with pytest.raises(UserError, match=r"^vision_dataset: packed=true and padding_free=true: .*set one of them$"):
        vision_dataset(None, packed=True, padding_free=True, max_seq_len=64)
