"""Instruct, chat and text datasets: exact tokens and label masks, column mapping, truncation, and user errors."""

import json

import pytest
from data_testlib import write_jsonl

from torchtune_ac.data import (
    EMBEDDED_TOKENIZER_DIR,
    IGNORE_INDEX,
    build_dataloader,
    chat_dataset,
    format_alpaca_prompt,
    instruct_dataset,
    load_tokenizer,
    text_dataset,
)
from torchtune_ac.errors import UserError

M = IGNORE_INDEX


@pytest.mark.parametrize(
    "record, prompt",
    [
        ({"instruction": "Reverse the word.", "input": "apple", "output": "elppa"}, "### Input:\napple\n\n"),
        ({"instruction": "What is 2 + 2?", "input": "", "output": "4"}, None),
        ({"instruction": "What is 2 + 2?", "output": "4"}, None),  # no input column at all
    ],
)
def test_instruct_alpaca_masks_the_prompt_exactly(tmp_path, tokenizer, record, prompt):
    ds = instruct_dataset(tokenizer, source=write_jsonl(tmp_path / "d.jsonl", [record]))
    prompt_text = format_alpaca_prompt(record["instruction"], record.get("input", ""))
    assert ("### Input:" in prompt_text) is (prompt is not None)
    prompt_ids = tokenizer.encode(prompt_text)
    response_ids = tokenizer.encode(record["output"])
    sample = ds[0]
    assert sample["tokens"] == [tokenizer.bos_id, *prompt_ids, *response_ids, tokenizer.eos_id]
    # labels[i] targets tokens[i + 1]: the prompt is never a target; the response and EOS are; EOS predicts nothing.
    assert sample["labels"] == [M] * len(prompt_ids) + response_ids + [tokenizer.eos_id, M]


def test_instruct_train_on_input_targets_every_next_token(tmp_path, tokenizer):
    source = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "Add.", "input": "1, 2", "output": "3"}])
    sample = instruct_dataset(tokenizer, source=source, train_on_input=True)[0]
    assert sample["labels"] == sample["tokens"][1:] + [M]


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_byte_order_mark_is_not_part_of_the_first_record(tmp_path, tokenizer, suffix):
    record = {"instruction": "Add.", "input": "1, 2", "output": "3"}
    text = json.dumps(record) + "\n" if suffix == ".jsonl" else json.dumps([record])
    (tmp_path / f"bom{suffix}").write_bytes(b"\xef\xbb\xbf" + text.encode())
    (tmp_path / f"plain{suffix}").write_text(text)
    with_bom = instruct_dataset(tokenizer, source=str(tmp_path / f"bom{suffix}"))
    assert with_bom[0] == instruct_dataset(tokenizer, source=str(tmp_path / f"plain{suffix}"))[0]


def test_instruct_reads_json_array_and_column_map(tmp_path, tokenizer):
    records = [{"prompt": "Sort.", "context": "3, 1", "answer": "1, 3"}]
    (tmp_path / "d.json").write_text(json.dumps(records, indent=2))
    mapped = instruct_dataset(
        tokenizer,
        source=str(tmp_path / "d.json"),
        column_map={"instruction": "prompt", "input": "context", "output": "answer"},
    )
    plain = instruct_dataset(
        tokenizer,
        source=write_jsonl(tmp_path / "p.jsonl", [{"instruction": "Sort.", "input": "3, 1", "output": "1, 3"}]),
    )
    assert mapped[0] == plain[0]


def test_instruct_chat_template_trains_only_the_reply(tmp_path, tokenizer):
    source = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "Reverse.", "input": "cat", "output": "tac"}])
    sample = instruct_dataset(tokenizer, source=source, template="chat")[0]
    text = tokenizer.decode(sample["tokens"])
    assert "<|start_header_id|>user<|end_header_id|>\n\nReverse.\n\ncat<|eot_id|>" in text
    targets = tokenizer.decode([label for label in sample["labels"] if label != M])
    assert targets == "tac<|eot_id|><|end_of_text|>"


def test_truncation_keeps_bos_and_the_real_next_token_label(tmp_path, tokenizer):
    source = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "Say it.", "output": "a long answer that will be cut"}])
    full = instruct_dataset(tokenizer, source=source)[0]
    n = len(full["tokens"]) - 3
    cut = instruct_dataset(tokenizer, source=source, max_seq_len=n)[0]
    assert cut["tokens"] == full["tokens"][:n] and cut["tokens"][0] == tokenizer.bos_id
    assert cut["labels"] == full["labels"][:n]
    assert cut["labels"][-1] == full["tokens"][n]  # target beyond the cut, from the same document
    assert cut["tokens"][-1] != tokenizer.eos_id


