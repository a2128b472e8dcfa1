"""Paths of the small dataset and tokenizer shipped with the package (made by ``scripts/make_embedded_data.py``).

``EMBEDDED_TOKENIZER_DIR`` holds ``tokenizer.json`` (byte-level BPE, 512 tokens) and ``tokenizer_config.json``
(bos ``<|begin_of_text|>``, eos ``<|end_of_text|>``, pad ``<|pad|>``, Llama-3-style chat template).
``EMBEDDED_INSTRUCT_PATH`` is a JSONL file of ~3000 Alpaca-style records with programmatically checkable answers.
``EMBEDDED_PREFERENCE_DIR`` holds preference pairs made from them (``train.jsonl``, ``validation.jsonl``: a folder
whose splits ``datasets`` names by file): the bare answer chosen, the answer in a hedge rejected; the validation
pairs hedge in words the training pairs never use.
``EMBEDDED_ADDITIONS_PATH`` is a JSONL file of the 100 additions of two digits (``prompt`` ``3+4=``, ``answer`` ``7``):
GRPO's embedded task (``tiny/grpo``).
``EMBEDDED_VLM_DIR`` (made by ``scripts/make_embedded_vlm.py``) holds a tiny image-text task (``train.jsonl``,
``images/``: what colour or shape is this?), the same questions as preference pairs (``preference.jsonl``: the right
answer chosen, another colour's or shape's rejected) and a tiny Qwen2.5-VL processor (``processor/``) whose sizes are
stated below, once, so that a tiny vision model can match them.
"""

from pathlib import Path

EMBEDDED_DIR = str(Path(__file__).resolve().parent)
EMBEDDED_TOKENIZER_DIR = EMBEDDED_DIR
EMBEDDED_INSTRUCT_PATH = str(Path(EMBEDDED_DIR) / "instruct.jsonl")
EMBEDDED_PREFERENCE_DIR = str(Path(EMBEDDED_DIR) / "preference")
EMBEDDED_ADDITIONS_PATH = str(Path(EMBEDDED_DIR) / "additions.jsonl")

EMBEDDED_VLM_DIR = str(Path(EMBEDDED_DIR) / "vlm")
EMBEDDED_VLM_PROCESSOR_DIR = str(Path(EMBEDDED_VLM_DIR) / "processor")
EMBEDDED_VLM_TRAIN_PATH = str(Path(EMBEDDED_VLM_DIR) / "train.jsonl")
EMBEDDED_VLM_PREFERENCE_PATH = str(Path(EMBEDDED_VLM_DIR) / "preference.jsonl")
# The tiny processor's vision sizes (Qwen2.5-VL's own patch, merge and temporal patch sizes): a 56 x 56 image is
# 4 x 4 patches of 14 x 14 pixels (image_grid_thw [1, 4, 4]; pixel_values [16, 3 * 2 * 14 * 14 = 1176]), merged
# 2 x 2 into 4 image tokens.
EMBEDDED_VLM_PATCH_SIZE = 14
EMBEDDED_VLM_MERGE_SIZE = 2
EMBEDDED_VLM_TEMPORAL_PATCH_SIZE = 2
EMBEDDED_VLM_IMAGE_SIZE = 56
# The processor's pixel limits (Qwen's min_pixels / max_pixels): a larger image is refused unless resizing is
# allowed, and then scaled down to fit.
EMBEDDED_VLM_MIN_PIXELS = 28 * 28
EMBEDDED_VLM_MAX_PIXELS = 112 * 112
