"""Paths of the small dataset and tokenizer shipped with the package (made by ``scripts/make_embedded_data.py``).

``EMBEDDED_TOKENIZER_DIR`` holds ``tokenizer.json`` (byte-level BPE, 512 tokens) and ``tokenizer_config.json``
(bos ``<|begin_of_text|>``, eos ``<|end_of_text|>``, pad ``<|pad|>``, Llama-3-style chat template).
``EMBEDDED_INSTRUCT_PATH`` is a JSONL file of ~3000 Alpaca-style records with programmatically checkable answers.
"""

from pathlib import Path

EMBEDDED_DIR = str(Path(__file__).resolve().parent)
EMBEDDED_TOKENIZER_DIR = EMBEDDED_DIR
EMBEDDED_INSTRUCT_PATH = str(Path(EMBEDDED_DIR) / "instruct.jsonl")
