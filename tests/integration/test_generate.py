"""``tune generate`` and ``output_dir/latest``: trying a fine-tuned model gives exactly what transformers' own greedy
generation gives for the same prompt, on the embedded checkpoint and on a run's output_dir (its latest checkpoint),
plain, in the Alpaca layout and as a chat turn; bad input is one line and exit 2."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from finetune_runs import check_success, final_checkpoint, run_tune_in_process, run_tune_subprocess, tune_run_argv
from transformers import AutoModelForCausalLM, AutoTokenizer

from torchtune_ac.checkpoint import LATEST_POINTER, list_checkpoints, resolve_hf_checkpoint
from torchtune_ac.cli import main
from torchtune_ac.data import format_alpaca_prompt

PROMPT = "What is 33 + 65?"
NEW_TOKENS = 12


def transformers_greedy(checkpoint: Path, input_ids: list[int]) -> str:
    """What transformers itself generates greedily after ``input_ids``, the new tokens decoded."""
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    with torch.no_grad():
        output = model.generate(torch.tensor([input_ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return tokenizer.decode(output[0, len(input_ids):], skip_special_tokens=True)


def bos_and(tokenizer, text: str) -> list[int]:
    """The prompt as training feeds it: BOS, then the text's tokens."""
    return [tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False).input_ids]


