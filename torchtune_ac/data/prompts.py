"""GRPO's data: prompts with the columns their rewards read (``answer``), from a JSONL file, a Hugging Face dataset
or a chat list rendered with the tokenizer's template; GSM8K's layout (``question``, ``answer`` ending ``#### 42``)
with ``prompt_column: question``. Each sample is a prompt's tokens and its index, whose other columns the rollout
hands the reward functions by name."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch.utils.data import Dataset

from torchtune_ac.component_marker import config_component
from torchtune_ac.data.datasets import Sources, describe_source, read_messages
from torchtune_ac.data.embedded import EMBEDDED_ADDITIONS_PATH
from torchtune_ac.data.records import Record
from torchtune_ac.data.samples import count_of
from torchtune_ac.data.sources import load_records, source_files
from torchtune_ac.data.tokenizer import Tokenizer
from torchtune_ac.errors import UserError

TEMPLATES = ("plain", "chat")


class PromptDataset(Dataset):
    """Prompts (token ids) and, per prompt, the record's other columns.

    Attributes:
        columns: the columns every record holds besides the prompt (what a reward may take by name).
    """

    def __init__(self, prompts: list[list[int]], rows: list[dict[str, Any]], columns: tuple[str, ...]) -> None:
        self.prompts, self.rows, self.columns = prompts, rows, columns
        self.report: Optional[str] = None
        self.packing = None
        self.source: Optional[str] = None
        self.source_files = None

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"prompt": self.prompts[index], "index": index}

    def columns_of(self, indices: Sequence[int]) -> dict[str, list[Any]]:
        """Each column's values for the prompts at ``indices``, in order (what reward functions take by name)."""
        return {name: [self.rows[i][name] for i in indices] for name in self.columns}


def collate_prompts(samples: Sequence[dict[str, Any]], *, pad_id: int, pad_to_multiple_of: int = 1,
                    max_length: Optional[int] = None) -> dict[str, torch.Tensor]:
    """``tokens`` ``[b, longest]`` right-padded, ``prompt_lengths`` ``[b]`` and the dataset ``index`` ``[b]``."""
    width = max(len(s["prompt"]) for s in samples)
    tokens = torch.full((len(samples), width), pad_id, dtype=torch.long)
    for row, sample in enumerate(samples):
        tokens[row, :len(sample["prompt"])] = torch.tensor(sample["prompt"], dtype=torch.long)
    return {"tokens": tokens, "prompt_lengths": torch.tensor([len(s["prompt"]) for s in samples]),
            "index": torch.tensor([s["index"] for s in samples])}


def blank_prompt(sample: dict[str, Any]) -> dict[str, Any]:
    return dict(sample)


def encode_prompt(tokenizer: Tokenizer, record: Record, column: str, *, template: str,
                  system_prompt: Optional[str]) -> list[int]:
    """A prompt's tokens: plain text after BOS, or (``chat``) a user turn or a message list rendered by the
    tokenizer's chat template, ending with the assistant's header."""
    value = record.value[column]
    if template == "plain":
        if not isinstance(value, str):
            raise UserError(f"{record.location}: the prompt must be a string with template: plain (got "
                            f"{type(value).__name__}); use template: chat for message lists")
        return tokenizer.encode(value, add_bos=True)
    if isinstance(value, str):
        messages = [{"role": "user", "content": value}]
    else:
        messages = read_messages(record, column)
    if system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    text = tokenizer.render_chat(messages, add_generation_prompt=True)
    tokens = tokenizer.encode(text)
    return tokens if tokens[:1] == [tokenizer.bos_id] or tokenizer.bos_id is None else [tokenizer.bos_id, *tokens]


@config_component
def prompt_dataset(tokenizer: Tokenizer, *, source: Sources = EMBEDDED_ADDITIONS_PATH, prompt_column: str = "prompt",
                   template: str = "plain", system_prompt: Optional[str] = None, split: str = "train",
                   max_seq_len: Optional[int] = None) -> PromptDataset:
    """Prompts and their columns, for ``tune run grpo``.

    Args:
        tokenizer: From :func:`load_tokenizer`.
        source: a ``.jsonl``/``.json``/``.parquet``/``.csv`` file, a folder or a Hub dataset (``openai/gsm8k``
            with ``prompt_column: question``); defaults to the embedded additions (``3+4=``, answer ``7``).
        prompt_column: the column holding the prompt: a string, or with ``template: chat`` a message list.
        template: ``plain`` (the text after BOS) or ``chat`` (the tokenizer's chat template, a generation prompt
            after it).
        system_prompt: with ``template: chat``, a system turn put before each prompt that has none.
        split: the split of a folder or Hub dataset.
        max_seq_len: the longest prompt kept (the recipe passes ``max_seq_len - generation.max_new_tokens``);
            longer ones are dropped and counted in the start-up log.

    Raises:
        UserError: an unknown template, a record without the prompt column, or no prompt short enough.
    """
    if template not in TEMPLATES:
        raise UserError(f"template={template!r}: expected one of {', '.join(TEMPLATES)}")
    name = describe_source(source)
    records = load_records(source, split=split)
    prompts, rows, dropped = [], [], 0
    columns: Optional[set[str]] = None
    for record in records:
        value = record.value
        if not isinstance(value, dict) or prompt_column not in value:
            raise UserError(f"{record.location}: no {prompt_column!r} column (prompt_column names the prompt; GSM8K "
                            "has prompt_column: question)")
        tokens = encode_prompt(tokenizer, record, prompt_column, template=template, system_prompt=system_prompt)
        if max_seq_len is not None and len(tokens) > max_seq_len:
            dropped += 1
            continue
        row = {k: v for k, v in value.items() if k != prompt_column}
        columns = set(row) if columns is None else columns & set(row)
        prompts.append(tokens)
        rows.append(row)
    if not prompts:
        raise UserError(f"dataset {name}: no prompt fits in {max_seq_len} tokens (max_seq_len minus "
                        "generation.max_new_tokens); raise max_seq_len")
    dataset = PromptDataset(prompts, rows, tuple(sorted(columns or ())))
    dataset.source, dataset.source_files = name, source_files(source, split)
    if dropped:
        dataset.report = (f"data {name}: {count_of(dropped, 'prompt')} of {len(records):,} longer than "
                          f"{max_seq_len} tokens (max_seq_len minus generation.max_new_tokens) dropped")
    return dataset
