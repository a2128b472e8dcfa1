"""``tune migrate``: turn a torchtune (0.6) config into a torchtune_ac config: ``full_finetune_*`` configs into
``full_finetune`` ones, ``full_dpo_distributed`` configs (a ``ref_checkpointer``, a DPO loss, a preference dataset)
into ``full_dpo`` ones, and their adapter twins (a ``lora_``/``qlora_`` model builder: ``lora_finetune_*``,
``qat_lora_finetune_distributed``, ``lora_dpo_*``) into ``lora_finetune`` and ``lora_dpo`` ones, the builder's LoRA
arguments as the ``adapter`` section.

Everything torchtune-specific lives here: the tables from torchtune's components and keys to ours, and the
notes on what could not be carried over (the model builders come from the families, each declaring the torchtune
builders it replaces). :func:`migrate_torchtune_config` is a pure function from the torchtune config (a plain
mapping, interpolations resolved) to our config and the notes; :func:`migrate_file` is the thin I/O around it that
``tune migrate`` calls.

The migrated config says what the torchtune user asked for. Where torchtune silently did something else
(``ac_mode`` ignored when ``enable_activation_checkpointing`` is true, ``ac_option: 0`` meaning every block,
a null seed drawing a random one, ...), a note says so.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from torchtune_ac.config.schema import FullFinetuneConfig
from torchtune_ac.config.loading import ADAPTER_NAME
from torchtune_ac.config.validation import torchtune_marker
from torchtune_ac.errors import UserError
from torchtune_ac.memory.feature import MemoryConfig
from torchtune_ac.parallel.fsdp import FSDPConfig
from torchtune_ac.activation_checkpointing.config import ACConfig
from torchtune_ac.activation_checkpointing.mechanism import ACMode
from torchtune_ac.models.families import FAMILIES

COMPONENT_KEY = "_component_"

# torchtune's Llama 3.2 Vision builders and its full configs of them: refused in one line naming them.
LLAMA_VISION_PACKAGE = "torchtune.models.llama3_2_vision."
LLAMA_VISION_CONFIGS = ("llama3_2_vision/11B_full", "llama3_2_vision/11B_full_single_device",
                        "llama3_2_vision/90B_full")

# torchtune model builder -> ours, as each family declares (``ModelFamily.torchtune_builders``). A builder absent
# from this table has no equivalent and is refused.
_REPLACED = {torchtune: ours for family in FAMILIES for torchtune, ours in family.torchtune_builders.items()}
MODEL_BUILDERS = {torchtune: f"torchtune_ac.models.{ours.ours}" for torchtune, ours in _REPLACED.items()}
# Why a builder maps to another name than its own size (printed as a "changed" note).
MODEL_NOTES = {torchtune: ours.note for torchtune, ours in _REPLACED.items() if ours.note}
# torchtune model package -> the family of its architecture: its other full-model builders (llama2_13b,
# qwen2_5_3b, ...) become from_hf_config over their checkpoint, whose config.json gives the shapes.
MODEL_PACKAGES = {package: family.name for family in FAMILIES for package in family.torchtune_packages}
FROM_HF_CONFIG = "torchtune_ac.models.from_hf_config"
# Builders of those packages that are not a full model of the package's architecture: adapters, reward and
# classifier heads, tokenizers, mixtures of experts (Qwen3's).
_NOT_A_FULL_MODEL = re.compile(r"^q?lora_|reward|classifier|tokenizer|moe")

LOAD_TOKENIZER = "torchtune_ac.data.load_tokenizer"
PREFERENCE_DATASET = "torchtune_ac.data.preference_dataset"
INSTRUCT_DATASET = "torchtune_ac.data.instruct_dataset"
CHAT_DATASET = "torchtune_ac.data.chat_dataset"
TEXT_DATASET = "torchtune_ac.data.text_dataset"
COSINE_SCHEDULE = "torchtune_ac.training.cosine_schedule_with_warmup"
# The module that holds them (configs also accept torchtune's layout, compat/torchtune/paths.py's alias; Python
# imports only this one).
TENSORBOARD_LOGGER = "torchtune_ac.observability.metric_logging.TensorBoardLogger"
WANDB_LOGGER = "torchtune_ac.observability.metric_logging.WandBLogger"
ADAMW = "torch.optim.AdamW"
# Low-bit AdamW of torchtune configs -> torchao's (the ao extra): bitsandbytes' (paged) 8-bit AdamW and torchao's
# own under its older prototype path.
LOW_BIT_OPTIMIZERS = {
    "bitsandbytes.optim.PagedAdamW8bit": "torchao.optim.AdamW8bit",
    "bitsandbytes.optim.AdamW8bit": "torchao.optim.AdamW8bit",
    "torchao.prototype.low_bit_optim.AdamW8bit": "torchao.optim.AdamW8bit",
    "torchao.prototype.low_bit_optim.AdamW4bit": "torchao.optim.AdamW4bit",
    "torchao.optim.AdamW8bit": "torchao.optim.AdamW8bit",
    "torchao.optim.AdamW4bit": "torchao.optim.AdamW4bit",
}

TORCHTUNE_PREFIX = "torchtune."
TT_DATASETS = "torchtune.datasets."
# torchtune dataset builder -> (our builder, torchtune's defaults that differ from ours or that ours lacks).
DATASET_BUILDERS = {
    "alpaca_dataset": (INSTRUCT_DATASET, {"source": "tatsu-lab/alpaca", "train_on_input": True}),
    "alpaca_cleaned_dataset": (INSTRUCT_DATASET, {"source": "yahma/alpaca-cleaned", "train_on_input": True}),
    "instruct_dataset": (INSTRUCT_DATASET, {"train_on_input": False}),
    "chat_dataset": (CHAT_DATASET, {"train_on_input": False}),
    "text_completion_dataset": (TEXT_DATASET, {}),
    # Preference pairs (full_dpo_distributed): chosen/rejected message lists, or stack exchange's strings rendered
    # as a user and an assistant turn, as torchtune renders them.
    "preference_dataset": (PREFERENCE_DATASET, {}),
    "hh_rlhf_helpful_dataset": (PREFERENCE_DATASET, {"source": "RLHFlow/HH-RLHF-Helpful-standard"}),
    "stack_exchange_paired_dataset": (PREFERENCE_DATASET, {
        "source": "lvwerra/stack-exchange-paired", "template": "chat",
        "column_map": {"prompt": "question", "chosen": "response_j", "rejected": "response_k"}}),
}
# Hugging Face `load_dataset` builder names a torchtune `source:` may hold; the file is in `data_files`.
HF_FILE_BUILDERS = ("json", "parquet", "csv", "arrow", "text")

COSINE_SCHEDULES = (
    "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
    "torchtune.training.get_cosine_schedule_with_warmup",
)
CHUNKED_LOSSES = (
    "torchtune.modules.loss.CEWithChunkedOutputLoss",
    "torchtune.modules.loss.LinearCrossEntropyLoss",
)
# torchtune chunks the output into 8 pieces unless told otherwise.
DEFAULT_LOSS_CHUNKS = 8
PLAIN_LOSSES = ("torch.nn.CrossEntropyLoss",)
# full_dpo_distributed's losses: DPO (with cDPO's label smoothing) is ours; RSO's hinge loss is not.
DPO_LOSSES = ("torchtune.rlhf.loss.DPOLoss", "torchtune.modules.rlhf.loss.DPOLoss")
RLHF_LOSSES = "torchtune.rlhf.loss."
METRIC_LOGGERS = "torchtune.training.metric_logging."

# torchtune's LoRA builder arguments -> the adapter section. Its attention names -> PEFT's target_modules names (the
# adapter section's), in PEFT's order; apply_lora_to_mlp adds the three MLP projections (torchtune's w1, w3, w2).
LORA_ATTN_TARGETS = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "output_proj": "o_proj"}
LORA_MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
ADAPTER_TARGET_ORDER = (*LORA_ATTN_TARGETS.values(), *LORA_MLP_TARGETS)
# torchtune's LoRA builders' defaults (every lora_* builder of 0.6.1 shares them).
LORA_DEFAULTS = {"lora_rank": 8, "lora_alpha": 16, "lora_dropout": 0.0, "apply_lora_to_mlp": False,
                 "apply_lora_to_output": False, "use_dora": False, "quantize_base": False}
LORA_MODEL_ARGS = ("lora_attn_modules", *LORA_DEFAULTS)
# Knowledge distillation configs (knowledge_distillation_*): a teacher beside the LoRA student.
DISTILLATION_KEYS = ("teacher_model", "teacher_checkpointer", "kd_loss", "kd_ratio")

# Keys copied unchanged: same name and meaning here, as the schema marks them (``torchtune: same``). The memory
# switches' keys (ours, top-level) are written when they differ from our default.
SAME_KEYS = tuple(f.name for f in dataclasses.fields(FullFinetuneConfig) if f.metadata.get("torchtune") == "same")
MEMORY_KEYS = tuple(f.name for f in dataclasses.fields(MemoryConfig))
AC_KEYS = tuple(f.name for f in dataclasses.fields(ACConfig))
# torchtune's top-level fsdp_* keys -> ours under fsdp (the fields of the fsdp group name torchtune's key).
FSDP_KEYS = {f.metadata["torchtune"]: f.name for f in dataclasses.fields(FSDPConfig)
             if f.metadata.get("torchtune") not in (None, "same")}
# The modes torchtune's recipes knew (auto is ours).
TORCHTUNE_AC_MODES = tuple(mode.value for mode in ACMode if mode is not ACMode.AUTO)

# Top-level torchtune keys with no counterpart here, and why (a key the schema or a memory switch takes is
# carried over instead, so adding the switch removes it from here without an edit).
_NOT_CARRIED_OVER = {
    "activation_offloading_use_streams": "activation offloading (enable_activation_offloading) always copies on a "
    "side stream",
    "profiler": "the torch profiler is not built into the recipe",
    "log_peak_memory_stats": "peak memory is always recorded (peak_memory_gib in metrics.jsonl)",
    "log_level": "the recipe logs at INFO on rank 0",
    "custom_sharded_layers": "FSDP2 here shards each transformer block, the embeddings and [final norm, output] "
    "(the root holds them when tied), then the root; extra groups are not configurable",
    "data_parallel_shard_dim": "the shard degree is the world size / fsdp.replicate_degree",
    "enable_async_checkpointing": "checkpoints are written synchronously",
    "cudnn_deterministic_mode": "not configurable",
    "collate_fn": "batches are padded, or packed rows when dataset.packed is true; the collate function is fixed",
    "quantizer": "quantization-aware training is not supported: the model trains against its unquantised weights "
    "(no fake quantisation), so the result is not prepared for that quantizer",
    "low_cpu_ram": "not configurable (torchtune's QLoRA option to keep the state dict off host memory while "
    "quantising)",
}
_SCHEMA_KEYS = {f.name for f in dataclasses.fields(FullFinetuneConfig)} | set(MEMORY_KEYS) | set(AC_KEYS) | set(FSDP_KEYS)
UNSUPPORTED_KEYS = {key: why for key, why in _NOT_CARRIED_OVER.items() if key not in _SCHEMA_KEYS}
# The values of those keys with which dropping them loses nothing (mostly "off").
HARMLESS_VALUES = {
    "profiler": (None,),  # or {enabled: false}
    "activation_offloading_use_streams": (True, None),
    "log_peak_memory_stats": (True, False, None),
    "custom_sharded_layers": (None, []),
    "data_parallel_shard_dim": (-1, None),
    "enable_async_checkpointing": (False, None),
    "cudnn_deterministic_mode": (False, None),
    "collate_fn": (None, "torchtune.data.padded_collate_sft"),
    "low_cpu_ram": (False, None),
}

# Key order and blank-line-separated sections of the YAML we write (as in the shipped configs).
OUTPUT_SECTIONS = (
    ("output_dir", "checkpoint_dir", "resume_from_checkpoint", "ref_checkpoint_dir"),
    ("model", "tokenizer", "dataset", "max_seq_len", "dataset_val", "run_val_every_n_steps", "batch_size_val"),
    ("adapter",),
    ("dpo",),
    ("seed", "shuffle", "batch_size", "epochs", "max_steps_per_epoch", "gradient_accumulation_steps",
     "clip_grad_norm", "optimizer", "lr_scheduler", *MEMORY_KEYS),
    ("device", "dtype", "compile"),
    AC_KEYS,
    ("save_every_n_steps", "log_every_n_steps", "metric_logger", "fsdp", "tensor_parallel_dim"),
)
# torchtune's own tensor-parallel plans (``tensor_parallel_plan: {_component_: torchtune.models.llama3.base_llama_tp_plan}``
# and its other families'): each splits the layers our family plans split.
TORCHTUNE_TP_PLANS = re.compile(r"^torchtune\.models\.[\w.]+\.\w*tp_plan$")


@dataclass(frozen=True)
class MigrationNote:
    """One line of ``tune migrate``'s report about the torchtune key ``key``.

    ``carried`` is False when the key (or part of it) could not be carried over, True when it was carried over
    with a change worth knowing (a torchtune behaviour corrected, a path adjusted, ...).
    """

    key: str
    message: str
    carried: bool

    def __str__(self) -> str:
        return f"{'changed' if self.carried else 'not carried over'}: {self.key}: {self.message}"


@dataclass(frozen=True)
class Migration:
    """Our config (plain values, in our key order), the notes about what changed or was left behind, the recipe
    it is for (``full_finetune``, ``full_dpo``, ``lora_finetune`` or ``lora_dpo``), and the user's own components it
    names (``--allow-component`` each, to run it)."""

    config: dict[str, Any]
    notes: tuple[MigrationNote, ...]
    recipe: str = "full_finetune"
    allow: tuple[str, ...] = ()

    def flags(self) -> str:
        """The ``--allow-component`` flags its commands need ("" when none)."""
        return "".join(f" --allow-component {path}" for path in self.allow)


def adapter_builder(tt: Mapping[str, Any]) -> Optional[str]:
    """The model builder of a torchtune adapter config (``lora_llama3_1_8b``, ``qlora_qwen2_5_7b``, ...), or None."""
    model = tt.get("model")
    path = model.get(COMPONENT_KEY) if isinstance(model, Mapping) else None
    return path if isinstance(path, str) and ADAPTER_NAME.search(path.rsplit(".", 1)[-1]) else None


def is_preference_config(tt: Mapping[str, Any]) -> bool:
    """Whether a torchtune config is ``full_dpo_distributed``'s: it has a ``ref_checkpointer``, or a loss of
    ``torchtune.rlhf.loss``."""
    loss = tt.get("loss")
    path = loss.get(COMPONENT_KEY) if isinstance(loss, Mapping) else None
    return "ref_checkpointer" in tt or (isinstance(path, str) and (path in DPO_LOSSES or path.startswith(RLHF_LOSSES)))


class _Migrator:
    """Walks a torchtune config once; every key it reads is marked as handled, the rest get a note."""

    def __init__(self, tt: Mapping[str, Any]) -> None:
        self.tt = tt
        self.preference = is_preference_config(tt)
        self.adapter = adapter_builder(tt) is not None
        self.out: dict[str, Any] = {}
        self.notes: list[MigrationNote] = []
        self.handled: set[str] = set()
        self.allow: list[str] = []

    def take(self, key: str, default: Any = None) -> Any:
        self.handled.add(key)
        return self.tt.get(key, default)

    def dropped(self, key: str, message: str) -> None:
        self.notes.append(MigrationNote(key, message, carried=False))

    def changed(self, key: str, message: str) -> None:
        self.notes.append(MigrationNote(key, message, carried=True))

    def run(self) -> Migration:
        distillation = [key for key in DISTILLATION_KEYS if key in self.tt]
        if distillation:
            raise UserError(f"{distillation[0]}: a knowledge distillation config (torchtune's "
                            "knowledge_distillation_* recipes); distillation has no recipe in torchtune_ac")
        self.migrate_output_and_checkpoint()
        if self.preference:
            self.migrate_reference()
        self.migrate_model()
        self.migrate_tokenizer()
        self.migrate_dataset()
        if self.tt.get("dataset_val") is not None:
            self.migrate_dataset("dataset_val")
        self.migrate_training_keys()
        self.migrate_optimizer()
        self.migrate_lr_scheduler()
        self.migrate_loss()
        self.migrate_device_and_dtype()
        self.migrate_activation_checkpointing()
        self.migrate_fsdp()
        self.migrate_tensor_parallel_plan()
        self.migrate_metric_logger()
        for key in self.tt:
            if key in self.handled:
                continue
            value = self.tt[key]
            if key in UNSUPPORTED_KEYS:
                harmless = key in HARMLESS_VALUES and _is_harmless(value, HARMLESS_VALUES[key])
                suffix = f" (nothing lost with {_show(value)})" if harmless else ""
                self.dropped(key, UNSUPPORTED_KEYS[key] + suffix)
            else:
                self.dropped(key, "no such setting in torchtune_ac")
        recipe = f"{'lora' if self.adapter else 'full'}_{'dpo' if self.preference else 'finetune'}"
        return Migration(_ordered(self.out), tuple(self.notes), recipe, tuple(dict.fromkeys(self.allow)))

    # ------------------------------------------------------------------------------------- sections

    def migrate_output_and_checkpoint(self) -> None:
        checkpointer = self.take("checkpointer")
        output_dir = self.take("output_dir")
        checkpointer_out = checkpointer.get("output_dir") if isinstance(checkpointer, Mapping) else None
        if output_dir is None and checkpointer_out is not None:
            output_dir = checkpointer_out
            self.changed("checkpointer.output_dir", "used as output_dir (the config has no top-level output_dir)")
        elif checkpointer_out is not None and _same_path(checkpointer_out, output_dir) is False:
            self.dropped(
                "checkpointer.output_dir",
                f"checkpoints go to output_dir ({output_dir}), not to {checkpointer_out}",
            )
        if output_dir is None:
            raise UserError("output_dir: the torchtune config has neither output_dir nor checkpointer.output_dir")
        self.out["output_dir"] = output_dir
        if checkpointer is None:
            self.out["checkpoint_dir"] = None
            self.changed("checkpointer", "absent: training starts from a random initialisation (seeded)")
        elif not isinstance(checkpointer, Mapping) or checkpointer.get("checkpoint_dir") is None:
            raise UserError("checkpointer.checkpoint_dir: missing; torchtune_ac needs the folder of the checkpoint")
        else:
            self.out["checkpoint_dir"] = self.checkpoint_dir(checkpointer)
        resume = self.tt.get("resume_from_checkpoint")
        if resume is True:
            self.changed(
                "resume_from_checkpoint",
                "resumes from the newest checkpoint in output_dir (torchtune read checkpointer.recipe_checkpoint); "
                "a checkpoint written by torchtune cannot be resumed here",
            )

    def checkpoint_dir(self, checkpointer: Mapping[str, Any]) -> str:
        kind = str(checkpointer.get(COMPONENT_KEY, ""))
        directory = str(checkpointer["checkpoint_dir"])
        if kind.endswith("FullModelMetaCheckpointer"):
            path = Path(directory)
            if path.name == "original":
                directory = str(path.parent)
                self.changed(
                    "checkpointer.checkpoint_dir",
                    f"{kind.rsplit('.', 1)[-1]} read Meta's consolidated .pth files from original/; torchtune_ac reads "
                    f"Hugging Face safetensors, so checkpoint_dir is the folder above it ({directory})",
                )
            else:
                self.changed(
                    "checkpointer.checkpoint_dir",
                    "torchtune read Meta's consolidated .pth files here; torchtune_ac needs a Hugging Face checkpoint "
                    "(config.json and *.safetensors) in this folder",
                )
        elif kind and not kind.endswith("FullModelHFCheckpointer"):
            self.changed(
                "checkpointer._component_",
                f"{kind}: torchtune_ac reads a Hugging Face checkpoint (config.json and *.safetensors) from "
                "checkpoint_dir",
            )
        reasons = {
            "checkpoint_files": "every *.safetensors file of checkpoint_dir is read (through "
            "model.safetensors.index.json when sharded)",
            "recipe_checkpoint": "resume_from_checkpoint continues from the newest checkpoint in output_dir",
            "model_type": "the architecture comes from `model`, checked against checkpoint_dir/config.json",
            "adapter_checkpoint": "torchtune read it only to resume (with resume_from_checkpoint), which here "
            "continues from the newest checkpoint in output_dir; to start from an adapter, set adapter.checkpoint_dir "
            "to a PEFT adapter folder (adapter_config.json and adapter_model.safetensors, which torchtune 0.6 wrote "
            "beside adapter_model.pt)" if self.adapter else "a full fine-tuning config trains no adapters",
            "safe_serialization": "checkpoints are always written as safetensors",
        }
        files = checkpointer.get("checkpoint_files")
        pickled = isinstance(files, list) and any(str(f).endswith((".bin", ".pt", ".pth")) for f in files)
        if pickled and not kind.endswith("FullModelMetaCheckpointer"):  # Meta's: handled above
            reasons["checkpoint_files"] = "torchtune_ac reads only *.safetensors files (no pickled .bin/.pt/.pth): " \
                "convert the checkpoint, or download its safetensors version, into checkpoint_dir"
        for name in checkpointer:
            if name in (COMPONENT_KEY, "checkpoint_dir", "output_dir"):
                continue
            if name in ("recipe_checkpoint", "adapter_checkpoint") and checkpointer[name] is None:
                continue
            self.dropped(f"checkpointer.{name}", reasons.get(name, "no such setting in torchtune_ac"))
        return directory

    def migrate_reference(self) -> None:
        """``ref_checkpointer`` (full_dpo_distributed's reference weights) as ``ref_checkpoint_dir``: left out (the
        reference is the starting weights) when it is the checkpointer's folder. LoRA DPO's reference is the base
        with its adapters off: no ``ref_checkpointer`` is read."""
        if self.adapter:
            if self.take("ref_checkpointer") is not None:
                self.dropped("ref_checkpointer", "lora_dpo's reference is the base model with its adapters off (no "
                             "second model in memory): its weights are checkpoint_dir's")
            return
        reference = self.take("ref_checkpointer")
        if not isinstance(reference, Mapping) or reference.get("checkpoint_dir") is None:
            raise UserError("ref_checkpointer.checkpoint_dir: missing; the reference model's weights are needed (its "
                            "folder, usually the checkpointer's)")
        directory = str(reference["checkpoint_dir"])
        if _same_path(directory, self.out.get("checkpoint_dir")):
            self.out["ref_checkpoint_dir"] = None
        else:
            self.out["ref_checkpoint_dir"] = directory
        for name in reference:
            if name not in (COMPONENT_KEY, "checkpoint_dir", "output_dir", "recipe_checkpoint", "checkpoint_files",
                            "model_type"):
                self.dropped(f"ref_checkpointer.{name}", "no such setting of the reference here")

    def migrate_model(self) -> None:
        model = self.take("model")
        path = model.get(COMPONENT_KEY) if isinstance(model, Mapping) else None
        if isinstance(path, str) and path.startswith(LLAMA_VISION_PACKAGE):
            raise UserError(f"model._component_={path}: Llama 3.2 Vision (cross-attention; torchtune's "
                            f"{', '.join(LLAMA_VISION_CONFIGS)}) has no equivalent here; vision-language models here "
                            "are Qwen2.5-VL, Qwen3-VL and Gemma 3: tune cp qwen2_5_vl/7B_full my.yaml, or "
                            "qwen3_vl/8B_full, gemma3/4B_vision_full (docs/vision.md)")
        if self.adapter:
            # lora_llama3_1_8b, qlora_qwen2_5_7b: the full model's builder, and its LoRA arguments as the adapter.
            package, name = path.rsplit(".", 1)
            full = f"{package}.{ADAPTER_NAME.sub('', name, count=1).lstrip('_')}"
            if full not in MODEL_BUILDERS and _architecture_of(full) is None:
                packages = ", ".join(sorted(p.rsplit(".", 1)[-1] for p in MODEL_PACKAGES))
                raise UserError(f"model._component_={path}: an adapter on a model with no equivalent in torchtune_ac "
                                f"(adapters go on the full models of {packages})")
            self.migrate_adapter(path, model)
            model = {**{k: v for k, v in model.items() if k not in LORA_MODEL_ARGS}, COMPONENT_KEY: full}
            path = full
        family = _architecture_of(path)
        if path in MODEL_BUILDERS:
            ours = MODEL_BUILDERS[path]
            if path in MODEL_NOTES:
                self.changed("model._component_", MODEL_NOTES[path])
        elif family is not None:
            ours = FROM_HF_CONFIG
            self.changed("model._component_", f"{path.rsplit('.', 1)[-1]} is a {family} model with no builder of "
                         "its own here: from_hf_config builds the one checkpoint_dir's config.json describes")
        elif _is_moe_builder(path):
            raise UserError(f"model._component_={path}: a mixture-of-experts builder; tune migrate does not carry "
                            "torchtune's MoE models over: start from this product's own MoE configs (tune cp "
                            "qwen3_moe/30B_A3B_full my.yaml, or gpt_oss/20B_full; docs/moe.md), which train "
                            "Qwen3-MoE and gpt-oss checkpoints")
        else:
            supported = ", ".join(sorted(p.rsplit(".", 1)[-1] for p in MODEL_BUILDERS))
            packages = ", ".join(sorted(p.rsplit(".", 1)[-1] for p in MODEL_PACKAGES))
            raise UserError(f"model._component_={path}: no equivalent in torchtune_ac; supported: {supported}, and "
                            f"any other full model of {packages} (as from_hf_config)")
        self.out["model"] = {COMPONENT_KEY: ours}
        for name in model:
            if name != COMPONENT_KEY:
                self.dropped(f"model.{name}", f"not an argument of {ours}")

    def migrate_adapter(self, path: str, model: Mapping[str, Any]) -> None:
        """A torchtune LoRA builder's arguments (``lora_attn_modules``, ``apply_lora_to_mlp``, ``lora_rank``, ...,
        ``use_dora``, ``quantize_base`` or a ``qlora_`` builder) and ``save_adapter_weights_only`` as the
        ``adapter`` section."""
        args = {**LORA_DEFAULTS, **{k: v for k, v in model.items() if k in LORA_MODEL_ARGS}}
        attention = args.get("lora_attn_modules")
        if not isinstance(attention, list):
            raise UserError(f"model.lora_attn_modules={_show(attention)}: expected a list of "
                            f"{', '.join(LORA_ATTN_TARGETS)} (the attention projections that get LoRA)")
        unknown = [name for name in attention if name not in LORA_ATTN_TARGETS]
        if unknown:
            raise UserError(f"model.lora_attn_modules: {unknown[0]!r} is not one of torchtune's attention "
                            f"projections ({', '.join(LORA_ATTN_TARGETS)})")
        targets = {LORA_ATTN_TARGETS[name] for name in attention}
        if args["apply_lora_to_mlp"]:
            targets |= set(LORA_MLP_TARGETS)
        quantized = path.rsplit(".", 1)[-1].startswith("qlora_") or bool(args["quantize_base"])
        # torchtune saved the merged model beside the adapters unless told not to.
        adapter_only = self.take("save_adapter_weights_only", False)
        self.out["adapter"] = {
            "kind": "dora" if args["use_dora"] else "lora",
            "rank": args["lora_rank"],
            "alpha": args["lora_alpha"],
            "dropout": args["lora_dropout"],
            "targets": [name for name in ADAPTER_TARGET_ORDER if name in targets],
            "output": bool(args["apply_lora_to_output"]),
            "quantize_base": "nf4" if quantized else None,
            "save_merged": not adapter_only,
        }

    def migrate_tokenizer(self) -> None:
        tokenizer = self.take("tokenizer")
        if not isinstance(tokenizer, Mapping) or not (tokenizer.get("path") or tokenizer.get("vocab_path")):
            raise UserError("tokenizer.path: missing; torchtune_ac needs the folder holding tokenizer.json")
        source = "path" if tokenizer.get("path") else "vocab_path"  # vocab_path: Phi-4's tokenizer
        given = str(tokenizer[source])
        folder = Path(given)
        if folder.suffix:  # tokenizer.model, vocab.json, tokenizer.json: the folder holding it
            folder = folder.parent
        if folder.name == "original":  # Meta's tiktoken/sentencepiece files; tokenizer.json sits one level up
            folder = folder.parent
        checkpoint_dir = self.out.get("checkpoint_dir")
        if checkpoint_dir is not None and _same_path(str(folder), checkpoint_dir):
            path = "${checkpoint_dir}"
        else:
            path = str(folder)
        self.out["tokenizer"] = {COMPONENT_KEY: LOAD_TOKENIZER, "path": path}
        if str(folder) != given.rstrip("/"):
            self.changed(
                f"tokenizer.{source}",
                f"torchtune_ac reads tokenizer.json (and tokenizer_config.json) from {folder}, not {given}",
            )
        max_seq_len = tokenizer.get("max_seq_len")
        top_level = self.take("max_seq_len")
        if max_seq_len is None:
            max_seq_len = top_level
        if max_seq_len is not None:
            self.out["max_seq_len"] = max_seq_len
        reasons = {
            "prompt_template": "prompts come from the dataset's template (alpaca or chat) and the tokenizer's chat "
            "template",
            "special_tokens_path": "special tokens come from tokenizer.json and tokenizer_config.json",
            "merges_file": "tokenizer.json holds the merges",
            "merges_path": "tokenizer.json holds the merges",
        }
        for name, value in tokenizer.items():
            if name in (COMPONENT_KEY, source, "max_seq_len") or value is None:
                continue
            self.dropped(f"tokenizer.{name}", reasons.get(name, "no such tokenizer setting in torchtune_ac"))

    def migrate_dataset(self, key: str = "dataset") -> None:
        """torchtune's ``dataset`` (or ``dataset_val``, the same kind of component) as ours."""
        dataset = self.take(key)
        if isinstance(dataset, list):
            raise UserError("dataset: a list of datasets is not supported; torchtune_ac trains on one dataset")
        path = dataset.get(COMPONENT_KEY) if isinstance(dataset, Mapping) else None
        name = path[len(TT_DATASETS):] if isinstance(path, str) and path.startswith(TT_DATASETS) else None
        if isinstance(path, str) and not path.startswith(TORCHTUNE_PREFIX):
            self.custom_dataset(key, path, dataset)
            return
        if name not in DATASET_BUILDERS:
            supported = ", ".join(DATASET_BUILDERS)
            raise UserError(f"{key}._component_={path}: no equivalent in torchtune_ac; supported: {supported}")
        ours, torchtune_defaults = DATASET_BUILDERS[name]
        if (ours == PREFERENCE_DATASET) != self.preference:
            preference = ", ".join(n for n, (o, _) in DATASET_BUILDERS.items() if o == PREFERENCE_DATASET)
            raise UserError(
                f"{key}._component_={path}: not a preference dataset, and the config is full_dpo_distributed's (it "
                f"has a ref_checkpointer or a DPO loss); supported: {preference}" if self.preference else
                f"{key}._component_={path}: a preference dataset, for full_dpo_distributed's configs (with a "
                "ref_checkpointer and a DPO loss), not for fine-tuning")
        args = {**torchtune_defaults, **{k: v for k, v in dataset.items() if k != COMPONENT_KEY}}
        node: dict[str, Any] = {COMPONENT_KEY: ours}
        node["source"] = self.dataset_source(key, args)
        if args.pop("split", "train") != "train":
            node["split"] = dataset["split"]
        if ours == PREFERENCE_DATASET:
            self.preference_arguments(key, name, args, node)
            self.out[key] = node
            self.drop_other_arguments(key, args)
            return
        if ours == INSTRUCT_DATASET:
            self.instruct_arguments(key, name, args, node)
        elif ours == CHAT_DATASET:
            node["conversation_column"] = args.pop("conversation_column", "messages")
            style = args.pop("conversation_style", None)
            if style not in ("openai", "sharegpt"):
                raise UserError(f"{key}.conversation_style={style!r}: expected openai or sharegpt")
            if style != "openai":
                node["conversation_style"] = style
            node["train_on_input"] = args.pop("train_on_input")
        else:
            if "column" in args:
                node["column"] = args.pop("column")
            if args.pop("add_eos", True) is not True:
                self.dropped(f"{key}.add_eos", "every text sample ends with EOS")
            if args.pop("split_across_pack", True) is not True:
                self.dropped(f"{key}.split_across_pack", "packing never splits a sample across rows")
        node["packed"] = bool(args.pop("packed", False))
        if node["packed"] and self.out.get("max_seq_len") is None:
            self.changed(f"{key}.packed", "packing needs max_seq_len: set it (torchtune needed tokenizer.max_seq_len)")
        self.drop_other_arguments(key, args)
        self.out[key] = node

    def custom_dataset(self, key: str, path: str, dataset: Mapping[str, Any]) -> None:
        """The user's own dataset class: written as it is, with its arguments (nothing here knows what they mean),
        and not carried over: it runs only where its user allows it, and is called as ours are."""
        self.out[key] = dict(dataset)
        self.allow.append(path)
        self.dropped(f"{key}._component_",
                     f"{path} is your own class, not one of torchtune's datasets: written as it is, with its "
                     f"arguments; to run it, pass --allow-component {path} to tune validate and tune run (it is "
                     "called as torchtune_ac's datasets are, with the tokenizer and max_seq_len), or use one of "
                     "torchtune_ac's datasets (docs/data.md)")

    def drop_other_arguments(self, key: str, args: Mapping[str, Any]) -> None:
        reasons = {
            "filter_fn": "filtering with a Python function is not supported; filter the data file instead",
            "new_system_prompt": "system prompts are not injected; add a system message to the data",
        }
        for arg, value in args.items():
            if value is None:
                continue
            self.dropped(f"{key}.{arg}", reasons.get(arg, "not an argument of the dataset here (Hugging Face "
                                                       "load_dataset arguments are not passed through)"))

    def preference_arguments(self, key: str, name: str, args: dict[str, Any], node: dict[str, Any]) -> None:
        """torchtune's preference datasets as ``preference_dataset``: its column map and template; the prompt is
        always masked here."""
        column_map = args.pop("column_map", None)
        if column_map:
            node["column_map"] = dict(column_map)
        if args.pop("template", "plain") == "chat":
            node["template"] = "chat"
        if args.pop("train_on_input", False):
            self.dropped(f"{key}.train_on_input", "the prompt is never scored here: DPO compares the answers' "
                         "log-probabilities")
        if args.pop("packed", False):
            self.dropped(f"{key}.packed", "preference pairs are not packed")
        if name == "stack_exchange_paired_dataset" and node["source"] == "lvwerra/stack-exchange-paired":
            self.changed(f"{key}.source", "torchtune read only the Hub dataset's data/rl folder; here the source is "
                         "read whole: download data/rl (hf download --repo-type dataset "
                         "lvwerra/stack-exchange-paired --include 'data/rl/*') and point source at it")

    def dataset_source(self, key: str, args: dict[str, Any]) -> str:
        source = args.pop("source", None)
        data_files = args.pop("data_files", None)
        data_dir = args.pop("data_dir", None)
        if source is None:
            raise UserError(f"{key}.source: missing")
        if source not in HF_FILE_BUILDERS:
            if data_files is not None:
                raise UserError(f"{key}.data_files with source={source}: torchtune_ac reads one file, folder or Hub "
                                "dataset; point source at it")
            if not _is_local_path(source):
                self.changed(f"{key}.source", f"{source} is loaded from the Hugging Face Hub at run time (needs "
                             "network access); for offline runs download it and point source at the local files")
            return source
        if isinstance(data_files, Mapping):
            data_files = data_files.get(args.get("split", "train"))
        if isinstance(data_files, list) and len(data_files) == 1:
            data_files = data_files[0]
        if isinstance(data_files, str):
            file = data_files
        elif data_files is None and data_dir is not None:
            file = data_dir
        else:
            raise UserError(
                f"{key}.data_files={data_files!r}: torchtune_ac reads one file or one folder; put the files in a "
                "folder and set source to it"
            )
        if source == "text":
            self.changed(f"{key}.source", f"a .txt file is split into documents at blank lines here (Hugging "
                         f"Face's text loader made one sample per line): check {file}")
        elif source == "json" and not file.endswith((".json", ".jsonl")):
            raise UserError(f"{key}.data_files={file}: a JSON source must end in .json or .jsonl here")
        return file

    def instruct_arguments(self, key: str, name: str, args: dict[str, Any], node: dict[str, Any]) -> None:
        column_map = args.pop("column_map", None)
        if name == "instruct_dataset":
            # torchtune's instruct_dataset reads the prompt from an `input` column and renders the pair with the
            # model's chat format: our instruction column, with no separate input column, and the chat template.
            column_map = dict(column_map or {})
            node["column_map"] = {"instruction": column_map.pop("input", "input"), "input": None,
                                  "output": column_map.pop("output", "output")}
            for column in column_map:
                self.dropped(f"{key}.column_map.{column}", "instruct_dataset reads input and output columns")
            node["template"] = "chat"
        else:
            if column_map:
                node["column_map"] = dict(column_map)
            self.changed(
                f"{key}._component_",
                f"{name} -> instruct_dataset with the alpaca template: the prompt wording differs a little from "
                "torchtune's, and it is not wrapped in the model's chat format",
            )
        node["train_on_input"] = args.pop("train_on_input")
        if name.startswith("alpaca") and node["train_on_input"] and "train_on_input" not in self.tt[key]:
            self.changed(f"{key}.train_on_input", "torchtune's alpaca datasets train on the prompt by default; "
                         "kept as train_on_input: true (torchtune_ac's default is false)")

    def migrate_training_keys(self) -> None:
        for key in SAME_KEYS:
            if key in self.tt:
                value = self.take(key)
                if key == "compile" and isinstance(value, Mapping):
                    value = bool(value.get("model", False))
                    self.changed("compile", "torchtune_ac compiles each transformer block (compile: true) or "
                                 "nothing; the loss and optimizer step are not compiled")
                if value is not None or key in ("max_steps_per_epoch", "clip_grad_norm"):
                    self.out[key] = value
        seed = self.take("seed")
        if seed is None:
            self.changed("seed", "null made torchtune draw a random seed each run; torchtune_ac runs are "
                         "reproducible with seed 0 (set another to vary)")
        else:
            self.out["seed"] = seed
        defaults = MemoryConfig()
        for key in MEMORY_KEYS:
            value = self.take(key)
            if key in self.tt and value is not None and value != getattr(defaults, key):
                self.out[key] = value

    def migrate_optimizer(self) -> None:
        optimizer = self.take("optimizer")
        path = optimizer.get(COMPONENT_KEY) if isinstance(optimizer, Mapping) else None
        if not isinstance(path, str):
            raise UserError("optimizer._component_: missing")
        if path.startswith("torch.optim."):
            self.out["optimizer"] = dict(optimizer)
            return
        if path in LOW_BIT_OPTIMIZERS:
            target = LOW_BIT_OPTIMIZERS[path]
            low_bit_args = ("lr", "betas", "eps", "weight_decay", "amsgrad")
            self.out["optimizer"] = {COMPONENT_KEY: target, **{k: v for k, v in optimizer.items() if k in low_bit_args}}
            lost = sorted(k for k in optimizer if k != COMPONENT_KEY and k not in low_bit_args)
            if target != path:
                paged = " (not paged: fsdp.cpu_offload: true keeps the state in host memory)" if "Paged" in path else ""
                self.changed("optimizer._component_", f"{path} becomes {target}, the same state precision{paged}; "
                             "it needs the ao extra (pip install 'torchtune_ac[ao]')"
                             + (f"; dropped: {', '.join(lost)}" if lost else ""))
            return
        adamw_args = ("lr", "betas", "eps", "weight_decay", "amsgrad", "fused", "foreach")
        node = {COMPONENT_KEY: ADAMW, **{k: v for k, v in optimizer.items() if k in adamw_args}}
        lost = sorted(k for k in optimizer if k != COMPONENT_KEY and k not in adamw_args)
        self.out["optimizer"] = node
        self.changed(
            "optimizer._component_",
            f"{path} is not a torch.optim optimizer; using torch.optim.AdamW with the same settings"
            + (f" (dropped: {', '.join(lost)})" if lost else "")
            + f"; to keep it, install its package, set it back and pass --allow-component {path.split('.')[0]}",
        )

    def migrate_lr_scheduler(self) -> None:
        scheduler = self.take("lr_scheduler")
        if scheduler is None:
            return
        path = scheduler.get(COMPONENT_KEY) if isinstance(scheduler, Mapping) else None
        if path not in COSINE_SCHEDULES:
            self.dropped("lr_scheduler", f"{path}: no equivalent; the learning rate stays constant (torchtune_ac "
                         f"offers {COSINE_SCHEDULE} and torchtune_ac.training.constant_schedule)")
            return
        node = {COMPONENT_KEY: COSINE_SCHEDULE, "num_warmup_steps": scheduler.get("num_warmup_steps", 0)}
        self.out["lr_scheduler"] = node
        if scheduler.get("num_cycles", 0.5) != 0.5:
            self.dropped("lr_scheduler.num_cycles", "the cosine decays once, from lr to 0 (num_cycles 0.5)")
        if scheduler.get("num_training_steps") is not None:
            self.dropped("lr_scheduler.num_training_steps", "the recipe passes the run's number of optimizer steps")

    def migrate_loss(self) -> None:
        loss = self.take("loss")
        if loss is None:
            return
        path = loss.get(COMPONENT_KEY) if isinstance(loss, Mapping) else None
        if self.preference:
            self.migrate_dpo_loss(path, loss)
            return
        if path in CHUNKED_LOSSES:
            chunks = loss.get("num_output_chunks", DEFAULT_LOSS_CHUNKS)
            self.out["loss_chunks"] = chunks
        elif path not in PLAIN_LOSSES:
            self.dropped("loss", f"{path}: torchtune_ac trains with the cross-entropy of the next token")
            return
        if loss.get("ignore_index", -100) != -100:
            self.dropped("loss.ignore_index", "masked positions always have label -100")

    def migrate_dpo_loss(self, path: Optional[str], loss: Mapping[str, Any]) -> None:
        """full_dpo_distributed's ``loss`` as the ``dpo`` keys (a DPOLoss's beta and label smoothing)."""
        if path not in DPO_LOSSES:
            raise UserError(f"loss._component_={path}: no equivalent in torchtune_ac's full_dpo (it trains with the "
                            "DPO loss, torchtune.rlhf.loss.DPOLoss: dpo.beta, dpo.label_smoothing, dpo.loss_type: "
                            "ipo)")
        self.out["dpo"] = {"beta": loss.get("beta", 0.1), "label_smoothing": loss.get("label_smoothing", 0.0)}
        for name in loss:
            if name not in (COMPONENT_KEY, "beta", "label_smoothing"):
                self.dropped(f"loss.{name}", "not a setting of the DPO loss here")

    def migrate_device_and_dtype(self) -> None:
        device = self.take("device")
        if device in ("cpu", "cuda"):
            self.out["device"] = device
        elif device is not None:
            self.dropped("device", f"{device}: torchtune_ac runs on cpu or cuda (device: auto picks CUDA when present)")
        dtype = self.take("dtype")
        if dtype in ("fp32", "bf16"):
            self.out["dtype"] = dtype
        elif dtype is not None:
            self.dropped("dtype", f"{dtype}: torchtune_ac trains in fp32 or bf16; fp32 is used")

    def migrate_activation_checkpointing(self) -> None:
        flag = self.take("enable_activation_checkpointing")
        mode = self.take("ac_mode")
        option = self.take("ac_option")
        for key, value in migrate_ac_keys(flag, mode, option).items():
            self.out[key] = value
        for key, message in ac_notes(flag, mode, option):
            self.changed(key, message)

    def migrate_fsdp(self) -> None:
        if self.take("fsdp") is not None:
            self.dropped("fsdp", "torchtune's recipes never read an fsdp section (they read the top-level fsdp_* "
                         "keys), and neither is it carried over")
        defaults = FSDPConfig()
        for torchtune_key, key in FSDP_KEYS.items():
            value = self.take(torchtune_key)
            if value is not None and value != getattr(defaults, key):
                self.out.setdefault("fsdp", {})[key] = value

    def migrate_tensor_parallel_plan(self) -> None:
        """``tensor_parallel_dim`` is carried over as it is (a schema key); the plan is the model family's here."""
        plan = self.take("tensor_parallel_plan")
        if plan is None:
            return
        path = plan.get(COMPONENT_KEY) if isinstance(plan, Mapping) else plan
        ours = "each model family declares its own plan here (torchtune_ac/models/tensor_parallel.py), used with " \
               "tensor_parallel_dim"
        if isinstance(path, str) and TORCHTUNE_TP_PLANS.match(path):
            self.changed("tensor_parallel_plan", f"{path} is torchtune's stock plan: dropped, the family's own plan "
                         "splits the same layers (attention heads, MLP columns, the vocabulary, the norms along the "
                         f"sequence); {ours}")
        else:
            self.dropped("tensor_parallel_plan", f"a custom plan ({_show(path)}) is not carried over: {ours}, and "
                         "it cannot be replaced")

    def migrate_metric_logger(self) -> None:
        logger = self.take("metric_logger")
        if logger is None:
            return
        path = logger.get(COMPONENT_KEY) if isinstance(logger, Mapping) else None
        name = path[len(METRIC_LOGGERS):] if isinstance(path, str) and path.startswith(METRIC_LOGGERS) else path
        args = {k: v for k, v in logger.items() if k != COMPONENT_KEY}
        if name in ("DiskLogger", "StdoutLogger"):
            self.changed("metric_logger", f"{name}: metrics.jsonl in output_dir is always written (and progress "
                         "goes to stderr), so no logger is needed: metric_logger is null")
            return
        if name == "TensorBoardLogger":
            node = {COMPONENT_KEY: TENSORBOARD_LOGGER}
            known = ("log_dir",)
        elif name == "WandBLogger":
            node = {COMPONENT_KEY: WANDB_LOGGER}
            known = ("project", "entity", "group", "name", "mode", "tags", "notes", "log_dir")
        else:
            self.dropped("metric_logger", f"{path}: torchtune_ac logs to metrics.jsonl, TensorBoard or Weights & Biases")
            return
        output_dir = str(self.out["output_dir"])
        for key, value in args.items():
            if key not in known:
                if key != "organize_logs":
                    self.dropped(f"metric_logger.{key}", f"not an argument of {node[COMPONENT_KEY]}")
                elif value is not False:
                    self.changed("metric_logger.organize_logs", "events go straight into log_dir (no run_<time> "
                                 "subfolder); a resumed run continues the same event stream")
                continue
            if key == "log_dir" and isinstance(value, str) and _is_under(value, output_dir):
                value = "${output_dir}" + value[len(output_dir.rstrip("/")):]
            node[key] = value
        self.out["metric_logger"] = node


