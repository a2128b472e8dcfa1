"""Sources read through Hugging Face ``datasets``: every format gives the same samples as the JSONL file,
records name their row or line, nothing is written next to the data, and a Hub name offline is one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

datasets = pytest.importorskip("datasets")

from torchtune_ac.data import EMBEDDED_TOKENIZER_DIR, chat_dataset, instruct_dataset, load_tokenizer, text_dataset  # noqa: E402
from torchtune_ac.data.sources import SourceFiles, check_folder_formats, load_records, source_files  # noqa: E402
from torchtune_ac.errors import UserError  # noqa: E402

ROWS = [
    {"instruction": f"Say {word} twice.", "input": "" if i % 2 else "loud", "output": f"{word} {word}"}
    for i, word in enumerate(["red", "green", "blue", "gold", "grey"])
]
CHATS = [
    {"messages": [{"role": "user", "content": f"Name {n}."}, {"role": "assistant", "content": f"It is {n}."}]}
    for n in ("one", "two", "three")
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(EMBEDDED_TOKENIZER_DIR)


def write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_source(folder: Path, kind: str, rows: list) -> str:
    """``rows`` written as one kind of source under ``folder``; returns what to put in ``source:``."""
    ds = datasets.Dataset.from_list(rows)
    if kind == "parquet":
        ds.to_parquet(str(folder / "d.parquet"))
        return str(folder / "d.parquet")
    if kind == "csv":
        ds.to_csv(str(folder / "d.csv"), index=False)
        return str(folder / "d.csv")
    if kind == "arrow":
        ds.save_to_disk(str(folder / "saved"))  # one .arrow file inside
        (arrow,) = (folder / "saved").glob("*.arrow")
        return str(arrow)
    if kind == "save_to_disk":
        ds.save_to_disk(str(folder / "saved"))
        return str(folder / "saved")
    if kind == "dataset_dict":
        datasets.DatasetDict(train=ds, test=ds.select([0])).save_to_disk(str(folder / "saved_dict"))
        return str(folder / "saved_dict")
    if kind == "parquet_folder":
        (folder / "files").mkdir()
        ds.to_parquet(str(folder / "files" / "train-00000-of-00001.parquet"))
        return str(folder / "files")
    raise AssertionError(kind)


def snapshot(folder: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime for p in folder.rglob("*")}


FORMATS = ["parquet", "csv", "arrow", "save_to_disk", "dataset_dict", "parquet_folder"]


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("packed", [False, True])
def test_instruct_samples_equal_the_jsonl_ones(tmp_path, tokenizer, kind, packed):
    expected = instruct_dataset(tokenizer, source=write_jsonl(tmp_path / "d.jsonl", ROWS), packed=packed,
                                max_seq_len=64)
    source = write_source(tmp_path, kind, ROWS)
    before = snapshot(tmp_path)
    got = instruct_dataset(tokenizer, source=source, packed=packed, max_seq_len=64)
    assert [got[i] for i in range(len(got))] == [expected[i] for i in range(len(expected))]
    assert snapshot(tmp_path) == before  # read in place: no cache or lock file next to the data


@pytest.mark.parametrize("kind", ["parquet", "save_to_disk"])
def test_chat_and_text_from_parquet_and_saved(tmp_path, tokenizer, kind):
    chat_expected = chat_dataset(tokenizer, source=write_jsonl(tmp_path / "c.jsonl", CHATS))
    chat_dir = tmp_path / "chat"
    chat_dir.mkdir()
    got = chat_dataset(tokenizer, source=write_source(chat_dir, kind, CHATS))
    assert [got[i] for i in range(len(got))] == [chat_expected[i] for i in range(len(chat_expected))]

    texts = [{"text": "first document"}, {"text": "second one"}]
    text_expected = text_dataset(tokenizer, source=write_jsonl(tmp_path / "t.jsonl", texts))
    text_dir = tmp_path / "text"
    text_dir.mkdir()
    got = text_dataset(tokenizer, source=write_source(text_dir, kind, texts))
    assert [got[i] for i in range(len(got))] == [text_expected[i] for i in range(len(text_expected))]


def test_sharegpt_messages_equal_openai_ones(tmp_path, tokenizer):
    roles = {"user": "human", "assistant": "gpt"}
    sharegpt = [{"conversations": [{"from": roles[m["role"]], "value": m["content"]} for m in c["messages"]]}
                for c in CHATS]
    openai = chat_dataset(tokenizer, source=write_jsonl(tmp_path / "o.jsonl", CHATS))
    got = chat_dataset(tokenizer, source=write_jsonl(tmp_path / "s.jsonl", sharegpt),
                       conversation_column="conversations", conversation_style="sharegpt")
    assert [got[i] for i in range(len(got))] == [openai[i] for i in range(len(openai))]


def test_instruct_column_map_input_null_reads_no_input_column(tmp_path, tokenizer):
    # torchtune's instruct_dataset layout: the prompt is in `input`.
    rows = [{"input": r["instruction"], "output": r["output"]} for r in ROWS]
    plain = [{"instruction": r["instruction"], "output": r["output"]} for r in ROWS]
    expected = instruct_dataset(tokenizer, source=write_jsonl(tmp_path / "p.jsonl", plain))
    got = instruct_dataset(tokenizer, source=write_jsonl(tmp_path / "t.jsonl", rows),
                           column_map={"instruction": "input", "input": None})
    assert [got[i] for i in range(len(got))] == [expected[i] for i in range(len(expected))]


def test_dataset_dict_split_is_chosen(tmp_path):
    source = write_source(tmp_path, "dataset_dict", ROWS)
    records = load_records(source, split="test")
    assert [r.value for r in records] == [ROWS[0]]
    assert records[0].location == f"{source} [test] row 0"


@pytest.mark.parametrize(
    "kind, location",
    [
        ("parquet", "{dir}/d.parquet row 3"),
        ("csv", "{dir}/d.csv:5"),  # header on line 1: row 3 is line 5
        ("save_to_disk", "{dir}/saved row 3"),
        ("parquet_folder", "{dir}/files [train] row 3"),
    ],
)
def test_records_name_their_row(tmp_path, kind, location):
    records = load_records(write_source(tmp_path, kind, ROWS))
    assert [r.value for r in records] == ROWS
    assert records[3].location == location.replace("{dir}", str(tmp_path))


def test_errors_name_the_row(tmp_path, tokenizer):
    rows = [dict(r) for r in ROWS]
    rows[3]["output"] = None
    source = write_source(tmp_path, "parquet", rows)
    with pytest.raises(UserError) as info:
        instruct_dataset(tokenizer, source=source)
    assert str(info.value) == f"{source} row 3: column 'output' must be a string, got null"


def test_csv_cells_are_strings_and_empty_cells_empty(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text('instruction,input,output\n"Add 2, 3",,5\n007,x,"two\nlines"\n')
    records = load_records(str(path))
    assert [r.value for r in records] == [
        {"instruction": "Add 2, 3", "input": "", "output": "5"},
        {"instruction": "007", "input": "x", "output": "two\nlines"},
    ]
    # A field spans lines, so line numbers would lie: rows are named instead.
    assert [r.location for r in records] == [f"{path} row 0", f"{path} row 1"]


def test_json_file_holding_json_lines(tmp_path):
    path = tmp_path / "d.json"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:2]))
    assert [(r.location, r.value) for r in load_records(str(path))] == [(f"{path}:1", ROWS[0]), (f"{path}:2", ROWS[1])]


@pytest.mark.parametrize(
    "setup, split, message",
    [
        (lambda d: write_source(d, "dataset_dict", ROWS), "validation",
         "no split 'validation' (the saved dataset has: train, test); set split"),
        (lambda d: write_source(d, "parquet", ROWS), "test", "split='test': {dir}/d.parquet is a single file"),
        (lambda d: write_source(d, "save_to_disk", ROWS), "test", "the folder holds one saved dataset"),
        (lambda d: str(d), "train", "the folder holds no data files"),
        (lambda d: (d / "bad.parquet").write_bytes(b"not parquet") and str(d / "bad.parquet"), "train",
         "{dir}/bad.parquet: cannot read it as parquet"),
        (lambda d: (d / "e.csv").write_text("a,b\n") and str(d / "e.csv"), "train", "holds no records"),
    ],
)
def test_source_errors_are_one_line(tmp_path, setup, split, message):
    source = setup(tmp_path)
    with pytest.raises(UserError) as info:
        load_records(source, split=split)
    assert message.replace("{dir}", str(tmp_path)) in str(info.value)
    assert "\n" not in str(info.value)


def test_a_folder_of_data_files_in_two_formats_is_refused_naming_the_files_left_out(tmp_path):
    """``datasets`` read such a folder in one format only: 3,000 JSONL records were dropped for 100 in Parquet."""
    folder = tmp_path / "data"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", ROWS)
    write_jsonl(folder / "c.jsonl", ROWS)
    datasets.Dataset.from_list(ROWS[:2]).to_parquet(str(folder / "b.parquet"))
    (folder / "README.md").write_text("# a dataset card is no data file\n")
    message = (f"dataset source {folder}: holds data files in 2 formats (2 json, 1 parquet), and a folder is read in "
               "one format only: the 2 json file(s) would be read and b.parquet left out; keep one format in the "
               "folder (convert the others), or point source at one file")
    for check in (lambda: load_records(str(folder)), lambda: check_folder_formats(str(folder))):
        with pytest.raises(UserError) as info:
            check()
        assert str(info.value) == message
    (folder / "b.parquet").unlink()
    check_folder_formats(str(folder))  # JSON Lines only: read whole
    assert [r.value for r in load_records(str(folder))] == ROWS + ROWS
    assert source_files(str(folder)) == SourceFiles(folder, ("a.jsonl", "c.jsonl"))


@pytest.mark.parametrize("kind", ["parquet", "save_to_disk", "dataset_dict", "parquet_folder"])
def test_source_files_are_the_files_a_source_is_read_from(tmp_path, kind):
    source = Path(write_source(tmp_path, kind, ROWS))
    files = source_files(str(source), split="train")
    if kind == "parquet":
        assert files == SourceFiles(tmp_path, ("d.parquet",))
    elif kind == "parquet_folder":
        assert files == SourceFiles(source, ("train-00000-of-00001.parquet",))
    else:  # every file of the saved dataset (of its train split's folder for a DatasetDict)
        expected = source / "train" if kind == "dataset_dict" else source
        assert files.root == source and {n for n in files.names if n.endswith(".arrow")}
        assert sorted(files.names) == sorted(p.relative_to(source).as_posix() for p in expected.rglob("*")
                                             if p.is_file())
    assert source_files("tatsu-lab/alpaca") is None  # a Hub dataset: its files are the cache's


def run_child(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def read_hub_in_child(name: str, cache: Path, **env: str) -> subprocess.CompletedProcess:
    """``load_records(name)`` in a child process (the Hub settings are read at import) with ``cache`` as the
    datasets cache: prints the records, or the UserError's message."""
    code = (
        "from torchtune_ac.data.sources import load_records\n"
        "from torchtune_ac.errors import UserError\n"
        f"try:\n    print([r.value for r in load_records({name!r})])\nexcept UserError as e:\n    print(e)\n"
    )
    base = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    return run_child(code, {**base, "HF_DATASETS_CACHE": str(cache), **env})


