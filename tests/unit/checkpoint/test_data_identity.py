"""What a checkpoint records of its data, and what a resume finds changed: each file by its size and content (not
its path), and the sample count."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from torchtune_ac.checkpoint import describe_data_change, identify_data


def _identity(root: Path, contents: dict[str, bytes], samples: int = 10) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    for name, content in contents.items():
        (root / name).write_bytes(content)
    return identify_data(str(root), root, list(contents), samples)


def test_each_file_is_recorded_by_size_and_sha256_in_reading_order(tmp_path):
    identity = _identity(tmp_path / "data", {"b.jsonl": b"{}\n", "a.jsonl": b'{"x": 1}\n'}, samples=2)
    assert identity == {
        "source": str(tmp_path / "data"), "root": str(tmp_path / "data"), "samples": 2,
        "files": [{"name": "b.jsonl", "bytes": 3, "sha256": hashlib.sha256(b"{}\n").hexdigest()},
                  {"name": "a.jsonl", "bytes": 9, "sha256": hashlib.sha256(b'{"x": 1}\n').hexdigest()}],
    }


def _short(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()[:12]


SAVED = {"a.jsonl": b"one\ntwo\nthree\n", "b.jsonl": b"four\n"}
CUT, OTHER = b"one\n", b"five\n"
CASES = {
    "the_same_files_elsewhere": ("moved", SAVED, 10, []),
    "a_file_cut_short": ("data", {**SAVED, "a.jsonl": CUT}, 4, [
        f"{{root}}/a.jsonl: 14 bytes (sha256 {_short(SAVED['a.jsonl'])}) in step_0000003, 4 bytes (sha256 "
        f"{_short(CUT)}) now",
        "10 samples in step_0000003, 4 now"]),
    "a_file_replaced_by_as_many_other_records": ("data", {**SAVED, "b.jsonl": OTHER}, 10, [
        f"{{root}}/b.jsonl: 5 bytes (sha256 {_short(SAVED['b.jsonl'])}) in step_0000003, 5 bytes (sha256 "
        f"{_short(OTHER)}) now"]),
    "a_file_added": ("data", {**SAVED, "c.jsonl": b"six\n"}, 11, [
        "{root}/c.jsonl is new", "10 samples in step_0000003, 11 now"]),
    "a_file_gone": ("data", {"a.jsonl": SAVED["a.jsonl"]}, 9, ["b.jsonl is gone", "10 samples in step_0000003, 9 now"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_change_is_named_by_the_file_as_it_is_now(tmp_path, name):
    folder, contents, samples, expected = CASES[name]
    saved = _identity(tmp_path / "saved", SAVED)
    current = _identity(tmp_path / folder, contents, samples)
    root = tmp_path / folder
    assert describe_data_change(saved, current, "step_0000003") == [e.format(root=root) for e in expected]


def test_a_hub_dataset_is_its_name_and_sample_count():
    saved = identify_data("tatsu-lab/alpaca", None, None, 52002)
    assert saved == {"source": "tatsu-lab/alpaca", "root": None, "files": None, "samples": 52002}
    assert describe_data_change(saved, saved, "step_0000003") == []
    other = identify_data("yahma/alpaca-cleaned", None, None, 51760)
    assert describe_data_change(saved, other, "step_0000003") == [
        "the source was tatsu-lab/alpaca in step_0000003, yahma/alpaca-cleaned now",
        "52,002 samples in step_0000003, 51,760 now"]


def test_the_hub_datasets_of_a_list_of_sources_are_recorded_by_name_beside_its_files(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    (root / "a.jsonl").write_bytes(SAVED["a.jsonl"])
    saved = identify_data("a + tatsu-lab/alpaca", root, ["a.jsonl"], 7, hub=["tatsu-lab/alpaca"])
    assert saved["hub"] == ["tatsu-lab/alpaca"] and [f["name"] for f in saved["files"]] == ["a.jsonl"]
    assert describe_data_change(saved, saved, "step_0000003") == []
    other = identify_data("a + yahma/alpaca-cleaned", root, ["a.jsonl"], 7,
                          hub=["yahma/alpaca-cleaned"])
    assert describe_data_change(saved, other, "step_0000003") == [
        "the Hub datasets were tatsu-lab/alpaca in step_0000003, yahma/alpaca-cleaned now"]
    files_only = identify_data("a", root, ["a.jsonl"], 7)
    assert "hub" not in files_only  # what a checkpoint records of local files alone is unchanged
    assert describe_data_change(saved, files_only, "step_0000003") == [
        "the Hub datasets were tatsu-lab/alpaca in step_0000003, none now"]