def test_tokenizer_max_seq_len_is_the_default(tmp_path):
    tok = load_tokenizer(EMBEDDED_TOKENIZER_DIR, max_seq_len=12)
    source = write_jsonl(tmp_path / "d.jsonl", [{"text": "word " * 50}])
    assert len(text_dataset(tok, source=source)[0]["tokens"]) == 12
    assert len(text_dataset(tok, source=source, max_seq_len=20)[0]["tokens"]) == 20


def test_records_with_nothing_to_train_are_dropped(tmp_path, tokenizer):
    short = {"instruction": "x", "output": "y"}
    long = {"instruction": "A much longer instruction " * 5, "output": "z"}
    source = write_jsonl(tmp_path / "d.jsonl", [short, long, short])
    limit = len(instruct_dataset(tokenizer, source=source)[0]["tokens"])
    ds = instruct_dataset(tokenizer, source=source, max_seq_len=limit)
    assert len(ds) == 2
    # Was "1 records lost ... and were dropped", and "none of the 1 records has".
    assert ds.report.endswith(f"1 of 3 samples is longer than max_seq_len={limit} and was truncated, losing 2 of 6 "
                              "target tokens (a truncated response is trained without its end and EOS); 1 record lost "
                              "every target to truncation and was dropped")
    with pytest.raises(UserError, match=r"e.jsonl: its only record has no token to train on: it lost every target to "
                                        r"max_seq_len=5 \(raise it\)$"):
        instruct_dataset(tokenizer, source=write_jsonl(tmp_path / "e.jsonl", [long]), max_seq_len=5)


def test_truncation_is_counted_once_with_the_targets_it_lost(tmp_path, tokenizer):
    """Over-long samples used to be cut silently: responses without their end and EOS, and no count."""
    records = [{"instruction": "Say it.", "output": "word " * n} for n in (1, 30, 2, 40)]
    source = write_jsonl(tmp_path / "d.jsonl", records)
    full = instruct_dataset(tokenizer, source=source)
    assert full.report is None  # nothing cut, nothing to say
    limit = len(full[2]["tokens"]) + 1  # the two short samples fit, the long ones keep part of their responses
    targets = [sum(label != M for label in sample["labels"]) for sample in full]
    kept = [sum(label != M for label in sample["labels"][:limit]) for sample in full]
    cut = [len(sample["tokens"]) > limit for sample in full]
    assert cut == [False, True, False, True]  # the test's premise
    ds = instruct_dataset(tokenizer, source=source, max_seq_len=limit)
    assert ds.report == (
        f"data {source}: 2 of 4 samples are longer than max_seq_len={limit} and were truncated, losing "
        f"{sum(targets) - sum(kept)} of {sum(targets)} target tokens (a truncated response is trained without its "
        "end and EOS)"
    )
    assert sum(sum(label != M for label in sample["labels"]) for sample in ds) == sum(kept)


def test_the_dataloader_reports_once_on_rank_zero(tmp_path, tokenizer, caplog):
    records = [{"instruction": "Say it.", "output": "word " * n} for n in (1, 30, 1, 30)]
    source = write_jsonl(tmp_path / "d.jsonl", records)
    short = len(instruct_dataset(tokenizer, source=source)[0]["tokens"])
    ds = instruct_dataset(tokenizer, source=source, max_seq_len=short)
    for rank in range(2):
        build_dataloader(ds, batch_size=1, pad_id=0, rank=rank, world_size=2)
    assert [r.getMessage() for r in caplog.records] == [ds.report]
    caplog.clear()
    # Tensor parallelism: the ranks of the first group all read data rank 0's share; only the run's rank 0 says it.
    for announce in (True, False):
        build_dataloader(ds, batch_size=1, pad_id=0, rank=0, world_size=1, announce=announce)
    assert [r.getMessage() for r in caplog.records] == [ds.report]


CHAT = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris"},
    {"role": "user", "content": "Of Italy?"},
    {"role": "assistant", "content": "Rome"},
]


@pytest.mark.parametrize(
    "train_on_input, expected_targets",
    [(False, "Paris<|eot_id|>Rome<|eot_id|><|end_of_text|>"), (True, None)],
)
def test_chat_dataset_masks(tmp_path, tokenizer, train_on_input, expected_targets):
    source = write_jsonl(tmp_path / "c.jsonl", [{"conv": CHAT}])
    sample = chat_dataset(tokenizer, source=source, conversation_column="conv", train_on_input=train_on_input)[0]
    assert sample["tokens"][0] == tokenizer.bos_id and sample["tokens"][-1] == tokenizer.eos_id
    if expected_targets is None:
        assert sample["labels"] == sample["tokens"][1:] + [M]
    else:
        assert tokenizer.decode([label for label in sample["labels"] if label != M]) == expected_targets
        # each kept label is the next token at its position
        assert all(label in (M, nxt) for label, nxt in zip(sample["labels"], sample["tokens"][1:]))


