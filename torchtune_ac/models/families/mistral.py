"""The Mistral family: Mistral 7B v0.3, the Llama decoder with a 32,768-token vocabulary and no sliding window.

Mistral 7B v0.1 attends within a 4096-token sliding window; v0.2 and v0.3 attend to the whole sequence
(``sliding_window: null``), which is what is supported here.
"""

from torchtune_ac.models.decoder_family import decoder_family
from torchtune_ac.models.family import TorchtuneBuilder
from torchtune_ac.models.hf_adapter import LlamaStyleHFAdapter, Refusal, refuse_unless
from torchtune_ac.models.llama import LlamaArgs

MISTRAL_7B = LlamaArgs(vocab_size=32_768, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, intermediate_dim=14_336,
                       max_seq_len=32_768, norm_eps=1e-5, rope_theta=1_000_000.0, model_type="mistral")

FAMILY = decoder_family(
    __name__,
    "mistral",
    LlamaStyleHFAdapter(
        model_type="mistral",
        architecture_name="MistralForCausalLM",
        refusals=(
            Refusal("sliding_window", refuse_unless(
                (None,), "sliding-window attention is not supported (Mistral 7B v0.2 and later have none)")),
        ),
        # transformers' MistralConfig defaults to a 4096-token window; null builds full attention, as ours.
        extra_config={"sliding_window": None},
    ),
    {"mistral_7b": (MISTRAL_7B, "Mistral 7B v0.3 (7,248,023,552 parameters).")},
    torchtune_builders={
        # torchtune's mistral_7b has Mistral 7B v0.1's shapes (32,000 tokens, RoPE base 10,000), ours v0.3's:
        # build whatever the checkpoint's config.json says (v0.2 and v0.3 load; v0.1's sliding window is refused).
        "torchtune.models.mistral.mistral_7b": TorchtuneBuilder(
            "from_hf_config",
            "torchtune's mistral_7b is Mistral 7B v0.1; from_hf_config builds the version in checkpoint_dir "
            "(v0.2 and v0.3 are supported; v0.1's sliding window is not)",
        ),
    },
)
# The builders are names of this module too (``torchtune_ac.models.families.mistral.mistral_7b``).
globals().update(FAMILY.builders)
