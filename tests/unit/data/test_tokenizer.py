"""Tokenizer loading (special ids, errors), round trips, and chat rendering with assistant masks."""

import json
import shutil
from pathlib import Path

import pytest

from torchtune_ac.data import EMBEDDED_TOKENIZER_DIR, load_tokenizer
from torchtune_ac.errors import UnavailableError, UserError

EMBEDDED_JSON = Path(EMBEDDED_TOKENIZER_DIR) / "tokenizer.json"
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "And 4 + 4?"},
    {"role": "assistant", "content": "8"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(EMBEDDED_TOKENIZER_DIR)


def make_tokenizer_dir(tmp_path: Path, **files: object) -> Path:
    """A folder with the embedded tokenizer.json plus the given JSON (dict) or raw text (str) files."""
    shutil.copy(EMBEDDED_JSON, tmp_path / "tokenizer.json")
    for name, content in files.items():
        text = content if isinstance(content, str) else json.dumps(content)
        (tmp_path / name.replace("__", ".")).write_text(text)
    return tmp_path


def test_embedded_tokenizer_has_512_tokens_and_named_specials(tokenizer):
    assert tokenizer.vocab_size == 512
    assert tokenizer.decode([tokenizer.bos_id]) == "<|begin_of_text|>"
    assert tokenizer.decode([tokenizer.eos_id]) == "<|end_of_text|>"
    assert tokenizer.decode([tokenizer.pad_id]) == "<|pad|>"
    assert len({tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id}) == 3


@pytest.mark.parametrize(
    "text",
    [
        "What is 33 + 65?",
        "",
        "  leading and trailing spaces  ",
        "line one\n\nline two\ttabbed\r\n",
        "héllo wörld, naïve café",
        "日本語のテキスト and emoji 🙂🚀",
        "<|eot_id|> special text inside <|begin_of_text|>",
        "zzqxj 1234567890 !@#$%^&*()",
    ],
)
def test_decode_inverts_encode(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


@pytest.mark.parametrize(
    "add_bos, add_eos, first_is_bos, last_is_eos",
    [(False, False, False, False), (True, False, True, False), (False, True, False, True), (True, True, True, True)],
)
def test_encode_adds_specials_only_when_asked(tokenizer, add_bos, add_eos, first_is_bos, last_is_eos):
    plain = tokenizer.encode("Reverse the word")
    ids = tokenizer.encode("Reverse the word", add_bos=add_bos, add_eos=add_eos)
    assert (ids[0] == tokenizer.bos_id) is first_is_bos
    assert (ids[-1] == tokenizer.eos_id) is last_is_eos
    assert ids[int(add_bos) : len(ids) - int(add_eos)] == plain


def test_encode_ignores_post_processor_that_adds_bos(tmp_path):
    spec = json.loads(EMBEDDED_JSON.read_text())
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {
            "<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [0], "tokens": ["<|begin_of_text|>"]}
        },
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end_of_text|>"}))
    tok = load_tokenizer(str(tmp_path))
    assert tok.encode("abc") == load_tokenizer(EMBEDDED_TOKENIZER_DIR).encode("abc")
    assert tok.encode("abc")[0] != 0


@pytest.mark.parametrize(
    "files, expected",
    [
        # strings in tokenizer_config.json
        ({"tokenizer_config__json": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}}, (0, 5, 5)),
        # {"content": ...} form, pad given
        (
            {
                "tokenizer_config__json": {
                    "bos_token": {"content": "<|begin_of_text|>"},
                    "eos_token": {"content": "<|end_of_text|>"},
                    "pad_token": {"content": "<|pad|>"},
                }
            },
            (0, 1, 2),
        ),
        # special_tokens_map.json when tokenizer_config.json has none
        (
            {"special_tokens_map__json": {"bos_token": "<|start_header_id|>", "eos_token": "<|end_header_id|>"}},
            (3, 4, 4),
        ),
        # both name eos: special_tokens_map.json wins (as in transformers); bos only in tokenizer_config.json
        (
            {
                "tokenizer_config__json": {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"},
                "special_tokens_map__json": {"eos_token": "<|eot_id|>"},
            },
            (0, 5, 5),
        ),
        # ids from generation_config.json; an eos list takes its first id
        ({"generation_config__json": {"bos_token_id": 0, "eos_token_id": [5, 1]}}, (0, 5, 5)),
        # config.json only, and no bos at all
        ({"config__json": {"eos_token_id": 1, "pad_token_id": 2}}, (None, 1, 2)),
        # tokenizer_config.json wins over config.json; null entries fall through to the next source
        (
            {
                "tokenizer_config__json": {"eos_token": "<|eot_id|>", "bos_token": None},
                "config__json": {"bos_token_id": 3, "eos_token_id": 1},
            },
            (3, 5, 5),
        ),
    ],
)
def test_special_ids_come_from_the_first_file_that_names_them(tmp_path, files, expected):
    tok = load_tokenizer(str(make_tokenizer_dir(tmp_path, **files)))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == expected


def test_special_ids_agree_with_transformers_when_the_files_disagree(tmp_path):
    from transformers import AutoTokenizer

    folder = make_tokenizer_dir(
        tmp_path,
        tokenizer_config__json={
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|end_of_text|>",
            "pad_token": "<|pad|>",
        },
        special_tokens_map__json={"eos_token": {"content": "<|eot_id|>"}, "pad_token": "<|end_header_id|>"},
    )
    ours, theirs = load_tokenizer(str(folder)), AutoTokenizer.from_pretrained(str(folder))
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id)
    assert (ours.eos_id, ours.pad_id) == (5, 4)


def test_path_may_name_the_tokenizer_json_file(tmp_path):
    folder = make_tokenizer_dir(tmp_path, tokenizer_config__json={"eos_token": "<|eot_id|>"})
    assert load_tokenizer(str(folder / "tokenizer.json")).eos_id == 5


@pytest.mark.parametrize(
    "files, path_suffix, message",
    [
        ({}, "missing", "does not exist"),
        (
            {"tokenizer_config__json": '{"eos_token": "<|end_of_text|>",\n  "bos_token": }'},
            "",
            "tokenizer_config.json:2: invalid JSON",
        ),
        (
            {"tokenizer_config__json": {"eos_token": "<|nope|>"}},
            "",
            "eos_token '<|nope|>' is not a token of tokenizer.json",
        ),
        ({"config__json": {"eos_token_id": 9999}}, "", "eos_token_id=9999 must be an integer in [0, 512)"),
        ({}, "", "no end-of-text token found"),
        (
            {
                "tokenizer_config__json": {
                    "eos_token": "<|end_of_text|>",
                    "chat_template": [{"name": "tool_use", "template": "x"}],
                }
            },
            "",
            "no 'default' entry",
        ),
    ],
)
def test_load_errors_name_the_file_and_problem(tmp_path, files, path_suffix, message):
    folder = make_tokenizer_dir(tmp_path, **files)
    with pytest.raises(UserError, match=None) as info:
        load_tokenizer(str(folder / path_suffix) if path_suffix else str(folder))
    assert message in str(info.value)


def test_folder_without_tokenizer_json_lists_its_contents_and_says_how_to_convert(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UnavailableError) as info:  # no tokenizer here at all: tune validate warns
        load_tokenizer(str(tmp_path))
    assert str(info.value) == f"{tmp_path}: no tokenizer.json in this folder (it holds: config.json)"
    (tmp_path / "tokenizer.model").write_text("sentencepiece")
    with pytest.raises(UserError) as info:  # one in another format: an error for tune validate too
        load_tokenizer(str(tmp_path))
    assert not isinstance(info.value, UnavailableError)
    assert str(info.value) == (
        f"{tmp_path}: no tokenizer.json in this folder (it holds: config.json, tokenizer.model); only tokenizer.json "
        f"is read: convert tokenizer.model once with transformers: AutoTokenizer.from_pretrained('{tmp_path}')"
        f".save_pretrained('{tmp_path}') writes tokenizer.json (with the sentencepiece package), or download the "
        "model's tokenizer.json")


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"version": "1.0",\n"model": ', "tokenizer.json:2: invalid JSON"),
        ('{"model": {"type": "Nope"}}', "not a Hugging Face tokenizer.json"),
    ],
)
def test_broken_tokenizer_json_is_a_user_error(tmp_path, text, message):
    (tmp_path / "tokenizer.json").write_text(text)
    with pytest.raises(UserError) as info:
        load_tokenizer(str(tmp_path))
    assert message in str(info.value)


