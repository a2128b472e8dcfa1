"""Preference pairs: a prompt with a chosen and a rejected answer, for preference tuning (``recipes/full_dpo.py``).

    dataset:
      _component_: torchtune_ac.data.preference_dataset
      source: pairs.jsonl            # any source ``dataset`` reads: JSON(L), Parquet, CSV, Arrow, folders, the Hub
      column_map: {prompt: question}  # optional

A record is one of two formats, told apart by the type of its ``chosen`` column:

- strings: ``prompt``, ``chosen`` and ``rejected`` are text. With ``template: plain`` (the default) the prompt is
  tokenized with BOS, each answer with EOS, and a sequence is the prompt's tokens followed by the answer's; with
  ``template: chat`` the prompt is a user turn and each answer an assistant turn, as message lists are rendered
  (torchtune's ``stack_exchange_paired_dataset`` does this).
- message lists: ``chosen`` and ``rejected`` are conversations (``{"role", "content"}``, or ``{"from", "value"}``
  with ``conversation_style: sharegpt``) that end with the assistant's answer and share every message before it,
  the prompt (Anthropic HH-style and UltraFeedback-binarized data). A ``prompt`` column holding a message list is
  put before both (TRL's explicit-prompt form); a ``prompt`` string beside message lists is not read (in
  UltraFeedback it repeats the first user turn). The conversation is rendered with the tokenizer's chat template:
  the prompt up to the assistant's header (the generation prompt), the answer as the rest of the rendering. Prompt
  and answer are tokenized apart, so chosen and rejected share exactly the prompt's tokens.

Only the answer's tokens (and the EOS after it) are targets: the prompt is masked from the loss.

Truncation (``max_seq_len``, a whole sequence: prompt and the longer answer) keeps the prompt's end and the
answer's start, as TRL's 0.x releases did (``max_prompt_length``, ``truncation_mode: keep_end``; TRL 1.16 cuts
each sequence's end instead and drops pairs whose prompt fills the limit: ``docs/preference-tuning.md``): the
prompt first loses tokens after its BOS, until the pair fits or the prompt is down to ``max_prompt_len`` tokens
(default: half of ``max_seq_len``); then each answer loses its end. What that cost is counted and said once at
start-up, as for the other datasets.

Packed (``packed: true``, which needs ``max_seq_len``): the pairs, truncated as above, go in order into rows of up
to ``2 * max_seq_len`` tokens (room for the longest pair), each pair's chosen sequence then its rejected one, each
a document of its own (``document_ids``: it attends only to itself, its positions restart). A pair is never split
across rows: one that does not fit the rest of a row starts the next. A row is as long as its pairs (the batch pads
to its longest row), so the padding of the unpacked batches, each pair's two rows padded to the batch's longest
sequence, is gone. Each sequence's log-probability is summed over its own tokens (``sequence_ids``), and the loss
pairs each chosen sequence with its rejected one, as unpacked.

A record is refused, in one line naming it, when a column is missing or of the wrong type, an answer is empty,
chosen and rejected are the same, or (message lists) they do not end with an assistant turn, have different
prompts, or have no prompt at all.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch.utils.data import Dataset

from torchtune_ac.component_marker import config_component
from torchtune_ac.data.collate import collate_batch
from torchtune_ac.data.datasets import (
    CONVERSATION_STYLES,
    Sources,
    TextColumns,
    describe_source,
    read_messages,
    register_preparer,
    resolve_column_map,
    resolve_max_seq_len,
)
from torchtune_ac.data.embedded import EMBEDDED_PREFERENCE_DIR
from torchtune_ac.data.samples import IGNORE_INDEX, PackingReport, TokenizedDataset
from torchtune_ac.data.sources import (
    JSON_SUFFIXES,
    Record,
    SourceFiles,
    describe_json_type,
    load_records,
    source_files,
)
from torchtune_ac.data.tokenizer import Tokenizer
from torchtune_ac.errors import UserError

PREFERENCE_COLUMNS = ("prompt", "chosen", "rejected")
ANSWERS = ("chosen", "rejected")
TEXT_TEMPLATES = ("plain", "chat")


@dataclass(frozen=True)
class EncodedPair:
    """One pair's tokens before truncation: the shared prompt and the two answers (EOS included)."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