def test_text_dataset_splits_txt_at_blank_lines_and_trains_everything(tmp_path, tokenizer):
    (tmp_path / "t.txt").write_text("first doc\nstill first\n\n\n  \nsecond doc\n")
    ds = text_dataset(tokenizer, source=str(tmp_path / "t.txt"))
    assert len(ds) == 2
    for index, text in enumerate(["first doc\nstill first", "second doc"]):
        tokens = tokenizer.encode(text, add_bos=True, add_eos=True)
        assert ds[index] == {"tokens": tokens, "labels": tokens[1:] + [M]}


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_text_dataset_reads_a_json_column(tmp_path, tokenizer, suffix):
    records = [{"body": "hello there"}, {"body": "general"}]
    path = tmp_path / f"t{suffix}"
    path.write_text(json.dumps(records) if suffix == ".json" else "".join(json.dumps(r) + "\n" for r in records))
    ds = text_dataset(tokenizer, source=str(path), column="body")
    assert [tokenizer.decode(ds[i]["tokens"]) for i in range(2)] == [
        "<|begin_of_text|>hello there<|end_of_text|>",
        "<|begin_of_text|>general<|end_of_text|>",
    ]


def test_packed_dataset_has_fixed_length_rows(tmp_path, tokenizer):
    ds = instruct_dataset(tokenizer, packed=True, max_seq_len=128)
    assert len(ds) > 0 and all(len(ds[i]["tokens"]) == 128 for i in range(0, len(ds), 50))
    assert set(ds[0]) == {"tokens", "labels", "document_ids"}


GOOD = {"instruction": "i", "input": "", "output": "o"}


@pytest.mark.parametrize(
    "file_name, content, kwargs, message",
    [
        ("missing.jsonl", None, {}, "dataset source {dir}/missing.jsonl does not exist"),
        (
            "d.xlsx",
            "a,b\n",
            {},
            "{dir}/d.xlsx: unsupported extension '.xlsx'; this dataset reads .json, .jsonl, .parquet, .csv, .arrow files",
        ),
        (
            "d.jsonl",
            '{"instruction": "i", "output": "o"}\n{"instruction": \n',
            {},
            "{dir}/d.jsonl:2: invalid JSON: Expecting value",
        ),
        (
            "d.json",
            '[\n {"instruction": "i",\n  "output" "o"}]',
            {},
            "{dir}/d.json:3: invalid JSON: Expecting ':' delimiter",
        ),
        (
            "d.jsonl",
            '{"instruction": "i", "output": "o"}\n\n["a list"]\n',
            {},
            "{dir}/d.jsonl:3: each line must be a JSON object, got array",
        ),
        (
            "d.json",
            '[{"instruction": "i", "output": "o"}, "text"]',
            {},
            "{dir}/d.json[1]: each record must be a JSON object, got string",
        ),
        ("d.json", '{"instruction": "i"}', {}, "{dir}/d.json: must hold a JSON array of objects, got object"),
        (
            "d.jsonl",
            '{"instruction": "i", "output": "o"}\n{"instruction": "i", "answer": "o"}\n',
            {},
            "{dir}/d.jsonl:2: missing column 'output' (the record has: answer, instruction); "
            "map a column of the file to it with column_map: {output: <column>}",
        ),
        (
            "d.jsonl",
            '{"instruction": "i", "output": "o"}\n',
            {"column_map": {"input": "context"}},
            "{dir}/d.jsonl:1: missing column 'context' (the record has: instruction, output)",
        ),
        (
            "d.jsonl",
            '{"instruction": "i", "output": [42]}\n',
            {},
            "{dir}/d.jsonl:1: column 'output' must be a string, got array",
        ),
        ("d.jsonl", "\n\n", {}, "{dir}/d.jsonl: the file holds no records"),
        ("d.jsonl", json.dumps(GOOD), {"max_seq_len": 0}, "max_seq_len=0: must be a positive integer"),
        ("d.jsonl", json.dumps(GOOD), {"packed": True}, "packed=true needs max_seq_len"),
        ("d.jsonl", json.dumps(GOOD), {"template": "vicuna"}, "template='vicuna': must be one of alpaca, chat"),
        (
            "d.jsonl",
            json.dumps(GOOD),
            {"column_map": {"prompt": "x"}},
            "column_map key 'prompt' is not a column of this dataset",
        ),
        ("d.txt", "text", {}, "{dir}/d.txt: unsupported extension '.txt'"),
    ],
)
def test_instruct_errors(tmp_path, tokenizer, file_name, content, kwargs, message):
    path = tmp_path / file_name
    if content is not None:
        path.write_text(content)
    with pytest.raises(UserError) as info:
        instruct_dataset(tokenizer, source=str(path), **kwargs)
    assert message.replace("{dir}", str(tmp_path)) in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "record, message",
    [
        ({"chat": CHAT}, "{dir}/c.jsonl:1: missing column 'messages' (the record has: chat); set conversation_column"),
        (
            {"messages": []},
            "{dir}/c.jsonl:1: column 'messages' must be a non-empty array of messages, got an empty array",
        ),
        ({"messages": "hi"}, "column 'messages' must be a non-empty array of messages, got string"),
        (
            {"messages": [{"role": "bot", "content": "x"}]},
            "{dir}/c.jsonl:1: messages[0]: role 'bot' must be one of system, user, assistant, tool",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant"}]},
            "messages[1]: content must be a string or a list of text parts, got null",
        ),
        ({"messages": ["hi"]}, "messages[0]: each message must be an object, got string"),
    ],
)
def test_chat_errors(tmp_path, tokenizer, record, message):
    source = write_jsonl(tmp_path / "c.jsonl", [record])
    with pytest.raises(UserError) as info:
        chat_dataset(tokenizer, source=source)
    assert message.replace("{dir}", str(tmp_path)) in str(info.value)


