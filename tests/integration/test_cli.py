"""The `tune` command as users type it: ls, cp, validate, and bad command lines (exit 2, one short message)."""

import collections
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from finetune_runs import run_tune_subprocess, tune_run_argv

from torchtune_ac.cli import main
from torchtune_ac.registry import RECIPES, builtin_config_names, builtin_config_path

REPO = Path(__file__).resolve().parents[2]


def run_tune(*args, cwd=None, env=None):
    """Run `python -m torchtune_ac.cli ARGS` in a subprocess (real exit status, real stderr)."""
    return subprocess.run(
        [sys.executable, "-m", "torchtune_ac.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


def test_ls_lists_every_recipe_and_config(capsys):
    assert main(["ls"]) == 0
    out = capsys.readouterr().out
    for recipe in RECIPES:
        assert recipe.name in out
    for name in builtin_config_names():
        assert name in out.split()


def test_ls_into_a_closed_pipe_stops_quietly():
    """`tune ls | head -1`: the reader is gone before tune writes (was a BrokenPipeError traceback, exit 1)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run([sys.executable, "-m", "torchtune_ac.cli", "ls"], stdout=write_end,
                                stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write_end)
    assert (result.returncode, result.stderr) == (141, "")


def test_every_builtin_config_file_is_registered():
    on_disk = {str(p.relative_to(REPO / "configs").with_suffix("")) for p in (REPO / "configs").rglob("*.yaml")}
    assert on_disk == set(builtin_config_names())


def test_cp_copies_and_refuses_to_clobber(tmp_path, capsys):
    dest = tmp_path / "my.yaml"
    assert main(["cp", "llama3/8B_full", str(dest)]) == 0
    assert dest.read_text() == builtin_config_path("llama3/8B_full").read_text()

    dest.write_text("mine: 1\n")
    assert main(["cp", "llama3/8B_full", str(dest)]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert dest.read_text() == "mine: 1\n"

    assert main(["cp", "--force", "llama3/8B_full", str(dest)]) == 0
    assert dest.read_text() == builtin_config_path("llama3/8B_full").read_text()


def test_cp_into_directory_and_recipe(tmp_path):
    assert main(["cp", "tiny/full", str(tmp_path)]) == 0
    assert (tmp_path / "full.yaml").is_file()
    assert main(["cp", "full_finetune", str(tmp_path / "my_recipe.py")]) == 0
    assert "def run(" in (tmp_path / "my_recipe.py").read_text()


def test_cp_to_a_missing_directory_with_trailing_slash(tmp_path, capsys):
    dest = f"{tmp_path / 'new'}/"
    assert main(["cp", "tiny/full", dest]) == 2
    assert "pass --make-parents" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # not silently written to new.yaml
    assert main(["cp", "--make-parents", "tiny/full", dest]) == 0
    assert (tmp_path / "new" / "full.yaml").is_file()


def test_cp_missing_parent(tmp_path, capsys):
    dest = tmp_path / "a" / "b.yaml"
    assert main(["cp", "tiny/full", str(dest)]) == 2
    assert "pass --make-parents" in capsys.readouterr().err
    assert not dest.parent.exists()
    assert main(["cp", "--make-parents", "tiny/full", str(dest)]) == 0
    assert dest.is_file()


@pytest.mark.parametrize("config", builtin_config_names())
def test_validate_every_builtin_config(config, capsys):
    from torchtune_ac.registry import builtin_config_path, config_recipe

    assert main(["validate", "--config", config]) == 0
    out = capsys.readouterr().out
    # The recipe its launch comment names (full_finetune, or full_dpo for *_dpo configs).
    assert f"is valid for recipe {config_recipe(builtin_config_path(config))}" in out
    assert "parameters" in out and "layers" in out
    assert "activation checkpointing" in out


def test_validate_prints_the_resolved_plan(capsys):
    assert main(["validate", "--config", "tiny/full", "ac_mode=selective", "ac_option=2"]) == 0
    out = capsys.readouterr().out
    assert "1,607,808 parameters, 8 layers" in out
    assert "selective every 2nd block: 4 of 8 blocks [1, 3, 5, 7]" in out


@pytest.mark.parametrize(
    "config, overrides, lines",
    [
        ("tiny/full", [], ["activation checkpointing  full: all 8 blocks", "optimizer step            after backward",
                           "loss                      targets only (vocabulary 512), at once: never the logits of "
                           "unlabelled positions"]),
        ("tiny/full", ["optimizer_in_bwd=true", "clip_grad_norm=null", "loss_chunks=4"],
         ["optimizer step            in backward: each parameter stepped as its gradient is ready",
          "loss                      4 chunks (vocabulary 512): targets only, each chunk's gradients computed "
          "as it goes (nothing recomputed in backward), never the whole logits"]),
        ("llama3/8B_full", [], ["loss                      8 chunks (vocabulary 128,256)",
                                "optimizer state           bf16 (torch.optim.AdamW: 2 states in bf16): 4.00 bytes"]),
        ("tiny/full", ["optimizer._component_=torchao.optim.AdamW8bit"],
         ["optimizer state           8-bit (torchao.optim.AdamW8bit: 2 states in 8 bits with an fp32 scale per 256 "
          "elements; tensors under 4,096 elements in fp32): 2.11 bytes per parameter, 0.26x fp32 AdamW's 8; its first "
          "step compiles (tens of seconds on a CPU)"]),
        ("mistral/7B_full", ["loss_chunks=1"], ["loss                      targets only (vocabulary 32,768), at once"]),
    ],
)
def test_validate_shows_the_memory_switches_with_the_ac_plan(config, overrides, lines, capsys):
    assert main(["validate", "--config", config, *overrides]) == 0
    out = capsys.readouterr().out
    for line in lines:
        assert line in out, out


def test_plan_answers_for_llama3_8b_on_4_processes_without_weights(capsys):
    assert main(["plan", "--config", "llama3/8B_full", "--nproc", "4", "--budget-gib", "24"]) == 0
    out = capsys.readouterr().out
    assert "8,030,261,248 parameters; 4 process(es), batch 2 x 2048 tokens per process" in out
    # The five parts, the step, the process's fixed cost, device (what fits compares), host.
    row = re.compile(r"^(none|per-op|every \S+ block|full) +((?:[\d.]+ +){9})([+\-][\d.]+%) +([\d.]+) +(yes|no)")
    rows = [m.groups() for m in map(row.match, out.splitlines()) if m]
    assert [r[0] for r in rows] == ["none", "per-op", "every 4th block", "every 2nd block", "full"]
    for r in rows:
        *parts, step, process, device, host = map(float, r[1].split())
        assert abs(sum(parts) - step) <= 0.03 and abs(step + process - device) <= 0.02 and process > 0 and host == 0
    totals = {r[0]: float(r[1].split()[-2]) for r in rows}
    fits = {r[0]: r[4] == "yes" for r in rows}
    assert totals["none"] > totals["full"]  # no AC needs more than full AC
    assert fits == {name: total <= 24 for name, total in totals.items()}
    picked = next(line for line in out.splitlines() if "<- ac_mode: auto picks this" in line)
    assert picked.startswith(next(name for name in totals if fits[name]))


def test_plan_of_compiled_blocks_counts_what_a_compiled_block_saves():
    """compile: true reaches the planner: without AC a compiled block saves less than an eager one; with full AC
    both keep the blocks' inputs, and the title and legend say the blocks are compiled. In subprocesses: tracing
    the compiled blocks grows a process, and the tests after this one size a budget by this process's memory."""
    saved = {}
    for compiled in ("false", "true"):
        result = run_tune("plan", "--config", "tiny/full", f"compile={compiled}")
        assert result.returncode == 0, result.stderr
        out = result.stdout
        assert (", compiled blocks," in out.splitlines()[0]) == (compiled == "true")
        assert ("saves what inductor's partitioner keeps" in out) == (compiled == "true")
        saved[compiled] = {line.split()[0]: float(line.split()[-1]) for line in out.splitlines()
                           if line.startswith(("none ", "full "))}
    assert saved["true"]["none"] < 0.9 * saved["false"]["none"]
    assert saved["true"]["full"] == saved["false"]["full"]


def test_plan_shows_what_fits_llama3_8b_on_a_24_gb_card_and_what_it_needs_on_the_host(capsys):
    assert main(["plan", "--config", "llama3/8B_full_single_device", "--budget-gib", "22"]) == 0
    out = capsys.readouterr().out
    ablation = out.split("each memory switch added to the ones above")[1].splitlines()
    row = re.compile(r"^(as configured|\+ .+?) +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+) +(yes|no)$")
    rows = {m[1]: tuple(map(float, m.groups()[1:5])) + (m[6] == "yes",) for m in map(row.match, ablation) if m}
    assert list(rows)[0] == "as configured" and rows["as configured"][2] > 22 and not rows["as configured"][4]
    fitting = {label: values for label, values in rows.items() if values[4]}
    assert fitting, out  # a row that fits 22 GiB on the device...
    optimizer, step, device, host, _ = fitting["+ fsdp.cpu_offload=true"]
    assert device <= 22 and host > 30  # ...and what it needs on the host: parameters, gradients, optimizer state


def test_plan_draws_the_estimates(tmp_path, capsys):
    png = tmp_path / "plan.png"
    assert main(["plan", "--config", "tiny/full", "max_seq_len=64", "--budget-gib", "0.05", "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {png}" in capsys.readouterr().out


def test_plan_png_labels_a_small_model_in_mib(tmp_path, monkeypatch):
    """Labelled in GiB to one decimal, every bar of a small model read 0.4 or 0.0. Each bar is the device total
    (the step and the process's fixed cost), as tall as its stacked parts. The table simulates each step once."""
    from matplotlib.axes import Axes

    import torchtune_ac.memory.planner.estimate as estimate_module
    from torchtune_ac.cli import load_recipe, load_recipe_config, resolve_recipe_path
    from torchtune_ac.run.memory_table import draw_memory_table, memory_table

    recipe = load_recipe(resolve_recipe_path("full_finetune"))
    cfg = load_recipe_config(recipe, "tiny/full", ["max_seq_len=64"], [])
    # A fresh process's resident set (0.35-0.4 GiB), not this one's after the tests before it (above 1 GiB once
    # the compiler has run in it, which would make GiB the right unit).
    monkeypatch.setattr("torchtune_ac.run.memory_table.process_fixed_bytes", lambda device: (400 * 2**20, "measured"))
    simulated, simulate = collections.Counter(), estimate_module._simulate
    monkeypatch.setattr(estimate_module, "_simulate", lambda *args: simulated.update([args[2:]]) or simulate(*args))
    table = memory_table(cfg, world_size=1, budget_gib=0.05)
    # Each step simulated once: the ablation's first row (full AC as configured) is the table's full-AC row.
    assert simulated and set(simulated.values()) == {1}, simulated
    (label, first), full = table.ablation[0], table.estimates[-1]
    assert label == "as configured" and dataclasses.replace(first, extra_flops=full.extra_flops) == full
    drawn, ylabels = [], []
    real_annotate, real_ylabel = Axes.annotate, Axes.set_ylabel
    monkeypatch.setattr(Axes, "annotate",
                        lambda ax, text, *a, **k: drawn.append(text) or real_annotate(ax, text, *a, **k))
    monkeypatch.setattr(Axes, "set_ylabel",
                        lambda ax, text, *a, **k: ylabels.append(text) or real_ylabel(ax, text, *a, **k))
    draw_memory_table(table, tmp_path / "plan.png")
    assert drawn == table.bar_labels() and ylabels == ["MiB per process at the step's peak"]
    for label, estimate in zip(drawn, table.estimates):
        mib, unit = label.split("\n")[0].split()
        assert unit == "MiB" and int(mib) == round(estimate.device / 2**20) and int(mib) >= 10


def test_plan_says_what_it_does_not_model(tmp_path, capsys):
    note = ("Note: fsdp.param_dtype=bf16 is not modelled: activations and gathered weights are counted in fp32 "
            "(dtype), so the estimate is higher than the run's")
    assert main(["plan", "--config", "tiny/full", "max_seq_len=64", "--nproc", "2", "fsdp.param_dtype=bf16"]) == 0
    assert note in capsys.readouterr().out.splitlines()
    # One process does not use FSDP2; bf16 storage computes in bf16, as modelled.
    for argv in (["--nproc", "1", "fsdp.param_dtype=bf16"], ["--nproc", "2", "dtype=bf16", "fsdp.param_dtype=bf16"]):
        assert main(["plan", "--config", "tiny/full", "max_seq_len=64", *argv]) == 0
        assert "Note:" not in capsys.readouterr().out


def test_plan_without_nproc_plans_for_the_processes_the_config_s_degrees_need(capsys):
    """tune plan of an EP config without --nproc said "world size 1", which the user never chose."""
    moe = ["--config", "tiny/full", "model._component_=torchtune_ac.models.qwen3_moe_tiny", "checkpoint_dir=null",
           "tokenizer.path=${embedded_checkpoint:}", "expert_parallel_dim=2", "max_seq_len=64"]
    assert main(["plan", *moe]) == 0
    title = capsys.readouterr().out.splitlines()[0]
    assert title.startswith("torchtune_ac.models.qwen3_moe_tiny: 1,057,152 parameters; 2 process(es) (2 shards, EP 2)")
    assert title.endswith("(--nproc not given: planned for 2 processes, the fewest for expert_parallel_dim=2; pass "
                          "--nproc for another count)")
    assert main(["plan", *moe, "--nproc", "1"]) == 2  # a world size the user chose is still checked
    assert "expert_parallel_dim=2: must divide the processes each replica shards over (world size 1" in \
        capsys.readouterr().err


def test_auto_says_what_its_estimate_does_not_model(tmp_path, monkeypatch):
    from torchtune_ac.cli import load_recipe, load_recipe_config, resolve_recipe_path

    # A fresh process's resident set, not this one's after the tests before it (above 1 GiB, the budget below, once
    # the compiler has run in it).
    monkeypatch.setattr("torchtune_ac.run.plan.process_fixed_bytes", lambda device: (400 * 2**20, "measured"))
    recipe = load_recipe(resolve_recipe_path("full_finetune"))
    cfg = load_recipe_config(recipe, "tiny/full", [f"output_dir={tmp_path}", "max_seq_len=64", "ac_mode=auto",
                                                   "enable_activation_checkpointing=null", "ac_memory_budget_gib=1",
                                                   "fsdp.param_dtype=bf16"], [])
    assert ("warning", "ac_mode=auto: fsdp.param_dtype=bf16 is not modelled: activations and gathered weights are "
            "counted in fp32 (dtype), so the estimate is higher than the run's") in recipe.preflight(cfg, world_size=2)


@pytest.mark.parametrize("name", ["plan", "plan.txt", "plan.jpg"])
def test_plan_refuses_a_png_path_of_another_format(name, tmp_path, capsys):
    # matplotlib picks the format from the suffix: "plan" was written as plan.png while tune said "wrote plan",
    # "plan.txt" was a traceback (exit 1), "plan.jpg" a JPEG.
    assert main(["plan", "--config", "tiny/full", "--png", str(tmp_path / name)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tune: error: --png {tmp_path / name}: the file name must end in .png"), err
    assert list(tmp_path.iterdir()) == []


def test_from_hf_config_reads_the_runs_checkpoint_dir(tmp_path, capsys, embedded_checkpoint):
    # Any supported Hugging Face checkpoint: name the builder and the directory, once.
    other = tmp_path / "six_layers"
    other.mkdir()
    config = json.loads((embedded_checkpoint / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 6}))
    assert main(["validate", "--config", "tiny/full", "model._component_=torchtune_ac.models.from_hf_config"]) == 0
    assert "torchtune_ac.models.from_hf_config: 1,607,808 parameters, 8 layers" in capsys.readouterr().out
    assert main(["validate", "--config", "tiny/full", "model._component_=torchtune_ac.models.from_hf_config",
                 f"checkpoint_dir={other}", "max_seq_len=32", "+model.max_seq_len=64"]) == 0
    assert "6 layers" in capsys.readouterr().out
    assert main(["validate", "--config", "tiny/full", "model._component_=torchtune_ac.models.from_hf_config",
                 "checkpoint_dir=null", f"tokenizer.path={embedded_checkpoint}"]) == 2
    assert "from_hf_config: no config.json to read: set checkpoint_dir" in capsys.readouterr().err


def test_validate_a_copied_config_with_overrides(tmp_path, capsys):
    dest = tmp_path / "my.yaml"
    assert main(["cp", "tiny/full", str(dest)]) == 0
    assert main(["validate", "--config", str(dest), "ac_mode=selective", "ac_option=op"]) == 0
    assert "per-op" in capsys.readouterr().out


def _bad_yaml(tmp_path, text):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return str(path)


TINY = builtin_config_path("tiny/full").read_text()

# (command line, text the one-line message must contain); `{tmp}` is replaced by a temporary directory.
BAD_COMMAND_LINES = [
    (["run", "no_such_recipe", "--config", "tiny/full"], "recipe no_such_recipe: not a built-in recipe"),
    (["run", "full_finetune", "--config", "no/such_config"], "config no/such_config: not a file"),
    (["run", "full_finetune", "--config", "{tmp}/missing.yaml"], "no such file"),
    (["run", "full_finetune"], "required: --config"),
    (["run", "full_finetune", "--config", "tiny/full", "batch_size=[1"], "malformed override 'batch_size=[1'"),
    (["run", "full_finetune", "--config", "tiny/full", "batch_size"], "malformed override 'batch_size'"),
    (["run", "full_finetune", "--config", "tiny/full", "~no_such_key"], "'no_such_key' does not exist"),
    (["validate", "--config", "tiny/full", "enable_activaton_checkpointing=true"],
     "did you mean enable_activation_checkpointing?"),
    (["validate", "--config", "tiny/full", "batch_size=four"], "batch_size='four': expected an integer"),
    (["validate", "--config", "tiny/full", "dtype=fp16"], "dtype='fp16': expected one of fp32, bf16"),
    (["validate", "--config", "tiny/full", "epochs=0"], "epochs=0: must be >= 1"),
    (["validate", "--config", "tiny/full", "optimizer._component_=os.system"], "not allowed"),
    (["validate", "--config", "tiny/full", "optimizer._component_=torch.hub.load"], "not allowed"),
    (["validate", "--config", "tiny/full", "optimizer.lrr=0.1"], "did you mean lr?"),
    (["validate", "--config", "tiny/full", "model._component_=torchtune_ac.models.llama_tyni"],
     "did you mean torchtune_ac.models.llama_tiny?"),
    (["validate", "--config", "{tmp}/bad.yaml"], "invalid YAML"),
    (["validate", "--config", "tiny/full", "ac_mode=partial"], "ac_mode"),
    (["validate", "--config", "tiny/full", "ac_mode=selective", "ac_option=12"], "8 layers"),
    (["validate", "--config", "tiny/full", "ac_mode=selective", "ac_option=0"], "ac_option"),
    (["validate", "--config", "tiny/full", "ac_mode=selective"], "ac_option"),
    (["validate", "--config", "tiny/full", "ac_mode=full", "ac_option=2"], "ac_option"),
    (["validate", "--config", "tiny/full", "enable_activation_checkpointing=false", "ac_mode=full"],
     "enable_activation_checkpointing"),
    (["validate", "--config", "tiny/full", "ac_mode=selective", "ac_option=true"], "ac_option"),
    (["validate", "--config", "tiny/full", "ac_mode=selective", "ac_option=1.5"], "ac_option"),
    (["validate", "--config", "tiny/full", "optimizer_in_bwd=true"],
     "optimizer_in_bwd=true with clip_grad_norm=1.0: in backward each parameter is updated"),
    (["validate", "--config", "tiny/full", "loss_chunks=0"], "loss_chunks=0: must be >= 1"),
    (["validate", "--config", "tiny/full", "optimizer_in_bwd=maybe"], "optimizer_in_bwd='maybe': expected true or false"),
    (["validate", "--config", "tiny/full", "checkpoint_dir=null", "tokenizer.path=/x", "loss_chunks=4",
      "model._component_=torch.nn.TransformerEncoder", "+model.encoder_layer._component_=torch.nn.TransformerEncoderLayer",
      "+model.encoder_layer.d_model=8", "+model.encoder_layer.nhead=2", "+model.num_layers=2"],
     "loss_chunks=4: the chunked loss runs through the model's output head"),
    (["validate", "--config", "tiny/full", "ac_mode=auto", "enable_activation_checkpointing=null"],
     "ac_mode=auto on cpu: set ac_memory_budget_gib"),
    (["validate", "--config", "tiny/full", "ac_mode=auto", "enable_activation_checkpointing=null",
      "ac_memory_budget_gib=0.001"], "ac_mode=auto: no plan fits ac_memory_budget_gib=0.001: even full AC needs"),
    # tiny/full turns the switch on: auto could pick none, which contradicts it (was silently "auto -> none").
    (["validate", "--config", "tiny/full", "ac_mode=auto", "ac_memory_budget_gib=1"],
     "enable_activation_checkpointing=true contradicts ac_mode=auto"),
    (["validate", "--config", "tiny/full", "ac_memory_budget_gib=4"], "ac_memory_budget_gib=4: only used by ac_mode: auto"),
    (["plan", "--config", "tiny/full", "--nproc", "0"], "--nproc: must be >= 1, got 0"),
    (["plan", "--config", "tiny/full", "--budget-gib", "-1"], "--budget-gib: must be > 0, got -1"),
    (["plan", "--config", "tiny/full", "max_seq_len=null"], "max_seq_len: must be set to estimate memory"),
    # The run's tensor-parallel checks: tune plan printed a full table, "fits: yes" on every row, before.
    (["plan", "--config", "tiny/full", "--nproc", "4", "tensor_parallel_dim=4"],
     "tensor_parallel_dim=4: must divide n_kv_heads=2 (fewer than 4: heads are not copied across ranks)"),
    (["validate", "--config", "tiny/full", "--bogus-flag"], "unrecognized arguments: --bogus-flag"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["run", "--nproc_per_node", "0", "full_finetune", "--config", "tiny/full"], "--nproc-per-node: must be >= 1, got 0"),
    (["run", "--nproc_per_node", "-1", "full_finetune", "--config", "tiny/full"], "must be >= 1, got -1"),
    (["run", "--nproc_per_node", "x", "full_finetune", "--config", "tiny/full"], "expected an integer, got 'x'"),
    (["run", "--nnodes", "abc", "full_finetune", "--config", "tiny/full"], "--nnodes: expected N or MIN:MAX"),
    (["run", "--nnodes", "0", "full_finetune", "--config", "tiny/full"], "--nnodes: expected N or MIN:MAX"),
    (["run", "--nnodes", "3:2", "full_finetune", "--config", "tiny/full"], "--nnodes: expected N or MIN:MAX"),
    (["run", "--node_rank", "-1", "full_finetune", "--config", "tiny/full"], "--node_rank"),
    (["run", "--master_port", "70000", "full_finetune", "--config", "tiny/full"], "between 1 and 65535"),
    (["cp", "no/such", "{tmp}/x.yaml"], "not a built-in recipe or config"),
    # torchtune's names: no hint, or a hint to the wrong config, before.
    (["run", "full_finetune_single_device", "--config", "tiny/full"],
     "recipe full_finetune_single_device: not a built-in recipe "
     "(full_finetune, full_dpo, lora_finetune, lora_dpo, grpo, lora_grpo) and "
     "not a .py file (did you mean "
     "full_finetune? It runs on one device and on many; see `tune ls`)"),
    (["run", "full_finetune", "--config", "llama3_2/1B_full_single_device"],
     "config llama3_2/1B_full_single_device: not a file and not a built-in config (did you mean llama3_2/1B_full?"),
    (["validate", "--config", "llama3/8B_ful"], "(did you mean llama3/8B_full?"),
    # torchtune's adapter configs and recipes: the adapter recipes' own names.
    (["validate", "--config", "llama3_2/1B_lora_single_device"],
     "config llama3_2/1B_lora_single_device: not a file and not a built-in config (did you mean llama3_2/1B_lora?"),
    (["run", "lora_finetune_single_device", "--config", "tiny/full"],
     "recipe lora_finetune_single_device: not a built-in recipe "
     "(full_finetune, full_dpo, lora_finetune, lora_dpo, grpo, lora_grpo) and "
     "not a .py file (did you mean lora_finetune? It runs on one device and on many; see `tune ls`)"),
    # Typos in dotted keys on the command line: blamed on the YAML file before.
    (["validate", "--config", "tiny/full", "optimzer.lr=1e-4"],
     "tune: error: command line: optimzer: unknown key (did you mean optimizer?)"),
    (["validate", "--config", "tiny/full", "+foo.bar=1"], "tune: error: command line: foo: unknown key"),
]


@pytest.mark.parametrize("argv, expected", BAD_COMMAND_LINES, ids=[" ".join(a) for a, _ in BAD_COMMAND_LINES])
def test_bad_command_lines_exit_2_with_one_short_message(argv, expected, tmp_path, capsys):
    (tmp_path / "bad.yaml").write_text("a: [1,\n b: 2\n")
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err, err
    assert "Traceback" not in err
    assert err.startswith("tune: error: ")
    assert len(err.strip().splitlines()) <= 2, err


def test_an_empty_output_dir_is_refused_not_the_current_directory(tmp_path, monkeypatch, capsys):
    # output_dir='' used to pass, and the run wrote its checkpoints and metrics.jsonl into the current directory.
    monkeypatch.chdir(tmp_path)
    assert main(["run", "full_finetune", "--config", "tiny/full", "max_steps_per_epoch=1", "output_dir=''"]) == 2
    assert "output_dir='': must not be empty" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_recipe_file_with_a_syntax_error_is_a_user_error(tmp_path, capsys):
    recipe = tmp_path / "mine.py"
    recipe.write_text("CONFIG_SCHEMA = None\ndef run(:\n")
    assert main(["run", str(recipe), "--config", "tiny/full"]) == 2
    err = capsys.readouterr().err
    assert f"recipe {recipe}:2: invalid Python" in err, err
    assert "Traceback" not in err


def test_user_errors_have_no_traceback_in_a_real_process(tmp_path):
    result = run_tune("validate", "--config", "tiny/full", "ac_mode=selective", "ac_option=12")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "8 layers" in result.stderr
    debug = run_tune("--debug", "validate", "--config", "tiny/full", "ac_mode=selective", "ac_option=12")
    assert debug.returncode == 2
    assert "Traceback" in debug.stderr


@pytest.mark.parametrize(
    "flags, standalone",
    [
        (["--nproc_per_node", "2"], True),
        (["--nproc_per_node", "2", "--master_port", "29611"], False),  # --standalone would ignore the port
        (["--nproc_per_node", "2", "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:29612"], False),
    ],
)
def test_launcher_flags_reach_torch_distributed_run(flags, standalone, monkeypatch, tmp_path):
    import torch.distributed.run

    launched = []
    monkeypatch.setattr(torch.distributed.run, "run", launched.append)
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # restored: the launcher path sets it
    argv = ["run", *flags, "full_finetune", "--config", "tiny/full", f"output_dir={tmp_path / 'out'}"]
    assert main(argv) == 0
    (args,) = launched
    assert args.nproc_per_node == "2"
    assert args.standalone is standalone
    if "--master_port" in flags:
        assert args.master_port == 29611
    if "--rdzv_endpoint" in flags:
        assert (args.rdzv_backend, args.rdzv_endpoint) == ("c10d", "localhost:29612")
    assert args.training_script.endswith("full_finetune.py")
    assert args.training_script_args[-1] == f"output_dir={tmp_path / 'out'}"


def test_several_config_problems_are_listed_together(capsys):
    assert main(["validate", "--config", "tiny/full", "batch_size=0", "seed=x", "shuffle=maybe"]) == 2
    err = capsys.readouterr().err
    assert "3 problems" in err
    for key in ("batch_size=0", "seed='x'", "shuffle='maybe'"):
        assert key in err


def test_a_bad_command_line_value_is_blamed_on_the_command_line_not_the_yaml(capsys):
    assert main(["validate", "--config", "tiny/full", "batch_size=0"]) == 2
    assert capsys.readouterr().err == "tune: error: command line: batch_size=0: must be >= 1\n"


def test_allow_component_flag_and_env(tmp_path, capsys, monkeypatch):
    argv = ["validate", "--config", "tiny/full", "optimizer._component_=textwrap.dedent"]
    assert main(argv) == 2
    assert "--allow-component textwrap.dedent " in capsys.readouterr().err
    monkeypatch.delenv("TUNE_ALLOWED_COMPONENTS", raising=False)
    # Allowed explicitly, the path is imported and checked like any other (dedent takes no lr).
    for allowed in ("textwrap", "textwrap.dedent"):
        assert main(argv + ["--allow-component", allowed, "optimizer.lr=1"]) == 2
        assert "optimizer.lr: not an argument of textwrap.dedent" in capsys.readouterr().err


@pytest.mark.slow
def test_wheel_install_runs_outside_the_source_tree(tmp_path):
    """Build the wheel, install it (no deps) into a fresh venv that borrows this venv's packages, run `tune`."""
    wheel_dir = tmp_path / "wheel"
    # No PYTHONPATH for pip: a source tree on it (with the egg-info a build leaves there) reads as torchtune_ac
    # already installed, and pip would skip the install.
    clean = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheel_dir), str(REPO)],
        check=True,
        capture_output=True,
        timeout=300,
        env=clean,
    )
    (wheel,) = wheel_dir.glob("torchtune_ac-*.whl")
    # Every shipped config, recipe and embedded data file is in the wheel (a new config folder must not be
    # left out of the package list).
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    expected = (
        [f"torchtune_ac/_configs/{p.relative_to(REPO / 'configs').as_posix()}" for p in (REPO / "configs").rglob("*.yaml")]
        + [f"torchtune_ac/_recipes/{p.name}" for p in (REPO / "recipes").glob("*.py")]
        + [f"torchtune_ac/data/embedded/{p.relative_to(REPO / 'torchtune_ac/data/embedded').as_posix()}"
           for p in (REPO / "torchtune_ac/data/embedded").rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    )
    assert len(expected) > 10
    assert sorted(set(expected) - in_wheel) == []
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next(venv.glob("lib/python*/site-packages"))
    # A plain path line: this venv's packages become importable, but their .pth hooks (the editable
    # install of the source tree among them) are not run.
    deps = next(p for p in map(Path, sys.path) if p.name == "site-packages" and (p / "torch").is_dir())
    (site / "borrowed.pth").write_text(f"{deps}\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--no-deps", "-q", str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
        env=clean,
    )
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {**os.environ, "TORCHTUNE_AC_CACHE": str(tmp_path / "cache"), "PYTHONPATH": ""}
    tune = [str(venv / "bin" / "tune")]
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import torchtune_ac; print(torchtune_ac.__file__)"],
        capture_output=True, text=True, cwd=outside, env=env, timeout=120,
    )
    assert str(site) in where.stdout, where.stdout + where.stderr
    ls = subprocess.run(tune + ["ls"], capture_output=True, text=True, cwd=outside, env=env, timeout=120)
    assert ls.returncode == 0, ls.stderr
    assert "llama3/8B_full" in ls.stdout
    validate = subprocess.run(
        tune + ["validate", "--config", "tiny/full"], capture_output=True, text=True, cwd=outside, env=env, timeout=300
    )
    assert validate.returncode == 0, validate.stderr
    assert str(site) in validate.stdout  # the config came from the wheel, not from the source tree
    assert "full: all 8 blocks" in validate.stdout


def test_validate_names_the_config_file_of_an_unsupported_checkpoint(tmp_path, capsys, embedded_checkpoint):
    checkpoint = tmp_path / "yarn"
    shutil.copytree(embedded_checkpoint, checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (checkpoint / "config.json").write_text(json.dumps(config))

    # A file that exists and contradicts the config is an error for validate as for run (a missing one: a warning).
    assert main(["validate", "--config", "tiny/full", f"checkpoint_dir={checkpoint}"]) == 2

    err = capsys.readouterr().err
    assert f"{checkpoint / 'config.json'}: unsupported Hugging Face llama config: rope_scaling.rope_type='yarn'" in err


def test_fsdp_settings_in_a_single_process_run_are_not_silently_ignored(tmp_path):
    from torchtune_ac.cli import load_recipe, load_recipe_config, resolve_recipe_path

    recipe = load_recipe(resolve_recipe_path("full_finetune"))
    cfg = load_recipe_config(recipe, "tiny/full", [f"output_dir={tmp_path}", "fsdp.param_dtype=bf16"], [])
    assert ("warning", "fsdp.*: these settings apply only when the run has more than one process (FSDP2)") in (
        recipe.preflight(cfg, world_size=1)
    )
    assert not [w for w in recipe.preflight(cfg, world_size=2) if w[0] == "warning"]
    assert not [w for w in recipe.preflight(cfg, world_size=None) if w[0] == "warning"]  # tune validate


def test_a_max_seq_len_beyond_the_model_context_is_not_silently_accepted(tmp_path):
    from torchtune_ac.cli import load_recipe, load_recipe_config, resolve_recipe_path

    recipe = load_recipe(resolve_recipe_path("full_finetune"))

    def warnings(*overrides):
        cfg = load_recipe_config(recipe, "tiny/full", [f"output_dir={tmp_path}", *overrides], [])
        return [w for kind, w in recipe.preflight(cfg, world_size=None) if kind == "warning"]

    assert warnings("max_seq_len=4096") == [
        "max_seq_len=4096: samples may be longer than the model's context (512 positions, "
        "torchtune_ac.models.llama_tiny); if you extend it on purpose, say so with model.max_seq_len=4096"
    ]
    assert warnings("max_seq_len=4096", "+model.max_seq_len=4096") == []
    assert warnings("max_seq_len=512") == []


def test_the_workers_errors_are_printed_once_each(capsys):
    from torchtune_ac.runtime.launcher import status_of_failed_workers

    assert status_of_failed_workers({0: 2, 1: 2, 2: -15}, {0: "data.jsonl:3: bad", 1: "data.jsonl:3: bad"}) == 2
    assert capsys.readouterr().err.splitlines() == ["tune: error: data.jsonl:3: bad"]
    assert status_of_failed_workers({0: 2, 1: 2}, {0: "a", 1: "b"}) == 2
    assert capsys.readouterr().err.splitlines() == ["tune: error: rank 0: a", "tune: error: rank 1: b"]
    assert status_of_failed_workers({0: 2, 1: 1}, {0: "a"}) == 1  # rank 1 failed without a line: say so
    assert capsys.readouterr().err.splitlines()[-1].endswith("failed with exit status [1, 2]; see their messages above")


@pytest.mark.parametrize(
    "exit_codes, status, says",
    [
        ({0: 143, 1: 143}, 143, None),  # stopped on a signal after the checkpoint: rank 0 said how to resume
        ({0: 143, 1: -15}, 143, None),  # the launcher ended the slower worker once the first had exited
        ({0: -2, 1: -2}, 130, "tune: interrupted"),  # Ctrl-C twice before the workers could say anything
        ({0: 130, 1: 130}, 130, None),  # a second Ctrl-C: rank 0 said what survived
        ({0: 2, 1: -15}, 2, "failed with exit status [2]"),
        ({0: 3, 1: 3}, 3, "failed with exit status [3]"),
        ({0: 1, 1: 2}, 1, "failed with exit status [1, 2]"),
        ({0: -9, 1: -15}, 1, "tune: error: rank 0 was killed by SIGKILL (the out-of-memory killer, a scheduler or "
                             "kill -9: not this run); the checkpoints written before are complete"),
        ({0: -11, 1: 1}, 1, "rank 0 was killed by SIGSEGV"),
    ],
)
def test_the_launcher_exits_with_its_workers_status(exit_codes, status, says, capsys):
    from torchtune_ac.runtime.launcher import status_of_failed_workers

    assert status_of_failed_workers(exit_codes) == status
    err = capsys.readouterr().err
    assert (says in err) if says else err == ""


def test_a_rank_that_lost_its_peer_is_one_line_after_the_rank_that_died(capsys):
    from torchtune_ac.runtime.launcher import lost_peer, status_of_failed_workers

    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
                        "peer [127.0.0.1]:5531. This is typically caused by a remote worker crashing. Check the logs")
    assert lost_peer(gloo) == "Connection closed by peer [127.0.0.1]:5531"
    assert lost_peer(RuntimeError("CUDA out of memory")) is None and lost_peer(ValueError("Broken pipe")) is None
    assert status_of_failed_workers({0: 1, 1: -9}, lost={0: lost_peer(gloo)}) == 1
    assert capsys.readouterr().err.splitlines() == [
        "tune: error: rank 1 was killed by SIGKILL (the out-of-memory killer, a scheduler or kill -9: not this run); "
        "rank 0 stopped when it lost the connection to it in a collective (Connection closed by peer "
        "[127.0.0.1]:5531); the checkpoints written before are complete: to continue, run the same command with "
        "resume_from_checkpoint=true"]


class _Left(Exception):
    """Raised by the stand-in for ``os._exit``."""


@pytest.mark.parametrize("world_size, leaves", [("2", True), ("1", False), (None, False)])
def test_a_worker_of_a_multi_process_run_leaves_with_its_exact_status(world_size, leaves, tmp_path, monkeypatch):
    """Workers skip the interpreter's teardown (where gloo's destructors can abort a finished rank); one process does not."""
    from torchtune_ac import cli
    from torchtune_ac.registry import find_recipe

    def fake_exit(status):
        raise _Left(status)

    monkeypatch.setattr(cli.os, "_exit", fake_exit)
    if world_size is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    argv = ["--config", "tiny/full", "no_such_key=1"]  # refused before any process group exists
    recipe = str(find_recipe("full_finetune").path)
    if leaves:
        with pytest.raises(_Left) as left:
            cli.recipe_main(argv, recipe)
        assert left.value.args == (2,)
    else:
        assert cli.recipe_main(argv, recipe) == 2


def test_validate_says_a_hub_dataset_is_read_at_run_time_and_whether_offline_mode_leaves_it_anything(capsys):
    """The tests run with HF_HUB_OFFLINE=1 and an empty datasets cache: the run would stop, validate says why."""
    assert main(["validate", "--config", "tiny/full", "dataset.source=tatsu-lab/alpaca"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"dataset source +tatsu-lab/alpaca: a Hugging Face Hub dataset, not in the datasets cache "
                     r"\(.*\); HF_HUB_OFFLINE is set: the run reads the cache only\n", out), out
    assert re.search(r"warning +dataset source tatsu-lab/alpaca: HF_HUB_OFFLINE is set and the dataset is not in the "
                     "datasets cache: the run will stop\n", out), out


def test_a_run_prints_its_result_on_stdout_and_its_logs_on_stderr(tmp_path):
    """Everything, the final done: line included, went to stderr."""
    result = run_tune_subprocess(tune_run_argv(tmp_path / "out", "max_steps_per_epoch=2"))
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(rf"done: 2 step\(s\) in [\d.]+ s, final loss [\d.]+, peak memory [\d.]+ GiB; checkpoints in "
                        rf"{re.escape(str(tmp_path / 'out'))}\n", result.stdout), result.stdout
    assert "saved checkpoint" in result.stderr and "done:" not in result.stderr



@pytest.mark.parametrize("command", ["run", "validate", "plan"])
def test_help_shows_overrides_in_the_usage_line(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    out = capsys.readouterr().out
    usage = out.split("\n\n")[0]
    assert exit_info.value.code == 0 and usage.startswith(f"usage: tune {command} ")
    assert usage.endswith(" [overrides ...]"), usage
    assert "overrides: config keys to change, in Hydra's grammar" in out


def test_validate_warns_for_a_from_hf_config_checkpoint_of_another_machine(tmp_path, capsys):
    """docs/usage.md promises a warning for a checkpoint path that does not exist here; from_hf_config made it
    exit 2."""
    elsewhere = tmp_path / "models" / "Llama-3.2-1B"
    argv = ["--config", "tiny/full", "model._component_=torchtune_ac.models.from_hf_config",
            f"checkpoint_dir={elsewhere}", f"tokenizer.path={elsewhere}"]
    assert main(["validate", *argv]) == 0
    out = capsys.readouterr().out
    assert ("  model           torchtune_ac.models.from_hf_config: its architecture is read from checkpoint_dir when "
            "the run starts (not on this machine: sizes and memory plan not checked)") in out.splitlines()
    assert (f"  warning         model (torchtune_ac.models.from_hf_config): checkpoint directory {elsewhere} does not "
            "exist: its size, memory plan and checkpoint are checked on the machine that has it") in out.splitlines()
    # tune plan has no architecture to simulate: it says how to give it one.
    assert main(["plan", *argv]) == 2
    assert capsys.readouterr().err == (
        f"tune: error: checkpoint directory {elsewhere} does not exist, and model torchtune_ac.models.from_hf_config "
        "reads the architecture from it: to plan here, copy its config.json alone (no weights) into a folder and set "
        "checkpoint_dir to it, or name the model's builder (model._component_=torchtune_ac.models.llama3_8b, ...)\n")


def test_validate_reads_the_data(tmp_path, capsys):
    """A malformed line, or ShareGPT data without its conversation_column, passed tune validate and failed only
    at tune run."""
    good = json.dumps({"instruction": "Add 2 and 2.", "output": "4"})
    (tmp_path / "bad.jsonl").write_text(good + "\n" + '{"instruction": \n')
    (tmp_path / "sharegpt.jsonl").write_text(json.dumps(
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}) + "\n")
    assert main(["validate", "--config", "tiny/full", f"+dataset.source={tmp_path}/bad.jsonl"]) == 2
    assert capsys.readouterr().err == (f"tune: error: {tmp_path}/bad.jsonl:2: invalid JSON: Expecting value "
                                       "(column 17)\n")
    sharegpt = ["dataset._component_=torchtune_ac.data.chat_dataset", f"+dataset.source={tmp_path}/sharegpt.jsonl",
                "+dataset.conversation_style=sharegpt"]
    assert main(["validate", "--config", "tiny/full", *sharegpt]) == 2
    assert capsys.readouterr().err == (f"tune: error: {tmp_path}/sharegpt.jsonl:1: missing column 'messages' (the "
                                       "record has: conversations); set conversation_column: <column>\n")
    assert main(["validate", "--config", "tiny/full", *sharegpt, "+dataset.conversation_column=conversations"]) == 0
    assert (f"  dataset                   {tmp_path}/sharegpt.jsonl: 1 record read and encoded, 1 sample"
            in capsys.readouterr().out.splitlines())
    # The embedded data, all of it, with what max_seq_len costs it; a file of another machine is a warning.
    assert main(["validate", "--config", "tiny/full", "max_seq_len=64",
                 f"+dataset_val={{_component_: torchtune_ac.data.instruct_dataset, source: {tmp_path}/val.jsonl}}"]
                ) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("  dataset                   ") and line.endswith(
        "instruct.jsonl: 3,000 records read and encoded, 2,887 samples") for line in lines), lines
    assert any(line.startswith("  warning                   data ") and "331 of 3,000 samples are longer than "
               "max_seq_len=64" in line for line in lines), lines
    assert f"  warning                   dataset_val: dataset source {tmp_path}/val.jsonl does not exist" in lines


def test_plan_shows_an_ac_setting_the_switches_refuse_as_not_applicable(capsys):
    """enable_activation_offloading with no AC is refused; the table's no-AC row refused the whole command."""
    assert main(["plan", "--config", "tiny/full", "device=cuda", "enable_activation_offloading=true",
                 "--budget-gib", "100"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line for line in lines[3:9]}
    assert rows["none"] == ("none              not applicable: enable_activation_offloading=true with no activation "
                            "checkpointing: it moves what checkpointed blocks keep for backward from a CUDA device to "
                            "pinned host memory, and no block is checkpointed")
    assert rows["per-op"].endswith("yes   <- ac_mode: auto picks this (the least recompute that fits)")
    assert rows["full"].split()[-1] == "yes"


def test_a_warmup_longer_than_the_run_is_said_by_validate_and_once_by_the_run(tmp_path, capsys, caplog):
    """A 3-step run with num_warmup_steps=100 ended at 3 % of the configured learning rate, without a word."""
    import logging

    from finetune_runs import check_success, run_tune_in_process

    warning = ("lr_scheduler.num_warmup_steps=100: the run has {}3 step(s), so it ends still warming up and the "
               "learning rate never reaches optimizer.lr=0.003; lower num_warmup_steps (or train longer)")
    overrides = ("max_steps_per_epoch=3", "lr_scheduler.num_warmup_steps=100")
    assert main(["validate", "--config", "tiny/full", f"output_dir={tmp_path}", *overrides]) == 0
    assert re.search(r"\n  warning +" + re.escape(warning.format("at most ")) + "\n", capsys.readouterr().out)
    # No cap: the data validate reads bounds the run (12 samples of batch 4: at most 3 steps, on one process).
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"q{i}", "output": f"a{i}"}) + "\n" for i in range(12)))
    assert main(["validate", "--config", "tiny/full", f"output_dir={tmp_path}", f"dataset.source={data}",
                 "batch_size=4", "max_steps_per_epoch=null", "lr_scheduler.num_warmup_steps=100"]) == 0
    assert re.search(r"\n  warning +" + re.escape(warning.format("at most ")) + "\n", capsys.readouterr().out)
    with caplog.at_level(logging.WARNING, logger="torchtune_ac"):
        check_success(run_tune_in_process(tune_run_argv(tmp_path / "run", *overrides)))
    assert [r.getMessage() for r in caplog.records].count(warning.format("")) == 1


