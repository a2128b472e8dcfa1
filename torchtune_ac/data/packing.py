"""Greedy packing of consecutive samples into fixed-length sequences that keep documents apart.

Each packed sequence carries ``document_ids``: 0, 1, 2, ... for the documents in it, and one more id for the
padding tail. The model uses them to let tokens attend only within their own document and to restart rotary
positions at each document, so a packed sequence trains exactly like its documents run one by one.

Labels never cross a document boundary: every sample's labels were shifted before packing (see
``samples.build_sample``), so a document's last position keeps its own label, ``IGNORE_INDEX`` after EOS (or the
document's real next token if it was truncated), never the next document's first token. Padding positions have
label ``IGNORE_INDEX``.
"""

from __future__ import annotations

from typing import Iterable

from torchtune_ac.data.samples import IGNORE_INDEX, TokenizedDataset


def pack_samples(samples: Iterable[dict[str, list[int]]], *, max_seq_len: int, pad_id: int) -> TokenizedDataset:
    """Pack samples, in order, into sequences of exactly ``max_seq_len`` tokens.

    A sample goes into the current sequence if it fits; otherwise the current sequence is padded and closed, and
    the sample starts the next one. Samples are never split.

    Args:
        samples: Dicts with ``tokens`` and ``labels``, each at most ``max_seq_len`` long.
        max_seq_len: Length of every packed sequence.
        pad_id: Token id used for the padding tail.

    Returns:
        A dataset of ``{"tokens", "labels", "document_ids"}`` samples, all ``max_seq_len`` long.

    Raises:
        ValueError: if a sample is longer than ``max_seq_len`` (samples must be truncated first).
    """
    packed = TokenizedDataset(("tokens", "labels", "document_ids"))
    tokens: list[int] = []
    labels: list[int] = []
    document_ids: list[int] = []

    def close_sequence() -> None:
        pad = max_seq_len - len(tokens)
        next_id = document_ids[-1] + 1
        packed.append(
            {
                "tokens": tokens + [pad_id] * pad,
                "labels": labels + [IGNORE_INDEX] * pad,
                "document_ids": document_ids + [next_id] * pad,
            }
        )

    for sample in samples:
        length = len(sample["tokens"])
        if length > max_seq_len:
            raise ValueError(f"sample of {length} tokens does not fit max_seq_len={max_seq_len}; truncate it first")
        if len(tokens) + length > max_seq_len:
            close_sequence()
            tokens, labels, document_ids = [], [], []
        next_id = document_ids[-1] + 1 if document_ids else 0
        tokens.extend(sample["tokens"])
        labels.extend(sample["labels"])
        document_ids.extend([next_id] * length)
    if tokens:
        close_sequence()
    return packed