def tune_generate(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["generate", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("generate") / "run"
    check_success(run_tune_in_process(tune_run_argv(out, "max_steps_per_epoch=4", "save_every_n_steps=2")))
    return out


def test_latest_names_the_newest_verified_checkpoint(run_dir):
    assert [c.name for c in list_checkpoints(run_dir)] == ["step_0000002", "step_0000004"]
    latest = run_dir / LATEST_POINTER
    assert latest.is_symlink() and os.readlink(latest) == "step_0000004"  # relative: survives moving the folder
    assert resolve_hf_checkpoint(run_dir) == run_dir / "step_0000004"


def test_latest_is_a_file_naming_the_checkpoint_where_links_cannot_be_made(tmp_path, monkeypatch):
    def no_links(*args, **kwargs):
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(os, "symlink", no_links)
    out = tmp_path / "run"
    check_success(run_tune_in_process(tune_run_argv(out, "max_steps_per_epoch=2")))
    assert (out / LATEST_POINTER).read_text() == "step_0000002\n"
    assert resolve_hf_checkpoint(out) == out / "step_0000002"


def test_a_copy_made_through_the_link_is_replaced_by_the_link(run_dir, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(run_dir, out)  # follows links: latest becomes a copy of step_0000004
    assert (out / LATEST_POINTER).is_dir() and not (out / LATEST_POINTER).is_symlink()
    assert resolve_hf_checkpoint(out) == out / "step_0000004"  # no pointer: the newest complete checkpoint
    check_success(run_tune_in_process(tune_run_argv(out, "max_steps_per_epoch=4", "save_every_n_steps=2", "epochs=2",
                                                    "resume_from_checkpoint=true")))
    assert os.readlink(out / LATEST_POINTER) == "step_0000008"


def test_generate_equals_transformers_greedy_on_the_embedded_checkpoint(capsys, embedded_checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(embedded_checkpoint)
    expected = transformers_greedy(embedded_checkpoint, bos_and(tokenizer, PROMPT))
    assert expected.strip()  # random weights: something, not an immediate end of text
    code, out, err = tune_generate(capsys, "--checkpoint", str(embedded_checkpoint), "--prompt", PROMPT,
                                   "--max-new-tokens", str(NEW_TOKENS))
    assert (code, out) == (0, expected + "\n"), err


def test_a_lora_checkpoint_is_generated_from_its_merged_model_alone(capsys, tmp_path, embedded_checkpoint):
    """A LoRA run's checkpoint with ``adapter.save_merged`` holds its PEFT adapters and, in ``merged/``, the merged
    model. Here the "merged" model is the base and the adapters are not zero: generate must give the base's text
    (transformers, with peft installed, applies adapters it finds beside a model's config.json)."""
    peft = pytest.importorskip("peft")
    folder = tmp_path / "step_0000004"
    lora = peft.LoraConfig(r=8, lora_alpha=64, target_modules=["q_proj", "v_proj", "down_proj"],
                           init_lora_weights=False)  # B random, not zero: the adapters change the logits
    torch.manual_seed(0)
    peft.get_peft_model(AutoModelForCausalLM.from_pretrained(embedded_checkpoint), lora).save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(embedded_checkpoint)
    expected = transformers_greedy(embedded_checkpoint, bos_and(tokenizer, PROMPT))
    with_adapters = tmp_path / "with_adapters"
    shutil.copytree(folder, with_adapters)
    shutil.copytree(embedded_checkpoint, with_adapters, dirs_exist_ok=True)
    assert transformers_greedy(with_adapters, bos_and(tokenizer, PROMPT)) != expected  # transformers adds them
    # Adapters alone: refused, naming the layout that works.
    capsys.readouterr()  # transformers' loading bars above
    code, out, err = tune_generate(capsys, "--checkpoint", str(folder), "--prompt", PROMPT)
    assert (code, out) == (2, "")
    assert err == (f"tune: error: checkpoint {folder}: the adapters of a LoRA run alone (adapter_config.json, no "
                   "merged/config.json); load them onto their base with peft's PeftModel.from_pretrained, or train "
                   "with adapter.save_merged=true, whose checkpoints also hold the merged model in merged/\n")
    shutil.copytree(embedded_checkpoint, folder / "merged")
    (tmp_path / LATEST_POINTER).symlink_to(folder.name)
    for checkpoint in (folder, tmp_path):  # the checkpoint, and an output_dir whose latest names it
        code, out, err = tune_generate(capsys, "--checkpoint", str(checkpoint), "--prompt", PROMPT,
                                       "--max-new-tokens", str(NEW_TOKENS))
        assert (code, out) == (0, expected + "\n"), err


def test_generate_prints_only_the_generated_text(embedded_checkpoint):
    """The real console path: the text on stdout, nothing on stderr (no loading bars, no library warnings)."""
    tokenizer = AutoTokenizer.from_pretrained(embedded_checkpoint)
    result = run_tune_subprocess(["generate", "--checkpoint", str(embedded_checkpoint), "--prompt", PROMPT,
                                  "--max-new-tokens", str(NEW_TOKENS)])
    expected = transformers_greedy(embedded_checkpoint, bos_and(tokenizer, PROMPT))
    assert (result.returncode, result.stdout, result.stderr) == (0, expected + "\n", "")


def test_generate_follows_latest_and_lays_out_alpaca_and_chat_prompts(capsys, run_dir):
    checkpoint = final_checkpoint(run_dir)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    alpaca = transformers_greedy(checkpoint, bos_and(tokenizer, format_alpaca_prompt(PROMPT, "")))
    code, out, err = tune_generate(capsys, "--checkpoint", str(run_dir), "--alpaca", "--prompt", PROMPT,
                                   "--max-new-tokens", str(NEW_TOKENS))
    assert (code, out) == (0, alpaca + "\n"), err

    chat_ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                             return_dict=True)["input_ids"]
    assert chat_ids[0] == tokenizer.bos_token_id  # the saved Llama 3 template writes BOS itself
    code, out, err = tune_generate(capsys, "--checkpoint", str(run_dir), "--chat", "--prompt", PROMPT,
                                   "--max-new-tokens", str(NEW_TOKENS))
    assert (code, out) == (0, transformers_greedy(checkpoint, chat_ids) + "\n"), err


def without_chat_template(checkpoint: Path, folder: Path) -> Path:
    shutil.copytree(checkpoint, folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_chat_without_a_template_says_a_run_wrote_it_so(capsys, tmp_path, run_dir):
    # Was "(it was fine-tuned without one)" for every checkpoint, base models included.
    checkpoint = without_chat_template(final_checkpoint(run_dir), tmp_path / "run_checkpoint")
    code, out, err = tune_generate(capsys, "--checkpoint", str(checkpoint), "--chat", "--prompt", PROMPT)
    assert (code, out) == (2, "")
    assert err == (f"tune: error: --chat: the tokenizer in {checkpoint} has no chat template (the run that wrote it "
                   "had no chat template); generate without --chat, or fine-tune on chat data with "
                   "tokenizer.chat_template set\n")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--checkpoint", "{tmp}/nowhere", "--prompt", "hi"], "checkpoint {tmp}/nowhere: no such directory"),
        (["--checkpoint", "{tmp}", "--prompt", "hi"],
         "checkpoint {tmp}: neither a Hugging Face checkpoint (no config.json, no merged/config.json) nor a run's "
         "output_dir with a checkpoint (no latest, no complete step_* folder)"),
        (["--checkpoint", "{embedded}", "--prompt", " "], "--prompt: empty"),
        (["--checkpoint", "{embedded}", "--prompt", "hi", "--max-new-tokens", "0"],
         "--max-new-tokens: must be >= 1, got 0"),
        (["--checkpoint", "{embedded}", "--prompt", "hi", "--max-new-tokens", "600"],
         "--max-new-tokens 600: with the prompt's 3 tokens it exceeds the model's context of 512 positions"),
        (["--checkpoint", "{embedded}", "--prompt", "hi", "--chat", "--alpaca"],
         "argument --alpaca: not allowed with argument --chat"),
        (["--checkpoint", "{no_template}", "--prompt", "hi", "--chat"],
         "--chat: the tokenizer in {no_template} has no chat template (base models usually ship without one); "
         "generate without --chat, or fine-tune on chat data with tokenizer.chat_template set"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, embedded_checkpoint, args, message):
    names = {"tmp": str(tmp_path), "embedded": str(embedded_checkpoint),
             "no_template": str(without_chat_template(embedded_checkpoint, tmp_path / "no_template"))}
    code, out, err = tune_generate(capsys, *(arg.format(**names) for arg in args))
    assert (code, out) == (2, "")
    assert len(err.strip().splitlines()) == 1 and message.format(**names) in err, err


def ending_at_once(embedded_checkpoint: Path, folder: Path) -> Path:
    """A copy of the embedded checkpoint whose output layer makes end of sequence the first greedy token after
    ``PROMPT`` (its row is the final hidden state, every other row 0)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(embedded_checkpoint, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([bos_and(tokenizer, PROMPT)]), output_hidden_states=True).hidden_states[-1][0, -1]
    weights = load_file(folder / "model.safetensors")
    weights["lm_head.weight"] = torch.zeros_like(weights["lm_head.weight"])
    weights["lm_head.weight"][tokenizer.eos_token_id] = hidden
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_generate_says_on_stderr_why_it_printed_nothing(capsys, tmp_path, embedded_checkpoint):
    checkpoint = ending_at_once(embedded_checkpoint, tmp_path / "eos")
    capsys.readouterr()  # what loading it printed
    code, out, err = tune_generate(capsys, "--checkpoint", str(checkpoint), "--prompt", PROMPT)
    assert (code, out) == (0, "\n")
    assert err == ("tune generate: no text generated: the model's first token was the end of sequence "
                   "(<|end_of_text|>, id 1), so it ended its answer at once; try another prompt or layout (--chat, "
                   "--alpaca), or a checkpoint trained longer\n")


def test_the_quick_start_check_prints_no_library_noise(run_dir):
    """scripts/check_run.py printed torchao's "Failed to load ..._C_mxfp8..." lines, two pytree deprecations and
    transformers' loading bar on stderr (transformers imports torchao when it loads a model)."""
    import subprocess
    import sys

    from finetune_runs import subprocess_env

    script = Path(__file__).resolve().parents[2] / "scripts" / "check_run.py"
    result = subprocess.run([sys.executable, str(script), str(run_dir)], capture_output=True, text=True,
                            env=subprocess_env(), timeout=300)
    assert result.stdout.splitlines()[-1] in ("OK", "PROBLEM: the loss did not fall or the logits disagree")
    assert result.stderr == ""
