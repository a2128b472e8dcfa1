"""Preference pairs: exact tokens and masks for strings and message lists, column mapping, truncation that keeps
the prompt's end and the answers' start, one-line refusals naming the row, and batches of chosen-then-rejected rows."""

import pytest
import torch
from data_testlib import write_jsonl

from torchtune_ac.data import (
    IGNORE_INDEX,
    blank_preference_sample,
    build_dataloader,
    collate_preference_batch,
    preference_dataset,
)
from torchtune_ac.data.preference import EncodedPair, PreferenceReport, truncate_pair
from torchtune_ac.data.sampler import evaluation_batches
from torchtune_ac.errors import UserError

M = IGNORE_INDEX


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def test_string_pairs_mask_the_prompt_and_share_it(tmp_path, tokenizer):
    source = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "five"}])
    sample = preference_dataset(tokenizer, source=source)[0]
    prompt = [tokenizer.bos_id, *tokenizer.encode("What is 2 + 2?")]
    for name, text in (("chosen", "4"), ("rejected", "five")):
        answer = [*tokenizer.encode(text), tokenizer.eos_id]
        assert sample[f"{name}_tokens"] == prompt + answer
        # labels[i] targets tokens[i + 1]: from the prompt's last position on, the answer and its EOS.
        assert sample[f"{name}_labels"] == [M] * (len(prompt) - 1) + answer + [M]


def test_message_lists_take_the_shared_prefix_as_the_prompt(tmp_path, tokenizer):
    history = [user("hi"), assistant("hello"), user("add 1 and 2")]  # HH-style: earlier turns are prompt
    record = {"chosen": [*history, assistant("3")], "rejected": [*history, assistant("12")]}
    sample = preference_dataset(tokenizer, source=write_jsonl(tmp_path / "p.jsonl", [record]))[0]
    prompt_text = tokenizer.render_chat(history, add_generation_prompt=True)
    prompt = tokenizer.encode(prompt_text)
    assert prompt[0] == tokenizer.bos_id  # the template writes BOS; none is added
    for name, reply in (("chosen", "3"), ("rejected", "12")):
        answer = tokenizer.encode(tokenizer.render_chat([*history, assistant(reply)])[len(prompt_text):])
        answer.append(tokenizer.eos_id)
        assert tokenizer.decode(answer) == f"{reply}<|eot_id|><|end_of_text|>"
        assert sample[f"{name}_tokens"] == prompt + answer
        assert sample[f"{name}_labels"] == [M] * (len(prompt) - 1) + answer + [M]


def test_every_chat_form_gives_the_same_pair(tmp_path, tokenizer):
    hh = {"chosen": [user("q"), assistant("good")], "rejected": [user("q"), assistant("bad")]}
    explicit = {"prompt": [user("q")], "chosen": [assistant("good")], "rejected": [assistant("bad")]}
    # UltraFeedback-binarized: a prompt string beside message lists repeats the first user turn; it is not read.
    ultrafeedback = {"prompt": "q", **hh}
    sharegpt = {"chosen": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "good"}],
                "rejected": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "bad"}]}
    # Strings rendered as a user and an assistant turn (torchtune's stack_exchange_paired_dataset).
    strings = {"prompt": "q", "chosen": "good", "rejected": "bad"}
    expected = preference_dataset(tokenizer, source=write_jsonl(tmp_path / "hh.jsonl", [hh]))[0]
    for name, record, options in (("explicit", explicit, {}), ("uf", ultrafeedback, {}),
                                  ("sharegpt", sharegpt, {"conversation_style": "sharegpt"}),
                                  ("strings", strings, {"template": "chat"})):
        source = write_jsonl(tmp_path / f"{name}.jsonl", [record])
        assert preference_dataset(tokenizer, source=source, **options)[0] == expected, name