@dataclass
class PreferenceReport:
    """What truncation cost, counted while the pairs are built (see the module docstring)."""

    source: str
    max_seq_len: Optional[int]
    max_prompt_len: Optional[int]
    pairs: int = 0
    prompts_cut: int = 0  # pairs whose prompt lost its start
    prompt_tokens_lost: int = 0
    answers_cut: int = 0  # answers (chosen and rejected counted apart) that lost their end
    answer_tokens: int = 0  # answer tokens before truncation
    answer_tokens_lost: int = 0
    identical_after_cut: int = 0  # pairs whose answers differ only past max_seq_len: dropped

    def describe(self, extra: Sequence[str] = ()) -> Optional[str]:
        """One line on what was cut or dropped (and ``extra`` parts), or None when there is nothing to say."""
        parts = []
        if self.prompts_cut:
            one = self.prompts_cut == 1
            parts.append(f"{self.prompts_cut:,} of {self.pairs:,} pairs {'is' if one else 'are'} longer than "
                         f"max_seq_len={self.max_seq_len} and had {'its' if one else 'their'} prompt's start cut (down "
                         f"to at least max_prompt_len={self.max_prompt_len} tokens), losing "
                         f"{_count(self.prompt_tokens_lost, 'prompt token')}")
        if self.answers_cut:
            one = self.answers_cut == 1
            parts.append(f"{_count(self.answers_cut, 'answer')} lost {'its' if one else 'their'} end to max_seq_len="
                         f"{self.max_seq_len}, {self.answer_tokens_lost:,} of {self.answer_tokens:,} answer tokens "
                         f"(trained without {'its' if one else 'their'} end and EOS)")
        if self.identical_after_cut:
            one = self.identical_after_cut == 1
            parts.append(f"{_count(self.identical_after_cut, 'pair')} {'differs' if one else 'differ'} only past "
                         f"max_seq_len and {'was' if one else 'were'} dropped")
        parts += extra
        return f"data {self.source}: " + "; ".join(parts) if parts else None


def _count(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1: "1 pair", "2 pairs"."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def truncate_pair(pair: EncodedPair, *, max_seq_len: Optional[int], max_prompt_len: int,
                  report: Optional[PreferenceReport] = None) -> EncodedPair:
    """Fit ``prompt + answer`` into ``max_seq_len`` for both answers: keep the prompt's end, then the answers' start.

    The prompt loses the tokens after its first (BOS, which stays where the prompt starts with it) until the prompt
    and the longer answer fit, but not below ``max_prompt_len`` tokens; then each answer keeps its first
    ``max_seq_len - len(prompt)`` tokens.

    Args:
        pair: the pair's tokens.
        max_seq_len: the longest sequence, or None for no truncation.
        max_prompt_len: the shortest the prompt is cut to (it is never cut below, nor made longer).
        report: counts what was cut.

    Returns:
        The truncated pair (``pair`` itself when it fits).
    """
    prompt, chosen, rejected = pair.prompt, pair.chosen, pair.rejected
    if report is not None:
        report.pairs += 1
        report.answer_tokens += len(chosen) + len(rejected)
    longer = max(len(chosen), len(rejected))
    if max_seq_len is None or len(prompt) + longer <= max_seq_len:
        return pair
    keep = min(len(prompt), max(max_prompt_len, max_seq_len - longer))
    if keep < len(prompt):
        head = 1 if keep >= 1 and len(prompt) > 1 else 0  # BOS (or whatever starts the prompt) stays first
        cut = prompt[:head] + prompt[len(prompt) - (keep - head):] if keep > head else prompt[:keep]
        if report is not None:
            report.prompts_cut += 1
            report.prompt_tokens_lost += len(prompt) - len(cut)
        prompt = cut
    room = max_seq_len - len(prompt)
    answers = []
    for answer in (chosen, rejected):
        if len(answer) > room:
            if report is not None:
                report.answers_cut += 1
                report.answer_tokens_lost += len(answer) - room
            answer = answer[:room]
        answers.append(answer)
    return EncodedPair(prompt, *answers)