def migrate_ac_keys(flag: Any, mode: Any, option: Any) -> dict[str, Any]:
    """Our AC keys for torchtune's ``enable_activation_checkpointing``, ``ac_mode`` and ``ac_option``.

    torchtune 0.6's distributed recipe applied ``ac_mode`` only when the flag was false, full AC when the flag
    was true and ``ac_mode`` unset, and nothing when both were set. Here ``ac_mode`` decides whenever it is set
    (what the config asks for); the flag is kept only when there is no ``ac_mode``, or when it agrees with it.
    """
    if mode is None:
        return {} if flag is None else {"enable_activation_checkpointing": flag}
    normalized = str(mode).lower()
    if normalized not in TORCHTUNE_AC_MODES:
        return {"ac_mode": mode} if option is None else {"ac_mode": mode, "ac_option": option}
    keys: dict[str, Any] = {}
    if flag is not None and flag == (normalized != "none"):
        keys["enable_activation_checkpointing"] = flag
    keys["ac_mode"] = normalized
    if normalized == "selective":
        keys["ac_option"] = 1 if _is_zero(option) else option
    return keys


def ac_notes(flag: Any, mode: Any, option: Any) -> list[tuple[str, str]]:
    """Why the AC keys differ from torchtune's, or what torchtune did silently with them."""
    if mode is None:
        return []
    notes = []
    normalized = str(mode).lower()
    if normalized not in TORCHTUNE_AC_MODES:
        return [("ac_mode", f"{mode!r} is not a mode ({', '.join(TORCHTUNE_AC_MODES)}): fix it before running")]
    if mode != normalized:
        notes.append(("ac_mode", f"torchtune compared ac_mode case-sensitively, so {mode!r} applied no activation "
                      "checkpointing at all; here it means " + normalized))
    if flag is True and normalized != "none":
        notes.append(("enable_activation_checkpointing", "torchtune applied no activation checkpointing at all "
                      "when the flag was true and ac_mode was set (neither branch ran); here ac_mode decides"))
    elif flag is True:
        notes.append(("enable_activation_checkpointing", "true with ac_mode: none is refused here as a "
                      "contradiction; dropped (torchtune applied no activation checkpointing either)"))
    elif flag is False and normalized != "none":
        notes.append(("enable_activation_checkpointing", "torchtune applied ac_mode only when this flag was false; "
                      "false with ac_mode full or selective is refused here as a contradiction, so it is dropped"))
    if normalized == "selective" and _is_zero(option):
        notes.append(("ac_option", "torchtune checkpointed every block for 0; that is ac_option: 1 here"))
    elif normalized == "selective" and option is None:
        notes.append(("ac_option", "missing: torchtune failed on it; set an integer k or op"))
    elif normalized != "selective" and option is not None:
        notes.append(("ac_option", f"ignored by torchtune with ac_mode {normalized}; dropped (refused here)"))
    if normalized != "none":
        notes.append(("ac_mode", "only torchtune's distributed recipe read ac_mode (single-device ignored it), "
                      "and it recomputed dropout with fresh randomness; here it applies to 1 and N processes "
                      "alike and replays dropout exactly"))
    return notes


