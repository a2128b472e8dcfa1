"""Chat data and chat templates through ``tune``: a tokenizer without a template is refused before anything runs
(it used to train silently on an undocumented fallback), a template named in the config is used, and it is saved
with the tokenizer, so ``apply_chat_template`` on the fine-tuned model renders what the model was trained on."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from finetune_runs import check_success, final_checkpoint, run_tune_in_process, run_tune_subprocess, tune_run_argv
from transformers import AutoTokenizer

from torchtune_ac.data import CHAT_TEMPLATES, EMBEDDED_TOKENIZER_DIR, load_tokenizer

CONVERSATIONS = [
    {"messages": [{"role": "user", "content": f"What is {a} + {b}?"}, {"role": "assistant", "content": str(a + b)}]}
    for a in range(10) for b in range(4)
]
CHAT_DATA = ("dataset._component_=torchtune_ac.data.chat_dataset",)


@pytest.fixture
def chat_inputs(tmp_path: Path) -> tuple[Path, Path]:
    """A chat JSONL file, and the embedded tokenizer without its chat template (as many base models ship)."""
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(record) + "\n" for record in CONVERSATIONS))
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    shutil.copy(Path(EMBEDDED_TOKENIZER_DIR) / "tokenizer.json", tokenizer)
    config = json.loads((Path(EMBEDDED_TOKENIZER_DIR) / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(config))
    return data, tokenizer


def test_chat_data_with_a_tokenizer_without_template_is_refused_in_one_line(tmp_path, chat_inputs):
    data, tokenizer = chat_inputs
    overrides = (*CHAT_DATA, f"dataset.source={data}", f"tokenizer.path={tokenizer}")
    expected = (f"tune: error: dataset: tokenizer {tokenizer} has no chat template (no chat_template in "
                "tokenizer_config.json, no chat_template.jinja), and chat data needs one: set tokenizer.chat_template "
                "to a built-in template (chatml, llama3, plain) or a Jinja template")
    out = tmp_path / "out"
    run = run_tune_subprocess(tune_run_argv(out, *overrides))
    assert (run.returncode, run.stderr.strip()) == (2, expected)
    assert not out.exists()
    validate = run_tune_subprocess(["validate", "--config", "tiny/full", f"output_dir={out}", *overrides])
    assert (validate.returncode, validate.stderr.strip()) == (2, expected)


def test_a_named_template_is_used_and_saved_with_the_tokenizer(tmp_path, chat_inputs):
    data, tokenizer = chat_inputs
    out = tmp_path / "out"
    check_success(run_tune_in_process(tune_run_argv(out, *CHAT_DATA, f"dataset.source={data}",
                                                    f"tokenizer.path={tokenizer}", "tokenizer.chat_template=chatml")))
    checkpoint = final_checkpoint(out)
    assert (checkpoint / "chat_template.jinja").read_text() == CHAT_TEMPLATES["chatml"]
    ours = load_tokenizer(str(tokenizer), chat_template="chatml")
    theirs = AutoTokenizer.from_pretrained(checkpoint)
    messages = CONVERSATIONS[5]["messages"]
    assert theirs.apply_chat_template(messages, tokenize=False) == ours.render_chat(messages)
    prompt = theirs.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == ours.render_chat(messages[:1], add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")


def test_a_template_that_replaces_the_tokenizers_own_is_the_one_saved(tmp_path):
    """The embedded tokenizer has a Llama 3 template in tokenizer_config.json; the config asks for ChatML."""
    out = tmp_path / "out"
    check_success(run_tune_in_process(tune_run_argv(out, "dataset.template=chat", "tokenizer.chat_template=chatml")))
    checkpoint = final_checkpoint(out)
    assert "chat_template" not in json.loads((checkpoint / "tokenizer_config.json").read_text())
    rendered = AutoTokenizer.from_pretrained(checkpoint).apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered == "<|begin_of_text|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
