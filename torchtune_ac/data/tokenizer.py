"""Load a Hugging Face ``tokenizer.json`` from local files and encode text and conversations for training.

Nothing here touches the network: the ``tokenizers`` library reads ``tokenizer.json``, and the special tokens
and chat template come from the JSON files next to it.

Chat rendering: the conversation is rendered to one string with the chat template (Hugging Face's Jinja
semantics, via ``transformers``): the config's ``chat_template`` (a built-in name or a Jinja template, see
``chat_templates.py``), else the tokenizer's own. A tokenizer with neither is refused for chat data, never given a
default. The conversation is tokenized as a whole, and each token is marked trainable when its characters
overlap an assistant turn. An assistant turn's characters are found by rendering the conversation up to the turn
with the generation prompt, then through the turn: the difference is the reply plus its end-of-turn marker. This
needs a template whose rendering of a prefix of a conversation is a prefix of the full rendering ("prefix
stable"), which holds for Llama 3 and most templates; others are reported as a ``UserError``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from tokenizers import Tokenizer as BackendTokenizer

from torchtune_ac.component_marker import config_component
from torchtune_ac.data.chat_templates import CHAT_TEMPLATES, resolve_chat_template_setting
from torchtune_ac.errors import UnavailableError, UserError

# In this order, as transformers reads them: special_tokens_map.json overrides tokenizer_config.json.
SPECIAL_TOKEN_FILES = ("special_tokens_map.json", "tokenizer_config.json")
SPECIAL_ID_FILES = ("generation_config.json", "config.json")
# A tokenizer's files in another format than tokenizer.json, which transformers converts (sentencepiece's, BPE's).
CONVERTIBLE_TOKENIZER_FILES = ("tokenizer.model", "tokenizer.model.v3", "spiece.model", "vocab.json", "vocab.txt")


class Tokenizer:
    """A byte-pair tokenizer with the special ids and chat template a training run needs.

    Build it with :func:`load_tokenizer`. ``encode`` never adds special tokens on its own, whatever
    post-processor ``tokenizer.json`` declares: callers say where BOS and EOS go.

    Attributes:
        bos_id: Beginning-of-text id, or None for tokenizers without one (then no BOS is prepended).
        eos_id: End-of-text id.
        pad_id: Padding id (the EOS id when the tokenizer defines no pad token).
        max_seq_len: Default truncation length for datasets built with this tokenizer, or None.
        path: The ``tokenizer.json`` file this was read from.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        path: Path,
        bos_id: Optional[int],
        eos_id: int,
        pad_id: int,
        special_tokens: dict[str, str],
        chat_template: Optional[str],
        chat_template_source: str,
        max_seq_len: Optional[int] = None,
    ) -> None:
        self._backend = backend
        self.path = path
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.max_seq_len = max_seq_len
        self._special_tokens = special_tokens
        self._chat_template = chat_template
        self._chat_template_source = chat_template_source
        self._renderer: Any = None

    @property
    def chat_template(self) -> Optional[str]:
        """The chat template conversations are rendered with, or None when there is none."""
        return self._chat_template

    def require_chat_template(self) -> str:
        """The chat template.

        Raises:
            UserError: there is none (naming the folder, the files looked at and how to name one).
        """
        if self._chat_template is None:
            raise UserError(
                f"tokenizer {self.path.parent} has no chat template (no chat_template in tokenizer_config.json, no "
                f"chat_template.jinja), and chat data needs one: set tokenizer.chat_template to a built-in template "
                f"({', '.join(CHAT_TEMPLATES)}) or a Jinja template"
            )
        return self._chat_template

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added special tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of ``text``, with BOS/EOS only where asked.

        Args:
            text: Any string (byte-level tokenizers encode any UTF-8).
            add_bos: Prepend the BOS id (no-op when the tokenizer has none).
            add_eos: Append the EOS id.

        Returns:
            The ids.
        """
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        if add_eos:
            ids = [*ids, self.eos_id]
        return ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; special tokens are written out unless ``skip_special_tokens``."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = False) -> str:
        """The conversation as the chat template writes it (before tokenization).

        Args:
            messages: ``{"role": ..., "content": ...}`` dicts.
            add_generation_prompt: End with the header that starts an assistant reply.

        Returns:
            The rendered string.

        Raises:
            UserError: there is no chat template, or it fails on these messages (naming where it came from).
        """
        from jinja2 import TemplateError

        template = self.require_chat_template()
        if self._renderer is None:
            self._renderer = self._build_renderer()
        try:
            return self._renderer.apply_chat_template(
                messages,
                chat_template=template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
        except TemplateError as e:
            raise UserError(f"chat template from {self._chat_template_source} failed: {e}") from None

    def encode_chat(
        self, messages: list[dict[str, str]], *, train_on_input: bool = False
    ) -> tuple[list[int], list[bool]]:
        """Tokenize a conversation and mark which tokens are training targets.

        The result starts with BOS (added unless the template wrote it) and ends with EOS (added unless the template
        wrote it; trainable when the conversation ends with an assistant turn).

        Args:
            messages: ``{"role": "system"|"user"|"assistant"|"tool", "content": str}`` dicts, already validated.
            train_on_input: Train on every token, not only assistant turns.

        Returns:
            ``(tokens, trainable)`` of equal length; ``trainable[i]`` says whether token ``i`` is a target.

        Raises:
            UserError: if the chat template fails, leaves out a tool message, or is not prefix stable (see the
                module docstring).
        """
        text = self.render_chat(messages)
        for message in messages:
            # A template written for system, user and assistant turns may skip any other role without a word.
            if message["role"] not in ("system", "user", "assistant") and message["content"] not in text:
                raise UserError(f"chat template from {self._chat_template_source} leaves out {message['role']} "
                                "messages (their content is missing from the rendering); use a template that renders "
                                f"them, or leave the {message['role']} messages out of the data")
        spans = [] if train_on_input else self._find_assistant_spans(messages, text)
        encoding = self._backend.encode(text, add_special_tokens=False)
        tokens = list(encoding.ids)
        # A token is a target when any of its characters lies in an assistant span.
        trainable = [
            train_on_input or any(start < span_end and end > span_start for span_start, span_end in spans)
            for start, end in encoding.offsets
        ]
        if self.bos_id is not None and (not tokens or tokens[0] != self.bos_id):
            tokens.insert(0, self.bos_id)
            trainable.insert(0, False)
        if not tokens or tokens[-1] != self.eos_id:
            tokens.append(self.eos_id)
            trainable.append(bool(trainable) and trainable[-1])
        return tokens, trainable

    def _find_assistant_spans(self, messages: list[dict[str, str]], text: str) -> list[tuple[int, int]]:
        """Character ranges ``[start, end)`` of ``text`` written for each assistant turn."""
        spans = []
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render_chat(messages[:index], add_generation_prompt=True)
            through = self.render_chat(messages[: index + 1])
            if not (through.startswith(before) and text.startswith(through)):
                raise UserError(
                    f"chat template from {self._chat_template_source} is not prefix stable (rendering the first "
                    f"{index + 1} messages is not a prefix of the whole conversation), so assistant turns cannot be "
                    "located for masking; set train_on_input: true or use another template"
                )
            spans.append((len(before), len(through)))
        return spans

    def _build_renderer(self) -> Any:
        """A transformers tokenizer used only to render templates with Hugging Face's Jinja environment."""
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(tokenizer_file=str(self.path), **self._special_tokens)


