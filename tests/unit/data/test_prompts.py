"""GRPO's prompts (``prompt_dataset``): GSM8K's layout read with ``prompt_column: question`` (its ``answer`` a column
the math reward checks), plain and chat prompts tokenized as the template says (a system turn added), columns kept
only where every record has them, prompts past ``max_seq_len`` dropped and counted, and bad records refused in one
line naming the row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchtune_ac.data.prompts import collate_prompts, prompt_dataset
from torchtune_ac.errors import UserError
from torchtune_ac.training.rewards import math_answer

GSM8K = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A box holds 12 eggs. How many in 100 boxes?", "answer": "12 * 100 = 1,200\n#### 1,200"},
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_gsm8k_layout_gives_prompts_and_the_answer_column(tokenizer, tmp_path: Path) -> None:
    data = prompt_dataset(tokenizer, source=str(write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K)),
                          prompt_column="question")
    assert len(data) == 2 and data.columns == ("answer",)
    assert data[1] == {"prompt": tokenizer.encode(GSM8K[1]["question"], add_bos=True), "index": 1}
    answers = data.columns_of([1, 0])["answer"]
    assert answers == [GSM8K[1]["answer"], GSM8K[0]["answer"]]
    # The answer after ####, thousands separators and all, is what the math reward checks against.
    completions = ["so 1200 eggs", "it is 8", "7", "1,300"]
    assert math_answer(completions, [*answers, answers[1], answers[0]]) == [1.0, 0.0, 1.0, 0.0]


def test_chat_prompts_end_with_the_assistants_header_and_get_the_system_turn(tokenizer, tmp_path: Path) -> None:
    rows = [{"prompt": "2+2=", "answer": "4"},
            {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3+3="}],
             "answer": "6"}]
    data = prompt_dataset(tokenizer, source=str(write_jsonl(tmp_path / "chat.jsonl", rows)), template="chat",
                          system_prompt="Think.")
    first = tokenizer.render_chat([{"role": "system", "content": "Think."}, {"role": "user", "content": "2+2="}],
                                  add_generation_prompt=True)
    second = tokenizer.render_chat(rows[1]["prompt"], add_generation_prompt=True)  # its own system turn kept
    assert [data[i]["prompt"] for i in range(2)] == [tokenizer.encode(first), tokenizer.encode(second)]
    assert data[0]["prompt"].count(tokenizer.bos_id) == 1


def test_columns_are_those_every_record_has_and_long_prompts_are_dropped(tokenizer, tmp_path: Path) -> None:
    rows = [{"prompt": "1+1=", "answer": "2", "level": 1}, {"prompt": "2+1=", "answer": "3"},
            {"prompt": "1+1+1+1+1+1+1+1+1=", "answer": "9", "level": 3}]
    data = prompt_dataset(tokenizer, source=str(write_jsonl(tmp_path / "p.jsonl", rows)), max_seq_len=8)
    assert len(data) == 2 and data.columns == ("answer",)
    assert "1 prompt of 3 longer than 8 tokens" in data.report
    batch = collate_prompts([data[1], data[0]], pad_id=tokenizer.pad_id)
    assert batch["tokens"].shape == (2, 5) and batch["prompt_lengths"].tolist() == [5, 5]
    assert batch["index"].tolist() == [1, 0]


@pytest.mark.parametrize("rows, overrides, message", [
    ([{"question": "q", "answer": "1"}], {}, ":1: no 'prompt' column (prompt_column names the prompt; GSM8K has "
     "prompt_column: question)"),
    ([{"prompt": [{"role": "user", "content": "q"}]}], {}, "the prompt must be a string with template: plain"),
    ([{"prompt": "1+1+1+1+1+1="}], {"max_seq_len": 3}, "no prompt fits in 3 tokens"),
    ([{"prompt": "q"}], {"template": "raw"}, "template='raw': expected one of plain, chat"),
])
def test_bad_prompts_are_refused_in_one_line(rows, overrides, message, tokenizer, tmp_path: Path) -> None:
    with pytest.raises(UserError) as refused:
        prompt_dataset(tokenizer, source=str(write_jsonl(tmp_path / "bad.jsonl", rows)), **overrides)
    assert message in str(refused.value) and "\n" not in str(refused.value)