def pair_sample(pair: EncodedPair) -> dict[str, list[int]]:
    """The sample of a (truncated) pair: each answer's sequence ``prompt + answer`` and its shifted labels, which
    are the answer's tokens where the next token is one (the prompt is masked: ``IGNORE_INDEX``)."""
    sample = {}
    for name, answer in (("chosen", pair.chosen), ("rejected", pair.rejected)):
        tokens = pair.prompt + answer
        # labels[i] is the target after reading tokens[i]: the answer's tokens, from the prompt's last position on.
        labels = [IGNORE_INDEX] * (len(pair.prompt) - 1) + answer + [IGNORE_INDEX]
        if not pair.prompt:  # no prompt at all: the answer's first token has no position before it
            labels = answer[1:] + [IGNORE_INDEX]
        sample[f"{name}_tokens"], sample[f"{name}_labels"] = tokens, labels
    return sample


class PreferenceDataset(Dataset):
    """Preference pairs: the chosen and the rejected sequence with their labels, and, once computed, the reference
    model's log-probabilities of both answers (``set_reference_logps``: ``dpo.reference: precomputed``).

    A sample is ``{"chosen_tokens", "chosen_labels", "rejected_tokens", "rejected_labels"}`` (lists of ints), plus
    ``"reference_logps": [chosen, rejected]`` (floats) when they were computed.
    """

    def __init__(self) -> None:
        self._chosen = TokenizedDataset(("tokens", "labels"))
        self._rejected = TokenizedDataset(("tokens", "labels"))
        self._reference: Optional[array] = None  # [2 * len]: chosen, rejected of each pair, float64
        # What building it cut or dropped, once, for the start-up log (``build_dataloader`` writes it on rank 0).
        self.report: Optional[str] = None
        # Where it was read from, as ``TokenizedDataset`` keeps it (a checkpoint records what identifies the files).
        self.source: Optional[str] = None
        self.source_files: Optional[SourceFiles] = None

    def append(self, sample: dict[str, list[int]]) -> None:
        """Add one pair (a ``pair_sample``)."""
        self._chosen.append({"tokens": sample["chosen_tokens"], "labels": sample["chosen_labels"]})
        self._rejected.append({"tokens": sample["rejected_tokens"], "labels": sample["rejected_labels"]})

    def __len__(self) -> int:
        return len(self._chosen)

    def __getitem__(self, index: int) -> dict[str, Any]:
        chosen, rejected = self._chosen[index], self._rejected[index]
        sample: dict[str, Any] = {"chosen_tokens": chosen["tokens"], "chosen_labels": chosen["labels"],
                                  "rejected_tokens": rejected["tokens"], "rejected_labels": rejected["labels"]}
        if self._reference is not None:
            index %= len(self)
            chosen, rejected = self._reference[2 * index], self._reference[2 * index + 1]
            if math.isnan(chosen):
                raise ValueError(f"pair {index} has no precomputed reference log-probabilities: the run was not "
                                 "to read it")
            sample["reference_logps"] = [chosen, rejected]
        return sample

    @property
    def pair_count(self) -> int:
        """How many pairs it holds (one a sample)."""
        return len(self)

    def pair_range(self, start: int, stop: int) -> tuple[int, int]:
        """The pairs of samples ``start`` to ``stop``: the same numbers (a packed dataset's rows hold several)."""
        return min(start, len(self)), min(stop, len(self))

    def set_reference_logps(self, logps: torch.Tensor) -> None:
        """Keep the reference model's log-probabilities with the pairs.

        Args:
            logps: ``[pair_count, 2]``: each pair's chosen and rejected answer's summed log-probability; NaN for a
                pair that was not computed, because the run does not read it (reading it raises).
        """
        if tuple(logps.shape) != (self.pair_count, 2):
            raise ValueError(f"reference log-probabilities of shape {tuple(logps.shape)}, expected "
                             f"({self.pair_count}, 2)")
        self._reference = array("d", logps.double().flatten().tolist())


