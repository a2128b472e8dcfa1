"""Generate the tiny image-text task and processor that ship in ``torchtune_ac/data/embedded/vlm/``.

    python scripts/make_embedded_vlm.py                  # rewrite the committed files
    python scripts/make_embedded_vlm.py --out-dir /tmp/x   # write elsewhere (the tests compare the two)

Outputs (sizes and token ids are stated in ``torchtune_ac/data/embedded/__init__.py``):
    processor/     a Qwen2.5-VL processor built from transformers' own classes (``Qwen2VLImageProcessorPil``, no
                   torchvision; the embedded byte-level BPE tokenizer plus Qwen's chat and vision tokens; a
                   Qwen-VL-style chat template with ``{% generation %}`` markers)
    images/        one small PNG per coloured shape (a circle, square or triangle in one of four colours)
    train.jsonl    conversations in TRL's layout: ``images`` (paths relative to the file) and ``messages`` whose
                   user turn holds an ``{"type": "image"}`` part; the assistant names the colour, the shape or both
    preference.jsonl  the same questions as preference pairs in TRL's vision layout (``images``, ``prompt``,
                   ``chosen``, ``rejected``): the right answer chosen, the next colour's or shape's rejected

Everything is derived from fixed seeds, so running the script twice gives byte-identical files.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from PIL import Image, ImageDraw
from tokenizers import AddedToken, Tokenizer

from torchtune_ac.data import embedded

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 60, 220), "yellow": (230, 210, 30)}
SHAPES = ("circle", "square", "triangle")
VARIANTS = 4  # images per (colour, shape): the shape's size and place vary
QUESTIONS = (("What colour is the shape?", "{colour}"), ("What shape is this?", "{shape}"),
             ("Describe the image.", "a {colour} {shape}"))
# Qwen2.5-VL's chat and vision tokens, added to the embedded tokenizer in this order.
SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                  "<|video_pad|>")
# Qwen-VL's turn layout; the assistant's reply and its end of turn inside {% generation %} (what TRL's and
# transformers' assistant masks read).
CHAT_TEMPLATE = (
    "{%- macro render(content) %}{%- if content is string %}{{- content }}{%- else %}{%- for part in content %}"
    "{%- if part['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}{%- endfor %}{%- endif %}{%- endmacro %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- render(message['content']) + '<|im_end|>\\n' }}{%- endgeneration %}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + render(message['content']) + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def draw_shape(colour: tuple[int, int, int], shape: str, rng: random.Random) -> Image.Image:
    """A white square image of ``EMBEDDED_VLM_IMAGE_SIZE`` pixels with one filled shape on it."""
    size = embedded.EMBEDDED_VLM_IMAGE_SIZE
    image = Image.new("RGB", (size, size), (255, 255, 255))
    extent = rng.randint(size // 2, size - 8)
    left, top = rng.randint(2, size - extent - 2), rng.randint(2, size - extent - 2)
    box = (left, top, left + extent, top + extent)
    draw = ImageDraw.Draw(image)
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    else:
        draw.polygon([(left + extent // 2, top), (left, top + extent), (left + extent, top + extent)], fill=colour)
    return image


def write_processor(out_dir: Path) -> None:
    """The tiny Qwen2.5-VL processor's files: transformers' own classes, configured small (written part by part:
    without torchvision, transformers cannot build the processor's video half to save it whole)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    folder = out_dir / "processor"
    backend = Tokenizer.from_file(str(Path(embedded.EMBEDDED_TOKENIZER_DIR) / "tokenizer.json"))
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS])
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|pad|>",
                            model_max_length=2048).save_pretrained(str(folder))
    Qwen2VLImageProcessorPil(
        patch_size=embedded.EMBEDDED_VLM_PATCH_SIZE, merge_size=embedded.EMBEDDED_VLM_MERGE_SIZE,
        temporal_patch_size=embedded.EMBEDDED_VLM_TEMPORAL_PATCH_SIZE,
        min_pixels=embedded.EMBEDDED_VLM_MIN_PIXELS, max_pixels=embedded.EMBEDDED_VLM_MAX_PIXELS,
    ).save_pretrained(str(folder))
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2_5_VLProcessor"}, indent=2)
                                                  + "\n")


def write_task(out_dir: Path) -> None:
    """The shapes' images and one conversation per (image, question)."""
    rng = random.Random(0)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    records, pairs = [], []
    for colour, rgb in COLOURS.items():
        for shape in SHAPES:
            for variant in range(VARIANTS):
                name = f"images/{colour}_{shape}_{variant}.png"
                draw_shape(rgb, shape, rng).save(out_dir / name, optimize=True)
                question, answer = QUESTIONS[(variant + SHAPES.index(shape)) % len(QUESTIONS)]
                user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}
                records.append({"images": [name], "messages": [user, reply(answer, colour, shape)]})
                colours = list(COLOURS)  # rejected: the next colour and the next shape, where the answer names them
                wrong = (colours[(colours.index(colour) + 1) % len(colours)], SHAPES[(SHAPES.index(shape) + 1) % 3])
                pairs.append({"images": [name], "prompt": [user], "chosen": [reply(answer, colour, shape)],
                              "rejected": [reply(answer, *wrong)]})
    rng.shuffle(records)
    random.Random(1).shuffle(pairs)  # its own generator: train.jsonl stays as it was
    for file, rows in (("train.jsonl", records), ("preference.jsonl", pairs)):
        with open(out_dir / file, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)


def reply(answer: str, colour: str, shape: str) -> dict:
    """The assistant's turn answering with ``answer`` (a ``QUESTIONS`` template) for this colour and shape."""
    return {"role": "assistant", "content": [{"type": "text", "text": answer.format(colour=colour, shape=shape)}]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=embedded.EMBEDDED_VLM_DIR)
    out_dir = Path(parser.parse_args().out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_processor(out_dir)
    write_task(out_dir)


if __name__ == "__main__":
    main()
