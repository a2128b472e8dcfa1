"""Checkpoints on disk: safetensors reading (header checks, per-rank regions), Hugging Face files in tensor names
(one shard at a time for sharded models), the one atomic directory writer, recipe state for exact resume (DCP), and
the manifest that ends each checkpoint of a run (sizes and SHA-256 of its files, checked on resume).

All the file-system code and collectives of checkpointing live here, and no model family: ``torchtune_ac.models``
translates a model through its family and calls these (``load_hf``, ``save_hf``, ``hf_model_files``).
"""

from torchtune_ac.checkpoint.data_identity import describe_data_change, identify_data
from torchtune_ac.checkpoint.files import (
    agreed_free_bytes,
    check_shared_directory,
    check_writable_directory,
    read_json,
    remove_debris,
    write_directory,
)
from torchtune_ac.checkpoint.hf import (
    CONFIG_FILE,
    TOKENIZER_FILES,
    HFModelFiles,
    copy_tokenizer_files,
    load_hf_tensors_,
    read_hf_config,
    save_hf_files,
    write_hf_files,
)
from torchtune_ac.checkpoint.manifest import MANIFEST_FILE
from torchtune_ac.checkpoint.output_lock import (
    OUTPUT_LOCK_FILE,
    LockHolder,
    create_output_dir,
    hold_output_dir,
    read_lock,
)
from torchtune_ac.checkpoint.recipe_state import (
    LATEST_POINTER,
    MERGED_DIR,
    RECIPE_STATE_DIR,
    RESUMABLE_KEPT,
    TRAINER_STATE_FILE,
    Progress,
    ResumeChoice,
    RunShape,
    RecipeState,
    check_resume_shape,
    choose_resume_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_trainer_state,
    resolve_hf_checkpoint,
    save_checkpoint,
)
from torchtune_ac.checkpoint.safetensors_io import INDEX_FILE, WEIGHTS_FILE, local_region, parse_shard_size

__all__ = [
    "CONFIG_FILE",
    "HFModelFiles",
    "INDEX_FILE",
    "LATEST_POINTER",
    "LockHolder",
    "MERGED_DIR",
    "MANIFEST_FILE",
    "OUTPUT_LOCK_FILE",
    "RECIPE_STATE_DIR",
    "RESUMABLE_KEPT",
    "TOKENIZER_FILES",
    "TRAINER_STATE_FILE",
    "WEIGHTS_FILE",
    "Progress",
    "ResumeChoice",
    "RunShape",
    "RecipeState",
    "agreed_free_bytes",
    "check_resume_shape",
    "check_shared_directory",
    "check_writable_directory",
    "choose_resume_checkpoint",
    "copy_tokenizer_files",
    "create_output_dir",
    "describe_data_change",
    "hold_output_dir",
    "identify_data",
    "list_checkpoints",
    "load_checkpoint",
    "load_hf_tensors_",
    "local_region",
    "parse_shard_size",
    "read_hf_config",
    "read_json",
    "read_lock",
    "read_trainer_state",
    "remove_debris",
    "resolve_hf_checkpoint",
    "save_checkpoint",
    "save_hf_files",
    "write_directory",
    "write_hf_files",
]
