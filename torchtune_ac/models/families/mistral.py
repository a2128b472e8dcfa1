"""The Mistral family: Mistral 7B v0.3, the Llama decoder with a 32,768-token vocabulary and no sliding window.

Mistral 7B v0.1 attends within a 4096-token sliding window; v0.2 and v0.3 attend to the whole sequence
(``sliding_window: null``), which is what is supported here.
"""

from torchtune_ac.component_marker import config_component
from torchtune_ac.models.families.common import build_published, llama_style_family
from torchtune_ac.models.hf_adapter import LlamaStyleHFAdapter, Refusal, refuse_unless
from torchtune_ac.models.llama import Llama, LlamaArgs


class Mistral(Llama):
    """A Mistral model: the Llama decoder (a class of its own so that generic code finds its family, and with
    it the Hugging Face ``mistral`` layout)."""


MISTRAL_7B = LlamaArgs(vocab_size=32_768, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, intermediate_dim=14_336,
                       max_seq_len=32_768, norm_eps=1e-5, rope_theta=1_000_000.0)


@config_component
def mistral_7b(*, attn_dropout: float = 0.0, resid_dropout: float = 0.0, max_seq_len: int | None = None) -> Mistral:
    """Mistral 7B v0.3 (7,248,023,552 parameters)."""
    return build_published(Mistral, "mistral_7b", MISTRAL_7B, attn_dropout=attn_dropout, resid_dropout=resid_dropout,
                           max_seq_len=max_seq_len)


MISTRAL = llama_style_family(
    "mistral",
    Mistral,
    {"mistral_7b": mistral_7b},
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
)
