"""Instruction, chat and plain-text datasets read from JSON, JSONL, text, Parquet, CSV or Arrow files, ``save_to_disk``
folders or Hugging Face Hub datasets (see ``sources.load_records``).

Each builder is a YAML component, ``dataset: {_component_: torchtune_ac.data.instruct_dataset, ...}``, called by
the recipe with the tokenizer as its first argument. A builder first prepares its data (``PreparedDataset``: every
record read and parsed, and how one is encoded), then builds the samples; ``tune validate`` prepares the same way
and encodes all records, or a stated sample of a large source (``check_dataset_records``). Records are tokenized when the dataset is built; every
sample starts with BOS and ends with EOS (unless truncated to ``max_seq_len``), and its labels are shifted and
masked as described in ``samples.py``. Records with nothing left to train on (for example a response cut off by
``max_seq_len``) are dropped; what truncation and dropping cost is reported once at start-up (``build_dataloader``);
if every record is dropped, that is an error saying why.
"""

from __future__ import annotations

import inspect
import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Union

from torchtune_ac.component_marker import config_component
from torchtune_ac.data.embedded import EMBEDDED_INSTRUCT_PATH
from torchtune_ac.data.packing import pack_samples
from torchtune_ac.data.samples import (
    RESPONSE_TRUNCATION,
    DataReport,
    TokenizedDataset,
    build_sample,
    count_of,
    describe_samples,
)
from torchtune_ac.data.records import Record
from torchtune_ac.data.sources import (
    JSON_SUFFIXES,
    TEXT_SUFFIXES,
    SourceFiles,
    describe_json_type,
    load_records,
    source_files,
)
from torchtune_ac.data.tokenizer import Tokenizer
from torchtune_ac.errors import UserError

# A source: a path or Hub name, or a list of them read one after the other as one dataset.
Sources = Union[str, list[str]]

INSTRUCT_COLUMNS = ("instruction", "input", "output")
INSTRUCT_TEMPLATES = ("alpaca", "chat")
# Tool messages (a tool's answer) are rendered as the chat template writes them, and never trained on.
CHAT_ROLES = ("system", "user", "assistant", "tool")
# sharegpt-style messages, {"from": ..., "value": ...}: their roles as ours (many ShareGPT exports write ours).
SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant", "user": "user", "assistant": "assistant",
                  "tool": "tool"}
CONVERSATION_STYLES = ("openai", "sharegpt")

# What truncating a plain-text document costs, and how to lose nothing.
TEXT_TRUNCATION = "the rest of a truncated document is not trained on; packed: true splits long documents across rows"

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
    source: Sources = EMBEDDED_INSTRUCT_PATH,
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
            (``org/name``), or a list of them read one after the other (see ``sources.load_records``); defaults
            to the embedded synthetic dataset.
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
    return build_dataset(prepare_instruct_dataset(
        tokenizer, source=source, column_map=column_map, train_on_input=train_on_input, max_seq_len=max_seq_len,
        packed=packed, template=template, split=split))


def prepare_instruct_dataset(
    tokenizer: Tokenizer, *, source: Sources, column_map: Optional[dict[str, str]], train_on_input: bool,
    max_seq_len: Optional[int], packed: bool, template: str, split: str,
) -> PreparedDataset:
    """:func:`instruct_dataset`'s records and encoding (its arguments, all given)."""
    if template not in INSTRUCT_TEMPLATES:
        raise UserError(f"template={template!r}: must be one of {', '.join(INSTRUCT_TEMPLATES)}")
    columns = resolve_column_map(column_map, INSTRUCT_COLUMNS, optional=("input",))
    input_required = column_map is not None and column_map.get("input") is not None
    max_seq_len = resolve_max_seq_len(max_seq_len, tokenizer, packed)
    records = load_records(source, suffixes=JSON_SUFFIXES, split=split)
    text = TextColumns()

    def read_column(record: Record, name: str) -> str:
        fix = f"map a column of the file to it with column_map: {{{name}: <column>}}"
        # An input of null is no input, as an empty one (instruction data often writes it so).
        return text.read(record, columns[name], fix, null_is_empty=name == "input")

    def encode(record: Record) -> tuple[list[int], list[bool]]:
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

    return PreparedDataset(describe_source(source), records, encode, tokenizer.pad_id, max_seq_len, packed,
                           source_files=source_files(source, split), text_columns=text)


