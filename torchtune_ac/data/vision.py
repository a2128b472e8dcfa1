"""Image-text chat data: records with images, preprocessed by the model's own transformers processor.

API (what the run uses):
    processor = load_vision_processor(path)          # AutoProcessor; image-only where torchvision is missing
    dataset = build_vision_dataset(source, processor, max_seq_len=..., resize_images=False, packed=False)
    batch = collate_vision_batch(samples, pad_id=processor.tokenizer.pad_token_id)

A record holds ``messages`` (``{"role", "content"}``; content a string or a list of ``{"type": "text"|"image"}``
parts, as TRL and the HF processors write them) and, unless every image part carries its own (``"image"``,
``"path"`` or ``"url"`` key), an ``images`` column (or ``image``, one) filling the parts in order. A string content
marks images with ``<image>``. An image is a path (relative to the dataset file), ``bytes``, a datasets ``Image``
cell (``{"bytes", "path"}``) or a PIL image. The processor (``apply_chat_template``) makes the tokens and the image
tensors; nothing here resizes or normalizes an image.

A sample is ``tokens``, ``labels`` (shifted as in ``samples.py``: the next token where it belongs to an
assistant turn, else ``IGNORE_INDEX``), the processor's per-token outputs as lists (``mm_token_type_ids``) and its
image tensors as it returns them (Qwen2.5-VL: ``pixel_values[n_patches, 3 * t * p * p]``, ``image_grid_thw
[n_images, 3]``; Gemma 3: ``pixel_values[n_images, 3, size, size]``). A sample longer than ``max_seq_len`` is dropped (truncation would cut an image's tokens, or the
answer), counted in ``dataset.report``, which the run logs once. Packed samples add ``document_ids`` (positions,
multimodal RoPE's included, restart at each document) and concatenate their documents' image tensors in order.
"""

from __future__ import annotations

import functools
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch
from torch.utils.data import Dataset

from torchtune_ac.component_marker import config_component
from torchtune_ac.data.collate import collate_batch
from torchtune_ac.data.embedded import EMBEDDED_VLM_TRAIN_PATH
from torchtune_ac.data.records import Record
from torchtune_ac.data.samples import IGNORE_INDEX, PackingReport, count_of
from torchtune_ac.data.datasets import Sources, register_preparer
from torchtune_ac.data.sources import load_records, source_files
from torchtune_ac.data.tokenizer import Tokenizer
from torchtune_ac.errors import UnavailableError, UserError

IMAGE_PLACEHOLDER = "<image>"
# Processor outputs the sample rebuilds itself (from the tokens) rather than keeping.
_REBUILT_KEYS = ("input_ids", "attention_mask")
# What the processor is asked for besides its outputs: where each token's characters are in the text it tokenized,
# and where it replaced the images' placeholders (``mark_assistant_tokens``).
_OFFSET_KWARGS = {"return_offsets_mapping": True, "return_text_replacement_offsets": True}


def load_vision_processor(path: str) -> Any:
    """The model's transformers processor from a local folder (``AutoProcessor``).

    Without torchvision, transformers cannot build a Qwen-VL processor's video processor; the same processor class
    is then built without it (images and text only, the image processor's PIL backend).

    Raises:
        UserError: the folder is missing or holds no processor (``UnavailableError`` when it is missing).
    """
    import transformers

    if not Path(path).expanduser().is_dir():
        raise UnavailableError(f"{path}: no such processor folder")
    try:
        return transformers.AutoProcessor.from_pretrained(path)
    except ImportError as err:
        if "Torchvision" not in str(err):
            raise
    except (OSError, ValueError) as err:
        raise UserError(f"{path}: no transformers processor there ({err})") from None
    # Where transformers writes the processor's class: processor_config.json, older checkpoints the other two.
    names = [json.loads(file.read_text()).get("processor_class") for file in
             (Path(path) / name for name in ("processor_config.json", "preprocessor_config.json",
                                             "tokenizer_config.json")) if file.is_file()]
    name = next((name for name in names if name), None)
    if name is None or not hasattr(transformers, name):
        raise UserError(f"{path}: the processor's class ({name}) needs torchvision, which is not installed")
    processor_class = getattr(transformers, name)

    def init(self: Any, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None,
             **kwargs: Any) -> None:
        processor_class.__init__(self, image_processor=image_processor, tokenizer=tokenizer,
                                 chat_template=chat_template, **kwargs)

    image_only = type(processor_class.__name__, (processor_class,), {"__init__": init})
    return image_only.from_pretrained(path)