def test_chat_without_assistant_turn_says_so_not_max_seq_len(tmp_path, tokenizer):
    source = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT[:2]}, {"messages": CHAT[:1]}])
    with pytest.raises(UserError) as refused:
        chat_dataset(tokenizer, source=source, max_seq_len=256)
    assert str(refused.value) == (f"{source}: none of the 2 records has a token to train on: 2 have no assistant turn "
                                  "(only assistant turns are trained on, unless train_on_input: true)")


def test_text_errors_name_the_column(tmp_path, tokenizer):
    source = write_jsonl(tmp_path / "t.jsonl", [{"text": "ok"}, {"content": "no"}])
    with pytest.raises(UserError, match=r"t.jsonl:2: missing column 'text' \(the record has: content\); set column"):
        text_dataset(tokenizer, source=source)


def test_real_world_instruct_data_is_read(tmp_path, tokenizer):
    """Each was refused: ``input: null``, a number as the output, a .jsonl.gz file, and a list of sources."""
    import gzip

    plain = [{"instruction": "Add 2 and 2.", "output": "4"}, {"instruction": "Say hi.", "input": "", "output": "hi"}]
    written = [{"instruction": "Add 2 and 2.", "input": None, "output": 4}, {"instruction": "Say hi.", "input": "",
                                                                             "output": "hi"}]
    expected = instruct_dataset(tokenizer, source=write_jsonl(tmp_path / "plain.jsonl", plain))
    real = instruct_dataset(tokenizer, source=write_jsonl(tmp_path / "real.jsonl", written))
    assert list(real) == list(expected)
    assert real.report == (f"data {tmp_path}/real.jsonl: 1 number where text was expected was read as text (the "
                           f"first at {tmp_path}/real.jsonl:1, column 'output')")
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress((tmp_path / "plain.jsonl").read_bytes()))
    assert list(instruct_dataset(tokenizer, source=str(tmp_path / "d.jsonl.gz"))) == list(expected)
    both = instruct_dataset(tokenizer, source=[str(tmp_path / "plain.jsonl"), str(tmp_path / "d.jsonl.gz")])
    assert list(both) == list(expected) * 2


