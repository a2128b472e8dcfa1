"""The generated reference pages are current: each is what ``scripts/gen_docs.py`` makes from the schema's fields and
``tune``'s argument parser now, so a key or a flag is described once, where it is defined."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import gen_docs  # scripts/ is on sys.path (tests/conftest.py)
import pytest

from torchtune_ac.cli import build_parser
from torchtune_ac.config.schema import FullDPOConfig, FullFinetuneConfig
from torchtune_ac.config_key import config_key, config_keys

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("page", sorted(gen_docs.PAGES))
def test_generated_page_is_current(page):
    committed = (REPO / page).read_text()
    assert committed == gen_docs.PAGES[page](), f"{page} is stale: regenerate it with `{gen_docs.REGENERATE}`"


def test_the_config_reference_has_every_key_with_its_doc_and_default():
    page = (REPO / "docs" / "config-reference.md").read_text()
    rows = {line.split(" | ")[0].removeprefix("| `").removesuffix("`"): line
            for line in page.splitlines() if line.startswith("| `")}
    for schema in (FullFinetuneConfig, FullDPOConfig):
        for key in config_keys(schema):
            assert key.name in rows, key.name
    row = rows["gradient_accumulation_steps"]
    assert row == ("| `gradient_accumulation_steps` | int (>= 1) | `1` | Micro-batches per optimizer step; the global "
                   "batch is batch_size x this x the processes. |")
    assert rows["fsdp.reduce_dtype"].startswith("| `fsdp.reduce_dtype` | `fp32` / `bf16` or null | `null` | ")
    assert rows["output_dir"].startswith("| `output_dir` | str (not empty) | required | ")


def test_a_changed_field_changes_its_row():
    """What makes the staleness test able to fail: a row is the field's type, bounds, default and doc."""

    @dataclasses.dataclass(frozen=True)
    class Schema:
        steps: Optional[int] = config_key(None, doc="How many | steps.", minimum=1)

    @dataclasses.dataclass(frozen=True)
    class Changed:
        steps: Optional[int] = config_key(2, doc="How many | steps.", minimum=1)

    assert gen_docs._key_rows(Schema) == {"steps": "| `steps` | int or null (>= 1) | `null` | How many \\| steps. |"}
    assert gen_docs._key_rows(Changed)["steps"] == "| `steps` | int or null (>= 1) | `2` | How many \\| steps. |"


def test_the_cli_reference_has_every_subcommand_and_flag():
    page = (REPO / "docs" / "cli-reference.md").read_text()
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in commands.items():
        assert f"\n## `tune {name}`\n" in page, name
        for action in sub._actions:
            for flag in action.option_strings:
                assert flag in ("-h", "--help") or f"`{flag}" in page, (name, flag)


def test_a_stale_page_is_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "config-reference.md").write_text(gen_docs.render_config_reference())
    (tmp_path / "docs" / "cli-reference.md").write_text("stale\n")
    assert gen_docs.stale_pages(tmp_path) == ["docs/cli-reference.md"]
