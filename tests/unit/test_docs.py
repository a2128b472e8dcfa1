"""The generated reference pages are current: each is what ``scripts/gen_docs.py`` makes from the schema's fields and
``tune``'s argument parser now, so a key or a flag is described once, where it is defined."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import runpy
import shlex
import sys
import typing
from pathlib import Path
from typing import Optional

import gen_docs  # scripts/ is on sys.path (tests/conftest.py)
import pytest

from torchtune_ac.cli import build_parser
from torchtune_ac.config.schema import FullDPOConfig, FullFinetuneConfig
from torchtune_ac.config_key import config_key, config_keys
from torchtune_ac.errors import UserError

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("page", sorted(gen_docs.PAGES))
def test_generated_page_is_current(page):
    committed = (REPO / page).read_text()
    assert committed == gen_docs.PAGES[page](), f"{page} is stale: regenerate it with `{gen_docs.REGENERATE}`"


def test_a_union_s_members_are_named_in_one_order_whichever_the_process_made_first():
    # typing caches Union[int, str] and Union[str, int] as one object: its get_args order is the first one made.
    assert gen_docs._type_name(typing.Optional[typing.Union[str, int]]) == "int or str or null"
    assert gen_docs._type_name(typing.Union[float, bool]) == "bool or float"


def test_the_config_reference_has_every_key_with_its_doc_and_default():
    page = (REPO / "docs" / "config-reference.md").read_text()
    rows = {line.split(" | ")[0].removeprefix("| `").removesuffix("`"): line
            for line in page.splitlines() if line.startswith("| `")}
    for schema in (FullFinetuneConfig, FullDPOConfig):
        for key in config_keys(schema):
            assert key.name in rows, key.name
    row = rows["gradient_accumulation_steps"]
    assert row == ("| `gradient_accumulation_steps` | int (>= 1) | `1` | Micro-batches per optimizer step; the global "
                   "batch is batch_size x this x the processes. | same |")
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

    assert gen_docs._key_rows(Schema) == {"steps": "| `steps` | int or null (>= 1) | `null` | How many \\| steps. |  |"}
    assert gen_docs._key_rows(Changed)["steps"] == "| `steps` | int or null (>= 1) | `2` | How many \\| steps. |  |"


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


# ---------------------------------------------------------------------------------------------- commands the pages show
#
# Every command a page shows in a ```sh block is checked here: a `tune` command is parsed by tune's own parser, names
# a built-in recipe and config (or a file an earlier command of the page made: `tune cp`, `tune migrate -o`), its
# config is loaded with its overrides and validated against the recipe's schema as `tune validate` does; a Python
# script's arguments are parsed by the script's own parser (its work never starts); a shell script exists, is
# executable and still reads every flag shown. A typo'd config, a removed flag or a misspelt key fails the test.

PAGES = [REPO / "README.md", REPO / "scripts" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
HAND_WRITTEN = [page for page in PAGES if page.relative_to(REPO).as_posix() not in gen_docs.PAGES]
LANGUAGES = {"sh", "python", "yaml", "text"}
_COMMAND = re.compile(r"^(\$ )?(tune |\./scripts/|(\S*/)?python3? scripts/|[A-Z_]+=\S+ \./scripts/)")


def code_blocks(page: Path) -> list[tuple[str, int, list[str]]]:
    """(language, first line number, lines) of every fenced block of ``page``."""
    blocks, current = [], None
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            if current is None:
                current = (line[3:].strip(), number + 1, [])
            else:
                blocks.append(current)
                current = None
        elif current is not None:
            current[2].append(line)
    assert current is None, f"{page.name}: a code block is not closed"
    return blocks


def shown_commands(page: Path) -> list[tuple[int, list[str]]]:
    """(line number, argv) of every command in the page's ``sh`` blocks: continuation lines joined, comments and
    environment assignments dropped; in a block of a session (``$ `` prompts) only the prompted lines."""
    commands = []
    for language, first, lines in code_blocks(page):
        if language != "sh":
            continue
        session = any(line.startswith("$ ") for line in lines)
        joined, start = "", first
        for offset, line in enumerate(lines):
            if not joined:
                start = first + offset
            joined += line.rstrip("\\").strip() + " " if line.endswith("\\") else line.strip()
            if line.endswith("\\"):
                continue
            text, joined = joined, ""
            if not text or text.startswith("#") or (session and not text.startswith("$ ")):
                continue
            argv = shlex.split(text.removeprefix("$ "), comments=True)
            while argv and re.fullmatch(r"[A-Z_]+=.*", argv[0]):
                argv = argv[1:]
            commands.append((start, argv))
    return commands


_PLACEHOLDER = re.compile(r"[\[<|]|\.\.\.|\b[A-Z]{1,}\b(?!=)")


def inline_commands(page: Path) -> list[tuple[int, list[str]]]:
    """(line number, argv) of the complete commands a page names in its prose (`` `tune plan --config ...` ``): a
    ``tune run``, ``validate`` or ``plan`` with its ``--config``, or a script with its arguments; not a grammar with
    placeholders (``tune run [launcher flags] RECIPE ...``)."""
    text = page.read_text()
    prose = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    found = []
    for match in re.finditer(r"`([^`]+)`", prose):
        span = " ".join(match.group(1).split())
        line = prose.count("\n", 0, match.start()) + 1
        tune = re.match(r"tune (run|validate|plan) ", span) and " --config " in span
        # a script with an interpreter, ./, or arguments (a bare `scripts/x.py` names the file)
        script = re.match(r"([A-Z_]+=\S+ )?(\S*python3? )?(\./)?scripts/[\w/]+\.(py|sh)( |$)", span)
        script = script and (any(script.group(i) for i in (1, 2, 3)) or " " in span)
        if not (tune or script) or _PLACEHOLDER.search(re.sub(r"^[A-Z_]+=\S+ ", "", span)):
            continue
        argv = shlex.split(span)
        while re.fullmatch(r"[A-Z_]+=.*", argv[0]):
            argv = argv[1:]
        if argv[0].startswith("scripts/"):  # named without its interpreter
            argv = ["./" + argv[0], *argv[1:]] if argv[0].endswith(".sh") else ["python", *argv]
        found.append((line, argv))
    return found


def check_tune_command(argv: list[str], made: dict[str, Optional[str]]) -> None:
    """Parse a shown ``tune`` command and check what it names; record the files it makes in ``made`` (a copy of a
    built-in config: its name; a migrated config: None)."""
    from torchtune_ac.cli import load_recipe, load_recipe_config, parse_with_overrides
    from torchtune_ac.registry import builtin_config_path, config_recipe, find_recipe

    parser = build_parser()
    args = parse_with_overrides(parser, argv[1:])
    subparser = next(a for a in parser._actions if a.dest == "command").choices[args.command]
    check_spelled_out(argv, parser, subparser)
    if args.command == "cp":
        assert builtin_config_path(args.source) is not None or find_recipe(args.source) is not None, (
            f"tune cp {args.source}: no such built-in config or recipe")
        made[args.destination] = args.source if builtin_config_path(args.source) is not None else None
    elif args.command == "migrate":
        made[args.output] = None
    elif args.command in ("run", "validate", "plan"):
        config = made.get(args.config, args.config)
        if config is None:  # made by `tune migrate` from the reader's own file: parsed only
            return
        path = builtin_config_path(config)
        assert path is not None, f"--config {config}: no such built-in config (see `tune ls`)"
        launch_recipe = config_recipe(path)
        name = args.recipe if args.command == "run" else (args.recipe or launch_recipe or "full_finetune")
        recipe = find_recipe(name)
        assert recipe is not None, f"recipe {name}: not a built-in recipe"
        assert args.command != "run" or launch_recipe in (None, name), (
            f"config {config} is {launch_recipe}'s, not {name}'s")
        load_recipe_config(load_recipe(recipe.path), config, args.overrides, args.allow_component)


def check_spelled_out(argv: list[str], *parsers: argparse.ArgumentParser) -> None:
    """Every flag shown is one the parser declares, in full (argparse would accept an abbreviation, which a longer
    flag added later makes ambiguous)."""
    declared = {flag for parser in parsers for flag in parser._option_string_actions}
    for arg in argv[1:]:
        if arg.startswith("--") and arg.split("=")[0] not in declared:
            raise AssertionError(f"{arg.split('=')[0]}: not a flag of {parsers[-1].prog} (its flags: "
                                 f"{', '.join(sorted(f for f in declared if f.startswith('--')))})")


class _Parsed(Exception):
    """Raised in place of a script's work, once its parser has accepted the arguments."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


