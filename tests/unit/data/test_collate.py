"""Collation: right padding with pad_id / IGNORE_INDEX, rounding, and document ids of padding."""

import pytest
import torch

from torchtune_ac.data import IGNORE_INDEX, collate_batch

M = IGNORE_INDEX


@pytest.mark.parametrize(
    "multiple, expected_tokens, expected_labels",
    [
        (1, [[5, 6, 7], [8, 0, 0]], [[6, 7, M], [M, M, M]]),
        (4, [[5, 6, 7, 0], [8, 0, 0, 0]], [[6, 7, M, M], [M, M, M, M]]),
        (3, [[5, 6, 7], [8, 0, 0]], [[6, 7, M], [M, M, M]]),
    ],
)
def test_collate_pads_right(multiple, expected_tokens, expected_labels):
    samples = [{"tokens": [5, 6, 7], "labels": [6, 7, M]}, {"tokens": [8], "labels": [M]}]
    batch = collate_batch(samples, pad_id=0, pad_to_multiple_of=multiple)
    assert set(batch) == {"tokens", "labels", "target_count"}
    assert batch["tokens"].dtype == torch.long and batch["labels"].dtype == torch.long
    assert batch["tokens"].tolist() == expected_tokens
    assert batch["labels"].tolist() == expected_labels


@pytest.mark.parametrize("multiple, max_length, length", [
    (4, None, 4), (4, 3, 3),  # rounded up, but not past max_length
    (4, 2, 3),  # a sample longer than max_length is not cut
    (64, 40, 40), (64, 100, 64),
])
def test_collate_rounds_up_to_the_multiple_but_not_past_max_length(multiple, max_length, length):
    samples = [{"tokens": [5, 6, 7], "labels": [6, 7, M]}, {"tokens": [8], "labels": [M]}]
    batch = collate_batch(samples, pad_id=0, pad_to_multiple_of=multiple, max_length=max_length)
    assert batch["tokens"].shape == batch["labels"].shape == (2, length)
    assert batch["labels"][:, 3:].eq(M).all() and batch["tokens"][:, 3:].eq(0).all()


def test_collate_keeps_document_ids_and_gives_padding_its_own():
    samples = [
        {"tokens": [1, 2, 3], "labels": [2, 3, M], "document_ids": [0, 0, 1]},
        {"tokens": [4, 5], "labels": [5, M], "document_ids": [0, 0]},
    ]
    batch = collate_batch(samples, pad_id=9, pad_to_multiple_of=4)
    assert batch["document_ids"].tolist() == [[0, 0, 1, 2], [0, 0, 1, 1]]
    assert batch["tokens"].tolist() == [[1, 2, 3, 9], [4, 5, 9, 9]]


def test_collate_counts_on_the_host_what_the_step_would_otherwise_read_from_the_device():
    samples = [
        {"tokens": [1, 2, 3], "labels": [2, 3, M], "document_ids": [0, 0, 1]},
        {"tokens": [4, 5], "labels": [5, M], "document_ids": [0, 0]},
    ]
    batch = collate_batch(samples, pad_id=9, pad_to_multiple_of=4)
    assert batch["target_count"].item() == 3
    # Row 0: documents 0 and 1 and its padding; row 1: document 0 and its padding.
    assert batch["document_lengths"].tolist() == [2, 1, 1, 2, 2]
    assert batch["target_count"].device.type == batch["document_lengths"].device.type == "cpu"


@pytest.mark.parametrize(
    "samples, kwargs, message",
    [
        ([], {}, "empty batch"),
        ([{"tokens": [1], "labels": [M]}], {"pad_to_multiple_of": 0}, "pad_to_multiple_of=0"),
        ([{"tokens": [1], "labels": [M], "document_ids": [0]}, {"tokens": [1], "labels": [M]}], {}, "some samples"),
    ],
)
def test_collate_rejects_bad_batches(samples, kwargs, message):
    with pytest.raises(ValueError, match=message):
        collate_batch(samples, pad_id=0, **kwargs)