class PairPackingReport(PackingReport):
    """What packing made of preference pairs: ``samples`` pairs into ``rows`` of ``max_seq_len`` (twice the
    config's) tokens."""

    def unchanged(self) -> Optional[str]:
        if self.samples < 2 or self.rows != self.samples:
            return None
        return (f"packing changed nothing: each of the {self.rows:,} rows of {self.max_seq_len} tokens (2 x "
                f"max_seq_len={self.max_seq_len // 2}) holds one pair (none fit beside the one before it), "
                f"{100 * self.fill:.1f} % filled on average; raise max_seq_len, or set packed: false")


class PackedPreferenceDataset(PreferenceDataset):
    """Preference pairs packed into rows (``packed: true``, see the module docstring): a sample is a row
    ``{"tokens", "labels", "document_ids", "pairs"}``, its pairs' chosen and rejected sequences one after the other
    (documents ``2k`` and ``2k + 1`` are its ``k``-th pair's), ``pairs`` how many; plus ``"reference_logps"``, a
    ``[chosen, rejected]`` per pair, once computed."""

    def __init__(self, row_len: int) -> None:
        super().__init__()
        self.row_len = row_len
        self._rows = TokenizedDataset(("tokens", "labels", "document_ids"))
        self._pair_offsets = array("q", [0])  # row r holds pairs _pair_offsets[r] to _pair_offsets[r + 1]
        self._row: dict[str, list[int]] = {"tokens": [], "labels": [], "document_ids": []}
        self._pending = 0  # pairs in the row being filled
        self._tokens = 0
        self.packing: Optional[PackingReport] = None

    def append(self, sample: dict[str, list[int]]) -> None:
        """Add one pair (a ``pair_sample`` no longer than ``row_len``): to the row being filled when it fits, else
        to a new one."""
        length = len(sample["chosen_tokens"]) + len(sample["rejected_tokens"])
        if length > self.row_len:
            raise ValueError(f"pair of {length} tokens does not fit a row of {self.row_len}; truncate it first")
        if len(self._row["tokens"]) + length > self.row_len:
            self.close_row()
        for side, name in enumerate(ANSWERS):
            tokens = sample[f"{name}_tokens"]
            self._row["tokens"] += tokens
            self._row["labels"] += sample[f"{name}_labels"]
            self._row["document_ids"] += [2 * self._pending + side] * len(tokens)
        self._pending += 1
        self._tokens += length

    def close_row(self) -> None:
        """Store the row being filled (called once more after the last pair: ``finish``)."""
        if not self._pending:
            return
        self._rows.append(self._row)
        self._pair_offsets.append(self._pair_offsets[-1] + self._pending)
        self._row = {"tokens": [], "labels": [], "document_ids": []}
        self._pending = 0

    def finish(self) -> None:
        """Close the last row and count what packing made."""
        self.close_row()
        self.packing = PairPackingReport(samples=self.pair_count, rows=len(self), tokens=self._tokens,
                                         max_seq_len=self.row_len)

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def pair_count(self) -> int:
        return self._pair_offsets[-1]

    def pair_range(self, start: int, stop: int) -> tuple[int, int]:
        """The pairs of rows ``start`` to ``stop``."""
        return self._pair_offsets[min(start, len(self))], self._pair_offsets[min(stop, len(self))]

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample: dict[str, Any] = dict(self._rows[index])
        index %= len(self)
        first, last = self._pair_offsets[index], self._pair_offsets[index + 1]
        sample["pairs"] = last - first
        if self._reference is not None:
            if math.isnan(self._reference[2 * first]):
                raise ValueError(f"row {index} has no precomputed reference log-probabilities: the run was not to "
                                 "read it")
            sample["reference_logps"] = [[self._reference[2 * i], self._reference[2 * i + 1]]
                                         for i in range(first, last)]
        return sample


