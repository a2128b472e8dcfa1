"""Low-rank adapters (LoRA, DoRA) and QLoRA's NF4 base: one mechanism, one slot in the written order
(``run/assemble.py``), configured by the ``adapter:`` section (``config.py``) and saved in PEFT's format."""
