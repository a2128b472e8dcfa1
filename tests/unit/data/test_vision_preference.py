"""Image preference pairs: chosen and rejected share the prompt's tokens and images, a batch gives each row its
pair's images, and bad records are refused in one line naming the record."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from torchtune_ac.data.embedded import EMBEDDED_VLM_IMAGE_SIZE, EMBEDDED_VLM_PREFERENCE_PATH  # noqa: E402
from torchtune_ac.data.embedded import EMBEDDED_VLM_PROCESSOR_DIR  # noqa: E402
from torchtune_ac.data.records import Record  # noqa: E402
from torchtune_ac.data.samples import IGNORE_INDEX  # noqa: E402
from torchtune_ac.data.vision import load_vision_processor  # noqa: E402
from torchtune_ac.data.vision_preference import (  # noqa: E402
    build_vision_preference_dataset, collate_vision_preference_batch, process_vision_pair)
from torchtune_ac.errors import UserError  # noqa: E402


@pytest.fixture(scope="module")
def processor():
    return load_vision_processor(EMBEDDED_VLM_PROCESSOR_DIR)


def pair(**changes):
    user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}
    record = {"images": [Image.new("RGB", (EMBEDDED_VLM_IMAGE_SIZE,) * 2, (200, 20, 20))], "prompt": [user],
              "chosen": [{"role": "assistant", "content": "red"}],
              "rejected": [{"role": "assistant", "content": [{"type": "text", "text": "blue"}]}]}
    record.update(changes)
    return {key: value for key, value in record.items() if value is not None}


def process(processor, value):
    return process_vision_pair(Record("pairs.jsonl:1", value), processor, base_dir=Path("."))


def test_chosen_and_rejected_share_the_prompt_and_its_images_in_a_batch(processor):
    sample = process(processor, pair())
    prompt = 4 + 12  # the image's 4 tokens and the template's
    chosen, rejected = sample["chosen_tokens"], sample["rejected_tokens"]
    n_shared = next(i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b)
    image_id = processor.image_token_id
    assert n_shared >= prompt and chosen.count(image_id) == rejected.count(image_id) == 4
    # only the answers are targets (shifted: the label at the prompt's last position is the answer's first token)
    assert all(label == IGNORE_INDEX for label in sample["chosen_labels"][:n_shared - 1])
    decode = processor.tokenizer.decode
    assert decode([t for t in sample["chosen_labels"] if t != IGNORE_INDEX]) == "red<|im_end|>\n"
    dataset = build_vision_preference_dataset(EMBEDDED_VLM_PREFERENCE_PATH, processor, max_seq_len=64)
    batch = collate_vision_preference_batch([dataset[0], dataset[1]], pad_id=processor.tokenizer.pad_token_id)
    # rows: chosen 0, chosen 1, rejected 0, rejected 1; each row's image in that order
    assert batch["tokens"].shape[0] == 4 and batch["image_grid_thw"].shape == (4, 3)
    first, second = dataset[0]["pixel_values"], dataset[1]["pixel_values"]
    assert torch.equal(batch["pixel_values"], torch.cat([first, second, first, second]))


REFUSED = {
    "no_rejected": (dict(rejected=None), "pairs.jsonl:1: no 'rejected' column"),
    "image_in_an_answer": (dict(chosen=[{"role": "assistant", "content": [{"type": "image"}]}]),
                           "'chosen' holds an image; images go in the prompt"),
    "user_turn_as_answer": (dict(rejected=[{"role": "user", "content": "x"}]), "'rejected' holds a 'user' turn"),
    "same_answers": (dict(rejected=[{"role": "assistant", "content": "red"}]), "'chosen' and 'rejected' are the same"),
    "more_images_than_placeholders": (dict(images=[Image.new("RGB", (56, 56))] * 2),
                                      "1 image placeholder but 2 images"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_bad_pair_is_refused_naming_the_record(processor, name):
    changes, message = REFUSED[name]
    with pytest.raises(UserError, match="pairs.jsonl:1") as error:
        process(processor, pair(**changes))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_pair_that_cannot_fit_is_dropped_with_a_count_or_refused(processor):
    with pytest.raises(UserError, match=r"preference.jsonl:1: the pair is \d+ tokens .*max_seq_len=8"):
        build_vision_preference_dataset(EMBEDDED_VLM_PREFERENCE_PATH, processor, max_seq_len=8,
                                        drop_long_samples=False)
    with pytest.raises(UserError, match="no pair left to train on .*48 of 48 pairs are longer"):
        build_vision_preference_dataset(EMBEDDED_VLM_PREFERENCE_PATH, processor, max_seq_len=8)


def test_tune_validate_reads_every_pair_as_the_run_does(tmp_path):
    from torchtune_ac.data import load_tokenizer
    from torchtune_ac.data.datasets import check_dataset_records
    from torchtune_ac.data.vision_preference import vision_preference_dataset

    tokenizer = load_tokenizer(EMBEDDED_VLM_PROCESSOR_DIR)
    summary, report, samples = check_dataset_records(vision_preference_dataset, tokenizer, {}, 64)
    assert summary == f"{EMBEDDED_VLM_PREFERENCE_PATH}: 48 records read and encoded, 48 samples"
    assert (report, samples) == (None, 48)
    lines = Path(EMBEDDED_VLM_PREFERENCE_PATH).read_text().splitlines()
    (tmp_path / "images").symlink_to(Path(EMBEDDED_VLM_PREFERENCE_PATH).parent / "images")
    bad = tmp_path / "pairs.jsonl"
    bad.write_text(lines[0] + "\n" + lines[1].replace('"prompt"', '"question"') + "\n")
    with pytest.raises(UserError, match=f"^{bad}:2: no 'prompt' column"):
        check_dataset_records(vision_preference_dataset, tokenizer, {"source": str(bad)}, 64)