def migrate_torchtune_config(tt: Mapping[str, Any]) -> Migration:
    """Map a torchtune full fine-tuning (or full_dpo_distributed) config to ours.

    Args:
        tt: the torchtune config as plain values, interpolations resolved.

    Returns:
        Our config, in our key order, and one note per key not carried over or carried over with a change.

    Raises:
        UserError: a part with no equivalent that a run cannot do without (model builder, dataset, tokenizer
            path, output_dir, checkpointer without checkpoint_dir, several data files).
    """
    return _Migrator(tt).run()


def _ordered(config: Mapping[str, Any]) -> dict[str, Any]:
    order = [key for section in OUTPUT_SECTIONS for key in section]
    return {key: config[key] for key in sorted(config, key=order.index)}


def _is_harmless(value: Any, harmless: tuple) -> bool:
    if isinstance(value, Mapping):
        return value.get("enabled") is False  # profiler: {enabled: false}
    return any(value == h and type(value) is type(h) for h in harmless)


def _show(value: Any) -> str:
    if isinstance(value, Mapping) and value.get("enabled") is False:
        return "enabled: false"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)


def _is_zero(value: Any) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool) and value == 0) or value == "0"


def _architecture_of(path: Optional[str]) -> Optional[str]:
    """The family of a torchtune full-model builder in one of the packages the families declare, or None."""
    if not isinstance(path, str) or "." not in path:
        return None
    package, name = path.rsplit(".", 1)
    if package not in MODEL_PACKAGES or _NOT_A_FULL_MODEL.search(name):
        return None
    return MODEL_PACKAGES[package]


