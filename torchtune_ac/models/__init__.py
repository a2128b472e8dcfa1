"""Models: the Llama decoder, the model families built on it (their builders and pure Hugging Face adapters),
the family interface generic code goes through, and Hugging Face checkpoints of any family.

Each family's builders (``llama3_8b``, ``qwen2_5_7b``, ...) and its ``ModelFamily`` (``LLAMA``, ``QWEN2``, ...:
the family's name in capitals) are exported here from the family modules found under ``models/families/``, so a
new family needs no line here.
"""

from torchtune_ac.models.families import (
    FAMILIES,
    args_from_hf_config,
    family_for_hf_config,
    family_of,
    model_from_hf_config,
    transformer_blocks,
)
from torchtune_ac.models.family import HFAdapter, ModelFamily, TorchtuneBuilder
from torchtune_ac.models.hf_checkpoint import (
    check_checkpoint_matches,
    check_checkpoint_tensors,
    from_hf_config,
    hf_model_files,
    llama_from_hf_config,
    load_hf,
    load_hf_weights_,
    read_hf_args,
    save_hf,
    save_hf_state_dict,
    stored_layout,
    stored_tensor_problems,
)
from torchtune_ac.models.llama import LinearRopeScaling, Llama, LlamaArgs, LongRopeScaling, RopeScaling

__all__ = [
    "FAMILIES",
    "HFAdapter",
    "LinearRopeScaling",
    "Llama",
    "LlamaArgs",
    "LongRopeScaling",
    "ModelFamily",
    "RopeScaling",
    "TorchtuneBuilder",
    "args_from_hf_config",
    "check_checkpoint_matches",
    "check_checkpoint_tensors",
    "family_for_hf_config",
    "family_of",
    "from_hf_config",
    "hf_model_files",
    "llama_from_hf_config",
    "load_hf",
    "load_hf_weights_",
    "model_from_hf_config",
    "read_hf_args",
    "save_hf",
    "save_hf_state_dict",
    "stored_layout",
    "stored_tensor_problems",
    "transformer_blocks",
]

for _family in FAMILIES:
    globals()[_family.name.upper()] = _family
    globals().update(_family.builders)
    __all__ += [_family.name.upper(), *_family.builders]
del _family
