"""The run's plan: what a run decides before it builds anything, resolved once from the config and the process
context into one frozen value, ``RunPlan``.

    config + world size + one meta build of the model
        -> the parallelism (every degree checked against the world size and the model, here and only here);
           device and dtypes; the model's facts; the memory plan (ac_mode: auto's choice included);
           the run's length (global batch; steps per epoch and total steps once the data is read,
           ``RunPlan.with_data``); the save policy; what a resume keeps

``tune validate`` and ``tune plan`` print it, and ``tune run`` logs it and applies it (``assemble.py``). With N
processes rank 0 resolves it, the planner included, and every rank applies rank 0's (``decided_by_rank_zero``):
ranks never plan on their own free memory.

The planner's inputs for a config live here too (``planner_inputs``), for ``ac_mode: auto`` and ``tune plan``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Protocol

import torch
from torch import nn

from torchtune_ac.checkpoint import RunShape
from torchtune_ac.config.meta_model import ModelFacts, build_meta_model, model_facts
from torchtune_ac.config.components import Component
from torchtune_ac.config.schema import Device, FSDPConfig
from torchtune_ac.data.samples import count_of
from torchtune_ac.errors import UserError
from torchtune_ac.lora.config import AdapterConfig, QuantizeBase, adapter_record
from torchtune_ac.lora.mechanism import apply_adapters, find_targets, quantize_base_
from torchtune_ac.lora.sharded_nf4 import check_nf4_sharding
from torchtune_ac.lora.weights import check_adapter_start
from torchtune_ac.memory.feature import MemoryConfig, OptimizerSpec
from torchtune_ac.memory.plan import MemoryPlan, PlannerInputs, resolve_memory_plan
from torchtune_ac.memory.planner import ImageLoad, MemoryEstimate, PreferenceStep, Workload
from torchtune_ac.memory.planner.images import resolve_image_load
from torchtune_ac.models.families import family_of
from torchtune_ac.memory.planner.rollouts import RolloutStep
from torchtune_ac.models.moe import moe_args_of
from torchtune_ac.runtime.distributed import resolve_device
from torchtune_ac.runtime.dtypes import DType
from torchtune_ac.runtime.process_memory import (
    ASSUMED_CUDA_FIXED_BYTES,
    CPU_STEP_RUNTIME_BYTES,
    cublas_workspace_bytes,
    fixed_bytes,
)
from torchtune_ac.activation_checkpointing.config import ACConfig
from torchtune_ac.runtime.parallelism import Parallelism
from torchtune_ac.run.length import RunLength, SavePolicy
from torchtune_ac.parallel.tensor_parallel import check_tensor_parallel_degree


class RunConfig(Protocol):
    """The config keys the run layer reads: what a recipe's schema has for its runs to be planned, assembled,
    looped and saved by the library (``RunConfig`` has them; another recipe's schema adds its own)."""

    output_dir: str
    model: Component
    tokenizer: Component
    dataset: Component
    optimizer: Component
    checkpoint_dir: Optional[str]
    resume_from_checkpoint: bool
    lr_scheduler: Optional[Component]
    dataset_val: Optional[Component]
    run_val_every_n_steps: Optional[int]
    batch_size_val: Optional[int]
    batch_size: int
    data_batch_size: int  # samples the loader reads per micro-batch (GRPO: prompts, batch_size / num_generations)
    data_max_seq_len: Optional[int]
    epochs: int
    max_steps_per_epoch: Optional[int]
    gradient_accumulation_steps: int
    max_seq_len: Optional[int]
    clip_grad_norm: Optional[float]
    seed: int
    shuffle: bool
    device: Device
    dtype: DType
    compile: bool
    allow_tf32: bool
    distributed_timeout_s: int
    ac: ACConfig
    memory: MemoryConfig
    save_every_n_steps: Optional[int]
    keep_last_n_checkpoints: Optional[int]
    log_every_n_steps: int
    metric_logger: Optional[Component]
    fsdp: FSDPConfig
    tensor_parallel_dim: int
    expert_parallel_dim: int

    def preference_step(self) -> Optional[PreferenceStep]:
        """What the planner simulates instead of the token loss: a preference step (DPO), or None."""

    def rollout_step(self) -> Optional[RolloutStep]:
        """What the planner counts generated before each step: GRPO's rollouts, or None."""


def resolve_length(cfg: RunConfig, parallelism: Parallelism, samples: Optional[int] = None,
                   batches_per_epoch: Optional[int] = None) -> RunLength:
    """The run's length: its batch and epochs, and, when the data was read (``samples``, ``batches_per_epoch``), its
    steps (``RunLength.counted``).

    Raises:
        UserError: the dataset has fewer batches per process than one optimizer step needs.
    """
    length = RunLength(parallelism, cfg.data_batch_size, cfg.gradient_accumulation_steps, cfg.epochs,
                       cfg.max_steps_per_epoch, optimizer_steps_per_step=cfg.optimizer_steps_per_step)
    return length if batches_per_epoch is None else length.counted(samples, batches_per_epoch)


@dataclass(frozen=True)
class RunPlan:
    """Everything the run decided before building anything (see the module docstring).

    Attributes:
        parallelism: how the processes split the work: the world size (None: not known, ``tune validate``), the
            degrees, the device mesh's shape, each process's data-parallel share.
        device: the config's ``device`` (``auto``, ``cpu``, ``cuda``).
        device_type: what it is where the plan was resolved (``cpu``, ``cuda``; None: not available there).
        dtype: the parameters' storage dtype.
        fsdp: FSDP2's settings (mixed precision, resharding, HSDP, CPU offload).
        compile: each block is compiled.
        model: the model's facts.
        memory: the memory plan (activation checkpointing, with ac_mode: auto's choice, and the other features).
        length: the run's shape and length.
        save: when checkpoints are written and which are kept.
        resume_data: what decides the batches, and the optimizer's class, which a resume must keep
            (``resume_shape``).
        hyperparameters: the optimizer's and the schedule's settings, recorded in every checkpoint; a resume takes
            its own config's and says what changed.
        checkpoint_dir: the Hugging Face checkpoint the run starts from (None: random initialisation).
        adapter: the low-rank adapters on a frozen base (``lora_finetune``, ``lora_dpo``), checked against the
            model; None: every parameter trains.
        seed: seeds the initialisation without a checkpoint, dropout and the data's order.
        output_dir: where the run writes.
        notes: what resolving found worth a warning (one sentence each).
    """

    parallelism: Parallelism
    device: str
    device_type: Optional[str]
    dtype: DType
    fsdp: FSDPConfig
    compile: bool
    model: ModelFacts
    memory: MemoryPlan
    length: RunLength
    save: SavePolicy
    resume_data: Mapping[str, Any]
    hyperparameters: Mapping[str, Any]
    checkpoint_dir: Optional[str]
    seed: int
    output_dir: str
    notes: tuple[str, ...] = ()
    adapter: Optional[AdapterConfig] = None

    @property
    def world_size(self) -> Optional[int]:
        return self.parallelism.world_size

    def with_data(self, samples: int, batches_per_epoch: int, *, described: Optional[str] = None,
                  unit: str = "sample") -> "RunPlan":
        """This plan once the run has read its data: its steps counted (``RunLength.counted``)."""
        return dataclasses.replace(
            self, length=self.length.counted(samples, batches_per_epoch, described=described, unit=unit))

    @property
    def sharded(self) -> bool:
        """FSDP2 shards the model: several processes (tensor parallelism needs several), or a memory feature that
        works through it on one."""
        return (self.world_size or 1) > 1 or self.parallelism.tensor_parallel or bool(self.memory.shard_options())

    def resume_shape(self, world_size: Optional[int] = None) -> RunShape:
        """What a resume of this run must keep (recorded in every checkpoint), on ``world_size`` processes (default:
        the plan's)."""
        processes = world_size if world_size is not None else self.world_size
        if processes is None:
            raise ValueError("the resume shape needs a world size")
        return RunShape(processes, self.length.batch_size, self.length.gradient_accumulation_steps,
                        dict(self.model.architecture), dict(self.resume_data),
                        tensor_parallel_dim=self.parallelism.tensor)

    def describe_sharding(self) -> str:
        """How FSDP2 (and tensor parallelism) shard the model and reduce its gradients."""
        if self.world_size == 1 and not self.memory.shard_options():
            return "not sharded (1 process)"
        reduce = self.fsdp.resolved_reduce_dtype(self.dtype).value
        reduce += " (dtype)" if self.fsdp.reduce_dtype is None else ""
        parallelism = self.parallelism
        replicas, tp = parallelism.replicate, parallelism.tensor
        if self.world_size is None:
            rest = "world size" + (f" / {replicas}" if replicas > 1 else "") + (f" / {tp}" if tp > 1 else "")
            layout = ("sharded over every process" if replicas == 1 and tp == 1
                      else f"HSDP: {replicas} replicas, each sharded over {rest}" if replicas > 1
                      else f"sharded over {rest}")
        elif replicas == 1:
            layout = f"sharded over {parallelism.shard} process(es)"
        else:
            layout = f"HSDP: {replicas} replicas x {parallelism.shard} shards"
        mesh = parallelism.mesh_shape
        on_mesh = " on mesh " + " x ".join(f"{name} {size}" for name, size in mesh.items()) if mesh else ""
        if tp > 1:
            layout += f", each layer split over {tp} (tensor parallel){on_mesh}"
        if parallelism.expert_parallel:
            experts = (f"the {parallelism.expert_shard} process(es) holding the same ones"
                       if parallelism.expert_shard is not None else "the processes holding the same ones")
            layout += (f", each MoE layer's experts split over {parallelism.expert} (expert parallel) and sharded over "
                       f"{experts}{on_mesh}")
        return f"{layout}; gradients reduced in {reduce}"

    def describe_length(self) -> str:
        """The global batch and the run's steps, as far as they are known."""
        length = self.length
        unit = length.unit
        if length.global_batch is None:
            batch = f"global batch {count_of(length.per_process, unit)} x the processes"
        else:
            tp = length.parallelism.tensor
            readers = (count_of(length.world_size, 'process', 'processes') if tp == 1 else
                       f"{count_of(length.data_parallel_size, 'tensor-parallel group')} of {tp} processes")
            batch = (f"global batch {count_of(length.global_batch, unit)} ({length.batch_size} x "
                     f"{length.gradient_accumulation_steps} accumulation x {readers})")
        epochs = count_of(length.epochs, "epoch")
        if length.steps_per_epoch is None:
            cap = f" (at most {length.max_steps_per_epoch})" if length.max_steps_per_epoch is not None else ""
            return f"{batch}; steps per epoch counted when the run reads the data{cap}, {epochs}"
        return (f"{batch}; {length.described}, {count_of(length.steps_per_epoch, 'step')} per epoch, {epochs}: "
                f"{count_of(length.total_steps, 'step')}")

    def describe(self) -> list[tuple[str, str]]:
        """``(label, value)`` lines: ``tune validate`` and ``tune plan`` print them, ``tune run`` logs them."""
        length = self.length
        return [
            ("model", f"{self.model.builder}: {self.model.parameters:,} parameters, {self.model.layers} layers"),
            *([("adapter", self.adapter.describe())] if self.adapter is not None else []),
            *self.memory.describe(),
            ("dtype / device", f"{self.dtype.value} / {self.device}"
                               + (f" ({self.device_type})" if self.device == Device.AUTO.value and self.device_type
                                  else "")),
            ("fsdp", self.describe_sharding()),
            ("batch", f"{length.batch_size} per process x {length.gradient_accumulation_steps} accumulation step(s) = "
                      f"{length.per_process} samples per step per process"),
            ("length", self.describe_length()),
            ("save", self.save.describe()),
            ("checkpoint_dir", self.checkpoint_dir or "none (random initialisation from seed)"),
            ("output_dir", self.output_dir),
        ]


# --------------------------------------------------------------------------------------------------------------
# The planner's inputs for a config (ac_mode: auto, tune plan)
# --------------------------------------------------------------------------------------------------------------


def planned_device(device: Device) -> torch.device:
    """The device a run with ``device`` trains on, as far as planning goes: ``auto`` is CUDA where this machine has
    it; ``cuda`` is CUDA whether or not this machine has it (a plan for another machine)."""
    kind = device.value if device is not Device.AUTO else ("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(kind)


def process_fixed_bytes(device: Device) -> tuple[int, str]:
    """The fixed cost of a process of a run on ``device`` (see ``MemoryEstimate.device``), as this machine can
    tell: measured in this process when this machine has that device, else assumed; and which of the two, in
    words."""
    if planned_device(device).type == "cpu":
        return (fixed_bytes(torch.device("cpu")) + CPU_STEP_RUNTIME_BYTES,
                "measured: this process's resident set before the model, and "
                f"{CPU_STEP_RUNTIME_BYTES / 2**30:.2f} GiB for what a CPU process adds once it steps besides its "
                "tensors (the kernels' code, the math libraries' buffers, glibc's small allocations)")
    if torch.cuda.is_available():
        return fixed_bytes(torch.device("cuda", torch.cuda.current_device())), "measured: the CUDA device memory in use"
    return ASSUMED_CUDA_FIXED_BYTES, "assumed for a CUDA context (no GPU here to measure it)"


def planner_inputs(cfg: RunConfig, parallelism: Parallelism, device: torch.device,
                   model: Optional[nn.Module] = None) -> PlannerInputs:
    """The planner's inputs for ``cfg`` on ``parallelism``'s processes (``resolve_parallelism``: its world size
    known), with the fixed cost of this process as it is now (``process_fixed_bytes``); ``model``: the config's,
    on the meta device (whether it takes images; None: built here).

    Raises:
        UserError: ``max_seq_len`` is not set (the activations are sized by it), or ``planned_images`` cannot be
            planned (``resolve_image_load``).
    """
    if cfg.max_seq_len is None:
        raise UserError("max_seq_len: must be set to estimate memory (ac_mode: auto, tune plan): it sizes the activations")
    workload = Workload(batch_size=cfg.batch_size, seq_len=cfg.max_seq_len,
                        gradient_accumulation_steps=cfg.gradient_accumulation_steps, dtype=cfg.dtype,
                        parallelism=parallelism, fsdp=cfg.fsdp,
                        # Packed rows on a GPU in bf16 take varlen_attn (models/attention.py), whose K/V copies the
                        # simulation cannot make on a CPU's kernels.
                        varlen=(bool(cfg.dataset.kwargs.get("packed", False))
                                and planned_device(cfg.device).type == "cuda" and cfg.dtype is DType.BF16),
                        preference=cfg.preference_step(), rollouts=cfg.rollout_step(),
                        blas_workspaces=cublas_workspace_bytes(planned_device(cfg.device))[0],
                        compiled=cfg.compile, cuda=planned_device(cfg.device).type == "cuda",
                        images=planned_image_load(cfg, model if model is not None
                                                  else build_meta_model(cfg.model, cfg.checkpoint_dir)))
    return PlannerInputs(
        build_model=lambda: build_planned_model(cfg),
        make_optimizer=cfg.optimizer.instantiate,
        workload=workload,
        device=device,
        fixed_bytes=process_fixed_bytes(cfg.device)[0],
    )


def planned_image_load(cfg: RunConfig, model: nn.Module) -> Optional[ImageLoad]:
    """The images every planned sample holds (``planned_images.*``) when ``model`` takes images, else None; their
    default size is the largest the processor passes: ``max_pixels`` in its ``preprocessor_config.json`` (the
    dataset's ``processor`` folder, else ``checkpoint_dir``), else the family's processor's default; for a family
    whose processor resizes every image to one size (Gemma 3), that size."""
    family = family_of(model)
    if family is None or family.images is None:
        return None
    args = family.args_of(model)

    def resized(height: int, width: int) -> tuple[int, int, int]:
        return family.images.resized(args, height, width)

    if family.images.default_max_pixels is None:  # one size for every image: no processor's limit to read
        return resolve_image_load(cfg.planned_images, resized, None, "", cfg.max_seq_len)
    folder = cfg.dataset.kwargs.get("processor") or cfg.checkpoint_dir
    file = Path(folder).expanduser() / "preprocessor_config.json" if folder else None
    max_pixels, how = None, ""
    if file is not None and file.is_file():
        try:
            stored = json.loads(file.read_text())
        except (OSError, ValueError):
            stored = {}
        size = stored.get("size") if isinstance(stored.get("size"), dict) else {}
        max_pixels = stored.get("max_pixels") or size.get("longest_edge")
        how = f"{file}"
    if not isinstance(max_pixels, int) or max_pixels <= 0:
        max_pixels = family.images.default_max_pixels
        how = ("transformers' default for the model's processor"
               + (f": {file} gives none" if file is not None and file.is_file() else
                  ": no preprocessor_config.json at checkpoint_dir or dataset.processor to read"))
    return resolve_image_load(cfg.planned_images, resized, max_pixels, how, cfg.max_seq_len)


def build_planned_model(cfg: RunConfig) -> nn.Module:
    """The model a step of ``cfg`` trains, as the planner simulates it (under fake tensors): with the adapters of an
    adapter recipe, the base frozen (gradients and optimizer state only for the adapters) and, for QLoRA, its
    adapted linears stored as NF4 (the planner counts their inner tensors: 4-bit codes and scales)."""
    model = cfg.model.instantiate_with_defaults(checkpoint_dir=cfg.checkpoint_dir)
    adapter: Optional[AdapterConfig] = getattr(cfg, "adapter", None)  # a schema field of the adapter recipes only
    if adapter is not None:
        apply_adapters(model, adapter)
        if adapter.quantize_base is QuantizeBase.NF4:
            quantize_base_(model)
    return model


def unmodelled_settings(cfg: RunConfig, world_size: int) -> tuple[str, ...]:
    """What the planner's estimate leaves out of ``cfg`` on ``world_size`` processes, one sentence each."""
    mixed = cfg.fsdp.param_dtype
    if world_size == 1 or mixed is None or mixed is cfg.dtype:
        return ()
    direction = "higher" if mixed.torch.itemsize < cfg.dtype.torch.itemsize else "lower"
    return (f"fsdp.param_dtype={mixed.value} is not modelled: activations and gathered weights are counted in "
            f"{cfg.dtype.value} (dtype), so the estimate is {direction} than the run's",)


def resolve_features(cfg: RunConfig, model: nn.Module, ac: ACConfig,
                     planning: Optional[PlannerInputs] = None) -> MemoryPlan:
    """The memory plan of ``cfg``'s features for ``model``, with ``ac`` as its AC keys (see ``resolve_memory_plan``).

    Raises:
        UserError: as ``resolve_memory_plan``.
    """
    return resolve_memory_plan(ac, cfg.memory, model, clip_grad_norm=cfg.clip_grad_norm, planning=planning,
                               fsdp=cfg.fsdp, optimizer=OptimizerSpec(cfg.optimizer.path, dict(cfg.optimizer.kwargs)),
                               dtype=cfg.dtype.torch, device=cfg.device.value)


# --------------------------------------------------------------------------------------------------------------
# Resolving the plan
# --------------------------------------------------------------------------------------------------------------


def _resolve_memory(cfg: RunConfig, model: nn.Module, parallelism: Parallelism,
                    device: Optional[torch.device], notes: list[str],
                    auto_choice: Optional[tuple[MemoryEstimate, float]]) -> MemoryPlan:
    """The memory plan; with ``ac_mode: auto``, the planner's choice for this world size (1 when unknown)."""
    planning = None
    if cfg.ac.is_auto and auto_choice is not None:  # tune plan: its table estimated every plan already
        estimate, budget = auto_choice
        features = resolve_features(cfg, model, ACConfig())
        return dataclasses.replace(features, ac=estimate.plan, budget_gib=budget, estimate=estimate)
    if cfg.ac.is_auto:
        if device is None:  # not the run's own process (tune validate, tune plan)
            try:
                device = resolve_device(cfg.device.value)
            except UserError:
                if cfg.ac.ac_memory_budget_gib is None:
                    raise UserError(
                        f"ac_mode=auto with device={cfg.device.value}: the budget cannot be read on this machine; "
                        "set ac_memory_budget_gib to plan here"
                    ) from None
                device = torch.device("cpu")  # validating elsewhere: the given budget is all the planner needs
        if parallelism.world_size is None:
            notes.append("ac_mode=auto: planned for 1 process (the launch's world size is not known here)")
            parallelism = dataclasses.replace(parallelism, world_size=1)
        planning = planner_inputs(cfg, parallelism, device, model)
        notes.extend(f"ac_mode=auto: {note}" for note in unmodelled_settings(cfg, parallelism.world_size))
    return resolve_features(cfg, model, cfg.ac, planning)


def _positions_note(cfg: RunConfig, facts: ModelFacts) -> list[str]:
    if cfg.max_seq_len is None or facts.positions is None or cfg.max_seq_len <= facts.positions:
        return []
    # Positions are computed as needed, so nothing fails: longer samples just meet positions never trained.
    return [f"max_seq_len={cfg.max_seq_len}: samples may be longer than the model's context ({facts.positions} "
            f"positions, {cfg.model.path}); if you extend it on purpose, say so with "
            f"model.max_seq_len={cfg.max_seq_len}"]


def resolve_run_plan(cfg: RunConfig, model: nn.Module, *, world_size: Optional[int],
                     device: Optional[torch.device] = None,
                     auto_choice: Optional[tuple[MemoryEstimate, float]] = None) -> RunPlan:
    """Resolve the run's plan (pure but for ``ac_mode: auto``'s measurements of this process: see the module
    docstring).

    Args:
        cfg: the validated config.
        model: the model, built once on the meta device (``build_meta_model``).
        world_size: processes the run uses; None when not known (an elastic node range, ``tune validate``).
        device: this process's device when it is the run's (``ac_mode: auto`` reads its budget there); None for
            ``tune validate`` and ``tune plan``, which resolve the config's ``device`` where they can.
        auto_choice: with ``ac_mode: auto``, the estimate ``tune plan``'s table picked and its budget in GiB (the
            planner's choice, made already); None: the planner chooses here.

    Raises:
        UserError: the config cannot run (a combination of keys, ``ac_mode: auto`` with no plan that fits, a
            world size that is not whole HSDP rows).
    """
    parallelism = resolve_parallelism(cfg, model, world_size)  # before anything is estimated
    if cfg.dataset_val is None:
        for key in ("run_val_every_n_steps", "batch_size_val"):
            if getattr(cfg, key) is not None:
                raise UserError(f"{key}={getattr(cfg, key)}: only used with dataset_val; set dataset_val (a dataset "
                                f"component, like dataset) or remove {key}")
    notes: list[str] = []
    facts = model_facts(model, cfg.model.path)
    memory = _resolve_memory(cfg, model, parallelism, device, notes, auto_choice)
    notes += _positions_note(cfg, facts)
    adapter = _resolve_adapter(cfg, model, memory, parallelism)
    if world_size == 1 and cfg.fsdp != FSDPConfig() and not memory.shard_options():
        notes.append("fsdp.*: these settings apply only when the run has more than one process (FSDP2)")
    if device is None:
        try:
            device = resolve_device(cfg.device.value)
        except UserError:  # not on this machine (tune validate says so among its checks)
            device = None
    resume_data = {"optimizer._component_": cfg.optimizer.path, "seed": cfg.seed, "shuffle": cfg.shuffle,
                   "max_seq_len": cfg.max_seq_len,
                   # Not its source: the files are identified by their content (RecipeState.data), wherever they lie.
                   "dataset": {key: value for key, value in cfg.dataset.as_config().items() if key != "source"},
                   "tokenizer": cfg.tokenizer.as_config(), **memory.resume_record(),
                   **({"adapter": adapter_record(adapter)} if adapter is not None else {})}
    hyperparameters = {"optimizer": cfg.optimizer.as_config(),
                       "lr_scheduler": cfg.lr_scheduler.as_config() if cfg.lr_scheduler is not None else None}
    return RunPlan(
        parallelism=parallelism,
        device=cfg.device.value,
        device_type=None if device is None else device.type,
        dtype=cfg.dtype,
        fsdp=cfg.fsdp,
        compile=cfg.compile,
        model=facts,
        memory=memory,
        length=resolve_length(cfg, parallelism),
        save=SavePolicy(cfg.save_every_n_steps, cfg.keep_last_n_checkpoints),
        # As it reads back from trainer_state.json (tuples become lists), so a resume compares like with like.
        resume_data=json.loads(json.dumps(resume_data)),
        hyperparameters=json.loads(json.dumps(hyperparameters)),
        checkpoint_dir=cfg.checkpoint_dir,
        seed=cfg.seed,
        output_dir=cfg.output_dir,
        notes=tuple(notes),
        adapter=adapter,
    )


def _resolve_adapter(cfg: RunConfig, model: nn.Module, memory: MemoryPlan,
                     parallelism: Parallelism) -> Optional[AdapterConfig]:
    """The ``adapter:`` section of a recipe whose schema has one (``lora_finetune``, ``lora_dpo``), checked against
    the meta model before any weight is loaded; None for the others."""
    adapter = getattr(cfg, "adapter", None)  # a schema field of the adapter recipes only
    if adapter is None:
        return None
    check_adapter_start(model, adapter, loss_chunks=memory.settings.loss_chunks)
    if adapter.quantize_base is not None:
        if memory.shard_options():
            raise UserError(f"adapter.quantize_base={adapter.quantize_base.value}: the NF4 base is sharded by FSDP2 "
                            "over one dimension of processes, not with CPU offload (fsdp.cpu_offload); drop it, or "
                            "set adapter.quantize_base: null")
        if (parallelism.world_size or 1) > 1:
            check_nf4_sharding(find_targets(model, adapter), parallelism.world_size)
    return adapter


def resolve_parallelism(cfg: RunConfig, model: Optional[nn.Module], world_size: Optional[int]) -> Parallelism:
    """The run's parallelism: its degrees from the config, checked once against ``world_size`` (``Parallelism``:
    whole HSDP rows of whole tensor-parallel groups) and against ``model`` and ``max_seq_len``. ``tune validate``,
    ``tune plan``, the launcher and the run all come here.

    Args:
        cfg: the validated config.
        model: the meta model (None: the launcher's check, before any model is built; only the world size is
            checked).
        world_size: processes (None: not known).

    Raises:
        UserError: in one line naming the keys and the numbers.
    """
    parallelism = Parallelism(world_size, replicate=cfg.fsdp.replicate_degree, tensor=cfg.tensor_parallel_dim,
                              expert=cfg.expert_parallel_dim)
    _check_adapter_degrees(getattr(cfg, "adapter", None), parallelism)  # a schema field of the adapter recipes only
    if model is not None:
        _check_experts(model, parallelism)
        _check_tensor_parallel(cfg, model, parallelism.tensor)
    return parallelism


def _check_adapter_degrees(adapter: Optional[AdapterConfig], parallelism: Parallelism) -> None:
    """Refuse, in one line, a degree the adapters do not run under: tensor and expert parallelism (the families'
    plans do not split an adapted linear), and HSDP with an NF4 base (torchao's NF4 all-gather is over one mesh
    dimension). From the config alone, so the launcher and ``tune plan`` refuse what the run would."""
    if adapter is None:
        return
    if parallelism.tensor_parallel:
        raise UserError(f"tensor_parallel_dim={parallelism.tensor}: adapters (the adapter: section) do not run under "
                        "tensor parallelism (the family's plan does not split them); use tensor_parallel_dim: 1 "
                        "(FSDP2, fsdp.replicate_degree for HSDP)")
    if parallelism.expert_parallel:
        raise UserError(f"expert_parallel_dim={parallelism.expert}: adapters (the adapter: section) do not run under "
                        "expert parallelism; use expert_parallel_dim: 1 (FSDP2 shards the frozen experts)")
    if adapter.quantize_base is not None and parallelism.replicate > 1:
        raise UserError(f"adapter.quantize_base={adapter.quantize_base.value}: the NF4 base is sharded by FSDP2 over "
                        f"one dimension of processes, not under HSDP (fsdp.replicate_degree={parallelism.replicate}); "
                        "set fsdp.replicate_degree: 1, or adapter.quantize_base: null")


def _check_experts(model: nn.Module, parallelism: Parallelism) -> None:
    """Refuse, in one line naming the numbers, an expert-parallel degree the model's experts cannot be split by
    (it must divide the experts of each layer; a dense model has none to split), and tensor parallelism on a
    mixture of experts (its experts have no tensor-parallel plan)."""
    args = moe_args_of(model)
    if args is None:
        if parallelism.expert_parallel:
            raise UserError(f"expert_parallel_dim={parallelism.expert}: the model has no mixture-of-experts layers "
                            "to split; use expert_parallel_dim: 1")
        return
    if parallelism.tensor_parallel:
        raise UserError(f"tensor_parallel_dim={parallelism.tensor}: a mixture of experts ({args.num_experts} experts "
                        "a layer) does not run under tensor parallelism; use tensor_parallel_dim: 1, and "
                        "expert_parallel_dim to split its experts")
    if args.num_experts % parallelism.expert:
        raise UserError(f"expert_parallel_dim={parallelism.expert}: must divide the model's {args.num_experts} "
                        "experts a layer (each process of a group holds as many)")


def _check_tensor_parallel(cfg: RunConfig, model: nn.Module, degree: int) -> None:
    """Refuse, in one line naming the numbers, a tensor-parallel ``degree`` the model or the batches cannot be
    split by: it must divide the model's query heads, key/value heads (fewer key/value heads than the degree are
    refused, not copied across ranks) and MLP width, and ``max_seq_len`` (each rank of a group takes an equal piece
    of the sequence between the split layers; batches are padded to a multiple of the degree).
    """
    if degree == 1:
        return
    check_tensor_parallel_degree(model, degree)
    if cfg.max_seq_len is not None and cfg.max_seq_len % degree:
        raise UserError(f"tensor_parallel_dim={degree}: must divide max_seq_len={cfg.max_seq_len} (each process of a "
                        "tensor-parallel group takes an equal piece of the sequence)")
