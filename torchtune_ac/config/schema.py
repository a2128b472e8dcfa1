"""Typed schemas of the recipes' configs: every key, its type, its default and what it means, written once on its
field (``config_key``); a reference page can be generated from the fields alone (``config_key.config_keys``).

Top-level names follow torchtune's where torchtune has one, so a torchtune user's configs and command lines
carry over. Nothing downstream reads raw config keys: recipes receive these dataclasses, and pass the grouped
settings on whole (``cfg.ac``, ``cfg.memory``, ``cfg.fsdp``).

Groups of keys are written beside the subsystem that uses them, and composed here: ``ACConfig``
(``activation_checkpointing/config.py``), ``MemoryConfig`` (``memory/feature.py``) and ``FSDPConfig``
(``parallel/fsdp.py``, the ``fsdp.*`` keys). A group marked ``flatten`` keeps its keys at the top level of the YAML
(``ac_mode: full``, not ``ac: {mode: full}``), as torchtune names them.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from dataclasses import dataclass
from typing import ClassVar, Mapping, Optional

from torchtune_ac.config.components import Component
from torchtune_ac.config_key import config_key
from torchtune_ac.data.batching import PAIRS, PROMPTS, SAMPLES, Batching
from torchtune_ac.errors import UserError
from torchtune_ac.lora.config import AdapterConfig
from torchtune_ac.memory.feature import MemoryConfig
from torchtune_ac.memory.planner import PreferenceStep
from torchtune_ac.memory.planner.images import PlannedImagesConfig
from torchtune_ac.memory.planner.rollouts import RolloutStep
from torchtune_ac.runtime.distributed import DEFAULT_TIMEOUT_S
from torchtune_ac.parallel.fsdp import FSDPConfig
from torchtune_ac.runtime.dtypes import DType
from torchtune_ac.activation_checkpointing.config import ACConfig
from torchtune_ac.training.dpo import DPOConfig, ReferenceMode
from torchtune_ac.training.grpo import GRPOConfig
from torchtune_ac.training.rollouts import ROLLOUT_KEYWORDS, GenerationConfig

__all__ = ["Device", "DType", "FSDPConfig", "FullDPOConfig", "FullFinetuneConfig", "FullGRPOConfig", "LoRADPOConfig",
           "LoRAFinetuneConfig", "LoRAGRPOConfig"]


class Device(str, enum.Enum):
    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


# A key torchtune has too, with the same name and meaning: tune migrate copies it unchanged.
SAME = "same"

def check_dataset_kinds(cfg: "FullFinetuneConfig", recipe: str, wanted: Batching, other: Batching,
                        other_recipe: str) -> None:
    """Refuse a ``dataset`` or ``dataset_val`` whose builder returns the other recipe's kind of data (read from its
    return annotation; a builder without one is checked on its first sample, ``phases.build_data``).

    Raises:
        UserError: naming the key, the builder, the two recipes and what each trains on.
    """
    for key in ("dataset", "dataset_val"):
        component = getattr(cfg, key)
        if component is None:
            continue
        try:
            returned = typing.get_type_hints(component.target()).get("return")
        except Exception:  # noqa: BLE001 - an annotation that cannot be resolved says nothing: checked at run time
            continue
        if (isinstance(returned, type) and issubclass(returned, other.dataset_type)
                and not issubclass(returned, wanted.dataset_type)):
            raise UserError(f"{key}: {component.path} makes {other.kind}, which the {other_recipe} recipe trains on; "
                            f"the {recipe} recipe trains on {wanted.kind} ({wanted.builders}): run this config with "
                            f"`tune run {other_recipe}`, or give {key} a builder of {wanted.kind}")


@dataclass(frozen=True)
class FullFinetuneConfig:
    """Config of the ``full_finetune`` recipe."""

    output_dir: str = config_key(
        doc="Where the run writes its checkpoints (step_*), metrics.jsonl and its lock; a resume reads them back. An "
        "empty path would mean the current directory.", non_empty=True)
    model: Component = config_key(
        doc="The model builder: a torchtune_ac.models builder (llama3_8b, from_hf_config, ...) with its arguments.")
    tokenizer: Component = config_key(doc="The tokenizer: torchtune_ac.data.load_tokenizer with its path.")
    dataset: Component = config_key(
        doc="The training data: torchtune_ac.data.instruct_dataset, chat_dataset or text_dataset, with its source "
        "(a local file or a Hugging Face dataset).", positional=1, recipe_kwargs=("max_seq_len",))
    optimizer: Component = config_key(
        doc="The optimizer: a torch.optim class (AdamW) with its arguments, or torchao's (the ao extra) AdamW8bit, "
        "AdamW4bit (8-bit or 4-bit state) or _AdamW with bf16_stochastic_round: true.",
        positional=1)
    checkpoint_dir: Optional[str] = config_key(
        None, doc="The Hugging Face checkpoint to start from (config.json and safetensors); it is only read. null: "
        "random initialisation from seed.", non_empty=True)
    resume_from_checkpoint: bool = config_key(
        False, doc="Continue the run in output_dir from its newest checkpoint that matches its manifest (none yet: "
        "start at step 0).", torchtune=SAME)
    lr_scheduler: Optional[Component] = config_key(
        None, doc="The learning-rate schedule over the optimizer: torchtune_ac.training.cosine_schedule_with_warmup "
        "(num_warmup_steps, min_lr_ratio) or constant_schedule; the recipe passes the optimizer and "
        "num_training_steps, which torch's own schedulers do not take. null: the optimizer's lr throughout.",
        positional=1, recipe_kwargs=("num_training_steps",))
    dataset_val: Optional[Component] = config_key(
        None, doc="Held-out data for the validation loss (a dataset component like dataset); null: no validation.",
        positional=1, recipe_kwargs=("max_seq_len",))
    run_val_every_n_steps: Optional[int] = config_key(
        None, doc="Validate every N optimizer steps; null: at the end of every epoch (when dataset_val is set).",
        minimum=1, torchtune=SAME)
    batch_size_val: Optional[int] = config_key(
        None, doc="Samples per process per validation batch; null: batch_size.", minimum=1, torchtune=SAME)
    batch_size: int = config_key(1, doc="Samples per process per micro-batch.", minimum=1, torchtune=SAME)
    epochs: int = config_key(1, doc="Passes over the dataset.", minimum=1, torchtune=SAME)
    max_steps_per_epoch: Optional[int] = config_key(
        None, doc="Stop each epoch after this many optimizer steps; null: the whole dataset.", minimum=1,
        torchtune=SAME)
    gradient_accumulation_steps: int = config_key(
        1, doc="Micro-batches per optimizer step; the global batch is batch_size x this x the processes.",
        minimum=1, torchtune=SAME)
    max_seq_len: Optional[int] = config_key(
        None, doc="Truncate (or pack to) this many tokens per sample; null: the tokenizer's max_seq_len, else no "
        "truncation (packed: true, ac_mode: auto and tune plan need a length: they size the activations by it). "
        "Longer than the model's context (its builder's max_seq_len) is a warning unless model.max_seq_len says so "
        "too.", minimum=1)
    clip_grad_norm: Optional[float] = config_key(
        None, doc="Scale the gradients down to this total norm before each optimizer step; null: no clipping (the "
        "norm is still measured and logged).", exclusive_minimum=0.0, torchtune=SAME)
    # torch.manual_seed takes at most 64 bits, and epoch e seeds the data order with seed + e.
    seed: int = config_key(
        0, doc="Seeds the initial weights (without checkpoint_dir), dropout and the data order (epoch e uses seed + "
        "e).", minimum=0, maximum=2**63 - 1)
    shuffle: bool = config_key(True, doc="Shuffle the samples each epoch.", torchtune=SAME)
    device: Device = config_key(
        Device.AUTO, doc="Where the run computes: cuda (this process's GPU), cpu, or auto (CUDA when present).")
    dtype: DType = config_key(DType.FP32, doc="The parameters' storage and compute dtype: fp32 or bf16.")
    compile: bool = config_key(
        False, doc="torch.compile each transformer block (activation checkpointing included); batches are then "
        "padded to a multiple of 64 tokens (at most max_seq_len), so that their shapes repeat and compiled blocks "
        "are reused.", torchtune=SAME)
    allow_tf32: bool = config_key(
        True, doc="On CUDA, float32 matrix multiplies and convolutions run in TF32 (10-bit mantissa inputs, float32 "
        "sums); nothing changes on a CPU.")
    distributed_timeout_s: int = config_key(
        DEFAULT_TIMEOUT_S, doc="How long a process waits in one collective before the run fails: the others wait "
        "while rank 0 alone writes, fsyncs and prunes a checkpoint (NCCL's own default is 10 minutes).", minimum=1)
    ac: ACConfig = config_key(
        doc="Activation checkpointing: enable_activation_checkpointing, ac_mode, ac_option, ac_memory_budget_gib "
        "(top-level keys; ac_option's bound, the model's layer count, is checked once the model is built).",
        default_factory=ACConfig, flatten=True)
    memory: MemoryConfig = config_key(
        doc="The memory features' top-level keys: optimizer_in_bwd, loss_chunks, enable_activation_offloading.",
        default_factory=MemoryConfig, flatten=True)
    save_every_n_steps: Optional[int] = config_key(
        None, doc="Also save a checkpoint every N optimizer steps (one is saved at the end of every epoch and on a "
        "stop signal); null: only then.", minimum=1, torchtune=SAME)
    keep_last_n_checkpoints: Optional[int] = config_key(
        None, doc="Keep the newest N checkpoints whole and delete older ones once a new one is verified; null: keep "
        "every checkpoint's model files, and the recipe state (for resume) of the newest two.", minimum=1)
    log_every_n_steps: int = config_key(
        1, doc="Write a metrics.jsonl record (and a progress line in a log file) every N optimizer steps.",
        minimum=1, torchtune=SAME)
    metric_logger: Optional[Component] = config_key(
        None, doc="An experiment tracker besides metrics.jsonl (always written): "
        "torchtune_ac.observability.metric_logging.TensorBoardLogger or WandBLogger; null: none.")
    fsdp: FSDPConfig = config_key(doc="FSDP2's settings (see its keys).", default_factory=FSDPConfig)
    tensor_parallel_dim: int = config_key(
        1, doc="Tensor parallelism: each transformer block's attention heads and MLP columns, and the vocabulary of "
        "the embedding and the output layer, are split over this many consecutive processes (the GPUs of one node), "
        "the norms and residuals along the sequence between them; FSDP2 shards over the rest (the world size must "
        "be replicate_degree x shard x this). It must divide the model's heads, key/value heads and MLP width, and "
        "max_seq_len. 1: none.", minimum=1, torchtune=SAME)
    expert_parallel_dim: int = config_key(
        1, doc="Expert parallelism (a mixture of experts): each MoE layer's experts are split over this many "
        "consecutive processes, and each token is sent to its experts' process and back with an all-to-all. The "
        "processes of a group read their own batches; FSDP2 shards the experts over the processes that hold the same "
        "ones (world size / replicate_degree / this), the other layers over all. It must divide the number of experts "
        "and world size / replicate_degree; not with tensor_parallel_dim. 1: none (FSDP2 gathers every expert of a "
        "layer on every process).", minimum=1)
    planned_images: PlannedImagesConfig = config_key(
        doc="The images tune plan and ac_mode: auto assume in every sample of a vision-language model (see its keys); "
        "an image's tokens, and its patches in the vision tower, follow from its size.",
        default_factory=PlannedImagesConfig)

    # Keys of another built-in recipe, named when a config of it is given to this one (``config/validation.py``).
    keys_of_other_recipes: ClassVar[Mapping[str, str]] = {"dpo": "full_dpo", "ref_checkpoint_dir": "full_dpo",
                                                          "adapter": "lora_finetune"}

    def __post_init__(self) -> None:
        check_dataset_kinds(self, "full_finetune", SAMPLES, PAIRS, "full_dpo")

    def preference_step(self) -> Optional[PreferenceStep]:
        """What the planner simulates besides the token loss: nothing for fine-tuning."""
        return None

    def rollout_step(self) -> Optional[RolloutStep]:
        """What the planner counts generated before each step (GRPO's rollouts): nothing for fine-tuning."""
        return None

    @property
    def data_batch_size(self) -> int:
        """Samples the loader reads per process per micro-batch (GRPO's: prompts, each making several rows)."""
        return self.batch_size

    @property
    def data_max_seq_len(self) -> Optional[int]:
        """The length the dataset builder is given (GRPO's: the longest prompt)."""
        return self.max_seq_len

    @property
    def optimizer_steps_per_step(self) -> int:
        """Optimizer steps one step of the loop takes (GRPO's: ``grpo.num_iterations`` on each rollout)."""
        return 1


@dataclass(frozen=True)
class FullDPOConfig(FullFinetuneConfig):
    """Config of the ``full_dpo`` recipe: ``full_finetune``'s keys, preference data, the reference and the loss."""

    dataset: Component = config_key(
        doc="The preference pairs: torchtune_ac.data.preference_dataset with its source (prompt/chosen/rejected "
        "strings, or chosen/rejected message lists sharing their prompt); packed: true packs whole pairs into rows "
        "of up to 2 x max_seq_len tokens, each sequence a document of its own (batch_size then counts rows).",
        positional=1,
        recipe_kwargs=("max_seq_len",))
    ref_checkpoint_dir: Optional[str] = config_key(
        None, doc="The Hugging Face checkpoint of the reference model; null: the policy's starting weights "
        "(checkpoint_dir, or without it the seed's random ones). A resume keeps the reference it started from.",
        non_empty=True)
    dpo: DPOConfig = config_key(doc="The DPO loss and its reference (see its keys).", default_factory=DPOConfig)
    keys_of_other_recipes: ClassVar[Mapping[str, str]] = {"adapter": "lora_dpo"}

    def __post_init__(self) -> None:
        check_dataset_kinds(self, "full_dpo", PAIRS, SAMPLES, "full_finetune")
        # Not silently wrong: the sequence log-probabilities (training/sequence_logps.py) are summed over whole
        # vocabulary rows, which a tensor-parallel output layer does not hold; DPO has no plan for that yet.
        if self.tensor_parallel_dim > 1:
            raise UserError(f"tensor_parallel_dim={self.tensor_parallel_dim}: the full_dpo recipe does not run under "
                            "tensor parallelism (its sequence log-probabilities need whole vocabulary rows); use "
                            "tensor_parallel_dim: 1 (FSDP, fsdp.replicate_degree for HSDP)")

    @property
    def reference_checkpoint_dir(self) -> Optional[str]:
        """Where the reference's weights come from: ``ref_checkpoint_dir``, else ``checkpoint_dir``."""
        return self.ref_checkpoint_dir if self.ref_checkpoint_dir is not None else self.checkpoint_dir

    def preference_step(self) -> Optional[PreferenceStep]:
        """Pairs, two rows each, and the reference model when it stays resident. Packed pairs
        (``dataset.packed: true``) are planned the same: a row of up to ``2 * max_seq_len`` tokens holds what a
        padded pair's two rows of ``max_seq_len`` hold at most, and per-document attention spans no more than
        ``max_seq_len`` tokens, so the padded worst case bounds it."""
        return PreferenceStep(resident_reference=self.dpo.reference is ReferenceMode.RESIDENT)


ADAPTER_DOC = ("Low-rank adapters on a frozen base: LoRA or DoRA, their rank, scale and targets (PEFT's names), "
               "QLoRA's NF4 base, a PEFT folder to start from and the merged export (see its keys).")


@dataclass(frozen=True)
class LoRAFinetuneConfig(FullFinetuneConfig):
    """Config of the ``lora_finetune`` recipe: ``full_finetune``'s keys and the adapters (``adapter:``)."""

    adapter: AdapterConfig = config_key(doc=ADAPTER_DOC, default_factory=AdapterConfig)
    keys_of_other_recipes: ClassVar[Mapping[str, str]] = {"dpo": "lora_dpo", "ref_checkpoint_dir": "full_dpo"}

    def __post_init__(self) -> None:
        check_dataset_kinds(self, "lora_finetune", SAMPLES, PAIRS, "lora_dpo")


@dataclass(frozen=True)
class LoRADPOConfig(FullDPOConfig):
    """Config of the ``lora_dpo`` recipe: ``full_dpo``'s keys and the adapters; the reference is the base with the
    adapters off (no second model)."""

    adapter: AdapterConfig = config_key(doc=ADAPTER_DOC, default_factory=AdapterConfig)
    keys_of_other_recipes: ClassVar[Mapping[str, str]] = {}

    def __post_init__(self) -> None:
        check_dataset_kinds(self, "lora_dpo", PAIRS, SAMPLES, "lora_finetune")
        if self.ref_checkpoint_dir is not None:
            raise UserError(f"ref_checkpoint_dir={self.ref_checkpoint_dir}: the lora_dpo recipe's reference is its "
                            "base with the adapters off (checkpoint_dir); set ref_checkpoint_dir: null, or use "
                            "full_dpo for another reference")
        if self.dpo.reference is ReferenceMode.PRECOMPUTED and self.adapter.quantize_base is not None:
            raise UserError(f"dpo.reference=precomputed with adapter.quantize_base={self.adapter.quantize_base.value}"
                            ": the precomputing pass would run the base in dtype, not the NF4 base the policy "
                            "computes with; set dpo.reference: resident (the NF4 base with the adapters off)")

    def preference_step(self) -> Optional[PreferenceStep]:
        """Pairs, and the reference as the policy's base: its forward under ``no_grad``, no second model; or, with
        ``dpo.reference: precomputed``, its log-probabilities with the batch."""
        if self.dpo.reference is ReferenceMode.PRECOMPUTED:
            return PreferenceStep(resident_reference=False)
        return PreferenceStep(resident_reference=False, reference_is_policy=True)


@dataclass(frozen=True)
class FullGRPOConfig(FullFinetuneConfig):
    """Config of the ``grpo`` recipe: ``full_finetune``'s keys (``batch_size`` counts completions), prompts, the
    sampler, the rewards and the GRPO loss."""

    dataset: Component = config_key(
        doc="The prompts: torchtune_ac.data.prompt_dataset with its source (a prompt column, as text or a message "
        "list, and the columns the rewards read, such as answer); prompts longer than max_seq_len minus "
        "generation.max_new_tokens are dropped.", positional=1, recipe_kwargs=("max_seq_len",))
    rewards: list[Component] = config_key(
        default_factory=list, doc="The reward functions, summed with reward_weights: torchtune_ac.training.rewards.math_answer, "
        "format_match (pattern), length_penalty, or a function of your own that the command allows "
        "(--allow-component my_rewards). Each takes the completions' texts and, by keyword, prompts, "
        "completion_lengths, max_new_tokens and every dataset column, and returns one float per completion.",
        recipe_kwargs=ROLLOUT_KEYWORDS, partial=True)
    reward_weights: Optional[list[float]] = config_key(
        None, doc="One weight per reward function (TRL's reward_weights); null: 1.0 each.")
    ref_checkpoint_dir: Optional[str] = config_key(
        None, doc="The Hugging Face checkpoint of the reference model (read only when grpo.beta > 0); null: the "
        "policy's starting weights.", non_empty=True)
    grpo: GRPOConfig = config_key(doc="The GRPO loss (see its keys).", default_factory=GRPOConfig)
    generation: GenerationConfig = config_key(doc="How completions are sampled (see its keys).",
                                              default_factory=GenerationConfig)
    samples_every_n_steps: int = config_key(
        10, doc="Every N steps, a few completions with their prompts, rewards and advantages are appended to "
        "output_dir/samples.jsonl.", minimum=1)
    keys_of_other_recipes: ClassVar[Mapping[str, str]] = {"dpo": "full_dpo", "adapter": "lora_grpo"}

    def __post_init__(self) -> None:
        check_dataset_kinds(self, "grpo", PROMPTS, SAMPLES, "full_finetune")
        g, new = self.grpo.num_generations, self.generation.max_new_tokens
        if self.batch_size % g:
            raise UserError(f"batch_size={self.batch_size}: must be a multiple of grpo.num_generations={g} (batch_size "
                            "counts completions, and a prompt's group of completions stays on one process)")
        if self.max_seq_len is None:
            raise UserError("max_seq_len: required by GRPO (the longest prompt plus generation.max_new_tokens)")
        if new >= self.max_seq_len:
            raise UserError(f"generation.max_new_tokens={new}: must be less than max_seq_len={self.max_seq_len}, "
                            "which holds the prompt and its completion")
        if self.dataset_val is not None:
            raise UserError("dataset_val: the grpo recipe has no validation loss; set dataset_val: null")
        if self.tensor_parallel_dim > 1:
            raise UserError(f"tensor_parallel_dim={self.tensor_parallel_dim}: the grpo recipe does not run under "
                            "tensor parallelism (its log-probabilities need whole vocabulary rows); use 1")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.rewards):
            raise UserError(f"reward_weights: {len(self.reward_weights)} weight(s) for {len(self.rewards)} reward "
                            "function(s); give one each, or null for 1.0 each")
        if not self.rewards:
            raise UserError("rewards: give at least one reward function")

    def rollout_step(self) -> Optional[RolloutStep]:
        """The rollouts of a micro-batch: ``batch_size`` completions at the longest prompt (``max_seq_len`` minus
        ``generation.max_new_tokens``) plus ``max_new_tokens``; a resident reference with ``grpo.beta``."""
        new = self.generation.max_new_tokens
        return RolloutStep(rows=self.batch_size, prompt_len=self.max_seq_len - new, max_new_tokens=new,
                           reference=bool(self.grpo.beta))

    @property
    def data_batch_size(self) -> int:
        return self.batch_size // self.grpo.num_generations

    @property
    def optimizer_steps_per_step(self) -> int:
        return self.grpo.num_iterations

    @property
    def data_max_seq_len(self) -> Optional[int]:
        return self.max_seq_len - self.generation.max_new_tokens

    @property
    def reference_checkpoint_dir(self) -> Optional[str]:
        return self.ref_checkpoint_dir if self.ref_checkpoint_dir is not None else self.checkpoint_dir


@dataclass(frozen=True)
class LoRAGRPOConfig(FullGRPOConfig):
    """Config of the ``lora_grpo`` recipe: ``grpo``'s keys and the adapters; the reference is the base with the
    adapters off (no second model)."""

    adapter: AdapterConfig = config_key(doc=ADAPTER_DOC, default_factory=AdapterConfig)
    keys_of_other_recipes: ClassVar[Mapping[str, str]] = {"dpo": "lora_dpo"}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ref_checkpoint_dir is not None:
            raise UserError(f"ref_checkpoint_dir={self.ref_checkpoint_dir}: the lora_grpo recipe's reference is its "
                            "base with the adapters off (checkpoint_dir); set ref_checkpoint_dir: null, or use grpo")

    def rollout_step(self) -> Optional[RolloutStep]:
        """``grpo``'s rollouts; the reference is the base with the adapters off, no second model."""
        return dataclasses.replace(super().rollout_step(), reference=False)