def test_validate_reads_the_weights_headers_as_the_run_does(tmp_path, capsys, embedded_checkpoint):
    """A truncated model.safetensors and a folder of pickled weights passed tune validate, which tune run refuses at
    once; a folder of config.json alone (no weights on this machine) is a warning."""
    folders = {}
    for name in ("truncated", "pickled", "config_only"):
        folders[name] = tmp_path / name
        shutil.copytree(embedded_checkpoint, folders[name])
    weights = folders["truncated"] / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    (folders["pickled"] / "model.safetensors").rename(folders["pickled"] / "pytorch_model.bin")
    (folders["config_only"] / "model.safetensors").unlink()

    def validate(folder):
        code = main(["validate", "--config", "tiny/full", f"checkpoint_dir={folder}", f"output_dir={tmp_path / 'o'}"])
        return code, capsys.readouterr()

    code, out = validate(folders["truncated"])
    assert (code, out.err) == (2, f"tune: error: {weights}: not a readable safetensors file (truncated or corrupt?): "
                                  "Error while deserializing header: incomplete metadata, file not fully covered\n")
    code, out = validate(folders["pickled"])
    assert code == 2 and out.err.startswith(
        f"tune: error: {folders['pickled']}: no weights: expected model.safetensors or model.safetensors.index.json "
        "(found pytorch_model.bin: pickled weights are never loaded); convert them once")
    code, out = validate(folders["config_only"])
    assert code == 0 and re.search(rf"  warning +{re.escape(str(folders['config_only']))}: no weights: expected "
                                   "model.safetensors or model.safetensors.index.json\n", out.out)


