"""``migrate_torchtune_config``: torchtune 0.6 keys and components to ours, one table per part, and the notes
on what was not carried over or was corrected."""

from __future__ import annotations

import copy
import dataclasses
import importlib

import pytest
from torchtune_adapter_configs import TORCHTUNE_ADAPTER_CONFIGS

from torchtune_ac.compat.torchtune.migrate import (
    FROM_HF_CONFIG,
    MODEL_BUILDERS,
    ac_notes,
    migrate_ac_keys,
    migrate_torchtune_config,
    torchtune_marker,
)
from torchtune_ac.config.schema import LoRADPOConfig, LoRAFinetuneConfig
from torchtune_ac.config.validation import validate_config
from torchtune_ac.errors import UserError

CKPT = "/models/Llama-3.2-1B-Instruct"


def torchtune_config(**changes) -> dict:
    """A minimal torchtune 0.6 full fine-tuning config (HF checkpointer, alpaca), with ``changes`` applied
    (a value of ``...`` removes the key)."""
    cfg = {
        "output_dir": "/tmp/torchtune/run",
        "tokenizer": {"_component_": "torchtune.models.llama3.llama3_tokenizer",
                      "path": f"{CKPT}/original/tokenizer.model", "max_seq_len": None},
        "dataset": {"_component_": "torchtune.datasets.alpaca_dataset", "packed": False},
        "seed": None,
        "shuffle": True,
        "model": {"_component_": "torchtune.models.llama3_2.llama3_2_1b"},
        "checkpointer": {"_component_": "torchtune.training.FullModelHFCheckpointer", "checkpoint_dir": CKPT,
                         "checkpoint_files": ["model.safetensors"], "recipe_checkpoint": None,
                         "output_dir": "/tmp/torchtune/run", "model_type": "LLAMA3_2"},
        "resume_from_checkpoint": False,
        "batch_size": 4,
        "epochs": 1,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 2e-5, "fused": True},
        "loss": {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"},
        "max_steps_per_epoch": None,
        "gradient_accumulation_steps": 8,
        "device": "cuda",
        "enable_activation_checkpointing": False,
        "dtype": "bf16",
    }
    for key, value in changes.items():
        if value is ...:
            cfg.pop(key)
        else:
            cfg[key] = value
    return cfg


def notes_by_key(migration) -> dict[str, str]:
    return {note.key: note.message for note in migration.notes}


def test_minimal_config():
    migration = migrate_torchtune_config(torchtune_config())
    assert migration.config == {
        "output_dir": "/tmp/torchtune/run",
        "checkpoint_dir": CKPT,
        "resume_from_checkpoint": False,
        "model": {"_component_": "torchtune_ac.models.llama3_2_1b"},
        "tokenizer": {"_component_": "torchtune_ac.data.load_tokenizer", "path": "${checkpoint_dir}"},
        "dataset": {"_component_": "torchtune_ac.data.instruct_dataset", "source": "tatsu-lab/alpaca",
                    "train_on_input": True, "packed": False},
        "shuffle": True,
        "batch_size": 4,
        "epochs": 1,
        "max_steps_per_epoch": None,
        "gradient_accumulation_steps": 8,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 2e-5, "fused": True},
        "loss_chunks": 8,
        "device": "cuda",
        "dtype": "bf16",
        "enable_activation_checkpointing": False,
    }
    notes = notes_by_key(migration)
    assert set(notes) == {"checkpointer.checkpoint_files", "checkpointer.model_type", "tokenizer.path",
                          "dataset.source", "dataset._component_", "dataset.train_on_input", "seed"}
    assert "network access" in notes["dataset.source"]
    assert "random seed" in notes["seed"]


@pytest.mark.parametrize("torchtune_builder, ours", sorted(MODEL_BUILDERS.items()))
def test_model_builders(torchtune_builder, ours):
    migration = migrate_torchtune_config(torchtune_config(model={"_component_": torchtune_builder}))
    assert migration.config["model"] == {"_component_": ours}


@pytest.mark.parametrize(
    "builder",
    ["torchtune.models.clip.clip_vision_encoder", "mymodels.build", "torchtune.models.llama2.llama2_reward_7b"],
)
def test_model_without_equivalent_is_refused_listing_what_is_supported(builder):
    with pytest.raises(UserError) as info:
        migrate_torchtune_config(torchtune_config(model={"_component_": builder}))
    message = str(info.value)
    assert message.startswith(f"model._component_={builder}: no equivalent in torchtune_ac; supported: ")
    assert "llama3_2_1b" in message and "qwen2_5_0_5b" in message and "mistral_7b" in message
    assert "\n" not in message


@pytest.mark.parametrize("builder", ["torchtune.models.qwen3.qwen3_moe_30b_a3b_base",
                                     "torchtune.models.llama4.llama4_scout_17b_16e"])
def test_a_moe_builder_is_refused_pointing_at_the_product_s_moe_configs(builder):
    """The line listed the dense builders and said "any other full model of ... qwen3" is converted."""
    with pytest.raises(UserError) as info:
        migrate_torchtune_config(torchtune_config(model={"_component_": builder}))
    assert str(info.value) == (
        f"model._component_={builder}: a mixture-of-experts builder; tune migrate does not carry torchtune's MoE models "
        "over: start from this product's own MoE configs (tune cp qwen3_moe/30B_A3B_full my.yaml, or "
        "gpt_oss/20B_full; docs/moe.md), which train Qwen3-MoE and gpt-oss checkpoints")