@pytest.mark.parametrize("max_seq_len", [0, -4])
def test_non_positive_max_seq_len_is_rejected(max_seq_len):
    with pytest.raises(UserError, match=f"max_seq_len={max_seq_len}"):
        load_tokenizer(EMBEDDED_TOKENIZER_DIR, max_seq_len=max_seq_len)


def trained_text(tokenizer, tokens, trainable):
    return tokenizer.decode([t for t, keep in zip(tokens, trainable) if keep])


def test_chat_trains_only_on_assistant_turns_with_their_end_markers(tokenizer):
    tokens, trainable = tokenizer.encode_chat(CONVERSATION, train_on_input=False)
    assert tokenizer.decode(tokens) == tokenizer.render_chat(CONVERSATION) + "<|end_of_text|>"
    assert tokens[0] == tokenizer.bos_id and tokens.count(tokenizer.bos_id) == 1
    assert trained_text(tokenizer, tokens, trainable) == "5<|eot_id|>8<|eot_id|><|end_of_text|>"


def test_chat_train_on_input_trains_every_token(tokenizer):
    tokens, trainable = tokenizer.encode_chat(CONVERSATION, train_on_input=True)
    assert all(trainable)
    assert tokens[-1] == tokenizer.eos_id


def test_chat_ending_with_user_turn_does_not_train_the_eos(tokenizer):
    tokens, trainable = tokenizer.encode_chat(CONVERSATION[:4], train_on_input=False)
    assert tokens[-1] == tokenizer.eos_id and trainable[-1] is False
    assert trained_text(tokenizer, tokens, trainable) == "5<|eot_id|>"


