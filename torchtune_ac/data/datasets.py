"""Instruction, chat and plain-text datasets read from JSON, JSONL, text, Parquet, CSV or Arrow files, ``save_to_disk``
folders or Hugging Face Hub datasets (see ``sources.load_records``).

Each builder is a YAML component, ``dataset: {_component_: torchtune_ac.data.instruct_dataset, ...}``, called by
the recipe with the tokenizer as its first argument. Records are tokenized when the dataset is built; every
sample starts with BOS and ends with EOS (unless truncated to ``max_seq_len``), and its labels are shifted and
masked as described in ``samples.py``. Records with nothing left to train on (for example a response cut off by
``max_seq_len``) are dropped; what truncation and dropping cost is reported once at start-up (``build_dataloader``);
if every record is dropped, that is an error saying why.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Mapping, Optional

from torchtune_ac.component_marker import config_component
from torchtune_ac.data.embedded import EMBEDDED_INSTRUCT_PATH
from torchtune_ac.data.packing import pack_samples
from torchtune_ac.data.samples import DataReport, TokenizedDataset, build_sample
from torchtune_ac.data.sources import (
    JSON_SUFFIXES,
    TEXT_SUFFIXES,
    Record,
    describe_json_type,
    load_records,
    source_files,
)
from torchtune_ac.data.tokenizer import Tokenizer
from torchtune_ac.errors import UserError

INSTRUCT_COLUMNS = ("instruction", "input", "output")
INSTRUCT_TEMPLATES = ("alpaca", "chat")
CHAT_ROLES = ("system", "user", "assistant")
# sharegpt-style messages, {"from": ..., "value": ...}: their roles as ours.
SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant"}
CONVERSATION_STYLES = ("openai", "sharegpt")

ALPACA_PROMPT_WITH_INPUT = (
    "Below is a task, together with input that gives it context. Write a response that completes the task.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is a task. Write a response that completes the task.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)


def format_alpaca_prompt(instruction: str, input_text: str) -> str:
    """The Alpaca-layout prompt; the response is appended right after it.

    Args:
        instruction: What to do.
        input_text: Extra context; the "### Input" section is left out when it is empty.

    Returns:
        The prompt, ending in ``"### Response:\\n"``.
    """
    if input_text:
        return ALPACA_PROMPT_WITH_INPUT.format(instruction=instruction, input=input_text)
    return ALPACA_PROMPT_NO_INPUT.format(instruction=instruction)


@config_component
def instruct_dataset(
    tokenizer: Tokenizer,
    *,
    source: str = EMBEDDED_INSTRUCT_PATH,
    column_map: Optional[dict[str, str]] = None,
    train_on_input: bool = False,
    max_seq_len: Optional[int] = None,
    packed: bool = False,
    template: str = "alpaca",
    split: str = "train",
) -> TokenizedDataset:
    """Instruction/response pairs (``instruction``, optional ``input``, ``output`` columns).

    With ``template: alpaca`` the prompt is :func:`format_alpaca_prompt` and the response follows it; with
    ``template: chat`` the pair becomes a user turn (instruction, then a blank line and the input if any) and an
    assistant turn, rendered with the tokenizer's chat template.

    Args:
        tokenizer: From :func:`load_tokenizer`.
        source: ``.json``, ``.jsonl``, ``.parquet``, ``.csv`` or ``.arrow`` file, a folder, or a Hub dataset
            (``org/name``); defaults to the embedded synthetic dataset.
        column_map: Maps this dataset's column names to the file's, e.g. ``{"output": "answer"}``. The ``input``
            column may be absent from records (taken as empty) unless ``column_map`` names it; ``input: null``
            means the data has no input column (a column named ``input`` is then not read).
        train_on_input: Also train on the prompt tokens, not only on the response and EOS.
        max_seq_len: Truncation length (defaults to ``tokenizer.max_seq_len``); required when ``packed``.
        packed: Pack samples into sequences of exactly ``max_seq_len`` (see ``packing.py``).
        template: ``alpaca`` or ``chat``.
        split: Split of a folder or Hub dataset.

    Returns:
        The tokenized dataset.

    Raises:
        UserError: for a bad file, record, column, ``column_map``, ``template`` or ``max_seq_len``.
    """
    if template not in INSTRUCT_TEMPLATES:
        raise UserError(f"template={template!r}: must be one of {', '.join(INSTRUCT_TEMPLATES)}")
    columns = resolve_column_map(column_map, INSTRUCT_COLUMNS, optional=("input",))
    input_required = column_map is not None and column_map.get("input") is not None
    max_seq_len = resolve_max_seq_len(max_seq_len, tokenizer, packed)
    records = load_records(source, suffixes=JSON_SUFFIXES, split=split)

    def read_column(record: Record, name: str) -> str:
        fix = f"map a column of the file to it with column_map: {{{name}: <column>}}"
        return read_string_column(record, columns[name], fix)

    def tokenize(record: Record) -> tuple[list[int], list[bool]]:
        instruction = read_column(record, "instruction")
        output = read_column(record, "output")
        input_text = ""
        if input_required or (columns["input"] is not None and columns["input"] in record.value):
            input_text = read_column(record, "input")
        if template == "chat":
            user = f"{instruction}\n\n{input_text}" if input_text else instruction
            messages = [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
            return encode_chat_record(tokenizer, messages, record, train_on_input)
        prompt = tokenizer.encode(format_alpaca_prompt(instruction, input_text), add_bos=True)
        response = tokenizer.encode(output, add_eos=True)
        return prompt + response, [train_on_input] * len(prompt) + [True] * len(response)

    return build_dataset(source, map(tokenize, records), tokenizer, max_seq_len=max_seq_len, packed=packed,
                         split=split)


@config_component
def chat_dataset(
    tokenizer: Tokenizer,
    *,
    source: str,
    conversation_column: str = "messages",
    conversation_style: str = "openai",
    train_on_input: bool = False,
    max_seq_len: Optional[int] = None,
    packed: bool = False,
    split: str = "train",
) -> TokenizedDataset:
    """Conversations: each record's ``conversation_column`` is a list of ``{"role", "content"}`` messages.

    Roles are ``system``, ``user`` and ``assistant``. With ``conversation_style: sharegpt`` messages are
    ``{"from": system|human|gpt, "value": ...}`` instead. The conversation is rendered with the tokenizer's chat
    template; only assistant turns (with their end-of-turn marker) and the final EOS are trained on unless
    ``train_on_input``.

    Args:
        tokenizer: From :func:`load_tokenizer`.
        source: ``.json``, ``.jsonl``, ``.parquet`` or ``.arrow`` file, a folder, or a Hub dataset (``org/name``).
        conversation_column: Column holding the message list.
        conversation_style: ``openai`` (role/content) or ``sharegpt`` (from/value).
        train_on_input: Train on every token.
        max_seq_len: Truncation length (defaults to ``tokenizer.max_seq_len``); required when ``packed``.
        packed: Pack samples into sequences of exactly ``max_seq_len``.
        split: Split of a folder or Hub dataset.

    Returns:
        The tokenized dataset.

    Raises:
        UserError: for a bad file, record, message, chat template, ``conversation_style`` or ``max_seq_len``.
    """
    if conversation_style not in CONVERSATION_STYLES:
        raise UserError(f"conversation_style={conversation_style!r}: must be one of {', '.join(CONVERSATION_STYLES)}")
    max_seq_len = resolve_max_seq_len(max_seq_len, tokenizer, packed)
    records = load_records(source, suffixes=JSON_SUFFIXES, split=split)

    def tokenize(record: Record) -> tuple[list[int], list[bool]]:
        messages = read_messages(record, conversation_column, sharegpt=conversation_style == "sharegpt")
        return encode_chat_record(tokenizer, messages, record, train_on_input)

    return build_dataset(source, map(tokenize, records), tokenizer, max_seq_len=max_seq_len, packed=packed,
                         split=split, untrained_reason="no assistant turn (only assistant turns are trained on, unless "
                         "train_on_input: true)")


@config_component
def text_dataset(
    tokenizer: Tokenizer,
    *,
    source: str,
    column: str = "text",
    max_seq_len: Optional[int] = None,
    packed: bool = False,
    split: str = "train",
) -> TokenizedDataset:
    """Plain documents, every token trained on.

    A ``.txt`` source is split into documents at blank lines; any other source takes each record's ``column``. Documents longer than ``max_seq_len`` are truncated (the rest is not used).

    Args:
        tokenizer: From :func:`load_tokenizer`.
        source: ``.txt``, ``.json``, ``.jsonl``, ``.parquet``, ``.csv`` or ``.arrow`` file, a folder, or a Hub
            dataset (``org/name``).
        column: Text column of the records (ignored for ``.txt``).
        max_seq_len: Truncation length (defaults to ``tokenizer.max_seq_len``); required when ``packed``.
        packed: Pack samples into sequences of exactly ``max_seq_len``.
        split: Split of a folder or Hub dataset.

    Returns:
        The tokenized dataset.

    Raises:
        UserError: for a bad file, record, column or ``max_seq_len``.
    """
    max_seq_len = resolve_max_seq_len(max_seq_len, tokenizer, packed)
    records = load_records(source, suffixes=TEXT_SUFFIXES, split=split)

    def tokenize(record: Record) -> tuple[list[int], list[bool]]:
        if isinstance(record.value, str):
            text = record.value
        else:
            text = read_string_column(record, column, "set column: <column>")
        tokens = tokenizer.encode(text, add_bos=True, add_eos=True)
        return tokens, [True] * len(tokens)

    return build_dataset(source, map(tokenize, records), tokenizer, max_seq_len=max_seq_len, packed=packed,
                         split=split)


def uses_chat_template(builder: Callable[..., Any], arguments: Mapping[str, Any]) -> bool:
    """Whether the dataset ``builder`` called with ``arguments`` renders records with the tokenizer's chat template
    (``chat_dataset``, and ``instruct_dataset`` with ``template: chat``): start-up checks ask, before the data is read.
    """
    return builder is chat_dataset or (builder is instruct_dataset and arguments.get("template") == "chat")


def resolve_max_seq_len(max_seq_len: Optional[int], tokenizer: Tokenizer, packed: bool) -> Optional[int]:
    """The dataset's own ``max_seq_len``, else the tokenizer's; checked positive, and required for packing.

    Raises:
        UserError: if it is not a positive integer, or is missing while ``packed`` is true.
    """
    resolved = max_seq_len if max_seq_len is not None else tokenizer.max_seq_len
    if resolved is not None and (isinstance(resolved, bool) or not isinstance(resolved, int) or resolved <= 0):
        raise UserError(f"max_seq_len={resolved!r}: must be a positive integer")
    if packed and resolved is None:
        raise UserError("packed=true needs max_seq_len (the length of every packed sequence); set max_seq_len")
    return resolved


def resolve_column_map(
    column_map: Optional[dict[str, Optional[str]]], expected: tuple[str, ...], optional: tuple[str, ...] = ()
) -> dict[str, Optional[str]]:
    """Column name in the file for each expected column (identity unless remapped; None: an ``optional``
    column the data does not have).

    Raises:
        UserError: if ``column_map`` has a key that is not an expected column, or a value that is not a string
            (null only for an optional column).
    """
    column_map = dict(column_map or {})
    for key, value in column_map.items():
        if key not in expected:
            raise UserError(
                f"column_map key {key!r} is not a column of this dataset; allowed keys: {', '.join(expected)}"
            )
        if value is None and key in optional:
            continue
        if not isinstance(value, str):
            raise UserError(f"column_map.{key}={value!r}: must be the name (a string) of a column in the file")
    return {name: column_map.get(name, name) for name in expected}


def read_string_column(record: Record, column: str, fix: str) -> str:
    """The string in ``record``'s ``column``.

    Args:
        record: A JSON record.
        column: Column name in the file.
        fix: How to point the dataset at another column, appended to the missing-column error.

    Raises:
        UserError: if the column is missing (listing the record's columns) or not a string.
    """
    if column not in record.value:
        available = ", ".join(sorted(record.value)) or "none"
        raise UserError(f"{record.location}: missing column {column!r} (the record has: {available}); {fix}")
    value = record.value[column]
    if not isinstance(value, str):
        raise UserError(f"{record.location}: column {column!r} must be a string, got {describe_json_type(value)}")
    return value


def read_messages(record: Record, column: str, *, sharegpt: bool = False) -> list[dict[str, str]]:
    """The validated message list in ``record``'s ``column`` (``sharegpt``: ``from``/``value`` messages, returned
    as ``role``/``content``).

    Raises:
        UserError: if the column is missing, not a non-empty array, or a message lacks a known role or string content.
    """
    if column not in record.value:
        available = ", ".join(sorted(record.value)) or "none"
        raise UserError(
            f"{record.location}: missing column {column!r} (the record has: {available}); "
            "set conversation_column: <column>"
        )
    messages = record.value[column]
    if not isinstance(messages, list) or not messages:
        found = describe_json_type(messages) if not isinstance(messages, list) else "an empty array"
        raise UserError(f"{record.location}: column {column!r} must be a non-empty array of messages, got {found}")
    checked = []
    for index, message in enumerate(messages):
        where = f"{record.location}: {column}[{index}]"
        if not isinstance(message, dict):
            raise UserError(f"{where}: each message must be an object, got {describe_json_type(message)}")
        if sharegpt:
            speaker, content = message.get("from"), message.get("value")
            if speaker not in SHAREGPT_ROLES:
                raise UserError(f"{where}: from {speaker!r} must be one of {', '.join(SHAREGPT_ROLES)}")
            role = SHAREGPT_ROLES[speaker]
        else:
            role, content = message.get("role"), message.get("content")
        if role not in CHAT_ROLES:
            raise UserError(f"{where}: role {role!r} must be one of {', '.join(CHAT_ROLES)}")
        if not isinstance(content, str):
            raise UserError(f"{where}: content must be a string, got {describe_json_type(content)}")
        checked.append({"role": role, "content": content})
    return checked


def encode_chat_record(
    tokenizer: Tokenizer, messages: list[dict[str, str]], record: Record, train_on_input: bool
) -> tuple[list[int], list[bool]]:
    """``tokenizer.encode_chat`` with template errors prefixed by the record's location."""
    try:
        return tokenizer.encode_chat(messages, train_on_input=train_on_input)
    except UserError as e:
        raise UserError(f"{record.location}: {e}") from None