def test_phi_configs_take_the_phi3_family_and_phi4s_tokenizer_folder():
    """torchtune 0.6.1's phi3/mini_full and phi4/14B_full: Phi-4's tokenizer is named by its vocab and merges
    files, not a path."""
    phi3 = migrate_torchtune_config(torchtune_config(model={"_component_": "torchtune.models.phi3.phi3_mini"}))
    assert phi3.config["model"] == {"_component_": "torchtune_ac.models.phi3_mini"}
    assert "slide a 2,047-token window" in notes_by_key(phi3)["model._component_"]
    tokenizer = {"_component_": "torchtune.models.phi4.phi4_tokenizer", "vocab_path": f"{CKPT}/vocab.json",
                 "merges_path": f"{CKPT}/merges.txt", "max_seq_len": None}
    phi4 = migrate_torchtune_config(torchtune_config(model={"_component_": "torchtune.models.phi4.phi4_14b"},
                                                     tokenizer=tokenizer))
    assert phi4.config["model"] == {"_component_": "torchtune_ac.models.phi4_14b"}
    assert phi4.config["tokenizer"] == {"_component_": "torchtune_ac.data.load_tokenizer", "path": "${checkpoint_dir}"}
    notes = notes_by_key(phi4)
    assert f"from {CKPT}, not {CKPT}/vocab.json" in notes["tokenizer.vocab_path"]
    assert notes["tokenizer.merges_path"] == "tokenizer.json holds the merges"
    assert "model._component_" not in notes


# torchtune 0.6.1's full fine-tuning configs of a supported architecture whose builder has no twin here.
OTHER_SIZES = [
    ("torchtune.models.llama2.llama2_13b", "llama"),
    ("torchtune.models.code_llama2.code_llama2_7b", "llama"),
    ("torchtune.models.qwen2.qwen2_0_5b", "qwen2"),
    ("torchtune.models.qwen2.qwen2_1_5b", "qwen2"),
    ("torchtune.models.qwen2.qwen2_7b", "qwen2"),
    ("torchtune.models.qwen2_5.qwen2_5_3b", "qwen2"),
]


@pytest.mark.parametrize("torchtune_builder, family", OTHER_SIZES)
def test_other_full_models_of_a_supported_architecture_become_from_hf_config(torchtune_builder, family):
    migration = migrate_torchtune_config(torchtune_config(model={"_component_": torchtune_builder}))
    assert migration.config["model"] == {"_component_": "torchtune_ac.models.from_hf_config"}
    notes = notes_by_key(migration)
    assert f"is a {family} model with no builder of its own here: from_hf_config builds" in notes["model._component_"]


# (flag, ac_mode, ac_option) -> our keys, and the keys of the notes explaining the difference.
AC_TABLE = [
    ((None, None, None), {}, []),
    ((True, None, None), {"enable_activation_checkpointing": True}, []),
    ((False, None, None), {"enable_activation_checkpointing": False}, []),
    # torchtune applied nothing when the flag was true and ac_mode set; ac_mode decides here.
    ((True, "selective", 2), {"enable_activation_checkpointing": True, "ac_mode": "selective", "ac_option": 2},
     ["enable_activation_checkpointing", "ac_mode"]),
    ((True, "full", None), {"enable_activation_checkpointing": True, "ac_mode": "full"},
     ["enable_activation_checkpointing", "ac_mode"]),
    # torchtune applied ac_mode only with the flag false; that pair is a contradiction here: the flag goes.
    ((False, "full", None), {"ac_mode": "full"}, ["enable_activation_checkpointing", "ac_mode"]),
    ((False, "selective", "op"), {"ac_mode": "selective", "ac_option": "op"},
     ["enable_activation_checkpointing", "ac_mode"]),
    ((True, "none", None), {"ac_mode": "none"}, ["enable_activation_checkpointing"]),
    ((False, "none", None), {"enable_activation_checkpointing": False, "ac_mode": "none"}, []),
    # ac_option 0 checkpointed every block in torchtune.
    ((None, "selective", 0), {"ac_mode": "selective", "ac_option": 1}, ["ac_option", "ac_mode"]),
    # torchtune matched case-sensitively: "Full" applied nothing.
    ((None, "Full", None), {"ac_mode": "full"}, ["ac_mode", "ac_mode"]),
    ((None, "full", 2), {"ac_mode": "full"}, ["ac_option", "ac_mode"]),
    ((None, "selective", None), {"ac_mode": "selective", "ac_option": None}, ["ac_option", "ac_mode"]),
]


@pytest.mark.parametrize("keys, expected, note_keys", AC_TABLE)
def test_activation_checkpointing_keys(keys, expected, note_keys):
    assert migrate_ac_keys(*keys) == expected
    assert [key for key, _ in ac_notes(*keys)] == note_keys


def test_activation_checkpointing_in_a_config():
    migration = migrate_torchtune_config(torchtune_config(enable_activation_checkpointing=True, ac_mode="selective",
                                                          ac_option=2))
    assert {k: migration.config.get(k) for k in ("enable_activation_checkpointing", "ac_mode", "ac_option")} == {
        "enable_activation_checkpointing": True, "ac_mode": "selective", "ac_option": 2}
    assert "applied no activation checkpointing at all" in notes_by_key(migration)["enable_activation_checkpointing"]