def check_python_script(argv: list[str], monkeypatch) -> None:
    """Parse a shown ``python scripts/X.py ...`` command with the script's own parser, and stop there."""
    script = REPO / argv[1]
    assert script.is_file(), f"{argv[1]}: no such script"
    original_known, original = argparse.ArgumentParser.parse_known_args, argparse.ArgumentParser.parse_args
    depth = [0]

    def parse_known_args(self, args=None, namespace=None):
        depth[0] += 1
        try:
            parsed = original_known(self, args, namespace)
        finally:
            depth[0] -= 1
        if depth[0] == 0:  # the script's own call (parse_args calls this too)
            raise _Parsed(self)
        return parsed

    def parse_args(self, args=None, namespace=None):
        depth[0] += 1
        try:
            original(self, args, namespace)
        finally:
            depth[0] -= 1
        raise _Parsed(self)

    with monkeypatch.context() as patch:
        patch.setattr(sys, "argv", [str(script), *argv[2:]])
        patch.setattr(argparse.ArgumentParser, "parse_known_args", parse_known_args)
        patch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
        try:
            runpy.run_path(str(script), run_name="__main__")
        except _Parsed as parsed:
            check_spelled_out(argv[1:], parsed.parser)
            return
        except SystemExit as err:
            raise AssertionError(f"{' '.join(argv[1:])}: the script's parser refused it (exit {err.code})") from None
    raise AssertionError(f"{argv[1]}: parsed no arguments")