def no_template_dir(tmp_path: Path) -> Path:
    return make_tokenizer_dir(
        tmp_path, tokenizer_config__json={"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    )


def test_chat_without_a_chat_template_is_refused_not_given_a_fallback(tmp_path):
    """Many base models ship no template: rendering chat with an undocumented default trained silently on it."""
    tok = load_tokenizer(str(no_template_dir(tmp_path)))
    assert tok.chat_template is None
    with pytest.raises(UserError) as refused:
        tok.encode_chat(CONVERSATION[1:3], train_on_input=False)
    assert str(refused.value) == (
        f"tokenizer {tmp_path} has no chat template (no chat_template in tokenizer_config.json, no "
        "chat_template.jinja), and chat data needs one: set tokenizer.chat_template to a built-in template "
        "(chatml, llama3, plain) or a Jinja template"
    )


@pytest.mark.parametrize(
    "name, rendered, end_of_turn",
    [
        ("plain", "<|begin_of_text|>user: What is 2 + 3?\n\nassistant: 5\n\n", "\n\n"),
        ("chatml", "<|begin_of_text|><|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n5<|im_end|>\n",
         "<|im_end|>\n"),
        ("llama3", "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2 + 3?<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n5<|eot_id|>", "<|eot_id|>"),
    ],
)
def test_a_built_in_chat_template_named_in_the_config(tmp_path, name, rendered, end_of_turn):
    tok = load_tokenizer(str(no_template_dir(tmp_path)), chat_template=name)
    assert tok.render_chat(CONVERSATION[1:3]) == rendered
    # Prefix stable: both replies, with their end-of-turn marker, are the targets, and BOS is there once.
    tokens, trainable = tok.encode_chat(CONVERSATION, train_on_input=False)
    assert tokens.count(tok.bos_id) == 1 and tokens[0] == tok.bos_id
    assert trained_text(tok, tokens, trainable) == f"5{end_of_turn}8{end_of_turn}<|end_of_text|>"


def test_a_jinja_chat_template_in_the_config_replaces_the_tokenizers_own(tmp_path):
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    tok = load_tokenizer(EMBEDDED_TOKENIZER_DIR, chat_template=template)
    assert tok.chat_template == template
    assert tok.render_chat(CONVERSATION[1:3]) == "<user>What is 2 + 3?<assistant>5"


@pytest.mark.parametrize(
    "value, message",
    [
        ("chatm",
         r"chat_template='chatm': not a built-in template \(chatml, llama3, plain\) \(did you mean chatml\?\)"),
        ("{% for m in messages %}{{ m }}", r"not a valid Jinja template \(line 1: Unexpected end of template"),
    ],
)
def test_a_bad_chat_template_setting_is_one_line(value, message):
    with pytest.raises(UserError, match=message):
        load_tokenizer(EMBEDDED_TOKENIZER_DIR, chat_template=value)


def test_chat_template_jinja_wins_over_tokenizer_config_as_in_transformers(tmp_path):
    folder = make_tokenizer_dir(
        tmp_path,
        tokenizer_config__json={"eos_token": "<|end_of_text|>", "chat_template": "{{ 'from the config' }}"},
        chat_template__jinja="{{ 'from the file' }}",
    )
    assert load_tokenizer(str(folder)).render_chat(CONVERSATION[1:3]) == "from the file"


def test_chat_template_jinja_file_is_used(tmp_path):
    folder = make_tokenizer_dir(
        tmp_path,
        tokenizer_config__json={"eos_token": "<|end_of_text|>"},
        chat_template__jinja="{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}",
    )
    assert load_tokenizer(str(folder)).render_chat(CONVERSATION[1:3]) == "[user] What is 2 + 3?\n[assistant] 5\n"


def test_template_that_is_not_prefix_stable_is_reported(tmp_path):
    template = "{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m['content'] }} {% endfor %}"
    folder = make_tokenizer_dir(
        tmp_path, tokenizer_config__json={"eos_token": "<|end_of_text|>", "chat_template": template}
    )
    tok = load_tokenizer(str(folder))
    with pytest.raises(UserError, match="not prefix stable"):
        tok.encode_chat(CONVERSATION, train_on_input=False)
    assert tok.encode_chat(CONVERSATION, train_on_input=True)[1][-1] is True


def test_template_failure_names_its_source(tmp_path):
    template = "{{ raise_exception('roles must alternate') }}"
    folder = make_tokenizer_dir(
        tmp_path, tokenizer_config__json={"eos_token": "<|end_of_text|>", "chat_template": template}
    )
    with pytest.raises(UserError, match=r"tokenizer_config.json failed: roles must alternate"):
        load_tokenizer(str(folder)).render_chat(CONVERSATION)