# A Hub that refuses connections at once: what "no network" looks like to the HTTP client, on any machine.
UNREACHABLE = {"HF_ENDPOINT": "http://127.0.0.1:9"}


def test_hub_name_offline_is_one_line_and_writes_nothing_in_home(tmp_path):
    """In a child process with HF_HUB_OFFLINE=1 and HOME pointing at an empty folder."""
    home = tmp_path / "home"
    home.mkdir()
    result = read_hub_in_child("tatsu-lab/alpaca", tmp_path / "cache", HOME=str(home), HF_HUB_OFFLINE="1")
    assert result.stdout.strip() == (
        f"dataset source tatsu-lab/alpaca: not a local file or folder, and not in the datasets cache "
        f"({tmp_path / 'cache'}) while HF_HUB_OFFLINE is set; download it first (the cache is then read offline too) "
        "or point source at local files"
    ), result.stderr
    assert list(home.iterdir()) == []


def test_hub_name_without_network_fails_at_once_without_retries(tmp_path):
    """Reported: 30 s and 22 duplicated retry lines before the one-line error."""
    result = read_hub_in_child("tatsu-lab/alpaca", tmp_path / "cache", **UNREACHABLE)
    assert result.stdout.strip().startswith(
        f"dataset source tatsu-lab/alpaca: not a local file or folder, not in the datasets cache ({tmp_path / 'cache'}),"
        " and the Hugging Face Hub cannot be reached (http://127.0.0.1:9: "), result.stdout
    assert "Retrying" not in result.stderr and "127.0.0.1" not in result.stderr, result.stderr


