"""Training samples: how labels are derived from tokens, and a compact in-memory store for them.

A sample is ``{"tokens": list[int], "labels": list[int]}`` of equal length (packed samples add
``"document_ids"``). Labels are already shifted: ``labels[i]`` is the target for the prediction made after
reading ``tokens[i]``, i.e. the next token, or ``IGNORE_INDEX`` where that next token is not trained on.
The loss is therefore a plain ``cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)``.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from torch.utils.data import Dataset

from torchtune_ac.data.sources import SourceFiles

IGNORE_INDEX = -100


def build_sample(
    tokens: list[int], trainable: list[bool], *, max_seq_len: Optional[int]
) -> Optional[dict[str, list[int]]]:
    """Shift targets into labels and truncate.

    Labels are computed on the full sequence before truncation, so the last kept position of a truncated sample
    is still trained to predict its real next token. The last position of an untruncated sample (EOS) has
    label ``IGNORE_INDEX``; truncation keeps the first tokens, so BOS stays.

    Args:
        tokens: Token ids of one document, BOS first.
        trainable: ``trainable[i]`` says whether ``tokens[i]`` is a target (``trainable[0]`` is never used).
        max_seq_len: Keep at most this many positions, or None.

    Returns:
        The sample, or None when no position has a target (nothing to train on).
    """
    labels = [token if is_target else IGNORE_INDEX for token, is_target in zip(tokens[1:], trainable[1:])]
    labels.append(IGNORE_INDEX)
    if max_seq_len is not None:
        tokens, labels = tokens[:max_seq_len], labels[:max_seq_len]
    if all(label == IGNORE_INDEX for label in labels):
        return None
    return {"tokens": list(tokens), "labels": labels}


def count_of(n: int, noun: str, plural: Optional[str] = None) -> str:
    """``n`` and ``noun``, made plural (``plural``, else with an s) unless ``n`` is 1: ``1 record``, ``3,000
    records``."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {plural or noun + 's'}"


# What truncation costs a sample whose target is its response (instruction and chat data).
RESPONSE_TRUNCATION = "a truncated response is trained without its end and EOS"


@dataclass
class DataReport:
    """What building a dataset cost: samples cut to ``max_seq_len`` and the targets lost with their tails, and
    records dropped with nothing left to train on. Counted while the records are tokenized.

    ``unit`` names a sample in the report (``sample``, or ``document`` for plain text), and ``truncation_note``
    says what truncation costs one."""

    source: str
    max_seq_len: Optional[int]
    unit: str = "sample"
    truncation_note: str = RESPONSE_TRUNCATION
    records: int = 0
    targets: int = 0  # target tokens before truncation
    truncated: int = 0  # samples longer than max_seq_len
    lost_targets: int = 0  # target tokens past max_seq_len
    untrained: int = 0  # records with no target at all (a conversation with no assistant turn)
    cut_off: int = 0  # records whose every target lay past max_seq_len

    def count(self, trainable: list[bool]) -> int:
        """Count one record (``trainable`` as ``build_sample`` takes it); returns how many targets it keeps."""
        self.records += 1
        targets = sum(trainable[1:])  # the label of position i is token i + 1
        kept = targets if self.max_seq_len is None else sum(trainable[1:self.max_seq_len + 1])
        self.targets += targets
        if self.max_seq_len is not None and len(trainable) > self.max_seq_len:
            self.truncated += 1
            self.lost_targets += targets - kept
        if targets == 0:
            self.untrained += 1
        elif kept == 0:
            self.cut_off += 1
        return kept

    def describe(self, untrained_reason: str, extra: Sequence[str] = ()) -> Optional[str]:
        """One line on what was cut or dropped (None when nothing was); ``untrained_reason`` says what a record
        with no target lacks (``no assistant turn``), and ``extra`` adds what else building the samples says."""
        parts = []
        if self.truncated:
            parts.append(
                f"{self.truncated:,} of {count_of(self.records, self.unit)} "
                f"{'is' if self.truncated == 1 else 'are'} longer than max_seq_len={self.max_seq_len} and "
                f"{'was' if self.truncated == 1 else 'were'} truncated, losing {self.lost_targets:,} of "
                f"{count_of(self.targets, 'target token')} ({self.truncation_note})"
            )
        if self.cut_off:
            parts.append(f"{count_of(self.cut_off, 'record')} lost every target to truncation and "
                         f"{'was' if self.cut_off == 1 else 'were'} dropped")
        if self.untrained:
            parts.append(f"{count_of(self.untrained, 'record')} {'has' if self.untrained == 1 else 'have'} "
                         f"{untrained_reason} and {'was' if self.untrained == 1 else 'were'} dropped")
        parts.extend(extra)
        return f"data {self.source}: " + "; ".join(parts) if parts else None