# torchtune's loss / optimizer_in_bwd -> our upcoming keys (issue 11); plain cross-entropy and false emit nothing.
MEMORY_TABLE = [
    ({"loss": {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"}}, {"loss_chunks": 8}),
    ({"loss": {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss", "num_output_chunks": 16}},
     {"loss_chunks": 16}),
    ({"loss": {"_component_": "torchtune.modules.loss.LinearCrossEntropyLoss"}}, {"loss_chunks": 8}),
    ({"loss": {"_component_": "torch.nn.CrossEntropyLoss"}}, {}),
    ({"loss": ...}, {}),
    ({"loss": ..., "optimizer_in_bwd": True}, {"optimizer_in_bwd": True}),
    ({"loss": ..., "optimizer_in_bwd": False}, {}),
]


@pytest.mark.parametrize("changes, expected", MEMORY_TABLE)
def test_loss_and_optimizer_in_backward(changes, expected):
    config = migrate_torchtune_config(torchtune_config(**changes)).config
    assert {k: config[k] for k in ("loss_chunks", "optimizer_in_bwd") if k in config} == expected


def test_other_losses_are_reported():
    migration = migrate_torchtune_config(torchtune_config(loss={"_component_": "torchtune.modules.loss.ForwardKLLoss"}))
    assert "loss_chunks" not in migration.config
    assert "cross-entropy" in notes_by_key(migration)["loss"]


LOGGERS = "torchtune.training.metric_logging."
OURS = "torchtune_ac.observability.metric_logging."
METRIC_LOGGER_TABLE = [
    ({"_component_": LOGGERS + "DiskLogger", "log_dir": "/tmp/torchtune/run/logs"}, None, "metric_logger"),
    ({"_component_": LOGGERS + "StdoutLogger"}, None, "metric_logger"),
    ({"_component_": LOGGERS + "WandBLogger", "project": "p", "entity": "e", "group": "g",
      "log_dir": "/tmp/torchtune/run/logs"},
     {"_component_": OURS + "WandBLogger", "project": "p", "entity": "e", "group": "g",
      "log_dir": "${output_dir}/logs"}, None),
    ({"_component_": LOGGERS + "WandBLogger", "job_type": "x"}, {"_component_": OURS + "WandBLogger"},
     "metric_logger.job_type"),
    ({"_component_": LOGGERS + "TensorBoardLogger", "log_dir": "/elsewhere/tb", "organize_logs": True},
     {"_component_": OURS + "TensorBoardLogger", "log_dir": "/elsewhere/tb"}, "metric_logger.organize_logs"),
    ({"_component_": LOGGERS + "CometLogger", "project": "p"}, None, "metric_logger"),
]


@pytest.mark.parametrize("logger, expected, note_key", METRIC_LOGGER_TABLE)
def test_metric_logger(logger, expected, note_key):
    migration = migrate_torchtune_config(torchtune_config(metric_logger=logger))
    assert migration.config.get("metric_logger") == expected
    notes = notes_by_key(migration)
    assert (note_key in notes) if note_key else not any(k.startswith("metric_logger") for k in notes)
    if expected is not None:  # the module that holds the logger, which Python imports (not the configs' alias)
        module, _, name = expected["_component_"].rpartition(".")
        assert hasattr(importlib.import_module(module), name)


ALPACA = "torchtune.datasets.alpaca_dataset"
DATASET_TABLE = [
    ({"_component_": ALPACA, "source": "json", "data_files": "/data/a.json", "train_on_input": False},
     {"_component_": "torchtune_ac.data.instruct_dataset", "source": "/data/a.json", "train_on_input": False,
      "packed": False}),
    ({"_component_": "torchtune.datasets.alpaca_cleaned_dataset", "packed": True},
     {"_component_": "torchtune_ac.data.instruct_dataset", "source": "yahma/alpaca-cleaned", "train_on_input": True,
      "packed": True}),
    ({"_component_": "torchtune.datasets.instruct_dataset", "source": "parquet", "data_files": ["/d/x.parquet"],
      "column_map": {"input": "question", "output": "answer"}, "split": "train"},
     {"_component_": "torchtune_ac.data.instruct_dataset", "source": "/d/x.parquet",
      "column_map": {"instruction": "question", "input": None, "output": "answer"}, "template": "chat",
      "train_on_input": False, "packed": False}),
    ({"_component_": "torchtune.datasets.chat_dataset", "source": "csv", "data_files": {"test": "/d/c.csv"},
      "conversation_column": "conversations", "conversation_style": "sharegpt", "split": "test"},
     {"_component_": "torchtune_ac.data.chat_dataset", "source": "/d/c.csv", "split": "test",
      "conversation_column": "conversations", "conversation_style": "sharegpt", "train_on_input": False,
      "packed": False}),
    ({"_component_": "torchtune.datasets.chat_dataset", "source": "/d/chats", "conversation_column": "messages",
      "conversation_style": "openai", "train_on_input": True},
     {"_component_": "torchtune_ac.data.chat_dataset", "source": "/d/chats", "conversation_column": "messages",
      "train_on_input": True, "packed": False}),
    ({"_component_": "torchtune.datasets.text_completion_dataset", "source": "arrow", "data_dir": "/d/arrow",
      "column": "body", "packed": True},
     {"_component_": "torchtune_ac.data.text_dataset", "source": "/d/arrow", "column": "body", "packed": True}),
]


@pytest.mark.parametrize("dataset, expected", DATASET_TABLE)
def test_datasets(dataset, expected):
    assert migrate_torchtune_config(torchtune_config(dataset=dataset)).config["dataset"] == expected


@pytest.mark.parametrize(
    "dataset, message",
    [
        ([{"_component_": ALPACA}, {"_component_": ALPACA}], "dataset: a list of datasets is not supported"),
        ({"_component_": "torchtune.datasets.samsum_dataset"}, "dataset._component_=torchtune.datasets.samsum_dataset: "
         "no equivalent in torchtune_ac; supported: alpaca_dataset"),
        ({"_component_": ALPACA, "source": "json", "data_files": ["a.json", "b.json"]},
         "torchtune_ac reads one file or one folder"),
        ({"_component_": "torchtune.datasets.chat_dataset", "source": "x/y", "conversation_column": "m",
          "conversation_style": "vicuna"}, "dataset.conversation_style='vicuna': expected openai or sharegpt"),
    ],
)
def test_datasets_refused(dataset, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        migrate_torchtune_config(torchtune_config(dataset=dataset))


@pytest.mark.parametrize("key", ["dataset", "dataset_val"])
def test_the_user_s_own_dataset_class_is_written_as_it_is_and_the_rest_migrated(key):
    """It was refused ("no equivalent in torchtune_ac") and nothing was written."""
    mine = {"_component_": "my_pkg.data.MyDataset", "source": "data.jsonl", "shuffle_rows": True}
    migration = migrate_torchtune_config(torchtune_config(**{key: mine}))
    assert migration.config[key] == mine
    assert migration.config["model"] == {"_component_": "torchtune_ac.models.llama3_2_1b"}
    assert migration.allow == ("my_pkg.data.MyDataset",)
    assert migration.flags() == " --allow-component my_pkg.data.MyDataset"
    (note,) = [n for n in migration.notes if n.key == f"{key}._component_"]
    assert str(note) == (
        f"not carried over: {key}._component_: my_pkg.data.MyDataset is your own class, not one of torchtune's "
        "datasets: written as it is, with its arguments; to run it, pass --allow-component my_pkg.data.MyDataset to "
        "tune validate and tune run (it is called as torchtune_ac's datasets are, with the tokenizer and "
        "max_seq_len), or use one of torchtune_ac's datasets (docs/data.md)")
    assert migrate_torchtune_config(torchtune_config()).flags() == ""


def test_meta_checkpointer_reads_the_folder_above_original():
    checkpointer = {"_component_": "torchtune.training.FullModelMetaCheckpointer",
                    "checkpoint_dir": "/m/Meta-Llama-3-8B-Instruct/original/", "checkpoint_files": ["consolidated.00.pth"],
                    "output_dir": "/tmp/torchtune/run", "model_type": "LLAMA3"}
    tokenizer = {"_component_": "torchtune.models.llama3.llama3_tokenizer",
                 "path": "/m/Meta-Llama-3-8B-Instruct/original/tokenizer.model"}
    migration = migrate_torchtune_config(torchtune_config(checkpointer=checkpointer, tokenizer=tokenizer))
    assert migration.config["checkpoint_dir"] == "/m/Meta-Llama-3-8B-Instruct"
    assert migration.config["tokenizer"]["path"] == "${checkpoint_dir}"
    assert "safetensors" in notes_by_key(migration)["checkpointer.checkpoint_dir"]


def test_optimizer_outside_torch_optim_becomes_adamw():
    migration = migrate_torchtune_config(torchtune_config(
        optimizer={"_component_": "bitsandbytes.optim.Lion8bit", "lr": 1e-5, "optim_bits": 8}))
    assert migration.config["optimizer"] == {"_component_": "torch.optim.AdamW", "lr": 1e-5}
    note = notes_by_key(migration)["optimizer._component_"]
    assert "(dropped: optim_bits)" in note and "--allow-component bitsandbytes" in note


@pytest.mark.parametrize("path, ours", [("bitsandbytes.optim.PagedAdamW8bit", "torchao.optim.AdamW8bit"),
                                        ("torchao.prototype.low_bit_optim.AdamW4bit", "torchao.optim.AdamW4bit"),
                                        ("torchao.optim.AdamW8bit", "torchao.optim.AdamW8bit")])
def test_8_and_4_bit_adamw_become_torchaos(path, ours):
    migration = migrate_torchtune_config(torchtune_config(
        optimizer={"_component_": path, "lr": 1e-5, "optim_bits": 8}))
    assert migration.config["optimizer"] == {"_component_": ours, "lr": 1e-5}
    note = notes_by_key(migration).get("optimizer._component_")
    if path == ours:
        assert note is None
    else:
        assert f"{path} becomes {ours}, the same state precision" in note and "torchtune_ac[ao]" in note
        assert ("not paged" in note) == ("Paged" in path) and "dropped: optim_bits" in note


def test_lr_scheduler_and_training_keys():
    migration = migrate_torchtune_config(torchtune_config(
        lr_scheduler={"_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
                      "num_warmup_steps": 100},
        seed=42, clip_grad_norm=1.0, compile=True, max_steps_per_epoch=10, log_every_n_steps=5,
        fsdp_reshard_after_forward=False))
    config = migration.config
    assert config["lr_scheduler"] == {"_component_": "torchtune_ac.training.cosine_schedule_with_warmup",
                                      "num_warmup_steps": 100}
    assert (config["seed"], config["clip_grad_norm"], config["compile"]) == (42, 1.0, True)
    assert (config["max_steps_per_epoch"], config["log_every_n_steps"]) == (10, 5)
    assert config["fsdp"] == {"reshard_after_forward": False}
    assert "seed" not in notes_by_key(migration)


@pytest.mark.parametrize("value, expected", [(True, True), (False, None)])
def test_enable_activation_offloading_is_carried_over(value, expected):
    migration = migrate_torchtune_config(torchtune_config(enable_activation_offloading=value))
    assert migration.config.get("enable_activation_offloading") == expected
    assert "enable_activation_offloading" not in notes_by_key(migration)


@pytest.mark.parametrize("value, expected", [(True, {"cpu_offload": True}), (False, None)])
def test_fsdp_cpu_offload_becomes_fsdp_cpu_offload(value, expected):
    migration = migrate_torchtune_config(torchtune_config(fsdp_cpu_offload=value))
    assert migration.config.get("fsdp") == expected
    assert "fsdp_cpu_offload" not in notes_by_key(migration)


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("profiler", {"_component_": "torchtune.training.setup_torch_profiler", "enabled": False},
         "the torch profiler is not built into the recipe (nothing lost with enabled: false)"),
        ("custom_sharded_layers", ["tok_embeddings", "output"], "extra groups are not configurable"),
        ("tensor_parallel_plan", {"_component_": "my_project.plans.my_tp_plan"},
         "a custom plan ('my_project.plans.my_tp_plan') is not carried over: each model family declares its own"),
        ("my_own_key", 3, "no such setting in torchtune_ac"),
    ],
)
def test_keys_not_carried_over_say_why(key, value, expected):
    migration = migrate_torchtune_config(torchtune_config(**{key: value}))
    (note,) = [n for n in migration.notes if n.key == key]
    assert not note.carried and expected in note.message
    assert str(note) == f"not carried over: {key}: {note.message}"


def test_tensor_parallel_dim_is_carried_over_and_a_stock_plan_dropped_with_a_note():
    migration = migrate_torchtune_config(torchtune_config(
        tensor_parallel_dim=8, tensor_parallel_plan={"_component_": "torchtune.models.llama3.base_llama_tp_plan"}))
    assert migration.config["tensor_parallel_dim"] == 8
    assert list(migration.config)[-1] == "tensor_parallel_dim"  # after fsdp, in the written order
    (note,) = [n for n in migration.notes if n.key == "tensor_parallel_plan"]
    assert note.carried and note.message.startswith(
        "torchtune.models.llama3.base_llama_tp_plan is torchtune's stock plan: dropped, the family's own plan splits "
        "the same layers")
    assert "tensor_parallel_dim" not in notes_by_key(migration)


def test_output_dir_from_checkpointer_and_missing_parts():
    cfg = torchtune_config(output_dir=...)
    assert migrate_torchtune_config(cfg).config["output_dir"] == "/tmp/torchtune/run"
    del cfg["checkpointer"]["output_dir"]
    with pytest.raises(UserError, match="output_dir: the torchtune config has neither"):
        migrate_torchtune_config(cfg)
    with pytest.raises(UserError, match="tokenizer.path: missing"):
        migrate_torchtune_config(torchtune_config(tokenizer={"_component_": "torchtune.models.llama3.llama3_tokenizer"}))


def test_keys_come_out_in_our_order():
    config = migrate_torchtune_config(torchtune_config(seed=1, compile=False)).config
    assert list(config)[:5] == ["output_dir", "checkpoint_dir", "resume_from_checkpoint", "model", "tokenizer"]
    assert list(config).index("seed") < list(config).index("batch_size") < list(config).index("device")


def test_input_is_not_modified():
    cfg = torchtune_config(metric_logger={"_component_": LOGGERS + "WandBLogger", "project": "p"})
    before = copy.deepcopy(cfg)
    migrate_torchtune_config(cfg)
    assert cfg == before


@pytest.mark.parametrize(
    "config, marker",
    [
        ({"checkpointer": {}}, "checkpointer"),
        ({"model": {"_component_": "torchtune.models.llama3.llama3_8b"}}, "model._component_=torchtune.models.llama3.llama3_8b"),
        ({"metric_logger": {"_component_": LOGGERS + "DiskLogger"}}, f"metric_logger._component_={LOGGERS}DiskLogger"),
        ({"model": {"_component_": "torchtune_ac.models.llama_tiny"}}, None),
        ({"metric_logger": {"_component_": OURS + "WandBLogger"}}, None),
    ],
)
def test_torchtune_marker(config, marker):
    assert torchtune_marker(config) == marker


def test_pickled_checkpoint_files_are_called_out():
    checkpointer = {"_component_": "torchtune.training.FullModelHFCheckpointer", "checkpoint_dir": CKPT,
                    "checkpoint_files": ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"],
                    "output_dir": "/tmp/torchtune/run"}
    notes = notes_by_key(migrate_torchtune_config(torchtune_config(checkpointer=checkpointer)))
    assert "reads only *.safetensors files" in notes["checkpointer.checkpoint_files"]


def test_validation_keys_are_carried_over():
    val = {"_component_": "torchtune.datasets.alpaca_dataset", "packed": False, "split": "train[:5%]"}
    migration = migrate_torchtune_config(torchtune_config(dataset_val=val, run_val_every_n_steps=50,
                                                          batch_size_val=2))
    config = migration.config
    assert config["dataset_val"]["_component_"] == "torchtune_ac.data.instruct_dataset"
    assert (config["run_val_every_n_steps"], config["batch_size_val"]) == (50, 2)
    assert "dataset_val" not in {n.key for n in migration.notes if not n.carried}
    assert list(config).index("dataset_val") == list(config).index("max_seq_len" if "max_seq_len" in config
                                                                   else "dataset") + 1


@pytest.mark.parametrize("value, expected", [(2, {"replicate_degree": 2}), (1, None)])
def test_data_parallel_replicate_dim_becomes_fsdp_replicate_degree(value, expected):
    """torchtune's HSDP replicate dimension is ours under fsdp (from the fsdp group's schema metadata)."""
    migration = migrate_torchtune_config(torchtune_config(data_parallel_replicate_dim=value,
                                                          data_parallel_shard_dim=-1))
    assert migration.config.get("fsdp") == expected
    notes = notes_by_key(migration)
    assert "data_parallel_replicate_dim" not in notes
    assert "world size / fsdp.replicate_degree" in notes["data_parallel_shard_dim"]


# ------------------------------------------------------------------------------------------- full_dpo_distributed


def torchtune_dpo_config(**changes) -> dict:
    """A torchtune 0.6.1 full_dpo_distributed config in the layout of its llama3_1/8B_full_dpo (HF checkpointer and
    reference checkpointer on the same weights, stack exchange pairs, DPOLoss), with ``changes`` applied."""
    checkpointer = {"_component_": "torchtune.training.FullModelHFCheckpointer", "checkpoint_dir": CKPT,
                    "checkpoint_files": ["model.safetensors"], "recipe_checkpoint": None,
                    "output_dir": "/tmp/torchtune/dpo", "model_type": "LLAMA3_2"}
    return torchtune_config(**{
        "output_dir": "/tmp/torchtune/dpo",
        "checkpointer": checkpointer,
        "ref_checkpointer": dict(checkpointer),
        "dataset": {"_component_": "torchtune.datasets.stack_exchange_paired_dataset"},
        "loss": {"_component_": "torchtune.rlhf.loss.DPOLoss", "beta": 0.05, "label_smoothing": 0},
        **changes,
    })


def test_a_full_dpo_config_becomes_ours():
    migration = migrate_torchtune_config(torchtune_dpo_config())
    assert migration.recipe == "full_dpo"
    config = migration.config
    assert config["ref_checkpoint_dir"] is None  # the reference is the starting weights
    assert config["dpo"] == {"beta": 0.05, "label_smoothing": 0}
    assert config["dataset"] == {
        "_component_": "torchtune_ac.data.preference_dataset", "source": "lvwerra/stack-exchange-paired",
        "column_map": {"prompt": "question", "chosen": "response_j", "rejected": "response_k"}, "template": "chat"}
    assert "loss_chunks" not in config
    assert list(config)[:4] == ["output_dir", "checkpoint_dir", "resume_from_checkpoint", "ref_checkpoint_dir"]
    assert "data/rl" in notes_by_key(migration)["dataset.source"]
    assert migrate_torchtune_config(torchtune_config()).recipe == "full_finetune"


def test_a_reference_of_other_weights_is_kept():
    other = {"_component_": "torchtune.training.FullModelHFCheckpointer", "checkpoint_dir": "/models/sft",
             "checkpoint_files": ["model.safetensors"], "model_type": "LLAMA3_2", "adapter_checkpoint": "a.pt"}
    migration = migrate_torchtune_config(torchtune_dpo_config(ref_checkpointer=other))
    assert migration.config["ref_checkpoint_dir"] == "/models/sft"
    assert "ref_checkpointer.adapter_checkpoint" in notes_by_key(migration)


@pytest.mark.parametrize(
    "dataset, expected",
    [
        ({"_component_": "torchtune.datasets.preference_dataset", "source": "json", "data_files": "pairs.jsonl",
          "column_map": {"chosen": "good", "rejected": "bad"}, "train_on_input": False},
         {"_component_": "torchtune_ac.data.preference_dataset", "source": "pairs.jsonl",
          "column_map": {"chosen": "good", "rejected": "bad"}}),
        ({"_component_": "torchtune.datasets.hh_rlhf_helpful_dataset"},
         {"_component_": "torchtune_ac.data.preference_dataset", "source": "RLHFlow/HH-RLHF-Helpful-standard"}),
    ],
)
def test_preference_datasets(dataset, expected):
    assert migrate_torchtune_config(torchtune_dpo_config(dataset=dataset)).config["dataset"] == expected


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"loss": {"_component_": "torchtune.rlhf.loss.RSOLoss", "gamma": 0.1}},
         "loss._component_=torchtune.rlhf.loss.RSOLoss: no equivalent in torchtune_ac's full_dpo"),
        ({"dataset": {"_component_": "torchtune.datasets.alpaca_dataset"}},
         "dataset._component_=torchtune.datasets.alpaca_dataset: not a preference dataset"),
        ({"ref_checkpointer": {"_component_": "torchtune.training.FullModelHFCheckpointer"}},
         "ref_checkpointer.checkpoint_dir: missing"),
    ],
)
def test_dpo_configs_refused(changes, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        migrate_torchtune_config(torchtune_dpo_config(**changes))


def test_a_preference_dataset_in_a_fine_tuning_config_is_refused():
    dataset = {"_component_": "torchtune.datasets.hh_rlhf_helpful_dataset"}
    with pytest.raises(UserError, match="a preference dataset, for full_dpo_distributed's configs"):
        migrate_torchtune_config(torchtune_config(dataset=dataset))


def test_train_on_input_is_not_carried_over_for_pairs():
    dataset = {"_component_": "torchtune.datasets.hh_rlhf_helpful_dataset", "train_on_input": True}
    notes = notes_by_key(migrate_torchtune_config(torchtune_dpo_config(dataset=dataset)))
    assert "the prompt is never scored here" in notes["dataset.train_on_input"]


# ------------------------------------------------------------------------------------------- adapters (LoRA, QLoRA)


def torchtune_adapter_config(row) -> dict:
    """One of torchtune 0.6.1's adapter configs (a row of ``TORCHTUNE_ADAPTER_CONFIGS``) in its layout: its model
    node and the keys that matter, over the full fine-tuning layout (the DPO one for ``lora_dpo_*``)."""
    _, recipe, builder, attention, mlp, rank, alpha, extra = row
    letters = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "output_proj"}
    model = {"_component_": f"torchtune.models.{builder}", "lora_attn_modules": [letters[c] for c in attention],
             "apply_lora_to_mlp": mlp, "lora_rank": rank, "lora_alpha": alpha, "lora_dropout": 0.0}
    model.update({k: v for k, v in extra.items() if k in ("use_dora", "quantize_base", "apply_lora_to_output",
                                                          "lora_dropout")})
    top = {k: v for k, v in extra.items() if k in ("save_adapter_weights_only", "low_cpu_ram")}
    if extra.get("quantizer"):
        top["quantizer"] = {"_component_": "torchtune.training.quantization.Int8DynActInt4WeightQATQuantizer",
                            "groupsize": 256}
    if extra.get("teacher_model"):
        top["teacher_model"] = {"_component_": "torchtune.models.llama3_1.llama3_1_8b"}
    if recipe.startswith("lora_dpo"):
        cfg = torchtune_dpo_config(model=model, **top)
        del cfg["ref_checkpointer"]  # torchtune's LoRA DPO configs have none: the reference is the base
        return cfg
    return torchtune_config(model=model, save_adapter_weights_only=False, **top) if not top else \
        torchtune_config(model=model, **top)


