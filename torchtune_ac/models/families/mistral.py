"""The Mistral family: the Llama decoder with a 32,768-token vocabulary (v0.3), and for Mistral 7B v0.1 a
4096-token sliding window in every layer.

v0.2 and v0.3 attend to the whole sequence (``sliding_window: null``); v0.1's config.json says
``sliding_window: 4096``, which ``from_hf_config`` and ``load_hf`` read as such.
"""

from typing import Any, Mapping

from torchtune_ac.models.decoder_family import decoder_family
from torchtune_ac.models.family import TorchtuneBuilder
from torchtune_ac.models.hf_adapter import LlamaStyleHFAdapter, read_value
from torchtune_ac.models.llama import LlamaArgs

MISTRAL_7B = LlamaArgs(vocab_size=32_768, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, intermediate_dim=14_336,
                       max_seq_len=32_768, norm_eps=1e-5, rope_theta=1_000_000.0, model_type="mistral")


# transformers' MistralConfig builds this window when config.json has no sliding_window key.
_DEFAULT_WINDOW = 4096


class MistralHFAdapter(LlamaStyleHFAdapter):
    """Mistral's config.json: ``sliding_window`` applies to every layer (null: full attention)."""

    def read_family_keys(self, config: Mapping[str, Any], problems: list[str]) -> dict[str, Any]:
        if "sliding_window" not in config:
            return {"sliding_window": _DEFAULT_WINDOW}
        return {"sliding_window": read_value(config, "sliding_window", int, problems, default=None)}

    def family_architecture(self, args: LlamaArgs) -> dict[str, Any]:
        # transformers' MistralConfig defaults to a 4096-token window: null is written for full attention.
        return {"sliding_window": args.sliding_window}


FAMILY = decoder_family(
    __name__,
    "mistral",
    MistralHFAdapter(model_type="mistral", architecture_name="MistralForCausalLM"),
    {"mistral_7b": (MISTRAL_7B, "Mistral 7B v0.3 (7,248,023,552 parameters).")},
    torchtune_builders={
        # torchtune's mistral_7b has Mistral 7B v0.1's shapes (32,000 tokens, RoPE base 10,000), ours v0.3's:
        # build whatever the checkpoint's config.json says.
        "torchtune.models.mistral.mistral_7b": TorchtuneBuilder(
            "from_hf_config",
            "torchtune's mistral_7b is Mistral 7B v0.1; from_hf_config builds the version in checkpoint_dir "
            "(v0.1 with its 4096-token sliding window, v0.2 or v0.3)",
        ),
    },
    torchtune_packages=("torchtune.models.mistral",),
)
# The builders are names of this module too (``torchtune_ac.models.families.mistral.mistral_7b``).
globals().update(FAMILY.builders)