@config_component
def load_tokenizer(path: str, max_seq_len: Optional[int] = None, chat_template: Optional[str] = None) -> Tokenizer:
    """Load a tokenizer from a folder holding ``tokenizer.json`` (or from that file itself).

    Special tokens come from the first of these that names them: ``special_tokens_map.json`` and
    ``tokenizer_config.json`` (``bos_token``/``eos_token``/``pad_token``, a string or ``{"content": ...}``; the map
    wins where both name a token, as in transformers), then
    ``generation_config.json`` and ``config.json`` (``bos_token_id``/``eos_token_id``/``pad_token_id``; the first
    id of a list). The pad id falls back to the EOS id. The chat template is ``chat_template`` when given, else the
    folder's ``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template`` (transformers' order), else
    none: chat data is then refused (see ``Tokenizer.require_chat_template``).

    Args:
        path: Folder or ``tokenizer.json`` path. Sibling JSON files are read from the same folder.
        max_seq_len: Default truncation length for datasets built with this tokenizer.
        chat_template: A built-in template's name (``chatml``, ``llama3``, ``plain``; see ``chat_templates.py``) or
            a Jinja template; it replaces the tokenizer's own.

    Returns:
        The tokenizer.

    Raises:
        UnavailableError: the path, or the folder's tokenizer.json, does not exist.
        UserError: a folder with a tokenizer in another format only (``tokenizer.model``, ...: how to convert it),
            unreadable or invalid JSON, a special token not in the vocabulary, no EOS token anywhere,
            ``max_seq_len <= 0``, or a ``chat_template`` that is neither a built-in name nor valid Jinja.
    """
    if max_seq_len is not None and max_seq_len <= 0:
        raise UserError(f"tokenizer max_seq_len={max_seq_len}: must be a positive integer or null")
    setting = resolve_chat_template_setting(chat_template) if chat_template is not None else None
    location = Path(path).expanduser()
    if location.is_dir():
        folder, file = location, location / "tokenizer.json"
        if not file.is_file():
            names = sorted(p.name for p in folder.iterdir())
            message = f"{folder}: no tokenizer.json in this folder (it holds: {', '.join(names) or 'nothing'})"
            others = [name for name in names if name in CONVERTIBLE_TOKENIZER_FILES]
            if not others:  # nothing of a tokenizer here: not on this machine
                raise UnavailableError(message)
            raise UserError(f"{message}; only tokenizer.json is read: convert {others[0]} once with "
                            f"transformers: AutoTokenizer.from_pretrained('{folder}').save_pretrained('{folder}') "
                            "writes tokenizer.json" + (" (with the sentencepiece package)"
                                                       if others[0] == "tokenizer.model" else "")
                            + ", or download the model's tokenizer.json")
    elif location.is_file():
        folder, file = location.parent, location
    else:
        raise UnavailableError(f"tokenizer path {path} does not exist")

    text = read_text_file(file)
    parse_json_text(file, text)
    try:
        backend = BackendTokenizer.from_str(text)
    except Exception as e:  # the tokenizers library raises plain Exception for schema problems
        raise UserError(f"{file}: not a Hugging Face tokenizer.json ({e})") from None

    configs = {name: read_json_file(folder / name) for name in (*SPECIAL_TOKEN_FILES, *SPECIAL_ID_FILES)}
    tokens, ids = resolve_special_tokens(backend, folder, configs)
    if ids["eos"] is None:
        raise UserError(
            f"{folder}: no end-of-text token found (looked for eos_token in {', '.join(SPECIAL_TOKEN_FILES)} "
            f"and eos_token_id in {', '.join(SPECIAL_ID_FILES)})"
        )
    template, template_source = setting or resolve_chat_template(folder, configs["tokenizer_config.json"])
    return Tokenizer(
        backend,
        path=file,
        bos_id=ids["bos"],
        eos_id=ids["eos"],
        pad_id=ids["pad"] if ids["pad"] is not None else ids["eos"],
        special_tokens={f"{name}_token": token for name, token in tokens.items()},
        chat_template=template,
        chat_template_source=template_source,
        max_seq_len=max_seq_len,
    )


