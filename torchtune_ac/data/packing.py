"""Greedy packing of consecutive samples into fixed-length sequences that keep documents apart.

Each packed sequence carries ``document_ids``: 0, 1, 2, ... for the documents in it, and one more id for the
padding tail. The model uses them to let tokens attend only within their own document and to restart rotary
positions at each document, so a packed sequence trains exactly like its documents run one by one.

Labels never cross a document boundary: every sample's labels were shifted before packing (see
``samples.build_sample``), so a document's last position keeps its own label, ``IGNORE_INDEX`` after EOS (or the
document's real next token if it was truncated or split), never the next document's first token. Padding
positions have label ``IGNORE_INDEX``.

Two ways to pack. By default a sample is never split: one that does not fit the rest of a row starts the next
(instruction and chat samples, whose prompt must come with their response). With ``split_across_rows`` (plain
text, as torchtune packs text completion) every row is filled to the last token: a document that does not fit
goes on in the next row, where the continued piece is a document of its own (its positions restart, and it
attends only to itself), so nothing of a long document is lost.
"""

from __future__ import annotations

from typing import Iterable

from torchtune_ac.data.samples import IGNORE_INDEX, PackingReport, TokenizedDataset


def pack_samples(samples: Iterable[dict[str, list[int]]], *, max_seq_len: int, pad_id: int,
                 split_across_rows: bool = False) -> TokenizedDataset:
    """Pack samples, in order, into sequences of exactly ``max_seq_len`` tokens.

    Without ``split_across_rows``, a sample goes into the current sequence if it fits; otherwise the current
    sequence is padded and closed, and the sample starts the next one. With it, the sample fills the current
    sequence and goes on in the next (as often as its length needs); only the last sequence is padded.

    Args:
        samples: Dicts with ``tokens`` and ``labels`` (without ``split_across_rows``, at most ``max_seq_len`` long).
        max_seq_len: Length of every packed sequence.
        pad_id: Token id used for the padding tail.
        split_across_rows: Split samples at row ends instead of moving them whole to the next row.

    Returns:
        A dataset of ``{"tokens", "labels", "document_ids"}`` samples, all ``max_seq_len`` long, whose
        ``packing`` says how many samples became how many rows, and how full they are.

    Raises:
        ValueError: without ``split_across_rows``, if a sample is longer than ``max_seq_len`` (truncate it first).
    """
    packed = TokenizedDataset(("tokens", "labels", "document_ids"))
    tokens: list[int] = []
    labels: list[int] = []
    document_ids: list[int] = []
    count = {"samples": 0, "tokens": 0, "split": 0}

    def close_row() -> None:
        pad = max_seq_len - len(tokens)
        next_id = document_ids[-1] + 1
        packed.append({"tokens": tokens + [pad_id] * pad, "labels": labels + [IGNORE_INDEX] * pad,
                       "document_ids": document_ids + [next_id] * pad})
        tokens.clear()
        labels.clear()
        document_ids.clear()

    def add_document(sample_tokens: list[int], sample_labels: list[int]) -> None:
        next_id = document_ids[-1] + 1 if document_ids else 0
        tokens.extend(sample_tokens)
        labels.extend(sample_labels)
        document_ids.extend([next_id] * len(sample_tokens))
        if len(tokens) == max_seq_len:  # full: the row is closed at once, so a row being filled has room
            close_row()

    for sample in samples:
        length = len(sample["tokens"])
        count["samples"] += 1
        count["tokens"] += length
        if not split_across_rows:
            if length > max_seq_len:
                raise ValueError(f"sample of {length} tokens does not fit max_seq_len={max_seq_len}; truncate it first")
            if len(tokens) + length > max_seq_len:
                close_row()
            add_document(sample["tokens"], sample["labels"])
            continue
        count["split"] += len(tokens) + length > max_seq_len
        start = 0
        while start < length:
            end = start + min(max_seq_len - len(tokens), length - start)
            add_document(sample["tokens"][start:end], sample["labels"][start:end])
            start = end
    if tokens:
        close_row()
    packed.packing = PackingReport(samples=count["samples"], rows=len(packed), tokens=count["tokens"],
                                   max_seq_len=max_seq_len, split=count["split"])
    return packed