def open_image(image: Any, *, base_dir: Path, location: str) -> Any:
    """A loaded PIL image from a path, bytes, a datasets ``Image`` cell or a PIL image.

    Raises:
        UserError: naming the record and the file when it does not open.
    """
    from PIL import Image

    if isinstance(image, Image.Image):
        return image
    if isinstance(image, dict):
        image = image.get("bytes") or image.get("path")
    if isinstance(image, (bytes, bytearray)):
        name, opener = "the image bytes", lambda: Image.open(io.BytesIO(image))
    elif isinstance(image, str):
        file = Path(image).expanduser()
        file = file if file.is_absolute() else base_dir / file
        name, opener = str(file), lambda: Image.open(file)
    else:
        raise UserError(f"{location}: an image must be a path, bytes or a PIL image, got {type(image).__name__}")
    try:
        opened = opener()
        opened.load()
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        raise UserError(f"{location}: image {name} does not open ({err})") from None
    return opened


def max_pixels_of(processor: Any) -> Optional[int]:
    """The most pixels an image may have before the processor scales it down (Qwen-VL's ``max_pixels``), or None."""
    size = getattr(processor.image_processor, "size", None) or {}
    limit = size.get("longest_edge") if isinstance(size, dict) else getattr(size, "longest_edge", None)
    return getattr(processor.image_processor, "max_pixels", None) or limit


def prepare_messages(record: dict[str, Any], *, base_dir: Path, location: str, max_pixels: Optional[int],
                     resize_images: bool) -> list[dict[str, Any]]:
    """The record's conversation as structured parts, each image part holding its opened image.

    Raises:
        UserError: no ``messages``; more image placeholders than images or fewer; an image that does not open; an
            image over ``max_pixels`` without ``resize_images``.
    """
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{location}: an image-text record needs a non-empty 'messages' list")
    images = record.get("images", [record["image"]] if record.get("image") is not None else [])
    images = list(images) if images is not None else []
    prepared, placeholders = [], 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            pieces = content.split(IMAGE_PLACEHOLDER)
            parts = [{"type": "text", "text": pieces[0]}] if pieces[0] else []
            for piece in pieces[1:]:
                parts.append({"type": "image"})
                parts.extend([{"type": "text", "text": piece}] if piece else [])
        elif isinstance(content, list):
            parts = [dict(part) for part in content]
        else:
            raise UserError(f"{location}: message content must be a string or a list of parts")
        for part in parts:
            if part.get("type") != "image":
                continue
            given = next((part.pop(key) for key in ("image", "path", "url") if part.get(key) is not None), None)
            if given is None:
                placeholders += 1
                if placeholders > len(images):
                    continue  # counted, refused below with the total
                given = images[placeholders - 1]
            part["image"] = open_image(given, base_dir=base_dir, location=location)
            pixels = part["image"].width * part["image"].height
            if max_pixels is not None and pixels > max_pixels and not resize_images:
                shown = f" {given}" if isinstance(given, str) else ""
                width, height = part["image"].size
                raise UserError(f"{location}: image{shown} is {width}x{height} = {pixels:,} pixels, over the "
                                f"processor's limit of {max_pixels:,} (max_pixels); set resize_images: true to let "
                                "the processor scale it down, or resize the image")
        prepared.append({**message, "content": parts})
    if placeholders != len(images):
        raise UserError(f"{location}: {count_of(placeholders, 'image placeholder')} but "
                        f"{count_of(len(images), 'image')}; each image needs one {{\"type\": \"image\"}} part (or "
                        f"{IMAGE_PLACEHOLDER} in a string content) where it goes in the conversation")
    return prepared