@dataclass(frozen=True)
class PackingReport:
    """What packing made of a dataset: ``samples`` (holding ``tokens`` tokens in all) became ``rows`` of
    ``max_seq_len`` tokens; ``split`` samples went on from one row into the next."""

    samples: int
    rows: int
    tokens: int
    max_seq_len: int
    split: int = 0

    @property
    def fill(self) -> float:
        """The share of the rows' positions that hold a token of a sample (the rest is padding)."""
        return self.tokens / (self.rows * self.max_seq_len) if self.rows else 0.0

    def describe(self) -> str:
        """``3,000 samples -> 412 rows of 256 tokens, 93.1 % filled``, and how many samples were split."""
        line = (f"{count_of(self.samples, 'sample')} -> {count_of(self.rows, 'row')} of {self.max_seq_len} tokens, "
                f"{100 * self.fill:.1f} % filled")
        if self.split:
            line += f" ({count_of(self.split, 'document')} split across rows)"
        return line

    def unchanged(self) -> Optional[str]:
        """Why packing changed nothing, when it did not (each row holds one sample), else None."""
        if self.samples < 2 or self.rows != self.samples or self.split:
            return None
        return (f"packing changed nothing: each of the {self.rows:,} rows of max_seq_len={self.max_seq_len} tokens "
                f"holds one sample (none fit beside the one before it), {100 * self.fill:.1f} % filled on average; "
                "raise max_seq_len, or set packed: false")


def describe_samples(dataset: Any) -> str:
    """How many samples ``dataset`` has, and for a packed one, how many samples made how many rows."""
    packing = getattr(dataset, "packing", None)
    if packing is None:
        return count_of(len(dataset), "sample")
    return f"packed: {packing.describe()}"


class TokenizedDataset(Dataset):
    """Samples with the same keys, each key's values concatenated in one ``array('i')`` plus offsets.

    About 4 bytes per token per key, rather than a Python int object per token.
    """

    def __init__(self, keys: tuple[str, ...]) -> None:
        self.keys = keys
        self._values = {key: array("i") for key in keys}
        self._offsets = array("q", [0])
        # What building it cut or dropped, once, for the start-up log (``build_dataloader`` writes it on rank 0).
        self.report: Optional[str] = None
        # What packing made of it (``packing.pack_samples``); None: not packed.
        self.packing: Optional[PackingReport] = None
        # Where it was read from: the source as messages name it, and its local files (None: a Hub dataset; see
        # sources.py).
        self.source: Optional[str] = None
        self.source_files: Optional[SourceFiles] = None

    def append(self, sample: dict[str, list[int]]) -> None:
        """Add one sample; all its keys must have lists of the same length."""
        length = len(sample[self.keys[0]])
        for key in self.keys:
            if len(sample[key]) != length:
                raise ValueError(f"sample key {key!r} has length {len(sample[key])}, expected {length}")
            self._values[key].extend(sample[key])
        self._offsets.append(self._offsets[-1] + length)

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample index {index} out of range for {len(self)} samples")
        index %= len(self)
        start, end = self._offsets[index], self._offsets[index + 1]
        return {key: values[start:end].tolist() for key, values in self._values.items()}