def collate_preference_batch(samples: Sequence[dict[str, Any]], *, pad_id: int, pad_to_multiple_of: int = 1,
                             max_length: Optional[int] = None) -> dict[str, torch.Tensor]:
    """Stack ``b`` pairs into one batch of ``2b`` rows: the chosen sequences, then the rejected ones, right-padded to
    one length, so that both go through the model in one forward.

    Returns:
        What ``collate_batch`` returns for the ``2b`` rows (``tokens``, ``labels``, the host's ``target_count``),
        plus ``reference_logps`` ``[2b]`` (float32, chosen then rejected) when the samples carry them. A pair whose
        labels are all ignored (as ``evaluation_batches`` fills a last batch with) counts for nothing
        (``training.dpo.pair_mask``). Packed rows are collated by ``collate_packed_pairs``.
    """
    if "pairs" in samples[0]:
        return collate_packed_pairs(samples, pad_id=pad_id, pad_to_multiple_of=pad_to_multiple_of,
                                    max_length=max_length)
    rows = ([{"tokens": s["chosen_tokens"], "labels": s["chosen_labels"]} for s in samples]
            + [{"tokens": s["rejected_tokens"], "labels": s["rejected_labels"]} for s in samples])
    batch = collate_batch(rows, pad_id=pad_id, pad_to_multiple_of=pad_to_multiple_of, max_length=max_length)
    if "reference_logps" in samples[0]:
        reference = torch.tensor([[s["reference_logps"][0] for s in samples],
                                  [s["reference_logps"][1] for s in samples]], dtype=torch.float64)
        batch["reference_logps"] = reference.flatten().float()  # [2b]: chosen..., rejected...
    return batch


def collate_packed_pairs(samples: Sequence[dict[str, Any]], *, pad_id: int, pad_to_multiple_of: int = 1,
                         max_length: Optional[int] = None) -> dict[str, torch.Tensor]:
    """Stack packed rows (``PackedPreferenceDataset``'s) holding ``p`` pairs in all, right-padded to one length.

    Returns:
        What ``collate_batch`` returns for the rows (``tokens``, ``labels``, ``document_ids``, the host's
        ``target_count`` and ``document_lengths``), plus ``sequence_ids`` ``[b, s]``: the sequence each position
        belongs to, the chosen ones numbered ``0 .. p-1`` then the rejected ones ``p .. 2p-1`` in pair order (as the
        unpacked batch's rows are; padding says 0 and has no target), the host's ``sequence_count`` (``2p``, 0-d),
        and ``reference_logps`` ``[2p]`` when the rows carry them.
    """
    batch = collate_batch([{key: s[key] for key in ("tokens", "labels", "document_ids")} for s in samples],
                          pad_id=pad_id, pad_to_multiple_of=pad_to_multiple_of, max_length=max_length)
    pairs = torch.tensor([s["pairs"] for s in samples])  # [b]
    n_pairs = int(pairs.sum())
    first_pair = (pairs.cumsum(0) - pairs)[:, None]  # [b, 1]: the row's first pair's number in the batch
    documents = batch["document_ids"]  # [b, s]: 2k, 2k+1 for the row's k-th pair; 2 * pairs and up: padding
    sequence_ids = (documents % 2) * n_pairs + first_pair + documents // 2
    batch["sequence_ids"] = torch.where(documents < 2 * pairs[:, None], sequence_ids, 0)
    batch["sequence_count"] = torch.tensor(2 * n_pairs)
    if "reference_logps" in samples[0]:
        reference = torch.tensor([pair for s in samples for pair in s["reference_logps"]], dtype=torch.float64)
        batch["reference_logps"] = reference.t().flatten().float()  # [2p]: chosen..., rejected...
    return batch


def blank_preference_sample(sample: dict[str, Any]) -> dict[str, Any]:
    """A pair (or a packed row of pairs) that counts for nothing (every label ignored): what fills the last batch
    of an evaluation pass."""
    blank = dict(sample)
    if "labels" in sample:
        blank["labels"] = [IGNORE_INDEX] * len(sample["labels"])
        return blank
    for name in ANSWERS:
        blank[f"{name}_labels"] = [IGNORE_INDEX] * len(sample[f"{name}_labels"])
    return blank


# --------------------------------------------------------------------------------------------------- reading records


def encode_text_pair(tokenizer: Tokenizer, prompt: str, chosen: str, rejected: str) -> EncodedPair:
    """Strings: the prompt with BOS, each answer with EOS, tokenized apart."""
    return EncodedPair(tokenizer.encode(prompt, add_bos=True), tokenizer.encode(chosen, add_eos=True),
                       tokenizer.encode(rejected, add_eos=True))