def mark_assistant_tokens(processor: Any, messages: list[dict[str, Any]], offsets: list[tuple[int, int]],
                          replacements: list[dict[str, Any]], location: str) -> list[bool]:
    """Whether each of the processor's tokens belongs to an assistant turn.

    An assistant turn's characters are found as in ``tokenizer.py``: the rendering up to the turn with the
    generation prompt, then through the turn. The processor tokenizes that rendering with each image's placeholder
    replaced (a run of image tokens; Gemma 3's adds its begin and end tokens and newlines): each token's characters
    there (``offsets``) are moved back by the replacements before them (``replacements``, the processor's
    ``text_replacement_offsets``); a token inside a replacement belongs to the image.

    Raises:
        UserError: the template is not prefix stable.
    """
    def render(turns: list[dict[str, Any]], generation_prompt: bool) -> str:
        return processor.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation_prompt)

    text = render(messages, False)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = render(messages[:index], True), render(messages[:index + 1], False)
        if not (through.startswith(before) and text.startswith(through)):
            raise UserError(f"{location}: the processor's chat template is not prefix stable, so assistant turns "
                            "cannot be located for the loss")
        spans.append((len(before), len(through)))
    marks = []
    for start, end in offsets:
        shift, in_image = 0, False
        for replacement in replacements:
            (old_start, old_end), (new_start, new_end) = replacement["span"], replacement["new_span"]
            if start >= new_end:
                shift += (new_end - new_start) - (old_end - old_start)
            elif end > new_start:
                in_image = True
        marks.append(not in_image and any(start - shift < end_ and end - shift > start_ for start_, end_ in spans))
    return marks


def process_vision_record(record: Record, processor: Any, *, base_dir: Path, resize_images: bool = False
                          ) -> Optional[dict[str, Any]]:
    """One record as a sample (see the module docstring), or None when it has no assistant token to train on.

    Raises:
        UserError: as ``prepare_messages`` and ``mark_assistant_tokens``.
    """
    if not isinstance(record.value, dict):
        raise UserError(f"{record.location}: an image-text record must be a JSON object")
    messages = prepare_messages(record.value, base_dir=base_dir, location=record.location,
                                max_pixels=max_pixels_of(processor), resize_images=resize_images)
    output = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt",
                                           processor_kwargs=_OFFSET_KWARGS)
    tokens = output["input_ids"][0].tolist()
    offsets = [tuple(offset) for offset in output.pop("offset_mapping")[0].tolist()]
    trainable = mark_assistant_tokens(processor, messages, offsets, output.pop("text_replacement_offsets")[0],
                                      record.location)
    if not any(trainable[1:]):
        return None
    labels = [token if target else IGNORE_INDEX for token, target in zip(tokens[1:], trainable[1:])]
    sample: dict[str, Any] = {"tokens": tokens, "labels": labels + [IGNORE_INDEX]}
    for key, value in output.items():
        if key in _REBUILT_KEYS:
            continue
        per_token = isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape == (1, len(tokens))
        sample[key] = value[0].tolist() if per_token and key != "pixel_values" else value
    return sample


class VisionDataset(Dataset):
    """Image-text samples in memory (image tensors included); ``report`` says what building it dropped, once."""

    def __init__(self, samples: list[dict[str, Any]], *, report: Optional[str] = None,
                 packing: Optional[PackingReport] = None, padding_free: bool = False) -> None:
        self.samples = samples
        self.report = report
        self.packing = packing
        # Its batches one row of documents, no padding between them (``collate_vision_batch``; ``Batching.collate_of``).
        self.padding_free = padding_free
        # Where it was read from (set by ``vision_dataset``): the source as messages name it, and its local files.
        self.source: Optional[str] = None
        self.source_files: Optional[Any] = None

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.samples[index]


def images_folder(source: str | list[str]) -> Path:
    """The folder image paths are relative to: a file source's folder (the first source's), or the folder itself."""
    first = Path(source[0] if isinstance(source, list) else source).expanduser()
    return first.parent if first.is_file() else first