def test_column_map_renames_every_column(tmp_path, tokenizer):
    plain = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "p", "chosen": "yes", "rejected": "no"}])
    mapped = write_jsonl(tmp_path / "b.jsonl", [{"question": "p", "good": "yes", "bad": "no"}])
    ds = preference_dataset(tokenizer, source=mapped,
                            column_map={"prompt": "question", "chosen": "good", "rejected": "bad"})
    assert ds[0] == preference_dataset(tokenizer, source=plain)[0]
    # What a checkpoint identifies the data by (checkpoint/data_identity.py): its source and files.
    assert (ds.source, ds.source_files.root, ds.source_files.names) == (mapped, tmp_path, ("b.jsonl",))


def test_a_parquet_source_reads_like_jsonl(tmp_path, tokenizer):
    import datasets

    records = [{"prompt": "p", "chosen": "yes", "rejected": "no"}, {"prompt": "q", "chosen": "a", "rejected": "b"}]
    datasets.Dataset.from_list(records).to_parquet(str(tmp_path / "p.parquet"))
    from_parquet = preference_dataset(tokenizer, source=str(tmp_path / "p.parquet"))
    from_jsonl = preference_dataset(tokenizer, source=write_jsonl(tmp_path / "p.jsonl", records))
    assert [from_parquet[i] for i in range(2)] == [from_jsonl[i] for i in range(2)]


# prompt P = [BOS, p1 .. p7] (8 tokens), chosen C (6), rejected R (3).
P, C, R = [0, 11, 12, 13, 14, 15, 16, 17], [21, 22, 23, 24, 25, 26], [31, 32, 33]


@pytest.mark.parametrize(
    "max_seq_len, max_prompt_len, prompt, chosen, lost",
    [
        (14, 4, P, C, (0, 0)),  # 8 + 6 fits: nothing is cut
        (12, 4, [0, 13, 14, 15, 16, 17], C, (2, 0)),  # the prompt loses its start (BOS stays) until C fits
        (9, 4, [0, 15, 16, 17], C[:5], (4, 1)),  # the prompt down to max_prompt_len; then C loses its end
        (6, 2, [0, 17], C[:4], (6, 2)),
    ],
)
def test_truncation_keeps_the_prompts_end_and_the_answers_start(max_seq_len, max_prompt_len, prompt, chosen, lost):
    report = PreferenceReport("d", max_seq_len, max_prompt_len)
    pair = truncate_pair(EncodedPair(P, C, R), max_seq_len=max_seq_len, max_prompt_len=max_prompt_len,
                         report=report)
    assert (pair.prompt, pair.chosen, pair.rejected) == (prompt, chosen, R)
    assert (report.prompt_tokens_lost, report.answer_tokens_lost) == lost
    assert (report.prompts_cut, report.answers_cut) == (int(lost[0] > 0), int(lost[1] > 0))


def test_truncation_is_counted_and_said_once(tmp_path, tokenizer, caplog):
    long_prompt = " ".join(["apple"] * 40)
    records = [{"prompt": long_prompt, "chosen": "yes " * 20, "rejected": "no"},
               {"prompt": "short", "chosen": "a", "rejected": "b"}]
    ds = preference_dataset(tokenizer, source=write_jsonl(tmp_path / "p.jsonl", records), max_seq_len=32,
                            max_prompt_len=8)
    assert len(ds) == 2
    assert max(len(ds[0]["chosen_tokens"]), len(ds[0]["rejected_tokens"])) == 32
    assert ds[0]["chosen_tokens"][0] == tokenizer.bos_id
    # One of each: "1 of 2 pairs is", "1 answer lost its end" (were "are", "1 answers lost their end").
    assert ds.report.startswith(f"data {tmp_path / 'p.jsonl'}: 1 of 2 pairs is longer than max_seq_len=32 and had "
                                "its prompt's start cut")
    assert "; 1 answer lost its end to max_seq_len=32, " in ds.report
    with caplog.at_level("WARNING"):
        build_dataloader(ds, batch_size=1, pad_id=tokenizer.pad_id, collate=collate_preference_batch)
    assert [r.getMessage() for r in caplog.records] == [ds.report]