def check_shell_script(argv: list[str]) -> None:
    script = REPO / argv[0]
    assert script.is_file() and os.access(script, os.X_OK), f"{argv[0]}: no such executable script"
    text = script.read_text()
    for flag in (arg for arg in argv[1:] if arg.startswith("--")):
        assert re.search(re.escape(flag.split("=")[0]) + r"(?![\w-])", text), f"{argv[0]}: does not read {flag}"


def check_hf_command(argv: list[str]) -> None:
    """huggingface_hub's ``hf`` (installed beside this Python): the subcommand exists and takes each flag shown."""
    import subprocess

    hf = Path(sys.executable).parent / "hf"
    assert hf.is_file(), f"{hf}: huggingface_hub's hf command is not installed"
    shown = subprocess.run([str(hf), argv[1], "--help"], capture_output=True, text=True, check=False)
    assert shown.returncode == 0, f"hf {argv[1]}: not an hf subcommand:\n{shown.stderr[-1000:]}"
    for flag in (arg for arg in argv[2:] if arg.startswith("--")):
        assert re.search(re.escape(flag.split("=")[0]) + r"(?![\w-])", shown.stdout), f"hf {argv[1]}: no {flag}"


def check_command(argv: list[str], made: dict[str, Optional[str]], monkeypatch) -> None:
    if argv[0] == "tune":
        check_tune_command(argv, made)
    elif argv[0] == "hf":
        check_hf_command(argv)
    elif argv[0].startswith("./scripts/"):
        check_shell_script(argv)
    elif re.fullmatch(r"(\S*/)?python3?", argv[0]) and argv[1:2] and argv[1].startswith("scripts/"):
        check_python_script(argv, monkeypatch)
    else:
        raise AssertionError(f"not a command the docs test knows how to check: {argv[0]}")