def process_records(source: str | list[str], process: Callable[[Record, Path], Optional[dict[str, Any]]], *,
                    length: Callable[[dict[str, Any]], int], max_seq_len: int, drop_long_samples: bool, split: str,
                    unit: str, sample: str, counted: str, cut: str, records: Optional[list[Record]] = None
                    ) -> tuple[list[dict[str, Any]], Optional[str]]:
    """Every record of ``source`` processed in order, before any weight loads; image paths are relative to a file
    source's folder.

    Args:
        process: ``(record, base_dir) -> sample``; None: a record with no assistant turn, dropped with a count.
        records: ``source``'s records when they are read already (``load_records(source, split=split)``).
        length: a sample's length in tokens; one over ``max_seq_len`` is dropped with a count, or refused.
        unit, sample, counted, cut: the messages' words: what a record is (``pair``), what a sample is, what its
            length counts, and what truncation would cut besides an image.

    Returns:
        The samples, and the report of what was dropped (``data <source>: ...``), or None.

    Raises:
        UserError: a sample over ``max_seq_len`` without ``drop_long_samples``, or no sample left.
    """
    records = load_records(source, split=split) if records is None else records
    first = source[0] if isinstance(source, list) else source
    base_dir = images_folder(source)
    samples, untrained, too_long = [], 0, 0
    for record in records:
        processed = process(record, base_dir)
        if processed is None:
            untrained += 1
        elif length(processed) <= max_seq_len:
            samples.append(processed)
        elif drop_long_samples:
            too_long += 1
        else:
            raise UserError(f"{record.location}: the {sample} is {length(processed):,} tokens ({counted}), more than "
                            f"max_seq_len={max_seq_len}, and is not truncated through its images; raise max_seq_len, "
                            "use smaller images, or allow dropping")
    parts = []
    if too_long:
        parts.append(f"{too_long:,} of {count_of(len(records), unit)} "
                     f"{'is' if too_long == 1 else 'are'} longer than max_seq_len={max_seq_len} and "
                     f"{'was' if too_long == 1 else 'were'} dropped (truncation would cut an image or {cut})")
    if untrained:
        parts.append(f"{count_of(untrained, 'record')} with no assistant turn dropped")
    if not samples:
        raise UserError(f"data {first}: no {sample} left to train on ({'; '.join(parts)})")
    return samples, f"data {first}: " + "; ".join(parts) if parts else None


def build_vision_dataset(source: str | list[str], processor: Any, *, max_seq_len: int, resize_images: bool = False,
                         drop_long_samples: bool = True, packed: bool = False, padding_free: bool = False,
                         split: str = "train", records: Optional[list[Record]] = None) -> VisionDataset:
    """Read, check and process every record, before any weight loads.

    Args:
        source: What ``sources.load_records`` reads; image paths are relative to a file source's folder.
        processor: From ``load_vision_processor``.
        max_seq_len: Longest sample (and packed row) in tokens, image tokens included.
        resize_images: Let the processor scale down images over its pixel limit (else they are refused).
        drop_long_samples: Drop samples longer than ``max_seq_len`` with a count (else refuse the first).
        packed: Pack samples into rows of ``max_seq_len`` tokens, each sample a document.
        padding_free: Unpacked, each batch's samples the documents of one row (``collate_vision_batch``).
        split: Split of a folder or Hub dataset.
        records: ``source``'s records when they are read already (``load_records(source, split=split)``).

    Raises:
        UserError: a bad record (see ``prepare_messages``), a sample that cannot fit without
            ``drop_long_samples``, or no sample left.
    """
    samples, report = process_records(
        source, lambda record, base_dir: process_vision_record(record, processor, base_dir=base_dir,
                                                               resize_images=resize_images),
        length=lambda sample: len(sample["tokens"]), max_seq_len=max_seq_len, drop_long_samples=drop_long_samples,
        split=split, unit="record", sample="sample", counted="image tokens included", cut="the answer",
        records=records)
    if not packed:
        return VisionDataset(samples, report=report, padding_free=padding_free)
    pad_id = processor.tokenizer.pad_token_id
    rows = pack_vision_samples(samples, max_seq_len=max_seq_len, pad_id=pad_id)
    packing = PackingReport(samples=len(samples), rows=len(rows), tokens=sum(len(s["tokens"]) for s in samples),
                            max_seq_len=max_seq_len)
    return VisionDataset(rows, report=report, packing=packing)


def _is_per_token(sample: dict[str, Any], key: str) -> bool:
    return isinstance(sample[key], list)