def test_validate_without_a_tokenizer_still_says_the_data_is_missing(tmp_path, capsys):
    """The data was checked only through the tokenizer: a missing tokenizer hid a missing data file (and a migrated
    config, whose tokenizer is the checkpoint's, validated with no word about its data)."""
    assert main(["validate", "--config", "tiny/full", f"output_dir={tmp_path}", f"tokenizer.path={tmp_path / 'tok'}",
                 f"dataset.source={tmp_path / 'a.jsonl'}", "+dataset_val._component_=torchtune_ac.data.instruct_dataset",
                 f"+dataset_val.source=[{tmp_path / 'b.jsonl'},tatsu-lab/alpaca]"]) == 0
    warnings = re.findall(r"^  warning +(.*)$", capsys.readouterr().out, re.MULTILINE)
    assert warnings == [f"tokenizer path {tmp_path / 'tok'} does not exist",
                        f"dataset source {tmp_path / 'a.jsonl'} does not exist",
                        f"dataset_val: dataset source {tmp_path / 'b.jsonl'} does not exist"]


def test_validate_refuses_what_the_load_refuses_from_the_headers_in_the_run_s_words(tmp_path, capsys,
                                                                                    embedded_checkpoint, monkeypatch):
    """A checkpoint missing one tensor, and a mixture of experts whose config.json says 16 experts while its files
    hold 8, passed tune validate (it read the headers without comparing them with the model); tune run refused both
    once the model was built. Validate now says the run's line, reading no weight."""
    from safetensors.torch import load_file, save_file

    from finetune_runs import run_tune_in_process
    from torchtune_ac.models import qwen3_moe_tiny, save_hf

    missing = tmp_path / "missing"
    shutil.copytree(embedded_checkpoint, missing)
    tensors = load_file(missing / "model.safetensors")
    del tensors["model.layers.1.mlp.gate_proj.weight"]
    save_file(tensors, missing / "model.safetensors", metadata={"format": "pt"})
    moe = save_hf(qwen3_moe_tiny(), tmp_path / "moe")
    config = json.loads((moe / "config.json").read_text())
    (moe / "config.json").write_text(json.dumps({**config, "num_experts": 2 * config["num_experts"]}))
    cases = {missing: ("tiny/full", []),
             moe: ("tiny/full", ["model._component_=torchtune_ac.models.from_hf_config",
                                 f"tokenizer.path={embedded_checkpoint}"])}
    lines = {}
    for folder, (config_name, overrides) in cases.items():
        run = run_tune_in_process(["run", "full_finetune", "--config", config_name, f"checkpoint_dir={folder}",
                                   f"output_dir={tmp_path / 'out' / folder.name / 'run'}", "max_steps_per_epoch=1",
                                   *overrides])
        assert run.returncode == 2
        lines[folder] = [line for line in run.stderr.splitlines() if line.startswith("tune: error: ")]
        assert len(lines[folder]) == 1
    assert lines[missing][0] == f"tune: error: {missing}: missing tensor model.layers.1.mlp.gate_proj.weight"
    assert lines[moe][0].startswith(f"tune: error: {moe}: model.safetensors: model.layers.1.mlp.")
    assert "model.layers.2.mlp.experts.8." in lines[moe][0]  # the 9th expert of 16, which the files (8) lack
    capsys.readouterr()

    def no_weight_read(*args, **kwargs):
        raise AssertionError("tune validate read a weight")

    monkeypatch.setattr("torchtune_ac.checkpoint.hf.open_safetensors", no_weight_read)
    for folder, (config_name, overrides) in cases.items():
        assert main(["validate", "--config", config_name, f"checkpoint_dir={folder}",
                     f"output_dir={tmp_path / 'out' / folder.name / 'validate'}", *overrides]) == 2
        assert capsys.readouterr().err == lines[folder][0] + "\n"
    assert main(["validate", "--config", "tiny/full", f"checkpoint_dir={embedded_checkpoint}",
                 f"output_dir={tmp_path / 'o'}"]) == 0  # headers only: the intact checkpoint passes unread