@pytest.mark.parametrize("page", PAGES, ids=[page.relative_to(REPO).as_posix() for page in PAGES])
def test_every_command_a_page_shows_is_checked(page, monkeypatch):
    made: dict[str, Optional[str]] = {}
    failures = []
    for line, argv in shown_commands(page) + inline_commands(page):
        try:
            check_command(argv, made, monkeypatch)
        except (AssertionError, UserError) as err:
            failures.append(f"{page.relative_to(REPO)}:{line}: {' '.join(argv)}\n    {err}")
    assert not failures, "\n".join(failures)


def test_the_pages_show_commands():
    """The extraction finds what the pages show (a test over nothing would pass)."""
    readme = [" ".join(argv) for _, argv in shown_commands(REPO / "README.md")]
    assert readme[:5] == ["./scripts/quickstart.sh", "./scripts/test.sh", "./scripts/gpu/gpu_wheels.sh 3.12",
                          "./scripts/gpu/gpu_check.sh --out $OUT", "tune ls"]  # the GPU check's command (issue 28)
    assert "tune run --nproc_per_node 4 full_finetune --config my.yaml checkpoint_dir=/models/Meta-Llama-3-8B" in readme
    distributed = [argv for _, argv in shown_commands(REPO / "docs" / "distributed.md")]
    assert ["tune", "run", "--nnodes", "2", "--nproc_per_node", "8", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            "host:29500", "full_finetune", "--config", "llama3_1/8B_full", "fsdp.replicate_degree=2"] in distributed
    assert ["./scripts/gpu/gpu_check.sh", "--out", "$OUT"] in distributed
    memory = [argv for _, argv in shown_commands(REPO / "docs" / "memory.md")]
    assert memory == [["tune", "plan", "--config", "llama3/8B_full", "--nproc", "4", "--budget-gib", "40", "--png",
                       "plan.png"]]


def test_the_commands_named_in_prose_are_found():
    memory = [" ".join(argv) for _, argv in inline_commands(REPO / "docs" / "memory.md")]
    assert "tune plan --config llama3_1/70B_full --nproc 8" in memory
    assert "python scripts/bench/bench_memory.py --optimizers --repeats 1 --seq-len 512" in memory
    assert "python scripts/bench/bench_memory.py --ablation --model llama_small --batch-size 2 --seq-len 1024" in memory
    setup = [" ".join(argv) for _, argv in inline_commands(REPO / "docs" / "setup.md")]
    assert "./scripts/test.sh --numerics" in setup
    usage = [" ".join(argv) for _, argv in inline_commands(REPO / "docs" / "usage.md")]
    assert not any("RECIPE" in command for command in usage)


@pytest.mark.parametrize(("command", "error"), [
    ("tune run full_finetune --config tiny/ful", "--config tiny/ful: no such built-in config"),
    ("tune run full_finetun --config tiny/full", "recipe full_finetun: not a built-in recipe"),
    ("tune run full_finetune --config tiny/dpo", "config tiny/dpo is full_dpo's, not full_finetune's"),
    ("tune plan --config tiny/full --nprocs 2", "unrecognized arguments: --nprocs"),
    ("tune run full_finetune --config tiny/full max_step_per_epoch=5", "max_step_per_epoch"),
    ("tune validate --config mine.yaml", "no such built-in config"),
    ("tune cp llama3/8B_ful my.yaml", "no such built-in config or recipe"),
    ("./scripts/test.sh --numeric", "does not read --numeric"),
    ("./scripts/tests.sh", "no such executable script"),
    (".venv/bin/python scripts/bench/bench_ac.py --repeats five", "the script's parser refused it"),
    (".venv/bin/python scripts/bench/bench_ac.py --repeat 5", "--repeat: not a flag of bench_ac.py"),
    ("tune plan --config tiny/full --budget 40", "--budget: not a flag of tune plan"),
])
def test_a_wrong_command_fails_the_check(command, error, monkeypatch, capsys):
    with pytest.raises((AssertionError, UserError), match=re.escape(error)):
        check_command(shlex.split(command), {}, monkeypatch)


