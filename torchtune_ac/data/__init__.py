"""Data: tokenizer, datasets (instruct / chat / text, preference pairs, image-text conversations), packing, collation and sharded batching."""

from torchtune_ac.data.chat_templates import CHAT_TEMPLATES
from torchtune_ac.data.collate import collate_batch
from torchtune_ac.data.datasets import (
    chat_dataset,
    format_alpaca_prompt,
    instruct_dataset,
    text_dataset,
    uses_chat_template,
)
from torchtune_ac.data.embedded import EMBEDDED_DIR, EMBEDDED_INSTRUCT_PATH, EMBEDDED_TOKENIZER_DIR
from torchtune_ac.data.packing import pack_samples
from torchtune_ac.data.preference import (
    PreferenceDataset,
    blank_preference_sample,
    collate_preference_batch,
    preference_dataset,
)
from torchtune_ac.data.prompts import PromptDataset, prompt_dataset
from torchtune_ac.data.sampler import ShardedBatchSampler, ShardedDataLoader, build_dataloader
from torchtune_ac.data.samples import IGNORE_INDEX, TokenizedDataset, build_sample
from torchtune_ac.data.tokenizer import Tokenizer, load_tokenizer
from torchtune_ac.data.vision import VisionDataset, collate_vision_batch, vision_dataset
from torchtune_ac.data.vision_preference import VisionPreferenceDataset, vision_preference_dataset

__all__ = [
    "CHAT_TEMPLATES",
    "EMBEDDED_DIR",
    "EMBEDDED_INSTRUCT_PATH",
    "EMBEDDED_TOKENIZER_DIR",
    "IGNORE_INDEX",
    "PreferenceDataset",
    "PromptDataset",
    "ShardedBatchSampler",
    "ShardedDataLoader",
    "TokenizedDataset",
    "Tokenizer",
    "build_dataloader",
    "blank_preference_sample",
    "build_sample",
    "chat_dataset",
    "collate_batch",
    "collate_preference_batch",
    "format_alpaca_prompt",
    "instruct_dataset",
    "load_tokenizer",
    "pack_samples",
    "preference_dataset",
    "prompt_dataset",
    "text_dataset",
    "uses_chat_template",
    "VisionDataset",
    "collate_vision_batch",
    "vision_dataset",
    "VisionPreferenceDataset",
    "vision_preference_dataset",
]
