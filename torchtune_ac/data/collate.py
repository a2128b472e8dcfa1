"""Stack samples of different lengths into padded batch tensors."""

from __future__ import annotations

import torch

from torchtune_ac.data.samples import IGNORE_INDEX

# Under ``compile: true``, batch lengths are rounded up to a multiple of this, so that a few shapes repeat instead
# of a new one each step (each new shape costs a recompilation, and compiled kernels like lengths that divide).
COMPILED_LENGTH_MULTIPLE = 64


def collate_batch(
    samples: list[dict[str, list[int]]], *, pad_id: int, pad_to_multiple_of: int = 1, max_length: int | None = None
) -> dict[str, torch.Tensor]:
    """Right-pad samples to a common length and stack them.

    Args:
        samples: Dicts with ``tokens`` and ``labels`` (and ``document_ids`` for packed samples, in all or none).
        pad_id: Token id for padding.
        pad_to_multiple_of: Round the batch length up to a multiple of this.
        max_length: ...but not beyond this (the run's ``max_seq_len``), unless a sample is longer.

    Returns:
        ``tokens`` and ``labels`` as ``LongTensor[b, s]`` (labels padded with ``IGNORE_INDEX``), plus
        ``document_ids[b, s]`` when the samples have them (padding gets an id of its own per row). Counted here,
        on the host, so that the step never reads them back from the device (``training.objective.HOST_KEYS``):
        ``target_count``, the number of labels that are not ``IGNORE_INDEX`` (a 0-d ``LongTensor``), and with
        ``document_ids``, ``document_lengths``, the lengths of the documents row after row
        (``LongTensor[n_documents]``).

    Raises:
        ValueError: for an empty batch, ``pad_to_multiple_of < 1``, or samples that disagree on ``document_ids``.
    """
    if not samples:
        raise ValueError("cannot collate an empty batch")
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of={pad_to_multiple_of} must be >= 1")
    with_documents = ["document_ids" in sample for sample in samples]
    if any(with_documents) != all(with_documents):
        raise ValueError("some samples have document_ids and some do not")
    longest = max(len(sample["tokens"]) for sample in samples)
    length = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    if max_length is not None:
        length = max(longest, min(length, max_length))
    batch = {
        "tokens": torch.full((len(samples), length), pad_id, dtype=torch.long),
        "labels": torch.full((len(samples), length), IGNORE_INDEX, dtype=torch.long),
    }
    if all(with_documents):
        batch["document_ids"] = torch.zeros((len(samples), length), dtype=torch.long)
    for row, sample in enumerate(samples):
        n = len(sample["tokens"])
        batch["tokens"][row, :n] = torch.tensor(sample["tokens"], dtype=torch.long)
        batch["labels"][row, :n] = torch.tensor(sample["labels"], dtype=torch.long)
        if "document_ids" in batch:
            batch["document_ids"][row, :n] = torch.tensor(sample["document_ids"], dtype=torch.long)
            batch["document_ids"][row, n:] = sample["document_ids"][-1] + 1
    batch["target_count"] = (batch["labels"] != IGNORE_INDEX).sum()
    if "document_ids" in batch:
        batch["document_lengths"] = document_lengths(batch["document_ids"])
    return batch


def document_lengths(document_ids: torch.Tensor) -> torch.Tensor:
    """The lengths of the documents of ``document_ids[b, s]``, row after row: each row starts a document, and so
    does every change of id (the documents ``models.attention.document_runs`` finds, counted on the CPU)."""
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    offsets = torch.cat([starts.flatten().nonzero().flatten(), torch.tensor([document_ids.numel()])])
    return offsets.diff()