def _is_moe_builder(path: Optional[str]) -> bool:
    """A torchtune builder of a mixture of experts (``qwen3_moe_30b_a3b_base``, Llama 4's ``llama4_scout_17b_16e``)."""
    if not isinstance(path, str) or "." not in path:
        return False
    package, name = path.rsplit(".", 1)
    return package.startswith("torchtune.models.") and bool(re.search(r"moe|^llama4_", name))


def _same_path(a: Any, b: Any) -> Optional[bool]:
    if a is None or b is None:
        return None
    return os.path.normpath(str(a)) == os.path.normpath(str(b))


def _is_under(path: str, folder: str) -> bool:
    path, folder = os.path.normpath(path), os.path.normpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _is_local_path(source: str) -> bool:
    return not _HUB_NAME.match(source) or os.path.exists(os.path.expanduser(source))


# ---------------------------------------------------------------------------------------------------- I/O


def read_torchtune_config(path: str | os.PathLike) -> dict[str, Any]:
    """Read a torchtune YAML config, resolving its interpolations (``${output_dir}``).

    Raises:
        UserError: missing or unreadable file, invalid YAML (with line), not a mapping, an interpolation that
            cannot be resolved, or a file that is not a torchtune config.
    """
    import yaml
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    source = Path(path).expanduser()
    if not source.is_file():
        raise UserError(f"tune migrate: {path}: no such file")
    try:
        raw = OmegaConf.load(source)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise UserError(f"{where}: invalid YAML: {getattr(err, 'problem', None) or err}") from None
    except (OmegaConfBaseException, OSError, UnicodeDecodeError) as err:
        raise UserError(f"tune migrate: {path}: {str(err).splitlines()[0]}") from None
    if not isinstance(raw, DictConfig):
        raise UserError(f"tune migrate: {path}: expected a mapping of keys to values at the top level")
    # Recognised before resolving: one of our own configs uses resolvers (${embedded_checkpoint:}) that only
    # `tune run` registers, and would fail as an interpolation instead of as "not a torchtune config".
    if torchtune_marker(OmegaConf.to_container(raw, resolve=False)) is None:
        raise UserError(f"tune migrate: {path} does not look like a torchtune config (no torchtune. component, no "
                        "checkpointer key)")
    try:
        return OmegaConf.to_container(raw, resolve=True)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "an interpolation"
        raise UserError(f"tune migrate: {path}: cannot resolve {key}: {str(err).splitlines()[0]}") from None


