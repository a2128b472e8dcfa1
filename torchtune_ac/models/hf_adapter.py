"""Hugging Face adapter for the families built on the Llama decoder (``models/llama.py``).

Pure translation, no I/O (``torchtune_ac.checkpoint`` reads and writes the files). Our parameter names map to
Hugging Face names one prefix away, the same for every family here::

    tok_embeddings.weight              model.embed_tokens.weight
    layers.{i}.attn_norm.weight        model.layers.{i}.input_layernorm.weight
    layers.{i}.attn.{q,k,v,o}_proj.*   model.layers.{i}.self_attn.{q,k,v,o}_proj.*
    layers.{i}.mlp_norm.weight         model.layers.{i}.post_attention_layernorm.weight
    layers.{i}.mlp.*                   model.layers.{i}.mlp.*
    norm.weight                        model.norm.weight
    output.weight                      lm_head.weight   (absent when embeddings are tied)

A family whose checkpoints store some parameters otherwise than whole under these names declares how, as data
(``storage``: rules of ``checkpoint/layout.py``, the checkpoint's pure vocabulary of stored layouts): several
stacked as one tensor (Phi-3's ``self_attn.qkv_proj``), one stored as several (Qwen3-MoE's experts), one read
through a decoder (gpt-oss's MXFP4); the checkpoint code reads and writes every layout by walking one map.

The config.json keys are shared too; what differs between families (``model_type``, the variant flags every model
of the family has, which keys must be refused, what extra keys transformers needs) is a field of
``LlamaStyleHFAdapter``; a family whose config.json or names differ further overrides its methods in its own
module.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch

from torchtune_ac.checkpoint.layout import StorageRule
from torchtune_ac.errors import UserError
from torchtune_ac.models.llama import (
    LinearRopeScaling,
    LlamaArgs,
    LongRopeScaling,
    RopeScaling,
    YarnRopeScaling,
)

_TOP_LEVEL_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Our block's submodules -> Hugging Face's (no prefix here is a prefix of another).
LLAMA_BLOCK_NAMES = (
    ("attn_norm.", "input_layernorm."),
    ("attn.", "self_attn."),
    ("mlp_norm.", "post_attention_layernorm."),
    ("mlp.", "mlp."),
)
# The variant flags of ``LlamaArgs`` that a family fixes (every model of the family has the same value), and
# what each means, for messages.
VARIANT_FLAGS = {
    "qkv_bias": "q/k/v projection biases",
    "qk_norm": "q/k norms",
    "norm_offset": "norms scaling by norm_offset + weight",
    "norm_in_float32": "norms scaling in float32",
    "scale_embeddings": "embeddings scaled by sqrt(hidden_size)",
    "activation": "an MLP activation",
}
_LAYER_NAME = re.compile(r"layers\.(\d+)\.(.+)")
# Older Hugging Face conversions stored the rotary inverse frequencies; they are derived, not learned.
_DERIVED_HF_SUFFIX = ".rotary_emb.inv_freq"
_HF_DEFAULT_ROPE_THETA = 10000.0
_REQUIRED = object()
# Keys of an input config.json that state, in another spelling, what ``hf_config_from_args`` writes itself
# (transformers 5's rope form, the older name of ``dtype``): kept, they could contradict it.
_RESTATED_KEYS = ("rope_parameters", "torch_dtype")


@dataclass(frozen=True)
class Refusal:
    """A config.json key whose value this adapter cannot honour: ``refuse(value)`` says why, or None if fine."""

    key: str
    refuse: Callable[[Any], Optional[str]]


def refuse_truthy(reason: str) -> Callable[[Any], Optional[str]]:
    """A ``Refusal.refuse`` that refuses any true-ish value (``attention_bias: true``) with ``reason``."""
    return lambda value: reason if value else None


def refuse_unless(allowed: tuple[Any, ...], reason: str) -> Callable[[Any], Optional[str]]:
    """A ``Refusal.refuse`` that accepts only the ``allowed`` values (absent counts as None)."""
    return lambda value: None if value in allowed else reason


@dataclass(frozen=True)
class LlamaStyleHFAdapter:
    """``HFAdapter`` (see ``models/family.py``) for a family built on the Llama decoder.

    Attributes:
        model_type: config.json ``model_type`` (``llama``, ...), carried by the family's ``LlamaArgs``.
        architecture_name: config.json ``architectures[0]`` (``LlamaForCausalLM``).
        variant: the ``VARIANT_FLAGS`` every model of the family has, where they differ from ``LlamaArgs``'
            defaults (``{"qkv_bias": True}`` for Qwen2), whatever config.json says.
        refusals: config.json keys this family cannot honour (e.g. sliding-window attention), checked on read.
        extra_config: keys written into config.json on save besides the shared ones, so that transformers
            builds exactly our model (e.g. ``sliding_window: null`` for Mistral, whose default is 4096).
        rope_types: the RoPE scaling types (config.json ``rope_type``: ``llama3``, ``linear``, ``longrope``) read,
            besides ``default``.
        block_names: our block's submodule prefixes -> Hugging Face's.
        activation_key: the config.json key holding the MLP activation.
        storage: how its checkpoints store the parameters not stored whole under their own (``to_hf_name``'s)
            names: ``Stacked``, ``Split``, ``Encoded`` rules (``checkpoint/layout.py``).
    """

    model_type: str
    architecture_name: str
    variant: Mapping[str, Any] = field(default_factory=dict)
    refusals: tuple[Refusal, ...] = ()
    extra_config: Mapping[str, Any] = field(default_factory=dict)
    rope_types: tuple[str, ...] = ("llama3",)
    block_names: tuple[tuple[str, str], ...] = LLAMA_BLOCK_NAMES
    activation_key: str = "hidden_act"
    storage: tuple[StorageRule, ...] = ()

    def __post_init__(self) -> None:
        unknown = self.variant.keys() - VARIANT_FLAGS.keys()
        if unknown:
            raise ValueError(f"variant: {sorted(unknown)} are not variant flags ({', '.join(VARIANT_FLAGS)})")

    @property
    def model_types_read(self) -> tuple[str, ...]:
        return (self.model_type,)

    @property
    def model_types_loaded(self) -> tuple[str, ...]:
        return ()

    def flag(self, name: str) -> Any:
        """The value of variant flag ``name`` for every model of this family."""
        return self.variant.get(name, LlamaArgs.__dataclass_fields__[name].default)

    def check_args(self, args: LlamaArgs) -> None:
        """Refuse arguments that are not of this family: another ``model_type``, or a variant flag that differs.

        Raises:
            ValueError: naming the field.
        """
        if args.model_type != self.model_type:
            raise ValueError(f"model_type={args.model_type!r}: these are not {self.model_type} arguments")
        scaling = _rope_scaling_config(args.rope_scaling)
        if scaling is not None and scaling["rope_type"] not in self.rope_types:
            raise ValueError(f"rope_scaling={args.rope_scaling}: {self.model_type} has "
                             f"{' or '.join(self.rope_types)} RoPE scaling only")
        for name, meaning in VARIANT_FLAGS.items():
            value, fixed = getattr(args, name), self.flag(name)
            if value == fixed:
                continue
            if isinstance(fixed, bool):
                having = "has" if fixed else "has no"
                advice = f": build them with {name}=True" if fixed else ""
                raise ValueError(f"{name}={value}, but {self.model_type} {having} {meaning}{advice}")
            raise ValueError(f"{name}={value!r}, but {self.model_type} has {name}={fixed!r} ({meaning})")

    # ---------------------------------------------------------------------------------------------- names

    def to_hf_name(self, name: str) -> str:
        """``layers.3.attn.q_proj.weight`` -> ``model.layers.3.self_attn.q_proj.weight``.

        Raises:
            ValueError: the name is not a parameter of the Llama decoder.
        """
        if name in _TOP_LEVEL_NAMES:
            return _TOP_LEVEL_NAMES[name]
        match = _LAYER_NAME.fullmatch(name)
        if match:
            index, rest = match.groups()
            for ours, theirs in self.block_names:
                if rest.startswith(ours):
                    return f"model.layers.{index}.{theirs}{rest[len(ours):]}"
        raise ValueError(f"parameter {name!r} has no Hugging Face {self.model_type} equivalent")

    def stored_name(self, config: Mapping[str, Any], name: str) -> Optional[str]:
        return None if name.endswith(_DERIVED_HF_SUFFIX) else name

    def tied_parameters(self, args: LlamaArgs) -> dict[str, str]:
        return {"output.weight": "tok_embeddings.weight"} if args.tie_embeddings else {}

    # --------------------------------------------------------------------------------------------- config

    def args_from_hf_config(self, config: Mapping[str, Any], **overrides: Any) -> LlamaArgs:
        """Translate a parsed config.json to ``LlamaArgs``.

        Reads both the transformers 5 rope form (``rope_parameters``) and the older one (``rope_theta`` and
        ``rope_scaling``). Missing optional keys take transformers' defaults.

        Args:
            config: the parsed config.json.
            **overrides: ``LlamaArgs`` fields to set instead of what the config says (e.g. ``attn_dropout``).

        Raises:
            UserError: listing every unsupported or invalid key (another model_type, biases the family does
                not have, another activation than the family's, a rope type the family does not read, the
                family's own refusals, bad values).
        """
        d = config
        problems: list[str] = []
        model_type = d.get("model_type")
        if model_type not in self.model_types_read:
            problems.append(f"model_type={model_type!r}: this reader is for {self.model_type!r}")
        for key in ("attention_bias", "mlp_bias"):
            if d.get(key):
                problems.append(f"{key}={d[key]!r}: {self.model_type} projections with biases are not supported")
        activation = self.flag("activation")
        found = d.get(self.activation_key) or activation
        if found != activation:
            problems.append(f"{self.activation_key}={found!r}: only {activation!r} is supported")
        for refusal in self.refusals:
            reason = refusal.refuse(d.get(refusal.key))
            if reason is not None:
                problems.append(f"{refusal.key}={d.get(refusal.key)!r}: {reason}")

        dim = read_value(d, "hidden_size", int, problems)
        n_heads = read_value(d, "num_attention_heads", int, problems)
        max_pos = read_value(d, "max_position_embeddings", int, problems, default=2048)
        fields = dict(
            vocab_size=read_value(d, "vocab_size", int, problems),
            dim=dim,
            n_layers=read_value(d, "num_hidden_layers", int, problems),
            n_heads=n_heads,
            n_kv_heads=read_value(d, "num_key_value_heads", int, problems, default=n_heads),
            intermediate_dim=read_value(d, "intermediate_size", int, problems),
            max_seq_len=max_pos,
            norm_eps=read_value(d, "rms_norm_eps", float, problems, default=1e-6),
            tie_embeddings=read_value(d, "tie_word_embeddings", bool, problems, default=False),
            head_dim=read_value(d, "head_dim", int, problems, default=None),
            attn_dropout=read_value(d, "attention_dropout", float, problems, default=0.0),
            model_type=self.model_type,
            **{name: self.flag(name) for name in VARIANT_FLAGS},
        )
        fields["rope_theta"], fields["rope_scaling"] = _read_rope(d, max_pos, self.rope_types, problems)
        fields.update(self.read_family_keys(d, problems))
        if problems:
            raise UserError(f"unsupported Hugging Face {self.model_type} config: " + "; ".join(problems))
        # An explicit head_dim equal to the default is dropped so args compare equal to the builders'.
        if dim and n_heads and fields["head_dim"] == dim // n_heads and dim % n_heads == 0:
            fields["head_dim"] = None
        fields.update(overrides)
        try:
            return LlamaArgs(**fields)
        except ValueError as e:
            raise UserError(f"Hugging Face {self.model_type} config: {e}") from None

    def hf_config_from_args(
        self,
        args: LlamaArgs,
        dtype: torch.dtype,
        *,
        base_config: Optional[Mapping[str, Any]] = None,
        bos_token_id: Optional[int] = None,
        eos_token_id: Optional[int | list[int]] = None,
        pad_token_id: Optional[int] = None,
    ) -> dict[str, Any]:
        """A config.json dict that transformers' ``AutoModelForCausalLM`` builds this model from.

        Rope settings are written as top-level ``rope_theta`` plus ``rope_scaling``: the form of the published
        checkpoints, read correctly by transformers 4.x and 5.x alike. ``resid_dropout`` has no Hugging Face
        equivalent and is not written.

        Args:
            args: the model arguments.
            dtype: dtype of the saved weights, recorded as ``dtype``.
            base_config: the config.json the model was loaded from: every key this method does not write itself
                is kept (``initializer_range``, ``use_cache``, ``max_window_layers``, ``pad_token_id``, ...),
                except older spellings of what it writes (``rope_parameters``, ``torch_dtype``).
            bos_token_id, eos_token_id, pad_token_id: special token ids, when known: each replaces the base
                config's value unless that value already says the same (an equal id, or a list of end ids that
                holds this one); None keeps the base config's value (else null).
        """
        config = {key: value for key, value in (base_config or {}).items() if key not in _RESTATED_KEYS}
        config.update({
            "architectures": [self.architecture_name],
            "model_type": self.model_type,
            **self.architecture(args),
            self.activation_key: args.activation,
            "max_position_embeddings": args.max_seq_len,
            "attention_dropout": args.attn_dropout,
            "dtype": str(dtype).removeprefix("torch."),
            **self.extra_config,
        })
        for key, ours in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id),
                          ("pad_token_id", pad_token_id)):
            config[key] = _merge_token_id(config.get(key), ours)
        return config

    def read_family_keys(self, config: Mapping[str, Any], problems: list[str]) -> dict[str, Any]:
        """``LlamaArgs`` fields read from config.json keys of this family only (none here; a family with such
        keys overrides this and ``family_architecture``). Problems are appended, not raised."""
        return {}

    def family_architecture(self, args: LlamaArgs) -> dict[str, Any]:
        """The config.json keys of this family only that give weights their meaning (see ``architecture``)."""
        return {}

    def architecture(self, args: LlamaArgs) -> dict[str, Any]:
        self.check_args(args)
        return {
            "vocab_size": args.vocab_size,
            "hidden_size": args.dim,
            "intermediate_size": args.intermediate_dim,
            "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.n_kv_heads,
            "head_dim": args.resolved_head_dim,
            "rms_norm_eps": args.norm_eps,
            "rope_theta": args.rope_theta,
            "rope_scaling": _rope_scaling_config(args.rope_scaling),
            "tie_word_embeddings": args.tie_embeddings,
            **self.family_architecture(args),
        }


def _merge_token_id(base: Any, ours: Any) -> Any:
    """The token id(s) to write: ``ours`` unless it is None or ``base`` already says it (equal, or a list holding
    it: the several end-of-turn ids of an instruct model's config)."""
    if ours is None or base == ours or (isinstance(base, list) and not isinstance(ours, list) and ours in base):
        return base
    return ours


def read_value(
    d: Mapping[str, Any], key: str, kind: type, problems: list[str], default: Any = _REQUIRED, prefix: str = ""
) -> Any:
    """``d[key]`` checked to be of ``kind`` (ints accepted as floats); problems are appended, not raised (for a
    family's own keys in ``read_family_keys`` too).

    Returns:
        The value, ``default`` when it is absent or null (a problem when there is no default), None when it is
        of another kind.
    """
    value = d.get(key)
    if value is None:
        if default is _REQUIRED:
            problems.append(f"{prefix}{key}: missing")
            return None
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        problems.append(f"{prefix}{key}={value!r}: must be {kind.__name__}")
        return None
    if kind is float and not math.isfinite(value):  # JSON's NaN and Infinity, which Python's json reads
        problems.append(f"{prefix}{key}={value!r}: must be a finite number")
        return None
    return value


def _rope_scaling_config(
    scaling: Optional[RopeScaling | LinearRopeScaling | LongRopeScaling | YarnRopeScaling],
) -> Optional[dict[str, Any]]:
    """config.json's ``rope_scaling`` for ``scaling`` (LongRoPE's attention factor written out, so that it does not
    depend on ``max_position_embeddings``)."""
    if scaling is None:
        return None
    if isinstance(scaling, LinearRopeScaling):
        return {"rope_type": "linear", "factor": scaling.factor}
    if isinstance(scaling, LongRopeScaling):
        return {"rope_type": "longrope", "short_factor": list(scaling.short_factor),
                "long_factor": list(scaling.long_factor),
                "original_max_position_embeddings": scaling.original_max_position_embeddings,
                "attention_factor": scaling.attention_factor}
    if isinstance(scaling, YarnRopeScaling):
        config = {"rope_type": "yarn", **dataclasses.asdict(scaling)}
        if scaling.attention_factor is None:
            del config["attention_factor"]
        return config
    return {"rope_type": "llama3", **dataclasses.asdict(scaling)}


def _read_yarn(rope: Mapping[str, Any], max_position_embeddings: Optional[int], problems: list[str],
               prefix: str) -> Optional[YarnRopeScaling]:
    """A YaRN ``rope_scaling`` with transformers' defaults; mscale and partial rotary factors are refused."""
    for key in ("mscale", "mscale_all_dim", "partial_rotary_factor"):
        if rope.get(key) not in (None, 1, 1.0):
            problems.append(f"{prefix}{key}={rope[key]!r}: not supported with YaRN")
    values = dict(
        factor=read_value(rope, "factor", float, problems, prefix=prefix),
        original_max_position_embeddings=read_value(rope, "original_max_position_embeddings", int, problems,
                                                    default=max_position_embeddings, prefix=prefix),
        beta_fast=read_value(rope, "beta_fast", float, problems, default=32.0, prefix=prefix),
        beta_slow=read_value(rope, "beta_slow", float, problems, default=1.0, prefix=prefix),
        truncate=read_value(rope, "truncate", bool, problems, default=True, prefix=prefix),
        attention_factor=read_value(rope, "attention_factor", float, problems, default=None, prefix=prefix),
    )
    if values["factor"] is None or values["original_max_position_embeddings"] is None:
        return None
    return YarnRopeScaling(**values)


def _read_rope(
    d: Mapping[str, Any], max_position_embeddings: Optional[int], rope_types: tuple[str, ...], problems: list[str]
) -> tuple[Optional[float], Optional[RopeScaling | LinearRopeScaling | LongRopeScaling]]:
    """Rope theta and scaling from either the transformers 5 form (``rope_parameters``) or the older one
    (top-level ``rope_theta`` plus ``rope_scaling``); ``rope_types``: the scaled types read."""
    rope_key = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
    rope = d.get(rope_key) or {}
    if not isinstance(rope, dict):
        problems.append(f"{rope_key}={rope!r}: must be an object")
        return None, None
    theta = read_value(rope, "rope_theta", float, problems, default=None, prefix=f"{rope_key}.")
    if theta is None:
        theta = read_value(d, "rope_theta", float, problems, default=_HF_DEFAULT_ROPE_THETA)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type not in rope_types:
        supported = " or ".join(repr(t) for t in (*rope_types, "default"))
        problems.append(f"{rope_key}.rope_type={rope_type!r}: only {supported} RoPE is supported")
        return theta, None
    prefix = f"{rope_key}."
    if rope_type == "linear":
        factor = read_value(rope, "factor", float, problems, prefix=prefix)
        return theta, None if factor is None else LinearRopeScaling(factor)
    if rope_type == "longrope":
        return theta, _read_longrope(rope, max_position_embeddings, problems, prefix)
    if rope_type == "yarn":
        return theta, _read_yarn(rope, max_position_embeddings, problems, prefix)
    values = {key: read_value(rope, key, float, problems, prefix=prefix) for key in
              ("factor", "low_freq_factor", "high_freq_factor")}
    # transformers falls back to max_position_embeddings too when this key is absent.
    original = read_value(rope, "original_max_position_embeddings", int, problems,
                           default=max_position_embeddings, prefix=prefix)
    if None in values.values() or original is None:
        return theta, None
    return theta, RopeScaling(original_max_position_embeddings=original, **values)


def _read_longrope(rope: Mapping[str, Any], max_position_embeddings: Optional[int], problems: list[str],
                   prefix: str) -> Optional[LongRopeScaling]:
    """LongRoPE's settings, its attention factor as transformers derives it when absent: from ``factor``, else from
    ``max_position_embeddings / original_max_position_embeddings``."""
    factors = {}
    for key in ("short_factor", "long_factor"):
        value = rope.get(key)
        if not isinstance(value, list) or not value or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) for x in value):
            problems.append(f"{prefix}{key}={value!r}: must be a list of numbers")
        else:
            factors[key] = tuple(float(x) for x in value)
    original = read_value(rope, "original_max_position_embeddings", int, problems, default=max_position_embeddings,
                          prefix=prefix)
    factor = read_value(rope, "factor", float, problems, default=None, prefix=prefix)
    attention = read_value(rope, "attention_factor", float, problems, default=None, prefix=prefix)
    if original is not None and original < 2:
        problems.append(f"{prefix}original_max_position_embeddings={original}: must be at least 2")
    if len(factors) < 2 or not original or original < 2 or not max_position_embeddings:
        return None
    if attention is None:
        factor = max_position_embeddings / original if factor is None else factor
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return LongRopeScaling(original_max_position_embeddings=original, max_position_embeddings=max_position_embeddings,
                           attention_factor=attention, **factors)