def build_dataset(
    source: str,
    encoded: Iterable[tuple[list[int], list[bool]]],
    tokenizer: Tokenizer,
    *,
    max_seq_len: Optional[int],
    packed: bool,
    split: str = "train",
    untrained_reason: str = "nothing to train on",
) -> TokenizedDataset:
    """Turn ``(tokens, trainable)`` pairs into samples, drop the untrainable, and pack if asked.

    What truncation cost (samples cut, targets lost) and what was dropped is counted, and kept as the dataset's
    ``report`` line for the start-up log. The dataset also keeps its ``source`` and the files it was read from
    (``source_files``: a checkpoint records what identifies them).

    Args:
        split: the split ``source`` was read in (its files are the dataset's ``source_files``).
        untrained_reason: what a record with no target at all lacks, for messages (``no assistant turn``).

    Raises:
        UserError: if no record has anything to train on (saying how many lack a target and how many lost every
            target to ``max_seq_len``).
    """
    report = DataReport(source, max_seq_len)

    def iterate_samples() -> Iterator[dict[str, Any]]:
        for tokens, trainable in encoded:
            if report.count(trainable) == 0:
                continue
            yield build_sample(tokens, trainable, max_seq_len=max_seq_len)

    if packed:
        dataset = pack_samples(iterate_samples(), max_seq_len=max_seq_len, pad_id=tokenizer.pad_id)
    else:
        dataset = TokenizedDataset(("tokens", "labels"))
        for sample in iterate_samples():
            dataset.append(sample)
    if len(dataset) == 0:
        reasons = []
        if report.untrained:
            reasons.append(f"{report.untrained} have {untrained_reason}")
        if report.cut_off:
            reasons.append(f"{report.cut_off} lost every target to max_seq_len={max_seq_len} (raise it)")
        raise UserError(f"{source}: none of the {report.records} records has a token to train on: "
                        + "; ".join(reasons))
    dataset.report = report.describe(untrained_reason)
    dataset.source, dataset.source_files = source, source_files(source, split)
    return dataset