MIGRATED = [row for row in TORCHTUNE_ADAPTER_CONFIGS if "vision" not in row[2] and "teacher_model" not in row[7]]


def test_torchtune_adapter_configs_migrate_where_the_family_exists():
    """90 adapter configs in torchtune 0.6.1: 79 migrate (75 LoRA fine-tuning, QAT's 4 among them, of which 20 on an
    NF4 base: 19 QLoRA and one QDoRA, and 3 DoRA in all; 4 LoRA DPO), 7 are Llama 3.2 Vision's (no such family
    here) and 4 distil knowledge."""
    assert len(TORCHTUNE_ADAPTER_CONFIGS) == 90
    recipes = [migrate_torchtune_config(torchtune_adapter_config(row)).recipe for row in MIGRATED]
    assert (recipes.count("lora_finetune"), recipes.count("lora_dpo"), len(recipes)) == (75, 4, 79)
    adapters = [migrate_torchtune_config(torchtune_adapter_config(row)).config["adapter"] for row in MIGRATED]
    assert sum(a["quantize_base"] == "nf4" for a in adapters) == 20
    assert sum(a["kind"] == "dora" for a in adapters) == 3
    for row in TORCHTUNE_ADAPTER_CONFIGS:
        if row not in MIGRATED:
            with pytest.raises(UserError, match="teacher_model: a knowledge distillation config|Llama 3.2 Vision|"
                               "an adapter on a model with no equivalent in torchtune_ac"):
                migrate_torchtune_config(torchtune_adapter_config(row))


