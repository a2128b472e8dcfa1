"""``tune migrate`` on configs written in torchtune 0.6's layout (Llama 3, 3.1 and 3.2 full fine-tuning, single
device and distributed): the result passes ``tune validate``; ``tune run`` on a torchtune config points at
``tune migrate``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from torchtune_ac.cli import main
from torchtune_ac.models import MISTRAL, QWEN2, LlamaArgs
from torchtune_ac.models.families.mistral import MISTRAL_7B
from torchtune_ac.registry import builtin_config_path


def torchtune_yaml(builder: str, model_dir: str, *, distributed: bool, meta_checkpoint: bool = False,
                   loss: str = "torchtune.modules.loss.CEWithChunkedOutputLoss", lora: str = "") -> str:
    """A torchtune 0.6 full fine-tuning config, laid out as its shipped llama3*/*_full*.yaml are (``lora``: the
    LoRA builder arguments under ``model``, as its *_lora*.yaml have them)."""
    if meta_checkpoint:
        checkpointer = f"""checkpointer:
  _component_: torchtune.training.FullModelMetaCheckpointer
  checkpoint_dir: /tmp/{model_dir}/original/
  checkpoint_files: [
    consolidated.00.pth
  ]
  recipe_checkpoint: null
  output_dir: ${{output_dir}}
  model_type: LLAMA3"""
    else:
        checkpointer = f"""checkpointer:
  _component_: torchtune.training.FullModelHFCheckpointer
  checkpoint_dir: /tmp/{model_dir}/
  checkpoint_files: [
    model-00001-of-00002.safetensors,
    model-00002-of-00002.safetensors
  ]
  recipe_checkpoint: null
  output_dir: ${{output_dir}}
  model_type: LLAMA3"""
    if distributed:
        optimizer = """optimizer:
  _component_: torch.optim.AdamW
  lr: 2e-5
  fused: True"""
        memory = """optimizer_in_bwd: False  # True saves memory. Requires gradient_accumulation_steps=1
gradient_accumulation_steps: 1  # Use to increase effective batch size
device: cuda
enable_activation_checkpointing: True  # True reduces memory
enable_activation_offloading: False  # True reduces memory
custom_sharded_layers: ['tok_embeddings', 'output']"""
    else:
        optimizer = """optimizer:
  _component_: bitsandbytes.optim.PagedAdamW8bit
  lr: 1e-5
lr_scheduler:
  _component_: torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup
  num_warmup_steps: 100"""
        memory = """gradient_accumulation_steps: 1  # Use to increase effective batch size
optimizer_in_bwd: True  # True saves memory. Requires gradient_accumulation_steps=1
device: cuda
enable_activation_checkpointing: True  # True reduces memory
enable_activation_offloading: False  # True reduces memory"""
    return f"""# Config for {'multi' if distributed else 'single'}-device full finetuning (torchtune 0.6 layout)
output_dir: /tmp/torchtune/{model_dir}/full # /tmp may be deleted by your system. Change it to your preference.

# Tokenizer
tokenizer:
  _component_: torchtune.models.llama3.llama3_tokenizer
  path: /tmp/{model_dir}/original/tokenizer.model
  max_seq_len: null

# Dataset
dataset:
  _component_: torchtune.datasets.alpaca_dataset
  packed: False  # True increases speed
seed: null
shuffle: True

# Model Arguments
model:
  _component_: {builder}
{lora}
{checkpointer}
resume_from_checkpoint: False

# Fine-tuning arguments
batch_size: 2
epochs: 1
{optimizer}
loss:
  _component_: {loss}
max_steps_per_epoch: null
clip_grad_norm: null
compile: False  # torch.compile the model + loss, True increases speed + decreases memory
{memory}

# Reduced precision
dtype: bf16

# Logging
metric_logger:
  _component_: torchtune.training.metric_logging.DiskLogger
  log_dir: ${{output_dir}}/logs
log_every_n_steps: 1
log_peak_memory_stats: True

# Profiler (disabled)
profiler:
  _component_: torchtune.training.setup_torch_profiler
  enabled: False
  output_dir: ${{output_dir}}/profiling_outputs
  cpu: True
  cuda: True
  profile_memory: False
  with_stack: False
  record_shapes: True
  with_flops: False
  wait_steps: 5
  warmup_steps: 3
  active_steps: 2
  num_cycles: 1
"""


CONFIGS = {
    "llama3/8B_full": ("torchtune.models.llama3.llama3_8b", "Meta-Llama-3-8B-Instruct", True, True),
    "llama3/8B_full_single_device": ("torchtune.models.llama3.llama3_8b", "Meta-Llama-3-8B-Instruct", False, True),
    "llama3_1/8B_full": ("torchtune.models.llama3_1.llama3_1_8b", "Meta-Llama-3.1-8B-Instruct", True, False),
    "llama3_1/8B_full_single_device": ("torchtune.models.llama3_1.llama3_1_8b", "Meta-Llama-3.1-8B-Instruct", False,
                                       False),
    "llama3_2/1B_full": ("torchtune.models.llama3_2.llama3_2_1b", "Llama-3.2-1B-Instruct", True, False),
    "llama3_2/1B_full_single_device": ("torchtune.models.llama3_2.llama3_2_1b", "Llama-3.2-1B-Instruct", False, False),
    "llama3_2/3B_full": ("torchtune.models.llama3_2.llama3_2_3b", "Llama-3.2-3B-Instruct", True, False),
}


def write_torchtune_config(tmp_path: Path, name: str, **kwargs) -> Path:
    builder, model_dir, distributed, meta = CONFIGS[name]
    path = tmp_path / "torchtune.yaml"
    path.write_text(torchtune_yaml(builder, model_dir, distributed=distributed, meta_checkpoint=meta, **kwargs))
    return path


def migrate(tmp_path: Path, source: Path, capsys) -> tuple[Path, str]:
    out = tmp_path / "ours.yaml"
    assert main(["migrate", str(source), "-o", str(out)]) == 0
    return out, capsys.readouterr().out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_migrated_config_validates(tmp_path, capsys, name):
    out, report = migrate(tmp_path, write_torchtune_config(tmp_path, name), capsys)
    migrated = yaml.safe_load(out.read_text())
    assert migrated["loss_chunks"] == 8  # CEWithChunkedOutputLoss
    assert migrated.get("optimizer_in_bwd", False) is ("single_device" in name)
    assert main(["validate", "--config", str(out)]) == 0, capsys.readouterr().err
    validated = capsys.readouterr().out
    assert "is valid for recipe full_finetune" in validated
    assert "full: all" in validated  # enable_activation_checkpointing: true carried over
    for key in ("profiler", "log_peak_memory_stats", "checkpointer.checkpoint_files",
                "seed", "metric_logger"):
        assert f": {key}: " in report
    if "single_device" in name:
        assert "changed: optimizer._component_: bitsandbytes.optim.PagedAdamW8bit" in report
    else:
        assert "not carried over: custom_sharded_layers: " in report


def test_plain_cross_entropy_config_validates_as_written(tmp_path, capsys):
    source = write_torchtune_config(tmp_path, "llama3_2/1B_full", loss="torch.nn.CrossEntropyLoss")
    out, report = migrate(tmp_path, source, capsys)
    text = out.read_text()
    assert text.startswith(f"# Migrated from the torchtune config {source} by `tune migrate`.\n")
    assert f"#   tune run full_finetune --config {out}\n" in text
    assert "loss_chunks" not in text and "optimizer_in_bwd" not in text
    assert "path: ${checkpoint_dir}" in text
    assert report.splitlines()[0] == f"wrote {out} from the torchtune config {source}"
    assert report.splitlines()[-1] == f"check it with: tune validate --config {out}"
    assert main(["validate", "--config", str(out)]) == 0, capsys.readouterr().err


def test_a_custom_dataset_is_migrated_with_the_flag_that_runs_it(tmp_path, capsys):
    source = write_torchtune_config(tmp_path, "llama3_2/1B_full")
    source.write_text(source.read_text().replace("torchtune.datasets.alpaca_dataset", "my_pkg.data.MyDataset"))
    out, report = migrate(tmp_path, source, capsys)
    assert "not carried over: dataset._component_: my_pkg.data.MyDataset is your own class" in report
    assert report.splitlines()[-1] == (f"check it with: tune validate --config {out} "
                                       "--allow-component my_pkg.data.MyDataset")
    assert f"#   tune run full_finetune --config {out} --allow-component my_pkg.data.MyDataset\n" in out.read_text()
    assert yaml.safe_load(out.read_text())["dataset"]["_component_"] == "my_pkg.data.MyDataset"


def test_refuses_to_overwrite_without_force(tmp_path, capsys):
    source = write_torchtune_config(tmp_path, "llama3_2/1B_full")
    out = tmp_path / "ours.yaml"
    out.write_text("mine: 1\n")
    assert main(["migrate", str(source), "-o", str(out)]) == 2
    assert capsys.readouterr().err.strip() == f"tune: error: tune migrate: {out} already exists; pass --force to overwrite it"
    assert out.read_text() == "mine: 1\n"
    assert main(["migrate", str(source), "-o", str(out), "--force"]) == 0
    assert "torchtune_ac.models.llama3_2_1b" in out.read_text()


@pytest.mark.parametrize(
    "text, message",
    [
        # The file is named (a mapping problem was reported with the key only).
        ("output_dir: /tmp/x\nmodel:\n  _component_: torchtune.models.llama3_2_vision.llama3_2_vision_11b\n"
         "checkpointer:\n  checkpoint_dir: /m\n",
         "tune migrate: {source}: model._component_=torchtune.models.llama3_2_vision.llama3_2_vision_11b: "
         "Llama 3.2 Vision (cross-attention; torchtune's llama3_2_vision/11B_full"),
        ("output_dir: /tmp/x\nbatch_size: 2\n", "does not look like a torchtune config"),
        # One of our own configs: its resolver is not an interpolation error ("Unsupported interpolation type").
        (builtin_config_path("tiny/full").read_text(), "tune migrate: {source} does not look like a torchtune config"),
        ("model: [\n", "invalid YAML"),
    ],
)
def test_refusals_are_one_line_and_write_nothing(tmp_path, capsys, text, message):
    source = tmp_path / "torchtune.yaml"
    source.write_text(text)
    assert main(["migrate", str(source), "-o", str(tmp_path / "ours.yaml")]) == 2
    err = capsys.readouterr().err
    assert message.format(source=source) in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["torchtune.yaml"]


@pytest.mark.parametrize("command", ["run", "validate"])
def test_run_and_validate_point_a_torchtune_config_at_migrate(tmp_path, capsys, command):
    source = write_torchtune_config(tmp_path, "llama3_2/1B_full")
    argv = ["run", "full_finetune"] if command == "run" else ["validate"]
    assert main([*argv, "--config", str(source)]) == 2
    assert capsys.readouterr().err == (
        f"tune: error: {source} looks like a torchtune config; convert it with: tune migrate {source} -o NEW.yaml\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["torchtune.yaml"]


# Qwen2.5 and Mistral configs in torchtune 0.6's layout: (builder, tokenizer node, checkpoint folder, our builder).
OTHER_FAMILIES = [
    ("torchtune.models.qwen2_5.qwen2_5_0_5b",
     {"_component_": "torchtune.models.qwen2_5.qwen2_5_tokenizer", "path": "/tmp/Qwen2.5-0.5B-Instruct/vocab.json",
      "merges_file": "/tmp/Qwen2.5-0.5B-Instruct/merges.txt", "max_seq_len": None},
     "/tmp/Qwen2.5-0.5B-Instruct", "qwen2_5_0_5b"),
    # torchtune's mistral_7b has v0.1's shapes: ours builds whatever version checkpoint_dir holds ({tmp}: a folder
    # with a Mistral 7B v0.3 config.json, written by the test).
    ("torchtune.models.mistral.mistral_7b",
     {"_component_": "torchtune.models.mistral.mistral_tokenizer", "path": "{tmp}/Mistral-7B-v0.3/tokenizer.model",
      "max_seq_len": None},
     "{tmp}/Mistral-7B-v0.3", "from_hf_config"),
    # No Qwen2.5 3B builder here: any size of a supported architecture becomes from_hf_config.
    ("torchtune.models.qwen2_5.qwen2_5_3b",
     {"_component_": "torchtune.models.qwen2_5.qwen2_5_tokenizer", "path": "{tmp}/Qwen2.5-3B/vocab.json",
      "merges_file": "{tmp}/Qwen2.5-3B/merges.txt", "max_seq_len": None},
     "{tmp}/Qwen2.5-3B", "from_hf_config"),
]
# The config.json the test writes into a {tmp} checkpoint folder, and the parameter count validate then prints.
CHECKPOINT_CONFIGS = {
    "torchtune.models.mistral.mistral_7b": (MISTRAL, MISTRAL_7B, "7,248,023,552"),
    "torchtune.models.qwen2_5.qwen2_5_3b": (QWEN2, LlamaArgs(
        vocab_size=151_936, dim=2048, n_layers=36, n_heads=16, n_kv_heads=2, intermediate_dim=11_008,
        max_seq_len=32_768, norm_eps=1e-6, rope_theta=1e6, tie_embeddings=True, model_type="qwen2", qkv_bias=True),
        "3,085,938,688"),
}


@pytest.mark.parametrize("builder, tokenizer, checkpoint_dir, ours", OTHER_FAMILIES)
def test_other_families_migrate_and_validate(tmp_path, capsys, builder, tokenizer, checkpoint_dir, ours):
    if "{tmp}" in checkpoint_dir:
        checkpoint_dir = checkpoint_dir.format(tmp=tmp_path)
        tokenizer = {**tokenizer, "path": tokenizer["path"].format(tmp=tmp_path)}
        Path(checkpoint_dir).mkdir()
        family, args, _ = CHECKPOINT_CONFIGS[builder]
        config_json = family.hf.hf_config_from_args(args, torch.bfloat16)
        (Path(checkpoint_dir) / "config.json").write_text(json.dumps(config_json))
    config = {
        "output_dir": "/tmp/torchtune/full",
        "model": {"_component_": builder},
        "tokenizer": tokenizer,
        "checkpointer": {"_component_": "torchtune.training.FullModelHFCheckpointer", "checkpoint_dir": checkpoint_dir,
                         "checkpoint_files": ["model.safetensors"], "recipe_checkpoint": None,
                         "output_dir": "${output_dir}", "model_type": "QWEN2"},
        "resume_from_checkpoint": False,
        "dataset": {"_component_": "torchtune.datasets.alpaca_cleaned_dataset", "packed": False},
        "seed": None, "shuffle": True, "epochs": 1, "batch_size": 2, "gradient_accumulation_steps": 8,
        "optimizer": {"_component_": "torch.optim.AdamW", "fused": True, "lr": 2e-5},
        "loss": {"_component_": "torch.nn.CrossEntropyLoss"},
        "device": "cuda", "enable_activation_checkpointing": False, "dtype": "bf16",
        "metric_logger": {"_component_": "torchtune.training.metric_logging.DiskLogger"},
    }
    source = tmp_path / "torchtune.yaml"
    source.write_text(yaml.safe_dump(config))
    out, _ = migrate(tmp_path, source, capsys)
    migrated = yaml.safe_load(out.read_text())
    assert migrated["model"] == {"_component_": f"torchtune_ac.models.{ours}"}
    assert migrated["tokenizer"]["path"] == "${checkpoint_dir}"
    assert main(["validate", "--config", str(out)]) == 0, capsys.readouterr().err
    if builder in CHECKPOINT_CONFIGS:
        assert f"from_hf_config: {CHECKPOINT_CONFIGS[builder][2]} parameters" in capsys.readouterr().out


LORA_ARGS = """  lora_attn_modules: ['q_proj', 'v_proj', 'output_proj']
  apply_lora_to_mlp: True
  apply_lora_to_output: False
  lora_rank: 8  # higher increases accuracy and memory
  lora_alpha: 16  # usually alpha=2*rank
  lora_dropout: 0.0
"""


@pytest.mark.parametrize("builder, quantize_base, recipe", [
    ("torchtune.models.llama3_1.lora_llama3_1_8b", None, "lora_finetune"),
    ("torchtune.models.llama3_1.qlora_llama3_1_8b", "nf4", "lora_finetune"),
    ("torchtune.models.llama3_1.lora_llama3_1_8b", None, "lora_dpo"),
])
def test_an_adapter_config_migrates_and_validates(tmp_path, capsys, builder, quantize_base, recipe):
    """torchtune 0.6.1's llama3_1/8B_lora, 8B_qlora_single_device and 8B_lora_dpo, as files: the full model's
    builder and the adapter section, valid for lora_finetune or lora_dpo (the adapters found on the model)."""
    source = tmp_path / "torchtune.yaml"
    text = torchtune_yaml(builder, "Meta-Llama-3.1-8B-Instruct", distributed=quantize_base is None, lora=LORA_ARGS)
    if recipe == "lora_dpo":  # its DPO loss and pairs (torchtune's LoRA DPO configs have no ref_checkpointer)
        text = text.replace("torchtune.modules.loss.CEWithChunkedOutputLoss", "torchtune.rlhf.loss.DPOLoss")
        text = text.replace("torchtune.datasets.alpaca_dataset", "torchtune.datasets.stack_exchange_paired_dataset")
        text = text.replace("  packed: False  # True increases speed\n", "")
    source.write_text(text)
    out, report = migrate(tmp_path, source, capsys)
    text = out.read_text()
    assert f"#   tune run {recipe} --config {out}\n" in text
    assert f"#   tune run --nproc_per_node 4 {recipe} --config {out}" in text
    migrated = yaml.safe_load(text)
    assert migrated["model"] == {"_component_": "torchtune_ac.models.llama3_1_8b"}
    assert migrated["adapter"] == {"kind": "lora", "rank": 8, "alpha": 16, "dropout": 0.0,
                                   "targets": ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                                   "output": False, "quantize_base": quantize_base, "save_merged": True}
    assert ": model." not in report  # every LoRA argument is carried over
    assert main(["validate", "--config", str(out)]) == 0, capsys.readouterr().err
    validated = capsys.readouterr().out
    assert f"is valid for recipe {recipe}" in validated
    base = "NF4 (QLoRA)" if quantize_base else "in dtype"
    assert (f"lora rank 8, alpha 16 on q_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; base frozen, {base}"
            in validated)