def test_a_number_where_text_is_expected_is_read_as_text_and_said(tmp_path, tokenizer):
    source = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "What is 2 + 2?", "chosen": 4, "rejected": 5}])
    ds = preference_dataset(tokenizer, source=source)
    assert ds[0] == preference_dataset(tokenizer, source=write_jsonl(
        tmp_path / "q.jsonl", [{"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "5"}]))[0]
    assert ds.report == f"data {source}: 2 numbers where text was expected were read as text (the first at " \
                        f"{source}:1, column 'chosen')"


def test_pairs_that_differ_only_past_max_seq_len_are_dropped_and_counted(tmp_path, tokenizer):
    records = [{"prompt": "p", "chosen": "same start, then yes", "rejected": "same start, then no"},
               {"prompt": "p", "chosen": "a", "rejected": "b"}]
    ds = preference_dataset(tokenizer, source=write_jsonl(tmp_path / "p.jsonl", records), max_seq_len=5,
                            max_prompt_len=2)
    assert len(ds) == 1 and ds.report.endswith("1 pair differs only past max_seq_len and was dropped")  # not "1 pairs"
    twice = preference_dataset(tokenizer, source=write_jsonl(tmp_path / "q.jsonl", [records[0], *records]),
                               max_seq_len=5, max_prompt_len=2)
    assert twice.report.endswith("2 pairs differ only past max_seq_len and were dropped")
    for source, lost in ((write_jsonl(tmp_path / "one.jsonl", records[:1]), "its only pair differs only past"),
                         (write_jsonl(tmp_path / "two.jsonl", records[:1] * 2),
                          "none of the 2 pairs is left: every one differs only past")):
        with pytest.raises(UserError) as refused:
            preference_dataset(tokenizer, source=source, max_seq_len=5, max_prompt_len=2)
        assert str(refused.value) == f"{source}: {lost} max_seq_len=5 (raise it)"


@pytest.mark.parametrize(
    "record, message",
    [
        ({"prompt": "p", "chosen": "x", "rejected": "x"}, "chosen and rejected are the same answer"),
        ({"prompt": "p", "chosen": "  ", "rejected": "x"}, "chosen answer ('chosen') is empty"),
        ({"prompt": "p", "chosen": "x"}, "missing column 'rejected' (the record has: chosen, prompt); map a column"),
        ({"chosen": "x", "rejected": "y"}, "missing column 'prompt'"),
        ({"prompt": "p", "chosen": True, "rejected": "y"}, "column 'chosen' must be a string, got boolean"),
        ({"chosen": [user("q"), assistant("a")], "rejected": [user("other q"), assistant("b")]},
         "chosen and rejected have different prompts (the messages before the answer differ at message 0"),
        ({"chosen": [user("q"), assistant("a")], "rejected": [user("q"), assistant("")]},
         "rejected answer (its last message) is empty"),
        ({"chosen": [user("q"), assistant("a")], "rejected": [user("q"), assistant("a")]},
         "chosen and rejected are the same answer"),
        ({"chosen": [user("q")], "rejected": [user("q"), assistant("b")]},
         "chosen must end with the assistant's answer, but its last message is a 'user' turn"),
        ({"chosen": [user("q"), assistant("a")], "rejected": "b"}, "column 'rejected' must be a message list"),
        ({"chosen": [assistant("a")], "rejected": [assistant("b")]},
         "chosen and rejected hold only the assistant's answer; a pair answers a prompt"),
    ],
)
def test_bad_records_are_refused_in_one_line_naming_the_row(tmp_path, tokenizer, record, message):
    good = {"prompt": "p", "chosen": "yes", "rejected": "no"}
    source = write_jsonl(tmp_path / "p.jsonl", [good, good, record])
    with pytest.raises(UserError) as caught:
        preference_dataset(tokenizer, source=source)
    text = str(caught.value)
    assert text.startswith(f"{source}:3: ") and message in text and "\n" not in text


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"column_map": {"answer": "x"}}, "column_map key 'answer' is not a column of this dataset"),
        ({"conversation_style": "chatml"}, "conversation_style='chatml': must be one of openai, sharegpt"),
        ({"template": "alpaca"}, "template='alpaca': must be one of plain, chat"),
        ({"max_seq_len": 16, "max_prompt_len": 16}, "max_prompt_len=16: must be below max_seq_len=16"),
        ({"max_prompt_len": 0}, "max_prompt_len=0: must be a positive integer"),
    ],
)
def test_bad_arguments_are_refused(tmp_path, tokenizer, kwargs, message):
    source = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "p", "chosen": "yes", "rejected": "no"}])
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        preference_dataset(tokenizer, source=source, **kwargs)