@pytest.mark.parametrize("row", MIGRATED, ids=[row[0] for row in MIGRATED])
def test_each_torchtune_adapter_config(row):
    _, recipe, builder, attention, mlp, rank, alpha, extra = row
    migration = migrate_torchtune_config(torchtune_adapter_config(row))
    assert migration.recipe == ("lora_dpo" if recipe.startswith("lora_dpo") else "lora_finetune")
    adapter = migration.config["adapter"]
    names = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}
    assert adapter["targets"] == [names[c] for c in "qkvo" if c in attention] + (
        ["gate_proj", "up_proj", "down_proj"] if mlp else [])
    assert (adapter["rank"], adapter["alpha"], adapter["dropout"]) == (rank, alpha, 0.0)
    assert adapter["quantize_base"] == ("nf4" if ".qlora_" in builder or extra.get("quantize_base") else None)
    assert adapter["kind"] == ("dora" if extra.get("use_dora") else "lora")
    assert adapter["output"] is bool(extra.get("apply_lora_to_output"))
    assert adapter["save_merged"] is not extra.get("save_adapter_weights_only", False)
    package, lora_builder = builder.split(".")
    full = f"torchtune.models.{package}.{lora_builder.split('lora_', 1)[1]}"  # lora_llama3_1_8b -> llama3_1_8b
    assert migration.config["model"] == {"_component_": MODEL_BUILDERS.get(full, FROM_HF_CONFIG)}
    assert not any(note.key.startswith("model.") for note in migration.notes if not note.carried)
    # It passes the recipe's schema, the adapter section as written.
    schema = LoRADPOConfig if migration.recipe == "lora_dpo" else LoRAFinetuneConfig
    typed = validate_config(migration.config, schema, source=row[0])
    assert dataclasses.asdict(typed.adapter) == {**adapter, "checkpoint_dir": None}