def test_a_copied_or_migrated_config_is_followed():
    made: dict[str, Optional[str]] = {}
    check_tune_command(["tune", "cp", "tiny/full", "my.yaml"], made)
    check_tune_command(["tune", "validate", "--config", "my.yaml", "ac_mode=selective", "ac_option=2"], made)
    with pytest.raises(UserError, match="ac_optio"):
        check_tune_command(["tune", "validate", "--config", "my.yaml", "ac_optio=2"], made)
    check_tune_command(["tune", "migrate", "theirs.yaml", "-o", "ours.yaml"], made)
    check_tune_command(["tune", "run", "full_finetune", "--config", "ours.yaml"], made)
    assert made == {"my.yaml": "tiny/full", "ours.yaml": None}


@pytest.mark.parametrize("page", HAND_WRITTEN, ids=[page.relative_to(REPO).as_posix() for page in HAND_WRITTEN])
def test_no_command_hides_from_the_check(page):
    """Every code block is fenced and names its language, and commands are only in ``sh`` blocks (where the test
    above reads them)."""
    for language, first, lines in code_blocks(page):
        assert language in LANGUAGES, f"{page.name}:{first - 1}: a code block's language is {language!r}"
        if language != "sh":
            for offset, line in enumerate(lines):
                assert not _COMMAND.match(line), f"{page.name}:{first + offset}: a command outside an sh block"
    in_block, previous = False, ""
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            in_block = not in_block
        assert in_block or not (line.startswith("    ") and line.strip() and not previous.strip()), (
            f"{page.name}:{number}: an indented code block (fence it, with its language)")
        previous = line


def shown_sessions(page: Path) -> list[tuple[int, list[str], list[str]]]:
    """(line number, argv, the output lines shown under it) of every ``$ `` command of the page's ``sh`` blocks."""
    sessions = []
    for language, first, lines in code_blocks(page):
        if language != "sh":
            continue
        for offset, line in enumerate(lines):
            if line.startswith("$ "):
                sessions.append((first + offset, shlex.split(line[2:], comments=True), []))
            elif sessions and sessions[-1][0] >= first:
                sessions[-1][2].append(line)
    return sessions


SESSIONS = [(page, line, argv, shown) for page in HAND_WRITTEN for line, argv, shown in shown_sessions(page)]


@pytest.mark.slow  # tune plan of Llama 3 8B under fake tensors: about 10 s of CPU
@pytest.mark.parametrize(("page", "line", "argv", "shown"), SESSIONS,
                         ids=[f"{page.name}:{line}" for page, line, _, _ in SESSIONS])
def test_a_shown_session_prints_what_the_page_shows(page, line, argv, shown, tmp_path, monkeypatch, capsys):
    """A command shown with its output (``$ tune plan ...`` and the lines under it) is run, and prints those lines."""
    from torchtune_ac.cli import main

    assert argv[0] == "tune" and shown, f"{page.name}:{line}"
    monkeypatch.chdir(tmp_path)  # what it writes (tune plan --png) stays here
    assert main(argv[1:]) == 0
    printed = capsys.readouterr().out.splitlines()
    missing = [text for text in shown if text not in printed]
    assert not missing, f"{page.name}:{line}: `{' '.join(argv)}` no longer prints:\n" + "\n".join(missing)


def test_the_pages_show_a_session():
    assert [(page.name, argv[:4], len(shown)) for page, _, argv, shown in SESSIONS] == [
        ("memory.md", ["tune", "plan", "--config", "llama3/8B_full"], 8),
        ("moe.md", ["tune", "plan", "--config", "qwen3_moe/30B_A3B_full"], 7)]


# ---------------------------------------------------------------------------------------------- links

# Pages other branches write, linked from the README and the index before they land: checked once they exist.
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    return anchors_of_text(page.read_text())