def pack_vision_samples(samples: Iterable[dict[str, Any]], *, max_seq_len: int, pad_id: int
                        ) -> list[dict[str, Any]]:
    """Pack samples whole, in order, into rows of exactly ``max_seq_len`` tokens, each sample a document.

    A row's ``document_ids`` are 0, 1, ... per document and one more for the padding tail (as ``packing.py``);
    its per-token lists are concatenated (padding 0) and its image tensors concatenated along dim 0, in order.

    Raises:
        ValueError: a sample longer than ``max_seq_len``.
    """
    rows: list[dict[str, Any]] = []
    current: list[dict[str, Any]] = []

    def close_row() -> None:
        row: dict[str, Any] = {"tokens": [], "labels": [], "document_ids": []}
        for document, sample in enumerate(current):
            for key, value in sample.items():
                if key == "labels" or _is_per_token(sample, key):
                    row.setdefault(key, []).extend(value)
                else:
                    row.setdefault(key, []).append(value)
            row["document_ids"].extend([document] * len(sample["tokens"]))
        pad = max_seq_len - len(row["tokens"])
        for key, value in row.items():
            if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
                row[key] = torch.cat(value)
            elif key == "labels":
                value.extend([IGNORE_INDEX] * pad)
            elif key == "document_ids":
                value.extend([len(current)] * pad)
            else:
                value.extend([pad_id if key == "tokens" else 0] * pad)
        rows.append(row)
        current.clear()

    used = 0
    for sample in samples:
        length = len(sample["tokens"])
        if length > max_seq_len:
            raise ValueError(f"sample of {length} tokens does not fit max_seq_len={max_seq_len}")
        if used + length > max_seq_len:
            close_row()
            used = 0
        current.append(sample)
        used += length
    if current:
        close_row()
    return rows


def collate_vision_batch(samples: list[dict[str, Any]], *, pad_id: int, pad_to_multiple_of: int = 1,
                         max_length: Optional[int] = None, padding_free: bool = False) -> dict[str, torch.Tensor]:
    """``collate.collate_batch`` for the tokens, plus the processor's outputs.

    With ``padding_free``, unpacked samples are the documents of one row, one after the other
    (``pack_vision_samples``): the model computes nothing for padding but the tail that rounds the row up to
    ``pad_to_multiple_of``, and the loss sums the same targets (attention and positions restart at each document).

    Returns:
        What ``collate_batch`` returns, plus each per-token key as ``LongTensor[b, s]`` (padded with 0) and each
        image tensor concatenated along dim 0 over the batch in sample order (a text-only batch has none).
    """
    if padding_free and not any("document_ids" in sample for sample in samples):
        length = sum(len(sample["tokens"]) for sample in samples)
        length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
        samples = pack_vision_samples(samples, max_seq_len=length, pad_id=pad_id)  # one row
    batch = collate_batch(samples, pad_id=pad_id, pad_to_multiple_of=pad_to_multiple_of, max_length=max_length)
    length = batch["tokens"].shape[1]
    keys = dict.fromkeys(key for sample in samples for key in sample if key not in batch)
    for key in keys:
        present = [sample for sample in samples if key in sample]
        if _is_per_token(present[0], key):
            batch[key] = torch.zeros((len(samples), length), dtype=torch.long)
            for row, sample in enumerate(samples):
                values = sample.get(key, [])
                batch[key][row, :len(values)] = torch.tensor(values, dtype=torch.long)
        else:
            batch[key] = torch.cat([sample[key] for sample in present])
    return batch


