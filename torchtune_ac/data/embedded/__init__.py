"""Paths of the small dataset and tokenizer shipped with the package (made by ``scripts/make_embedded_data.py``).

``EMBEDDED_TOKENIZER_DIR`` holds ``tokenizer.json`` (byte-level BPE, 512 tokens) and ``tokenizer_config.json``
(bos ``<|begin_of_text|>``, eos ``<|end_of_text|>``, pad ``<|pad|>``, Llama-3-style chat template).
``EMBEDDED_INSTRUCT_PATH`` is a JSONL file of ~3000 Alpaca-style records with programmatically checkable answers.
``EMBEDDED_PREFERENCE_DIR`` holds preference pairs made from them (``train.jsonl``, ``validation.jsonl``: a folder
whose splits ``datasets`` names by file): the bare answer chosen, the answer in a hedge rejected; the validation
pairs hedge in words the training pairs never use.
``EMBEDDED_ADDITIONS_PATH`` is a JSONL file of the 100 additions of two digits (``prompt`` ``3+4=``, ``answer`` ``7``):
GRPO's embedded task (``tiny/grpo``).
"""

from pathlib import Path

EMBEDDED_DIR = str(Path(__file__).resolve().parent)
EMBEDDED_TOKENIZER_DIR = EMBEDDED_DIR
EMBEDDED_INSTRUCT_PATH = str(Path(EMBEDDED_DIR) / "instruct.jsonl")
EMBEDDED_PREFERENCE_DIR = str(Path(EMBEDDED_DIR) / "preference")
EMBEDDED_ADDITIONS_PATH = str(Path(EMBEDDED_DIR) / "additions.jsonl")
