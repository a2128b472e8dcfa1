"""The committed embedded files are exactly what the generator script writes, and every answer is right."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from torchtune_ac.data import EMBEDDED_DIR, EMBEDDED_INSTRUCT_PATH

REPO = Path(__file__).resolve().parents[3]
FILES = ("instruct.jsonl", "preference/train.jsonl", "preference/validation.jsonl", "tokenizer.json",
         "tokenizer_config.json")


def test_generator_reproduces_the_committed_files_byte_for_byte(tmp_path):
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_embedded_data.py"), "--out-dir", str(tmp_path)],
        check=True,
        cwd=REPO,
        capture_output=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (Path(EMBEDDED_DIR) / name).read_bytes(), name


def numbers(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", text)]


def quoted(text: str) -> list[str]:
    return re.findall(r'"([^"]*)"', text)


def word_of(record: dict) -> str:
    return (quoted(record["instruction"]) or [record["input"]])[-1]


def next_letter(record: dict) -> str:
    letter = quoted(record["instruction"])[0]
    return chr(ord(letter) + (1 if "after" in record["instruction"] else -1))


def sort_answer(record: dict) -> str:
    descending = "largest to smallest" in record["instruction"]
    return ", ".join(map(str, sorted(numbers(record["input"]), reverse=descending)))


def subtract(a: int, b: int) -> int:
    return a - b


CHECKS = {
    "add": lambda r: str(sum(numbers(r["instruction"] + " " + r["input"]))),
    "subtract": lambda r: str(subtract(*numbers(r["instruction"] + " " + r["input"]))),
    "multiply": lambda r: str(numbers(r["instruction"])[0] * numbers(r["instruction"])[1]),
    "reverse": lambda r: word_of(r)[::-1],
    "length": lambda r: str(len(word_of(r))),
    "count_letter": lambda r: str(quoted(r["instruction"])[1].count(quoted(r["instruction"])[0])),
    "sort": sort_answer,
    "uppercase": lambda r: word_of(r).upper(),
    "next_letter": next_letter,
    "extreme": lambda r: str((max if "largest" in r["instruction"] else min)(numbers(r["input"]))),
    "parity": lambda r: "even" if numbers(r["instruction"])[0] % 2 == 0 else "odd",
    "first_last_letter": lambda r: word_of(r)[0] if "first" in r["instruction"] else word_of(r)[-1],
}


@pytest.fixture(scope="module")
def records():
    return [json.loads(line) for line in Path(EMBEDDED_INSTRUCT_PATH).read_text(encoding="ascii").splitlines()]


def test_embedded_dataset_is_small_ascii_and_covers_every_task(records):
    assert Path(EMBEDDED_INSTRUCT_PATH).stat().st_size < 500_000
    assert len(records) == 3000
    assert {r["task"] for r in records} == set(CHECKS)
    assert all(set(r) == {"instruction", "input", "output", "task"} for r in records)
    assert sum(r["input"] == "" for r in records) > 1000


def test_every_embedded_answer_is_correct(records):
    wrong = [r for r in records if CHECKS[r["task"]](r) != r["output"]]
    assert wrong == []
