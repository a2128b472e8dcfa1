"""torchtune_ac: full fine-tuning of Llama-style models with activation checkpointing done right."""

__version__ = "0.1.0"
