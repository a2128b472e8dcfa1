"""Checkpoints on disk: safetensors reading (header checks, per-rank regions), Hugging Face load and save (one
shard at a time for sharded models), the one atomic directory writer, recipe state for exact resume (DCP), and the
manifest that ends each checkpoint of a run (sizes and SHA-256 of its files, checked on resume).

All the file-system code and collectives of checkpointing live here; ``torchtune_ac.models`` holds neither.
"""

from torchtune_ac.checkpoint.files import (
    check_shared_directory,
    check_writable_directory,
    read_json,
    remove_debris,
    write_directory,
)
from torchtune_ac.checkpoint.hf import (
    CONFIG_FILE,
    TOKENIZER_FILES,
    check_checkpoint_matches,
    copy_tokenizer_files,
    from_hf_config,
    llama_from_hf_config,
    load_hf,
    load_hf_weights_,
    read_hf_args,
    read_hf_config,
    save_hf,
    save_hf_state_dict,
    write_hf_files,
)
from torchtune_ac.checkpoint.manifest import MANIFEST_FILE
from torchtune_ac.checkpoint.output_lock import OUTPUT_LOCK_FILE, LockHolder, hold_output_dir, read_lock
from torchtune_ac.checkpoint.recipe_state import (
    LATEST_POINTER,
    RECIPE_STATE_DIR,
    RESUMABLE_KEPT,
    TRAINER_STATE_FILE,
    Progress,
    ResumeChoice,
    RunShape,
    check_resume_shape,
    choose_resume_checkpoint,
    create_output_dir,
    list_checkpoints,
    load_checkpoint,
    read_trainer_state,
    resolve_hf_checkpoint,
    save_checkpoint,
)
from torchtune_ac.checkpoint.safetensors_io import INDEX_FILE, WEIGHTS_FILE, local_region, parse_shard_size

__all__ = [
    "CONFIG_FILE",
    "INDEX_FILE",
    "LATEST_POINTER",
    "LockHolder",
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
    "check_checkpoint_matches",
    "check_resume_shape",
    "check_shared_directory",
    "check_writable_directory",
    "choose_resume_checkpoint",
    "copy_tokenizer_files",
    "create_output_dir",
    "from_hf_config",
    "hold_output_dir",
    "list_checkpoints",
    "llama_from_hf_config",
    "load_checkpoint",
    "load_hf",
    "load_hf_weights_",
    "local_region",
    "parse_shard_size",
    "read_hf_args",
    "read_hf_config",
    "read_json",
    "read_lock",
    "read_trainer_state",
    "remove_debris",
    "resolve_hf_checkpoint",
    "save_checkpoint",
    "save_hf",
    "save_hf_state_dict",
    "write_directory",
    "write_hf_files",
]