@pytest.mark.parametrize("name, adapter", [
    ("llama3_1/8B_qlora_single_device", {"kind": "lora", "rank": 8, "alpha": 16, "dropout": 0.0, "targets": [
        "q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], "output": False, "quantize_base": "nf4",
        "save_merged": True}),
    # lora_llama3_8b(use_dora=True, quantize_base=True): DoRA on an NF4 base.
    ("llama3/8B_qdora_single_device", {"kind": "dora", "rank": 8, "alpha": 16, "dropout": 0.0, "targets": [
        "q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], "output": False, "quantize_base": "nf4",
        "save_merged": True}),
    ("mistral/7B_lora", {"kind": "lora", "rank": 64, "alpha": 16, "dropout": 0.0, "targets": [
        "q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], "output": True,
        "quantize_base": None, "save_merged": True}),
    ("llama3_1/70B_lora", {"kind": "lora", "rank": 16, "alpha": 32, "dropout": 0.0, "targets": [
        "q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], "output": False,
        "quantize_base": None, "save_merged": False}),
])
def test_adapter_sections(name, adapter):
    (row,) = [row for row in TORCHTUNE_ADAPTER_CONFIGS if row[0] == name]
    assert migrate_torchtune_config(torchtune_adapter_config(row)).config["adapter"] == adapter


def test_an_adapter_config_s_keys_come_out_after_the_model_s_section():
    migration = migrate_torchtune_config(torchtune_adapter_config(MIGRATED[0]))
    keys = list(migration.config)
    assert keys.index("dataset") < keys.index("adapter") < keys.index("batch_size")


def test_lora_dpo_takes_no_reference_and_keeps_the_dpo_keys():
    (row,) = [row for row in TORCHTUNE_ADAPTER_CONFIGS if row[0] == "llama3_1/8B_lora_dpo"]
    migration = migrate_torchtune_config(torchtune_adapter_config(row))
    assert migration.recipe == "lora_dpo"
    assert "ref_checkpoint_dir" not in migration.config
    assert migration.config["dpo"] == {"beta": 0.05, "label_smoothing": 0}
    assert migration.config["dataset"]["_component_"] == "torchtune_ac.data.preference_dataset"
    with_reference = torchtune_adapter_config(row)
    with_reference["ref_checkpointer"] = dict(with_reference["checkpointer"])
    notes = notes_by_key(migrate_torchtune_config(with_reference))
    assert "the base model with its adapters off" in notes["ref_checkpointer"]


@pytest.mark.parametrize("key, value, expected", [
    ("quantizer", {"_component_": "torchtune.training.quantization.Int8DynActInt4WeightQATQuantizer"},
     "quantization-aware training is not supported"),
    ("low_cpu_ram", True, "not configurable"),
    ("fsdp", {"cpu_offload": False}, "torchtune's recipes never read an fsdp section"),
])
def test_adapter_config_keys_not_carried_over_say_why(key, value, expected):
    cfg = torchtune_adapter_config(MIGRATED[0])
    cfg[key] = value
    (note,) = [n for n in migrate_torchtune_config(cfg).notes if n.key == key]
    assert not note.carried and expected in note.message


def test_an_adapter_checkpoint_points_at_adapter_checkpoint_dir():
    cfg = torchtune_adapter_config(MIGRATED[0])
    cfg["checkpointer"]["adapter_checkpoint"] = "adapter_0.pt"
    notes = notes_by_key(migrate_torchtune_config(cfg))
    assert "set adapter.checkpoint_dir to a PEFT adapter folder" in notes["checkpointer.adapter_checkpoint"]
    full = torchtune_config()
    full["checkpointer"]["adapter_checkpoint"] = "adapter_0.pt"
    assert notes_by_key(migrate_torchtune_config(full))["checkpointer.adapter_checkpoint"] == (
        "a full fine-tuning config trains no adapters")


@pytest.mark.parametrize("model, message", [
    ({"_component_": "torchtune.models.llama3_2.lora_llama3_2_1b", "lora_attn_modules": ["q_proj", "gate_proj"]},
     "model.lora_attn_modules: 'gate_proj' is not one of torchtune's attention projections (q_proj, k_proj, v_proj, "
     "output_proj)"),
    ({"_component_": "torchtune.models.llama3_2.lora_llama3_2_1b"},
     "model.lora_attn_modules=null: expected a list of q_proj, k_proj, v_proj, output_proj"),
    ({"_component_": "torchtune.models.clip.lora_clip_vision_encoder", "lora_attn_modules": ["q_proj"]},
     "model._component_=torchtune.models.clip.lora_clip_vision_encoder: an adapter on a model with no equivalent "
     "in torchtune_ac (adapters go on the full models of code_llama2, gemma, "),
])
def test_adapter_models_refused(model, message):
    with pytest.raises(UserError) as info:
        migrate_torchtune_config(torchtune_config(model=model))
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


@pytest.mark.parametrize("builder", ["torchtune.models.llama3_2_vision.llama3_2_vision_11b",
                                     "torchtune.models.llama3_2_vision.llama3_2_vision_90b"])
def test_llama_vision_is_refused_in_one_line_naming_its_configs(builder):
    with pytest.raises(UserError) as info:
        migrate_torchtune_config(torchtune_config(model={"_component_": builder}))
    message = str(info.value)
    assert message.startswith(f"model._component_={builder}: Llama 3.2 Vision (cross-attention; torchtune's "
                              "llama3_2_vision/11B_full, llama3_2_vision/11B_full_single_device, "
                              "llama3_2_vision/90B_full) has no equivalent here")
    assert message.endswith("vision-language models here are Qwen2.5-VL, Qwen3-VL and Gemma 3: tune cp "
                            "qwen2_5_vl/7B_full my.yaml, or qwen3_vl/8B_full, gemma3/4B_vision_full (docs/vision.md)")
    assert "\n" not in message
