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

The config.json keys are shared too; what differs between families (``model_type``, where q/k/v biases come
from, which keys must be refused, what extra keys transformers needs) is a field of ``LlamaStyleHFAdapter``.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch

from torchtune_ac.errors import UserError
from torchtune_ac.models.llama import LlamaArgs, RopeScaling

_TOP_LEVEL_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# No prefix here is a prefix of another.
_BLOCK_PREFIXES = (
    ("attn_norm.", "input_layernorm."),
    ("attn.", "self_attn."),
    ("mlp_norm.", "post_attention_layernorm."),
    ("mlp.", "mlp."),
)
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
        model_type: config.json ``model_type`` (``llama``, ...).
        architecture_name: config.json ``architectures[0]`` (``LlamaForCausalLM``).
        qkv_bias: the family's q/k/v projections always have biases (Qwen2), whatever config.json says.
        refusals: config.json keys this family cannot honour (e.g. sliding-window attention), checked on read.
        extra_config: keys written into config.json on save besides the shared ones, so that transformers
            builds exactly our model (e.g. ``sliding_window: null`` for Mistral, whose default is 4096).
    """

    model_type: str
    architecture_name: str
    qkv_bias: bool = False
    refusals: tuple[Refusal, ...] = ()
    extra_config: Mapping[str, Any] = field(default_factory=dict)

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
            for ours, theirs in _BLOCK_PREFIXES:
                if rest.startswith(ours):
                    return f"model.layers.{index}.{theirs}{rest[len(ours):]}"
        raise ValueError(f"parameter {name!r} has no Hugging Face {self.model_type} equivalent")

    def is_derived_hf_tensor(self, hf_name: str) -> bool:
        return hf_name.endswith(_DERIVED_HF_SUFFIX)

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
                not have, an activation other than silu, a rope type other than llama3/default, the family's
                own refusals, bad values).
        """
        d = config
        problems: list[str] = []
        model_type = d.get("model_type")
        if model_type != self.model_type:
            problems.append(f"model_type={model_type!r}: this reader is for {self.model_type!r}")
        for key in ("attention_bias", "mlp_bias"):
            if d.get(key):
                problems.append(f"{key}={d[key]!r}: {self.model_type} projections with biases are not supported")
        hidden_act = d.get("hidden_act", "silu")
        if hidden_act != "silu":
            problems.append(f"hidden_act={hidden_act!r}: only 'silu' is supported")
        for refusal in self.refusals:
            reason = refusal.refuse(d.get(refusal.key))
            if reason is not None:
                problems.append(f"{refusal.key}={d.get(refusal.key)!r}: {reason}")

        dim = _read_value(d, "hidden_size", int, problems)
        n_heads = _read_value(d, "num_attention_heads", int, problems)
        max_pos = _read_value(d, "max_position_embeddings", int, problems, default=2048)
        fields = dict(
            vocab_size=_read_value(d, "vocab_size", int, problems),
            dim=dim,
            n_layers=_read_value(d, "num_hidden_layers", int, problems),
            n_heads=n_heads,
            n_kv_heads=_read_value(d, "num_key_value_heads", int, problems, default=n_heads),
            intermediate_dim=_read_value(d, "intermediate_size", int, problems),
            max_seq_len=max_pos,
            norm_eps=_read_value(d, "rms_norm_eps", float, problems, default=1e-6),
            tie_embeddings=_read_value(d, "tie_word_embeddings", bool, problems, default=False),
            head_dim=_read_value(d, "head_dim", int, problems, default=None),
            attn_dropout=_read_value(d, "attention_dropout", float, problems, default=0.0),
            qkv_bias=self.qkv_bias,
        )
        fields["rope_theta"], fields["rope_scaling"] = _read_rope(d, max_pos, problems)
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
            "hidden_act": "silu",
            "max_position_embeddings": args.max_seq_len,
            "attention_dropout": args.attn_dropout,
            "dtype": str(dtype).removeprefix("torch."),
            **self.extra_config,
        })
        for key, ours in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id),
                          ("pad_token_id", pad_token_id)):
            config[key] = _merge_token_id(config.get(key), ours)
        return config

    def architecture(self, args: LlamaArgs) -> dict[str, Any]:
        if args.qkv_bias != self.qkv_bias:
            having = "has" if self.qkv_bias else "has no"
            raise ValueError(f"qkv_bias={args.qkv_bias}, but {self.model_type} {having} q/k/v projection biases")
        scaling = args.rope_scaling
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
            "rope_scaling": None if scaling is None else {"rope_type": "llama3", **dataclasses.asdict(scaling)},
            "tie_word_embeddings": args.tie_embeddings,
        }


def _merge_token_id(base: Any, ours: Any) -> Any:
    """The token id(s) to write: ``ours`` unless it is None or ``base`` already says it (equal, or a list holding
    it: the several end-of-turn ids of an instruct model's config)."""
    if ours is None or base == ours or (isinstance(base, list) and not isinstance(ours, list) and ours in base):
        return base
    return ours


def _read_value(
    d: Mapping[str, Any], key: str, kind: type, problems: list[str], default: Any = _REQUIRED, prefix: str = ""
) -> Any:
    """``d[key]`` checked to be of ``kind`` (ints accepted as floats); problems are appended, not raised."""
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
    return value


def _read_rope(
    d: Mapping[str, Any], max_position_embeddings: Optional[int], problems: list[str]
) -> tuple[Optional[float], Optional[RopeScaling]]:
    """Rope theta and scaling from either the transformers 5 form (``rope_parameters``) or the older one
    (top-level ``rope_theta`` plus ``rope_scaling``)."""
    rope_key = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
    rope = d.get(rope_key) or {}
    if not isinstance(rope, dict):
        problems.append(f"{rope_key}={rope!r}: must be an object")
        return None, None
    theta = _read_value(rope, "rope_theta", float, problems, default=None, prefix=f"{rope_key}.")
    if theta is None:
        theta = _read_value(d, "rope_theta", float, problems, default=_HF_DEFAULT_ROPE_THETA)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        problems.append(f"{rope_key}.rope_type={rope_type!r}: only 'llama3' or 'default' RoPE is supported")
        return theta, None
    prefix = f"{rope_key}."
    values = {key: _read_value(rope, key, float, problems, prefix=prefix) for key in
              ("factor", "low_freq_factor", "high_freq_factor")}
    # transformers falls back to max_position_embeddings too when this key is absent.
    original = _read_value(rope, "original_max_position_embeddings", int, problems,
                           default=max_position_embeddings, prefix=prefix)
    if None in values.values() or original is None:
        return theta, None
    return theta, RopeScaling(original_max_position_embeddings=original, **values)