def encode_chat_pair(tokenizer: Tokenizer, prompt: list[dict[str, str]], chosen: dict[str, str],
                     rejected: dict[str, str], location: str) -> EncodedPair:
    """Message lists: the prompt rendered up to the assistant's header, each answer as the rest of its rendering
    (the reply and its end-of-turn marker), tokenized apart; BOS first and EOS last unless the template wrote them.

    Raises:
        UserError: the chat template fails, or rendering the prompt is not a prefix of rendering the conversation.
    """
    try:
        prompt_text = tokenizer.render_chat(prompt, add_generation_prompt=True)
        answers = []
        for answer in (chosen, rejected):
            text = tokenizer.render_chat([*prompt, answer])
            if not text.startswith(prompt_text):
                raise UserError(
                    "the chat template is not prefix stable (the prompt rendered with the generation prompt is not a "
                    "prefix of the conversation rendered with its answer), so the answer cannot be located; use "
                    "another template"
                )
            answers.append(tokenizer.encode(text[len(prompt_text):]))
    except UserError as e:
        raise UserError(f"{location}: {e}") from None
    prompt_tokens = tokenizer.encode(prompt_text)
    if tokenizer.bos_id is not None and (not prompt_tokens or prompt_tokens[0] != tokenizer.bos_id):
        prompt_tokens.insert(0, tokenizer.bos_id)
    answers = [tokens if tokens and tokens[-1] == tokenizer.eos_id else [*tokens, tokenizer.eos_id]
               for tokens in answers]
    return EncodedPair(prompt_tokens, *answers)


def column_fix(name: str) -> str:
    """How to point the dataset at another column, for a missing-column error."""
    return f"map a column of the file to it with column_map: {{{name}: <column>}}"


def read_pair(record: Record, columns: dict[str, str], *, sharegpt: bool, template: str, tokenizer: Tokenizer,
              text: TextColumns) -> EncodedPair:
    """Check one record and tokenize its pair (see the module docstring for the formats and refusals).

    Raises:
        UserError: naming the record, for a missing or mistyped column, an empty answer, identical answers, or
            (message lists) answers that do not end with an assistant turn or have different prompts.
    """
    chosen_column = columns["chosen"]
    if chosen_column not in record.value:
        text.read(record, chosen_column, column_fix("chosen"))  # raises: the missing column, and the record's
    if isinstance(record.value[chosen_column], list):
        return read_chat_pair(record, columns, sharegpt=sharegpt, tokenizer=tokenizer, text=text)
    texts = {name: text.read(record, columns[name], column_fix(name)) for name in PREFERENCE_COLUMNS}
    for name in ANSWERS:
        if not texts[name].strip():
            raise UserError(f"{record.location}: {name} answer ({columns[name]!r}) is empty")
    if texts["chosen"] == texts["rejected"]:
        raise UserError(f"{record.location}: chosen and rejected are the same answer; a pair needs two different "
                        "answers")
    if template == "chat":
        answers = [{"role": "assistant", "content": texts[name]} for name in ANSWERS]
        return encode_chat_pair(tokenizer, [{"role": "user", "content": texts["prompt"]}], *answers, record.location)
    return encode_text_pair(tokenizer, texts["prompt"], texts["chosen"], texts["rejected"])