def test_real_world_chat_data_is_read(tmp_path, tokenizer):
    """OpenAI's content parts, the tool role, and ShareGPT rows written with user/assistant were refused."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "Capital of "}, {"type": "text", "text": "France?"}]},
             {"role": "tool", "content": "lookup: Paris"},
             {"role": "assistant", "content": "Paris"}]
    joined = [{"role": "user", "content": "Capital of France?"}, parts[1], parts[2]]
    ds = chat_dataset(tokenizer, source=write_jsonl(tmp_path / "c.jsonl", [{"messages": parts}]))
    assert ds[0] == chat_dataset(tokenizer, source=write_jsonl(tmp_path / "j.jsonl", [{"messages": joined}]))[0]
    tokens, trainable = tokenizer.encode_chat(joined)
    assert "lookup: Paris" in tokenizer.decode(tokens)  # the tool's answer is in the context...
    targets = tokenizer.decode([t for t, on in zip(tokens, trainable) if on])
    assert "lookup" not in targets and "Paris" in targets  # ...and only the assistant's is trained on
    sharegpt = [{"from": "user", "value": "Capital of France?"}, {"from": "assistant", "value": "Paris"}]
    human_gpt = [{"from": "human", "value": "Capital of France?"}, {"from": "gpt", "value": "Paris"}]
    read = [chat_dataset(tokenizer, source=write_jsonl(tmp_path / f"{name}.jsonl", [{"conversations": rows}]),
                         conversation_style="sharegpt", conversation_column="conversations")[0]
            for name, rows in (("user", sharegpt), ("human", human_gpt))]
    assert read[0] == read[1]


@pytest.mark.parametrize(
    "messages, message",
    [
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
          {"role": "assistant", "content": "ok"}],
         "c.jsonl:1: messages[0]: content[0]: only text parts ({type: text, text: ...}) can be trained on, got type "
         "'image_url'"),
        ([{"role": "user", "content": "q"}, {"role": "tool", "content": "the answer"},
          {"role": "assistant", "content": "ok"}],
         "c.jsonl:1: chat template from the config's chat_template leaves out tool messages (their content is missing "
         "from the rendering); use a template that renders them, or leave the tool messages out of the data"),
    ],
)
def test_chat_data_a_template_cannot_render_is_one_line(tmp_path, messages, message):
    # A template written for user and assistant turns only, which skips the others without a word.
    template = ("{% for m in messages %}{% if m['role'] in ['user', 'assistant'] %}{{ m['role'] + ': ' + m['content'] "
                "+ '\\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    tokenizer = load_tokenizer(EMBEDDED_TOKENIZER_DIR, chat_template=template)
    with pytest.raises(UserError) as info:
        chat_dataset(tokenizer, source=write_jsonl(tmp_path / "c.jsonl", [{"messages": messages}]))
    assert str(info.value) == f"{tmp_path}/{message}"


@pytest.mark.parametrize(
    "source, message",
    [
        ([], "dataset source=[]: must be a file, folder or Hub dataset, or a non-empty list of them"),
        # Was "{dir}/l.jsonl: not UTF-8 text (invalid continuation byte at byte 36)".
        ("l.jsonl", "{dir}/l.jsonl:2: not UTF-8 text: byte 0xe9 at column 20 (invalid continuation byte); the file "
                    "must be UTF-8 encoded: convert it, for example with iconv -f LATIN1 -t UTF-8"),
        ("z.jsonl.gz", "{dir}/z.jsonl.gz: not a gzip file, or cut short"),
    ],
)
def test_source_errors(tmp_path, tokenizer, source, message):
    (tmp_path / "l.jsonl").write_bytes(b'{"instruction": "i", "output": "o"}\n'
                                       + '{"instruction":"caf\xe9", "output": "o"}\n'.encode("latin-1"))
    (tmp_path / "z.jsonl.gz").write_text('{"instruction": "i", "output": "o"}\n')
    with pytest.raises(UserError) as info:
        instruct_dataset(tokenizer, source=str(tmp_path / source) if source else source)
    assert str(info.value).startswith(message.replace("{dir}", str(tmp_path)))


def test_validate_encodes_a_stated_sample_of_a_large_source(tmp_path, tokenizer, monkeypatch):
    from torchtune_ac.data import datasets

    monkeypatch.setattr(datasets, "CHECKED_RECORDS", 10)
    records = [{"instruction": f"Say {i}.", "output": str(i)} for i in range(25)]
    source = write_jsonl(tmp_path / "d.jsonl", records)
    assert datasets.check_dataset_records(instruct_dataset, tokenizer, {"source": source}, None) == (
        f"{source}: 25 records read; an evenly spaced sample of 10 encoded (the run encodes them all)", None, None)
    # Every 2.5th record is encoded: the 13th (index 12) is, the 14th is not.
    for index, caught in ((12, True), (13, False)):
        bad = [dict(r, output=["x"]) if i == index else r for i, r in enumerate(records)]
        source = write_jsonl(tmp_path / f"bad{index}.jsonl", bad)
        if caught:
            with pytest.raises(UserError, match=rf"bad12.jsonl:13: column 'output' must be a string, got array$"):
                datasets.check_dataset_records(instruct_dataset, tokenizer, {"source": source}, None)
        else:
            assert datasets.check_dataset_records(instruct_dataset, tokenizer, {"source": source}, None) is not None
    assert datasets.check_dataset_records(len, tokenizer, {}, None) is None  # not a builder of this module's