@config_component
def chat_dataset(
    tokenizer: Tokenizer,
    *,
    source: Sources,
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
        source: ``.json``, ``.jsonl``, ``.parquet`` or ``.arrow`` file, a folder, or a Hub dataset (``org/name``);
            or a list of them, read one after the other (see ``sources.load_records``).
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
    return build_dataset(prepare_chat_dataset(
        tokenizer, source=source, conversation_column=conversation_column, conversation_style=conversation_style,
        train_on_input=train_on_input, max_seq_len=max_seq_len, packed=packed, split=split))


def prepare_chat_dataset(
    tokenizer: Tokenizer, *, source: Sources, conversation_column: str, conversation_style: str,
    train_on_input: bool, max_seq_len: Optional[int], packed: bool, split: str,
) -> PreparedDataset:
    """:func:`chat_dataset`'s records and encoding (its arguments, all given)."""
    if conversation_style not in CONVERSATION_STYLES:
        raise UserError(f"conversation_style={conversation_style!r}: must be one of {', '.join(CONVERSATION_STYLES)}")
    max_seq_len = resolve_max_seq_len(max_seq_len, tokenizer, packed)
    records = load_records(source, suffixes=JSON_SUFFIXES, split=split)

    def encode(record: Record) -> tuple[list[int], list[bool]]:
        messages = read_messages(record, conversation_column, sharegpt=conversation_style == "sharegpt")
        return encode_chat_record(tokenizer, messages, record, train_on_input)

    return PreparedDataset(describe_source(source), records, encode, tokenizer.pad_id, max_seq_len, packed,
                           source_files=source_files(source, split),
                           untrained_reason="no assistant turn (only assistant turns are trained on, unless "
                           "train_on_input: true)")


@config_component
def text_dataset(
    tokenizer: Tokenizer,
    *,
    source: Sources,
    column: str = "text",
    max_seq_len: Optional[int] = None,
    packed: bool = False,
    split: str = "train",
) -> TokenizedDataset:
    """Plain documents, every token trained on.

    A ``.txt`` source is split into documents at blank lines; any other source takes each record's ``column``.
    Unpacked, a document longer than ``max_seq_len`` is truncated (the rest is not used). Packed, documents are
    split across rows, every row filled to the last token: a long document goes on in the next row, as a
    document of its own there (see ``packing.py``), and nothing is lost.

    Args:
        tokenizer: From :func:`load_tokenizer`.
        source: ``.txt``, ``.json``, ``.jsonl``, ``.parquet``, ``.csv`` or ``.arrow`` file, a folder, or a Hub
            dataset (``org/name``), or a list of them read one after the other (see ``sources.load_records``).
        column: Text column of the records (ignored for ``.txt``).
        max_seq_len: Truncation length, or with ``packed`` the row length (defaults to ``tokenizer.max_seq_len``;
            required when ``packed``).
        packed: Pack documents into rows of exactly ``max_seq_len``, split across rows.
        split: Split of a folder or Hub dataset.

    Returns:
        The tokenized dataset.

    Raises:
        UserError: for a bad file, record, column or ``max_seq_len``.
    """
    return build_dataset(prepare_text_dataset(tokenizer, source=source, column=column, max_seq_len=max_seq_len,
                                              packed=packed, split=split))


def prepare_text_dataset(tokenizer: Tokenizer, *, source: Sources, column: str, max_seq_len: Optional[int],
                         packed: bool, split: str) -> PreparedDataset:
    """:func:`text_dataset`'s records and encoding (its arguments, all given)."""
    max_seq_len = resolve_max_seq_len(max_seq_len, tokenizer, packed)
    records = load_records(source, suffixes=TEXT_SUFFIXES, split=split)
    text = TextColumns()

    def encode(record: Record) -> tuple[list[int], list[bool]]:
        document = record.value if isinstance(record.value, str) else text.read(record, column, "set column: <column>")
        tokens = tokenizer.encode(document, add_bos=True, add_eos=True)
        return tokens, [True] * len(tokens)

    return PreparedDataset(describe_source(source), records, encode, tokenizer.pad_id, max_seq_len, packed,
                           source_files=source_files(source, split), split_across_rows=True, unit="document",
                           truncation_note=TEXT_TRUNCATION, text_columns=text)


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


class TextColumns:
    """Reads the text columns of records; a number where text is expected is taken as its JSON text (data exported
    from a spreadsheet writes ``"output": 42``), counted, and said once in the dataset's report."""

    def __init__(self) -> None:
        self.numbers = 0
        self.first_number: Optional[str] = None  # where, and in which column

    def read(self, record: Record, column: str, fix: str, *, null_is_empty: bool = False) -> str:
        """The text in ``record``'s ``column``.

        Args:
            record: A JSON record.
            column: Column name in the file.
            fix: How to point the dataset at another column, appended to the missing-column error.
            null_is_empty: Read null as empty text (an optional column).

        Raises:
            UserError: if the column is missing (listing the record's columns), or neither text nor a number.
        """
        if column not in record.value:
            available = ", ".join(sorted(record.value)) or "none"
            raise UserError(f"{record.location}: missing column {column!r} (the record has: {available}); {fix}")
        value = record.value[column]
        if isinstance(value, str):
            return value
        if value is None and null_is_empty:
            return ""
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            self.numbers += 1
            self.first_number = self.first_number or f"{record.location}, column {column!r}"
            return json.dumps(value)
        raise UserError(f"{record.location}: column {column!r} must be a string, got {describe_json_type(value)}")

    def describe(self) -> Optional[str]:
        """The line saying numbers were read as text, or None."""
        if not self.numbers:
            return None
        return (f"{count_of(self.numbers, 'number')} where text was expected {'was' if self.numbers == 1 else 'were'} "
                f"read as text (the first at {self.first_number})")


def read_messages(record: Record, column: str, *, sharegpt: bool = False) -> list[dict[str, str]]:
    """The validated message list in ``record``'s ``column`` (``sharegpt``: ``from``/``value`` messages, returned
    as ``role``/``content``).

    A content given as a list of parts (OpenAI's ``[{"type": "text", "text": ...}, ...]``) is the text of its parts
    joined; a part of another type (an image) is refused.

    Raises:
        UserError: if the column is missing, not a non-empty array, or a message lacks a known role or text content.
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
        checked.append({"role": role, "content": read_content(content, where)})
    return checked


def read_content(content: Any, where: str) -> str:
    """A message's text: a string, or the text parts of a list of parts joined.

    Raises:
        UserError: neither, or a part that is not text.
    """
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise UserError(f"{where}: content must be a string or a list of text parts, got {describe_json_type(content)}")
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            found = f"type {kind!r}" if isinstance(part, dict) else describe_json_type(part)
            raise UserError(f"{where}: content[{index}]: only text parts ({{type: text, text: ...}}) can be trained "
                            f"on, got {found}")
        texts.append(part["text"])
    return "".join(texts)


def encode_chat_record(
    tokenizer: Tokenizer, messages: list[dict[str, str]], record: Record, train_on_input: bool
) -> tuple[list[int], list[bool]]:
    """``tokenizer.encode_chat`` with template errors prefixed by the record's location."""
    try:
        return tokenizer.encode_chat(messages, train_on_input=train_on_input)
    except UserError as e:
        raise UserError(f"{record.location}: {e}") from None


def describe_source(source: Sources) -> str:
    """The source as messages name it: the path or name, or a list's items joined with ``+``."""
    return source if isinstance(source, str) else " + ".join(source)


@dataclass(frozen=True)
class PreparedDataset:
    """A dataset as a builder prepares it, before anything is encoded: every record read and parsed, how one
    becomes ``(tokens, trainable)`` (raising a ``UserError`` naming it when it cannot), and how the samples are
    made from those.

    Attributes:
        source: the source, for messages.
        records: every record, in order.
        encode: one record's tokens and which are targets.
        pad_id: the tokenizer's padding id.
        max_seq_len: truncation length (row length when packed), or None.
        packed: pack the samples into rows of ``max_seq_len``.
        source_files: the local files the records were read from (``sources.source_files``; None for a Hub
            dataset): a checkpoint records what identifies them.
        split_across_rows: when packed, split samples at row ends rather than truncate them (plain text).
        unit: what a sample is called in the report (``document``).
        truncation_note: what truncation costs a sample, for the report.
        untrained_reason: what a record with no target at all lacks, for messages (``no assistant turn``).
        text_columns: what reading the text columns converted, for the report.
    """

    source: str
    records: list[Record]
    encode: Callable[[Record], tuple[list[int], list[bool]]]
    pad_id: int
    max_seq_len: Optional[int]
    packed: bool
    source_files: Optional[SourceFiles] = None
    split_across_rows: bool = False
    unit: str = "sample"
    truncation_note: str = RESPONSE_TRUNCATION
    untrained_reason: str = "nothing to train on"
    text_columns: Optional[TextColumns] = None

    def build(self) -> TokenizedDataset:
        return build_dataset(self)


def build_dataset(prepared: PreparedDataset) -> TokenizedDataset:
    """Encode every record, turn them into samples, drop the untrainable, and pack if asked.

    What truncation cost (samples cut, targets lost), what was dropped and what was read as text is counted, and
    kept as the dataset's ``report`` line for the start-up log. The dataset also keeps its ``source`` and the
    files it was read from (``source_files``: a checkpoint records what identifies them).

    Raises:
        UserError: a record that cannot be encoded (naming it), or no record with anything to train on (saying how
            many lack a target and how many lost every target to ``max_seq_len``).
    """
    split = prepared.packed and prepared.split_across_rows
    truncate_at = None if split else prepared.max_seq_len  # split samples keep every token
    report = DataReport(prepared.source, truncate_at, unit=prepared.unit, truncation_note=prepared.truncation_note)

    def iterate_samples() -> Iterator[dict[str, Any]]:
        for record in prepared.records:
            tokens, trainable = prepared.encode(record)
            if report.count(trainable) == 0:
                continue
            yield build_sample(tokens, trainable, max_seq_len=truncate_at)

    if prepared.packed:
        dataset = pack_samples(iterate_samples(), max_seq_len=prepared.max_seq_len, pad_id=prepared.pad_id,
                               split_across_rows=split)
    else:
        dataset = TokenizedDataset(("tokens", "labels"))
        for sample in iterate_samples():
            dataset.append(sample)
    if len(dataset) == 0:
        if report.records == 1:  # not "none of the 1 records"
            why = (f"it has {prepared.untrained_reason}" if report.untrained
                   else f"it lost every target to max_seq_len={prepared.max_seq_len} (raise it)")
            raise UserError(f"{prepared.source}: its only record has no token to train on: {why}")
        reasons = []
        if report.untrained:
            reasons.append(f"{report.untrained:,} {'has' if report.untrained == 1 else 'have'} "
                           f"{prepared.untrained_reason}")
        if report.cut_off:
            reasons.append(f"{report.cut_off:,} lost every target to max_seq_len={prepared.max_seq_len} (raise it)")
        raise UserError(f"{prepared.source}: none of the {count_of(report.records, 'record')} has a token to train "
                        "on: " + "; ".join(reasons))
    converted = prepared.text_columns.describe() if prepared.text_columns is not None else None
    dataset.report = report.describe(prepared.untrained_reason, extra=[converted] if converted else [])
    dataset.source, dataset.source_files = prepared.source, prepared.source_files
    return dataset


# tune validate encodes every record of a source up to this many, and an evenly spaced sample of this many beyond
# (0.6 s for instruction data, 3 s for chat data, on one busy core).
CHECKED_RECORDS = 5_000

# builder -> its preparer: what returns the records, ``encode`` and ``build()`` (a PreparedDataset, or another
# module's own kind of samples: ``preference.PreparedPairs``).
_PREPARERS: dict[Callable[..., Any], Callable[..., Any]] = {}


def register_preparer(builder: Callable[..., Any], prepare: Callable[..., Any]) -> None:
    """Let ``tune validate`` check ``builder``'s records (``check_dataset_records``): ``prepare`` takes the builder's
    arguments and returns what has ``source``, ``records``, ``encode(record)`` and ``build()``."""
    _PREPARERS[builder] = prepare


def check_dataset_records(builder: Callable[..., Any], tokenizer: Tokenizer, arguments: Mapping[str, Any],
                          max_seq_len: Optional[int], check_first: Optional[Callable[[Mapping[str, Any]], None]] = None
                          ) -> Optional[tuple[str, Optional[str], Optional[int]]]:
    """``tune validate``'s look at the data: every record read and parsed, and encoded, all of them up to
    :data:`CHECKED_RECORDS`, else an evenly spaced sample of that many (said so).

    Args:
        builder: the dataset component's function (``instruct_dataset``, ...).
        tokenizer: the run's tokenizer.
        arguments: the component's arguments from the config.
        max_seq_len: the run's ``max_seq_len`` (the recipe passes it to the builder).
        check_first: called on the first sample made (as a run checks its first sample against the model), where
            the builder makes samples as mappings.

    Returns:
        ``(summary, report, samples)``: what was checked, what building the samples would cut or drop (None when
        nothing), and how many samples (rows, when packed) they make (None when a sample of the records was
        encoded); or None for a builder that is not one of this module's (nothing is checked).

    Raises:
        UserError: the first record that cannot be read or encoded (naming its line, index or row).
        UnavailableError: the source is not on this machine.
    """
    prepare = _PREPARERS.get(builder)
    if prepare is None:
        return None
    bound = inspect.signature(builder).bind(tokenizer, **arguments, max_seq_len=max_seq_len)
    bound.apply_defaults()
    prepared = prepare(*bound.args, **bound.kwargs)
    total = len(prepared.records)
    if total <= CHECKED_RECORDS:
        dataset = prepared.build()
        if check_first is not None and len(dataset):
            check_first(dataset[0])
        return f"{prepared.source}: {count_of(total, 'record')} read and encoded, {describe_samples(dataset)}", \
            dataset.report, len(dataset)
    step = total / CHECKED_RECORDS
    first = None
    for index in range(CHECKED_RECORDS):
        encoded = prepared.encode(prepared.records[int(index * step)])
        first = encoded if first is None and isinstance(encoded, Mapping) else first
    if check_first is not None and first is not None:
        check_first(first)
    return (f"{prepared.source}: {count_of(total, 'record')} read; an evenly spaced sample of {CHECKED_RECORDS:,} "
            "encoded (the run encodes them all)"), None, None


for _builder, _prepare in ((instruct_dataset, prepare_instruct_dataset), (chat_dataset, prepare_chat_dataset),
                          (text_dataset, prepare_text_dataset)):
    register_preparer(_builder, _prepare)