def read_chat_pair(record: Record, columns: dict[str, str], *, sharegpt: bool, tokenizer: Tokenizer,
                   text: TextColumns) -> EncodedPair:
    """A record whose ``chosen`` and ``rejected`` are message lists (see ``read_pair``)."""
    conversations = {}
    for name in ANSWERS:
        column = columns[name]
        if column not in record.value:
            text.read(record, column, column_fix(name))  # raises: the missing column
        if not isinstance(record.value[column], list):
            raise UserError(f"{record.location}: column {column!r} must be a message list like the chosen column, "
                            f"got {describe_json_type(record.value[column])}")
        conversations[name] = read_messages(record, column, sharegpt=sharegpt)
    prefix: list[dict[str, str]] = []
    prompt_value = record.value.get(columns["prompt"])
    if isinstance(prompt_value, list):  # the explicit-prompt form: the prompt's messages, then each answer's
        prefix = read_messages(record, columns["prompt"], sharegpt=sharegpt)
    for name, messages in conversations.items():
        if messages[-1]["role"] != "assistant":
            raise UserError(f"{record.location}: {name} must end with the assistant's answer, but its last message "
                            f"is a {messages[-1]['role']!r} turn")
        if not messages[-1]["content"].strip():
            raise UserError(f"{record.location}: {name} answer (its last message) is empty")
    chosen, rejected = conversations["chosen"], conversations["rejected"]
    if chosen[:-1] != rejected[:-1]:
        differ = next((i for i, (a, b) in enumerate(zip(chosen[:-1], rejected[:-1])) if a != b),
                      min(len(chosen), len(rejected)) - 1)
        raise UserError(f"{record.location}: chosen and rejected have different prompts (the messages before the "
                        f"answer differ at message {differ}: chosen has {len(chosen) - 1}, rejected "
                        f"{len(rejected) - 1} before it); a pair answers one prompt")
    if chosen[-1] == rejected[-1]:
        raise UserError(f"{record.location}: chosen and rejected are the same answer; a pair needs two different "
                        "answers")
    if not prefix + chosen[:-1]:
        raise UserError(f"{record.location}: chosen and rejected hold only the assistant's answer; a pair answers a "
                        f"prompt: put its messages before the answer, or in a {columns['prompt']!r} column holding a "
                        "message list")
    return encode_chat_pair(tokenizer, prefix + chosen[:-1], chosen[-1], rejected[-1], record.location)


@config_component
def preference_dataset(
    tokenizer: Tokenizer,
    *,
    source: Sources = EMBEDDED_PREFERENCE_DIR,
    column_map: Optional[dict[str, str]] = None,
    conversation_style: str = "openai",
    template: str = "plain",
    max_seq_len: Optional[int] = None,
    max_prompt_len: Optional[int] = None,
    packed: bool = False,
    split: str = "train",
) -> PreferenceDataset:
    """Preference pairs (see the module docstring for the formats, truncation and refusals).

    Args:
        tokenizer: From :func:`load_tokenizer`.
        source: ``.json``, ``.jsonl``, ``.parquet``, ``.csv`` or ``.arrow`` file, a folder, or a Hub dataset
            (``org/name``), or a list of them read one after the other (see ``sources.load_records``); defaults
            to the embedded synthetic pairs (splits ``train`` and ``validation``).
        column_map: Maps ``prompt``, ``chosen`` and ``rejected`` to the file's column names.
        conversation_style: message lists as ``openai`` (role/content) or ``sharegpt`` (from/value).
        template: string pairs as they are (``plain``), or as a user turn and an assistant turn (``chat``).
        max_seq_len: The longest sequence (prompt and answer); defaults to ``tokenizer.max_seq_len``.
        max_prompt_len: Truncation cuts a prompt down to no fewer tokens than this; defaults to half of
            ``max_seq_len``.
        packed: Pack the pairs into rows of up to ``2 * max_seq_len`` tokens, each sequence a document of its own
            (see the module docstring); needs ``max_seq_len``.
        split: Split of a folder or Hub dataset.

    Returns:
        The pairs, each a chosen and a rejected sequence (packed: rows of pairs).

    Raises:
        UserError: for a bad file, record, column, ``column_map``, ``conversation_style``, ``template``,
            ``max_seq_len`` or ``max_prompt_len``, and when no pair is left.
    """
    return build_preference_dataset(prepare_preference_dataset(
        tokenizer, source=source, column_map=column_map, conversation_style=conversation_style, template=template,
        max_seq_len=max_seq_len, max_prompt_len=max_prompt_len, packed=packed, split=split))


@dataclass(frozen=True)
class PreparedPairs:
    """Preference pairs as ``prepare_preference_dataset`` prepares them, before anything is encoded: every record
    read and parsed, and how one becomes an ``EncodedPair`` (raising a ``UserError`` naming it when it cannot).
    ``tune validate`` encodes them as a run would (``datasets.check_dataset_records``)."""

    source: str
    records: list[Record]
    encode: Callable[[Record], EncodedPair]
    max_seq_len: Optional[int]
    max_prompt_len: int
    source_files: Optional[SourceFiles]
    text_columns: TextColumns
    packed: bool = False

    def build(self) -> "PreferenceDataset":
        return build_preference_dataset(self)