@config_component
def vision_dataset(
    tokenizer: Tokenizer,
    *,
    source: Sources = EMBEDDED_VLM_TRAIN_PATH,
    processor: Optional[str] = None,
    max_seq_len: Optional[int] = None,
    packed: bool = False,
    padding_free: bool = False,
    resize_images: bool = False,
    drop_long_samples: bool = True,
    split: str = "train",
) -> VisionDataset:
    """Image-text conversations (see the module docstring), processed by the model's transformers processor.

    Args:
        tokenizer: From :func:`load_tokenizer` (its folder holds the processor unless ``processor`` is set).
        source: a ``.jsonl`` / ``.json`` file of records, a folder, or a Hub dataset (``sources.load_records``);
            image paths are relative to a file's folder. Defaults to the embedded coloured-shapes task.
        processor: folder of the transformers processor (``preprocessor_config.json``); None: the tokenizer's folder
            (a Hugging Face checkpoint holds it).
        max_seq_len: longest sample, image tokens included (defaults to ``tokenizer.max_seq_len``).
        packed: pack samples into rows of ``max_seq_len`` tokens, each a document.
        padding_free: each batch's samples the documents of one row, no padding between them: the same loss, no
            work spent on padding (docs/vision.md). For a model that attends per document (Qwen2.5-VL, Qwen3-VL);
            Gemma 3's image attention takes a mask over the whole row instead.
        resize_images: let the processor scale down an image over its pixel limit (else it is refused).
        drop_long_samples: drop a sample longer than ``max_seq_len`` with a count (else refuse it).
        split: split of a folder or Hub dataset.

    Raises:
        UserError: as ``build_vision_dataset``, ``max_seq_len`` unset, or both ``packed`` and ``padding_free``.
    """
    return prepare_vision_dataset(tokenizer, source=source, processor=processor, max_seq_len=max_seq_len,
                                  packed=packed, padding_free=padding_free, resize_images=resize_images,
                                  drop_long_samples=drop_long_samples, split=split).build()


@dataclass(frozen=True)
class PreparedVisionDataset:
    """An image dataset's records read and its processor loaded, no image opened yet (``vision_dataset``'s, or
    ``vision_preference_dataset``'s): what ``tune validate`` checks (``datasets.check_dataset_records``: ``build()``
    up to its record limit, else ``encode`` on a sample of the records)."""

    source: str
    records: list[Record]
    encode: Callable[[Record], Optional[dict[str, Any]]]
    build: Callable[[], Dataset]


def prepare_vision_dataset(tokenizer: Tokenizer, *, source: Sources = EMBEDDED_VLM_TRAIN_PATH,
                           processor: Optional[str] = None, max_seq_len: Optional[int] = None, packed: bool = False,
                           padding_free: bool = False, resize_images: bool = False, drop_long_samples: bool = True,
                           split: str = "train") -> PreparedVisionDataset:
    """``vision_dataset`` up to its records (the same arguments).

    Raises:
        UserError: ``max_seq_len`` unset, no processor, a source that cannot be read, or both ``packed`` and
            ``padding_free``.
    """
    if packed and padding_free:
        raise UserError("vision_dataset: packed=true and padding_free=true: packed rows hold documents already, "
                        "with padding only at their ends; set one of them")
    max_seq_len, loaded = processor_and_length(
        tokenizer, processor, max_seq_len, "vision_dataset: set max_seq_len (an image-text sample is never truncated)")
    records = load_records(source, split=split)

    def build() -> VisionDataset:
        return with_source(build_vision_dataset(source, loaded, max_seq_len=max_seq_len, resize_images=resize_images,
                                                drop_long_samples=drop_long_samples, packed=packed,
                                                padding_free=padding_free, split=split, records=records), source, split)

    return PreparedVisionDataset(source if isinstance(source, str) else ", ".join(source), records, functools.partial(
        process_vision_record, processor=loaded, base_dir=images_folder(source), resize_images=resize_images), build)


def processor_and_length(tokenizer: Tokenizer, processor: Optional[str], max_seq_len: Optional[int],
                         unset: str) -> tuple[int, Any]:
    """A dataset component's longest sequence (``max_seq_len``, else the tokenizer's) and its processor (from the
    folder ``processor``, else the tokenizer's folder).

    Raises:
        UserError: ``unset``, when neither gives the longest sequence.
    """
    max_seq_len = max_seq_len if max_seq_len is not None else tokenizer.max_seq_len
    if max_seq_len is None:
        raise UserError(unset)
    folder = processor if processor is not None else str(Path(tokenizer.path).parent)
    return max_seq_len, load_vision_processor(folder)


def with_source(dataset: Any, source: Sources, split: str) -> Any:
    """``dataset``, naming its ``source`` and the files ``split`` of it reads (what the run reports)."""
    dataset.source = source if isinstance(source, str) else ", ".join(source)
    dataset.source_files = source_files(source, split)
    return dataset


register_preparer(vision_dataset, prepare_vision_dataset)