def read_text_file(path: Path) -> str:
    """The UTF-8 text of ``path``, with a ``UserError`` naming the file when it cannot be read."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read as UTF-8 text ({e})") from None


def parse_json_text(path: Path, text: str) -> Any:
    """``json.loads`` with a ``UserError`` naming the file, line and column on failure."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno})") from None


def read_json_file(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``, or ``{}`` when the file does not exist.

    Raises:
        UserError: if the file is not valid JSON or not a JSON object.
    """
    if not path.is_file():
        return {}
    value = parse_json_text(path, read_text_file(path))
    if not isinstance(value, dict):
        raise UserError(f"{path}: expected a JSON object at the top level")
    return value


def resolve_special_tokens(
    backend: BackendTokenizer, folder: Path, configs: dict[str, dict[str, Any]]
) -> tuple[dict[str, str], dict[str, Optional[int]]]:
    """Find the bos/eos/pad tokens and ids; see :func:`load_tokenizer` for the order of sources.

    Returns:
        ``(tokens, ids)``: token strings by name (only those found) and ids by name (None when not found).

    Raises:
        UserError: if a named token is not in the vocabulary, or an id is not an integer in range.
    """
    tokens: dict[str, str] = {}
    ids: dict[str, Optional[int]] = {}
    vocab_size = backend.get_vocab_size(with_added_tokens=True)
    for name in ("bos", "eos", "pad"):
        ids[name] = None
        for file_name in SPECIAL_TOKEN_FILES:
            entry = configs[file_name].get(f"{name}_token")
            token = entry.get("content") if isinstance(entry, dict) else entry
            if token is None:
                continue
            token_id = backend.token_to_id(token) if isinstance(token, str) else None
            if token_id is None:
                raise UserError(f"{folder / file_name}: {name}_token {token!r} is not a token of tokenizer.json")
            tokens[name], ids[name] = token, token_id
            break
        if ids[name] is not None:
            continue
        for file_name in SPECIAL_ID_FILES:
            value = configs[file_name].get(f"{name}_token_id")
            if isinstance(value, list):
                value = value[0] if value else None
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < vocab_size:
                raise UserError(
                    f"{folder / file_name}: {name}_token_id={value!r} must be an integer in [0, {vocab_size})"
                )
            ids[name] = value
            tokens[name] = backend.id_to_token(value)
            break
    return tokens, ids


def resolve_chat_template(folder: Path, tokenizer_config: dict[str, Any]) -> tuple[Optional[str], str]:
    """The tokenizer's own chat template (None when it has none) and a description of where it came from.

    A ``chat_template.jinja`` file wins over ``tokenizer_config.json``'s ``chat_template``, as in transformers.
    ``chat_template`` may be a string or Hugging Face's list of ``{"name", "template"}`` (the ``default`` one is
    used).

    Raises:
        UserError: if ``chat_template`` has another shape or a list without a ``default`` entry.
    """
    jinja_path = folder / "chat_template.jinja"
    if jinja_path.is_file():
        return read_text_file(jinja_path), str(jinja_path)
    config_path = folder / "tokenizer_config.json"
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if not isinstance(named.get("default"), str):
            raise UserError(
                f"{config_path}: chat_template list has no 'default' entry (has: {sorted(map(str, named))})"
            )
        return named["default"], str(config_path)
    if isinstance(template, str):
        return template, str(config_path)
    if template is not None:
        raise UserError(f"{config_path}: chat_template must be a string or a list of named templates")
    return None, "nowhere"
