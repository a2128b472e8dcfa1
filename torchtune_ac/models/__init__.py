"""Models: the Llama module, named builders, Hugging Face checkpoint interop and the embedded tiny checkpoint."""

from torchtune_ac.models.builders import (
    hf_config_from_llama_args,
    llama2_7b,
    llama3_1_8b,
    llama3_1_70b,
    llama3_2_1b,
    llama3_2_3b,
    llama3_8b,
    llama3_70b,
    llama_args_from_hf_config,
    llama_from_hf_config,
    llama_small,
    llama_tiny,
)
from torchtune_ac.models.embedded import ensure_embedded_checkpoint
from torchtune_ac.models.hf_interop import (
    copy_tokenizer_files,
    load_hf,
    load_hf_weights_,
    read_hf_config,
    save_hf,
    save_hf_state_dict,
)
from torchtune_ac.models.llama import Llama, LlamaArgs, RopeScaling

__all__ = [
    "Llama",
    "LlamaArgs",
    "RopeScaling",
    "copy_tokenizer_files",
    "ensure_embedded_checkpoint",
    "hf_config_from_llama_args",
    "llama2_7b",
    "llama3_1_8b",
    "llama3_1_70b",
    "llama3_2_1b",
    "llama3_2_3b",
    "llama3_8b",
    "llama3_70b",
    "llama_args_from_hf_config",
    "llama_from_hf_config",
    "llama_small",
    "llama_tiny",
    "load_hf",
    "load_hf_weights_",
    "read_hf_config",
    "save_hf",
    "save_hf_state_dict",
]