def cache_as_hub_dataset(cache: Path, name: str, rows: list, tmp_path: Path) -> None:
    """Put ``rows`` into ``cache`` where ``datasets`` keeps a downloaded Hub dataset ``name`` (org/short)."""
    datasets.load_dataset("json", data_files=write_jsonl(tmp_path / "rows.jsonl", rows), split="train",
                          cache_dir=str(cache))
    built = next(p for p in cache.glob("json/*/*/*") if p.is_dir())
    org, short = name.split("/")
    copy = cache / f"{org}___{short}" / "default" / "0.0.0" / built.name
    copy.mkdir(parents=True)
    (copy / "dataset_info.json").write_bytes((built / "dataset_info.json").read_bytes())
    (copy / f"{short}-train.arrow").write_bytes((built / "json-train.arrow").read_bytes())


def test_a_cached_hub_dataset_is_read_without_network_and_without_retries(tmp_path):
    cache = tmp_path / "cache"
    cache_as_hub_dataset(cache, "someorg/tiny_set", ROWS, tmp_path)
    result = read_hub_in_child("someorg/tiny_set", cache, **UNREACHABLE)
    assert result.stdout.strip() == repr(ROWS), result.stdout + result.stderr
    assert "Retrying" not in result.stderr, result.stderr


def test_validate_says_what_a_run_will_do_with_a_hub_dataset(tmp_path, monkeypatch):
    from torchtune_ac.data.hf_sources import describe_hub_source

    cache = tmp_path / "cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    assert describe_hub_source("someorg/tiny_set") == (
        f"someorg/tiny_set: a Hugging Face Hub dataset, not in the datasets cache ({cache}); downloaded when the run "
        "starts", None)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    assert describe_hub_source("someorg/tiny_set")[1] == (
        "dataset source someorg/tiny_set: HF_HUB_OFFLINE is set and the dataset is not in the datasets cache: the run "
        "will stop")
    cache_as_hub_dataset(cache, "someorg/tiny_set", ROWS, tmp_path)
    summary, warning = describe_hub_source("someorg/tiny_set")
    assert summary.startswith(f"someorg/tiny_set: a Hugging Face Hub dataset, in the datasets cache ({cache}")
    assert summary.endswith("HF_HUB_OFFLINE is set: the run reads the cache only") and warning is None