def prepare_preference_dataset(
    tokenizer: Tokenizer, *, source: Sources, column_map: Optional[dict[str, str]], conversation_style: str,
    template: str, max_seq_len: Optional[int], max_prompt_len: Optional[int], split: str, packed: bool = False,
) -> PreparedPairs:
    """:func:`preference_dataset`'s records and encoding (its arguments, all given)."""
    if conversation_style not in CONVERSATION_STYLES:
        raise UserError(f"conversation_style={conversation_style!r}: must be one of {', '.join(CONVERSATION_STYLES)}")
    if template not in TEXT_TEMPLATES:
        raise UserError(f"template={template!r}: must be one of {', '.join(TEXT_TEMPLATES)}")
    columns = resolve_column_map(column_map, PREFERENCE_COLUMNS)
    max_seq_len = resolve_max_seq_len(max_seq_len, tokenizer, packed=packed)
    max_prompt_len = resolve_max_prompt_len(max_prompt_len, max_seq_len)
    records = load_records(source, suffixes=JSON_SUFFIXES, split=split)
    text = TextColumns()

    def encode(record: Record) -> EncodedPair:
        return read_pair(record, columns, sharegpt=conversation_style == "sharegpt", template=template,
                         tokenizer=tokenizer, text=text)

    return PreparedPairs(describe_source(source), records, encode, max_seq_len, max_prompt_len,
                         source_files(source, split), text, packed)


def resolve_max_prompt_len(max_prompt_len: Optional[int], max_seq_len: Optional[int]) -> int:
    """``max_prompt_len``, or half of ``max_seq_len``; checked to be positive and below ``max_seq_len``.

    Raises:
        UserError: not a positive integer, or not below ``max_seq_len`` (an answer would have no room).
    """
    if max_prompt_len is None:
        return max(1, max_seq_len // 2) if max_seq_len is not None else 0
    if isinstance(max_prompt_len, bool) or not isinstance(max_prompt_len, int) or max_prompt_len <= 0:
        raise UserError(f"max_prompt_len={max_prompt_len!r}: must be a positive integer")
    if max_seq_len is not None and max_prompt_len >= max_seq_len:
        raise UserError(f"max_prompt_len={max_prompt_len}: must be below max_seq_len={max_seq_len}, so that a "
                        "truncated pair keeps some of its answers")
    return max_prompt_len


def build_preference_dataset(prepared: PreparedPairs) -> PreferenceDataset:
    """Encode, truncate and store the pairs, counting what truncation cost.

    Raises:
        UserError: a record that cannot be encoded (naming it), or no pair is left.
    """
    report = PreferenceReport(prepared.source, prepared.max_seq_len, prepared.max_prompt_len)
    dataset = PackedPreferenceDataset(2 * prepared.max_seq_len) if prepared.packed else PreferenceDataset()
    for record in prepared.records:
        pair = truncate_pair(prepared.encode(record), max_seq_len=prepared.max_seq_len,
                             max_prompt_len=prepared.max_prompt_len, report=report)
        if pair.chosen == pair.rejected:
            report.identical_after_cut += 1
            continue
        dataset.append(pair_sample(pair))
    if isinstance(dataset, PackedPreferenceDataset):
        dataset.finish()  # the last row is stored only now: until then the pairs that fill it are not counted
    if dataset.pair_count == 0:
        lost = ("its only pair differs only past" if report.pairs == 1 else
                f"none of the {report.pairs:,} pairs is left: every one differs only past")
        raise UserError(f"{prepared.source}: {lost} max_seq_len={prepared.max_seq_len} (raise it)")
    converted = prepared.text_columns.describe()
    dataset.report = report.describe(extra=[converted] if converted else [])
    dataset.source, dataset.source_files = prepared.source, prepared.source_files
    return dataset


register_preparer(preference_dataset, prepare_preference_dataset)