def anchors_of_text(text: str) -> set[str]:
    """GitHub's anchors of the headings: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    found, in_block = set(), False
    for line in text.splitlines():
        if line.startswith("```"):
            in_block = not in_block
        elif not in_block and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def broken_links(page: Path, text: Optional[str] = None) -> list[str]:
    """The relative links and images of ``page`` (or of ``text`` as if it were there) that lead nowhere."""
    text = page.read_text() if text is None else text
    broken, text = [], re.sub(r"```.*?```", "", text, flags=re.S)
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not path and anchor in anchors_of_text(text):
            continue
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and anchor not in anchors(file):
            broken.append(f"{target}: no such heading in {file.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=[page.relative_to(REPO).as_posix() for page in PAGES])
def test_links_and_images_resolve(page):
    assert broken_links(page) == [], page.name


def test_the_link_check_can_fail():
    text = "# T\n[a](memory.md#no-such-heading) ![c](images/none.png) [b](#t) [d](setup.md#dependencies-and-why)\n"
    assert broken_links(REPO / "docs" / "probe.md", text) == [
        "memory.md#no-such-heading: no such heading in memory.md", "images/none.png: no such file"]


PYTHON_PATH = re.compile(r"\btorchtune_ac(?:\.\w+)+")


def unresolved_python_paths(text: str) -> list[str]:
    """The ``torchtune_ac.x.y`` paths of ``text`` that do not import (a module, then attributes of it)."""
    import importlib

    def resolves(path: str) -> bool:
        parts = path.split(".")
        for split in range(len(parts), 0, -1):
            try:
                found = importlib.import_module(".".join(parts[:split]))
            except ImportError:
                continue
            for name in parts[split:]:
                if not hasattr(found, name):
                    return False
                found = getattr(found, name)
            return True
        return False

    return sorted({path for path in PYTHON_PATH.findall(text) if not resolves(path)})


@pytest.mark.parametrize("page", PAGES, ids=[page.relative_to(REPO).as_posix() for page in PAGES])
def test_the_python_paths_a_page_names_import(page):
    """A config path that works only through an alias (torchtune_ac.training.metric_logging, mirroring torchtune's)
    is not one a reader can import; the pages name the module that holds the object."""
    assert unresolved_python_paths(page.read_text()) == [], page.name


def test_the_python_path_check_can_fail():
    assert unresolved_python_paths("`torchtune_ac.training.metric_logging.WandBLogger`, torchtune_ac.models.load_hf, "
                                   "torchtune_ac.models.no_such") == [
        "torchtune_ac.models.no_such", "torchtune_ac.training.metric_logging.WandBLogger"]


SCRIPTS_DIR = REPO / "scripts"
BENCHMARKS = sorted([*(SCRIPTS_DIR / "bench").glob("bench_*.py"), SCRIPTS_DIR / "gpu" / "gpu_peer.py"])


def test_the_scripts_readme_names_every_script():
    """``scripts/README.md`` says what each file of ``scripts/`` is for: a script added without a line fails."""
    text = (SCRIPTS_DIR / "README.md").read_text()
    scripts = sorted(path for path in SCRIPTS_DIR.rglob("*") if path.suffix in (".py", ".sh"))
    assert len(scripts) >= 30
    assert [path.name for path in scripts if f"`{path.name}`" not in text] == []


def test_the_benchmarks_page_lists_every_benchmark():
    """docs/benchmarks.md's table has a row for every benchmark, named by its path."""
    rows = [line for line in (REPO / "docs" / "benchmarks.md").read_text().splitlines() if line.startswith("| `")]
    assert len(BENCHMARKS) >= 12
    assert [path.relative_to(REPO).as_posix() for path in BENCHMARKS
            if not any(row.startswith(f"| `{path.relative_to(REPO).as_posix()}` |") for row in rows)] == []


def test_the_readme_is_short_and_opens_with_the_set_up():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 250
    assert lines[2:6] == ["```sh", "./scripts/quickstart.sh     # creates/reuses .venv, installs everything, "
                          "fine-tunes the embedded tiny model", "./scripts/test.sh           # same set-up, then the "
                          "whole test suite (about 25 minutes on 2 cores, in 2 workers)", "```"]


def test_the_readme_lists_every_exit_status():
    from torchtune_ac import errors

    text = (REPO / "README.md").read_text()
    table = text[text.index("## Exit codes"):]
    shown = {int(m) for m in re.findall(r"^\| (\d+) \|", table, flags=re.M)}
    assert shown == {0, 1} | {value for name, value in vars(errors).items() if name.startswith("EXIT_")}


# The commands a page shows that only read (and tune cp, which writes into the folder it is run in) are run as shown;
# tune run and tune generate are parsed and their configs validated above (the runs themselves are the integration
# tests'), and tune migrate's input is the reader's own file.
RUN_AS_SHOWN = ("ls", "cp", "validate", "plan")


def queries(page: Path) -> list[tuple[int, list[str]]]:
    """The page's commands to run as shown (not those on a config `tune migrate` made from the reader's file, nor
    those shown with their output, which the session test runs)."""
    found, migrated = [], set()
    sessions = {line for line, _, _ in shown_sessions(page)}
    run_with_output = [argv for _, _, argv, _ in SESSIONS]
    for line, argv in shown_commands(page):
        if argv[0] != "tune" or line in sessions or argv in run_with_output:
            continue
        if argv[1] == "migrate":
            migrated.add(argv[argv.index("-o") + 1])
        config = argv[argv.index("--config") + 1] if "--config" in argv else None
        if argv[1] in RUN_AS_SHOWN and config not in migrated:
            found.append((line, argv))
    return found


QUERIES = [page for page in HAND_WRITTEN if queries(page)]


@pytest.mark.slow  # tune plan of the 8B configs under fake tensors: about 10 s of CPU each
@pytest.mark.parametrize("page", QUERIES, ids=[page.relative_to(REPO).as_posix() for page in QUERIES])
def test_the_queries_a_page_shows_run(page, tmp_path, monkeypatch, capsys):
    from torchtune_ac.cli import main

    monkeypatch.chdir(tmp_path)  # where tune cp writes, and tune validate reads the copy back
    for line, argv in queries(page):
        status = main(argv[1:])
        err = capsys.readouterr().err
        assert status == 0, f"{page.name}:{line}: `{' '.join(argv)}` exited {status}:\n{err[-2000:]}"


def test_the_queries_are_found():
    assert [page.name for page in QUERIES] == ["README.md", "lora.md", "models.md", "preference-tuning.md", "usage.md",
                                               "vision.md"]
    assert [argv[1] for _, argv in queries(REPO / "README.md")] == ["ls", "validate", "cp", "plan"]
    # usage.md's tune plan is memory.md's, run with its output
    assert [argv[1] for _, argv in queries(REPO / "docs" / "usage.md")] == ["ls", "cp", "validate"]


def test_the_gpu_figures_shown_are_the_committed_gpu_run():
    """The README's H100 line and the GPU check's table quote bench_results/gpu_bench_train.json, not an older run."""
    report = json.loads((REPO / "bench_results" / "gpu_bench_train.json").read_text())
    readme = " ".join((REPO / "README.md").read_text().split())
    table = (REPO / "docs" / "distributed.md").read_text()
    for result in report["results"]:
        tokens, mfu = f"{result['tokens_per_second']:,.0f}", f"{100 * result['mfu']:.1f} %"
        assert f"{tokens} tokens/s and {mfu} MFU" in readme, (tokens, mfu)
        row = (f"| packed{' (random documents of 64-1024 tokens)' if result['setting'] == 'full' else ''} | "
               f"{result['setting']} | {result['median_step_time_s']:.3f} | {tokens} | {mfu} | "
               f"{result['peak_reserved_gib']:.2f} + {result['fixed_gib']:.2f} GiB | {result['planned_gib']:.2f} GiB | "
               f"{result['planned_over_reserved']:.2f} | {result['recompiles']} | {result['host_syncs_per_step']} |")
        assert row in table, row
    assert report["config"]["device"] in table and report["config"]["packed"]