def render_config(migration: Migration, *, source: str, destination: str) -> str:
    """The YAML text we write: a header saying where it came from and how to launch it, then the keys in
    sections."""
    import yaml

    lines = [
        f"# Migrated from the torchtune config {source} by `tune migrate`.",
        "#",
        f"#   tune run {migration.recipe} --config {destination}{migration.flags()}",
        f"#   tune run --nproc_per_node 4 {migration.recipe} --config {destination}{migration.flags()}      # FSDP2 "
        "over 4 processes",
    ]
    if migration.notes:
        lines += ["#", "# Notes from the migration:"]
        lines += [f"#   {note}" for note in migration.notes]
    for section in OUTPUT_SECTIONS:
        part = {key: migration.config[key] for key in section if key in migration.config}
        if part:
            lines.append("")
            lines.append(yaml.safe_dump(part, sort_keys=False, default_flow_style=False, width=1000).rstrip())
    return "\n".join(lines) + "\n"


def migrate_file(source: str, destination: str, *, force: bool = False) -> Migration:
    """Read the torchtune config ``source``, migrate it and write ours to ``destination`` (atomically).

    Raises:
        UserError: ``destination`` exists and not ``force``, its folder does not exist, or see
            :func:`read_torchtune_config` and :func:`migrate_torchtune_config`. Nothing is written then.
    """
    out = Path(destination).expanduser()
    if out.suffix not in (".yaml", ".yml"):
        raise UserError(f"tune migrate: -o {destination}: expected a .yaml or .yml file name")
    if out.exists() and not force:
        raise UserError(f"tune migrate: {destination} already exists; pass --force to overwrite it")
    if not out.parent.is_dir():
        raise UserError(f"tune migrate: directory {out.parent} does not exist")
    try:
        migration = migrate_torchtune_config(read_torchtune_config(source))
    except UserError as err:
        if str(err).startswith("tune migrate: "):
            raise
        raise UserError(f"tune migrate: {source}: {err}") from None
    text = render_config(migration, source=source, destination=destination)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, out)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise UserError(f"tune migrate: cannot write {destination}: {err.strerror}") from None
    return migration