def test_a_csv_that_is_not_utf8_names_its_line(tmp_path, tokenizer):
    path = tmp_path / "d.csv"
    path.write_bytes(b"instruction,output\nx,y\n" + "caf\xe9,q\n".encode("latin-1"))
    with pytest.raises(UserError) as info:
        instruct_dataset(tokenizer, source=str(path))
    assert str(info.value) == (f"{path}:3: not UTF-8 text: byte 0xe9 at column 4 (invalid continuation byte); the "
                               "file must be UTF-8 encoded: convert it, for example with iconv -f LATIN1 -t UTF-8")


def test_source_files_of_a_list_are_every_item_s_files_in_reading_order(tmp_path):
    """A list of sources (a file, a compressed file, a folder, a Hub dataset): the identity a checkpoint records
    must cover each of them, relative to the folder that holds them all."""
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    a = write_jsonl(tmp_path / "x" / "a.jsonl", ROWS)
    (tmp_path / "y" / "b.jsonl.gz").write_bytes(b"not read here")
    folder = write_source(tmp_path / "y", "parquet_folder", ROWS)
    source = [folder, "tatsu-lab/alpaca", str(tmp_path / "y" / "b.jsonl.gz"), a]
    assert source_files(source) == SourceFiles(
        tmp_path, ("y/files/train-00000-of-00001.parquet", "y/b.jsonl.gz", "x/a.jsonl"), hub=("tatsu-lab/alpaca",))
    assert source_files([a]) == SourceFiles(tmp_path / "x", ("a.jsonl",))
    assert source_files(["tatsu-lab/alpaca", "yahma/alpaca-cleaned"]) is None  # Hub datasets only: by name


def test_a_list_holding_a_folder_of_two_formats_is_refused(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", ROWS)
    datasets.Dataset.from_list(ROWS[:2]).to_parquet(str(folder / "b.parquet"))
    single = write_jsonl(tmp_path / "c.jsonl", ROWS)
    with pytest.raises(UserError, match=f"^dataset source {folder}: holds data files in 2 formats"):
        check_folder_formats([single, str(folder)])
    check_folder_formats([single, single])  # files are not folders: nothing to check


def test_a_relative_folder_is_read_from_the_working_directory(tmp_path, monkeypatch):
    """``source=files`` (or ``./files``) failed in ``folder_files``: ``datasets`` names the files by absolute path."""
    write_source(tmp_path, "parquet_folder", ROWS)
    write_source(tmp_path, "dataset_dict", ROWS)
    monkeypatch.chdir(tmp_path)
    for source in ("files", "./files"):
        check_folder_formats(source)
        assert [r.value for r in load_records(source)] == ROWS
        assert source_files(source) == SourceFiles(Path(source), ("train-00000-of-00001.parquet",))
    assert source_files("saved_dict").names == source_files(str(tmp_path / "saved_dict")).names


def test_a_saved_dataset_dict_with_an_empty_split_reads_its_other_splits(tmp_path):
    """``load_from_disk`` of the whole DatasetDict failed with an IndexError inside ``datasets`` when any split had
    no rows, even one not read, and before a misspelt split could be named."""
    ds = datasets.Dataset.from_list(ROWS)
    folder = tmp_path / "dd"
    datasets.DatasetDict(train=ds, validation=ds.select([])).save_to_disk(str(folder))
    assert [r.value for r in load_records(str(folder))] == ROWS
    for split, message in [("validation", f"{folder} [validation]: the dataset holds no records"),
                           ("trian", f"{folder}: no split 'trian' (the saved dataset has: train, validation); "
                                     "set split")]:
        with pytest.raises(UserError) as info:
            load_records(str(folder), split=split)
        assert str(info.value) == message
    ds.select([]).save_to_disk(str(tmp_path / "empty"))
    with pytest.raises(UserError, match=r"empty: the dataset holds no records$"):
        load_records(str(tmp_path / "empty"))