def test_a_batch_is_the_chosen_rows_then_the_rejected_rows(tmp_path, tokenizer):
    records = [{"prompt": "a prompt", "chosen": "long chosen answer", "rejected": "r"},
               {"prompt": "p", "chosen": "c", "rejected": "a longer rejected answer"}]
    ds = preference_dataset(tokenizer, source=write_jsonl(tmp_path / "p.jsonl", records))
    batch = collate_preference_batch([ds[0], ds[1]], pad_id=tokenizer.pad_id)
    rows = [ds[0]["chosen_tokens"], ds[1]["chosen_tokens"], ds[0]["rejected_tokens"], ds[1]["rejected_tokens"]]
    assert batch["tokens"].shape == (4, max(map(len, rows)))
    for row, tokens in enumerate(rows):
        assert batch["tokens"][row, :len(tokens)].tolist() == tokens
        assert (batch["tokens"][row, len(tokens):] == tokenizer.pad_id).all()
    assert int(batch["target_count"]) == int((batch["labels"] != M).sum())
    assert "reference_logps" not in batch

    ds.set_reference_logps(torch.tensor([[-1.5, -2.5], [-3.25, -4.0]], dtype=torch.float64))
    batch = collate_preference_batch([ds[0], ds[1]], pad_id=tokenizer.pad_id)
    assert batch["reference_logps"].tolist() == [-1.5, -3.25, -2.5, -4.0]  # chosen..., rejected...


def test_an_evaluation_pass_fills_its_last_batch_with_pairs_that_count_for_nothing(tmp_path, tokenizer):
    records = [{"prompt": f"p{i}", "chosen": "yes", "rejected": "no"} for i in range(3)]
    ds = preference_dataset(tokenizer, source=write_jsonl(tmp_path / "p.jsonl", records))
    batches = list(evaluation_batches(ds, batch_size=2, pad_id=tokenizer.pad_id, collate=collate_preference_batch,
                                      blank=blank_preference_sample))
    assert [b["tokens"].shape[0] for b in batches] == [4, 4]  # 2 pairs a batch: the last one's second a filler
    assert (batches[1]["labels"][[1, 3]] == M).all()  # the filler's chosen and rejected rows
    assert (batches[1]["labels"][[0, 2]] != M).any(dim=1).all()
    from torchtune_ac.training.dpo import answer_tokens, pair_mask

    assert pair_mask(answer_tokens(batches[1])).tolist() == [True, False]


def test_a_list_of_sources_reads_one_after_the_other(tmp_path, tokenizer):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "p", "chosen": "yes", "rejected": "no"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"}])
    both = preference_dataset(tokenizer, source=[a, b])
    assert [both[0], both[1]] == [preference_dataset(tokenizer, source=a)[0], preference_dataset(tokenizer, source=b)[0]]
    assert both.source == f"{a} + {b}" and both.source_files.names == ("a.jsonl", "b.jsonl")


def test_tune_validate_encodes_the_pairs_as_a_run_would(tmp_path, tokenizer):
    from torchtune_ac.data.datasets import check_dataset_records

    good = [{"prompt": f"p{i}", "chosen": "yes", "rejected": "no"} for i in range(3)]
    source = write_jsonl(tmp_path / "p.jsonl", good)
    summary, report, samples = check_dataset_records(preference_dataset, tokenizer, {"source": source}, 64)
    assert summary == f"{source}: 3 records read and encoded, 3 samples" and report is None and samples == 3
    bad = write_jsonl(tmp_path / "bad.jsonl", [*good, {"prompt": "p", "chosen": "x", "rejected": "x"}])
    with pytest.raises(UserError, match=f"^{bad}:4: chosen and rejected are the same answer"):
        check_dataset_records(preference_dataset, tokenizer, {"source": bad}, 64)
