"""``tune generate``: try a fine-tuned model on a prompt, with transformers' own generation.

    tune generate --checkpoint outputs/tiny_full --alpaca --prompt "What is 33 + 65?"
    tune generate --checkpoint outputs/run/step_0000080 --chat --prompt "Hello"

``--checkpoint`` is a Hugging Face checkpoint folder, or a run's ``output_dir`` (its ``latest`` checkpoint); a LoRA
run's checkpoint stands for its ``merged/`` model (saved with ``adapter.save_merged``; one of adapters alone is
refused).
The model is ``AutoModelForCausalLM`` and the tokenizer ``AutoTokenizer``, both read from that folder, and
the text comes from ``model.generate``: greedy unless ``--temperature`` is above 0, at most ``--max-new-tokens``
new tokens, stopping at the end-of-text ids of the checkpoint's config. Only the generated text is printed, on
stdout; every problem with the input is one line and exit 2.

The prompt reaches the model as a fine-tune fed it: ``--chat`` renders it as a user turn with the checkpoint's
saved chat template and its generation prompt; ``--alpaca`` puts it in the Alpaca layout ``instruct_dataset``
trains on; a plain prompt is tokenized as it is. A sample always starts with BOS in training, so the prompt does
too, when the tokenizer has one.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from torchtune_ac.checkpoint import MANIFEST_FILE, MERGED_DIR, resolve_hf_checkpoint
from torchtune_ac.data import format_alpaca_prompt
from torchtune_ac.errors import UnavailableError, UserError


@dataclass(frozen=True)
class GenerateRequest:
    """What ``tune generate`` was asked for (its command-line flags)."""

    checkpoint: str
    prompt: str
    chat: bool = False
    alpaca: bool = False
    max_new_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0
    device: str = "auto"


def generate_command(args: Any) -> int:
    """``tune generate``: print the text generated for ``args`` (the parsed flags) on stdout.

    Raises:
        UserError: see :func:`generate_text`.
    """
    request = GenerateRequest(checkpoint=args.checkpoint, prompt=args.prompt, chat=args.chat, alpaca=args.alpaca,
                              max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                              device=args.device)
    generated = generate_text(request)
    print(generated.text, flush=True)
    if generated.empty_reason is not None:
        print(f"tune generate: no text generated: {generated.empty_reason}", file=sys.stderr, flush=True)
    return 0


@dataclass(frozen=True)
class Generated:
    """What the model generated: the text (the prompt and special tokens left out), and why it is empty when it
    is (None otherwise)."""

    text: str
    empty_reason: Optional[str] = None


def generate_text(request: GenerateRequest) -> Generated:
    """The text the checkpoint's model generates after the prompt (the prompt itself left out, and the special
    tokens), and why there is none when there is none.

    Raises:
        UserError: an empty prompt, ``--chat`` with ``--alpaca``, no checkpoint at the path, a checkpoint
            transformers cannot load, ``--chat`` with a tokenizer that has no chat template, or a prompt that
            leaves no room in the model's context for ``max_new_tokens``.
        UnavailableError: ``--device cuda`` without CUDA.
    """
    import torch
    import transformers

    if not request.prompt.strip():
        raise UserError("--prompt: empty; give the text to continue (or the user's message with --chat)")
    if request.chat and request.alpaca:
        raise UserError("--chat and --alpaca: choose one way to lay out the prompt")
    checkpoint = resolve_hf_checkpoint(request.checkpoint)
    device = _resolve_device(request.device, torch)
    with _transformers_quiet(transformers):
        return _generate(request, checkpoint, device, torch, transformers)


def _generate(request: GenerateRequest, checkpoint: Path, device: Any, torch: Any, transformers: Any) -> str:
    tokenizer = _load(transformers.AutoTokenizer, checkpoint, "tokenizer")
    input_ids = _encode(tokenizer, request, checkpoint)
    model = _load(transformers.AutoModelForCausalLM, checkpoint, "model", dtype="auto").to(device).eval()
    context = getattr(model.config, "max_position_embeddings", None)
    if context is not None and len(input_ids) + request.max_new_tokens > context:
        raise UserError(f"--max-new-tokens {request.max_new_tokens}: with the prompt's {len(input_ids)} tokens it "
                        f"exceeds the model's context of {context} positions ({checkpoint / 'config.json'})")
    config = model.generation_config
    config.max_new_tokens = request.max_new_tokens
    config.do_sample = request.temperature > 0
    # The checkpoint's own sampling settings (Llama instruct ships some) would turn greedy decoding into sampling.
    config.temperature = request.temperature if config.do_sample else None
    config.top_p = config.top_k = None
    if config.pad_token_id is None:
        config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    torch.manual_seed(request.seed)
    tokens = torch.tensor([input_ids], device=device)
    with torch.no_grad():
        output = model.generate(tokens, attention_mask=torch.ones_like(tokens), generation_config=config)
    new_ids = output[0, len(input_ids):].tolist()
    text = tokenizer.decode(new_ids, skip_special_tokens=True)
    return Generated(text, _why_empty(new_ids, text, config, tokenizer))


def _why_empty(new_ids: list[int], text: str, config: Any, tokenizer: Any) -> Optional[str]:
    """Why ``text``, decoded from ``new_ids``, holds nothing to read (None when it does)."""
    if text.strip():
        return None
    stops = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    if new_ids and new_ids[0] in stops:
        return (f"the model's first token was the end of sequence ({tokenizer.convert_ids_to_tokens(new_ids[0])}, "
                f"id {new_ids[0]}), so it ended its answer at once; try another prompt or layout (--chat, --alpaca), "
                "or a checkpoint trained longer")
    if not text:
        return (f"the model generated {len(new_ids)} token(s), all of them special tokens, which are not printed "
                f"({' '.join(tokenizer.convert_ids_to_tokens(new_ids[:8]))})")
    return f"the model generated {len(new_ids)} token(s) of white space only"


@contextlib.contextmanager
def _transformers_quiet(transformers: Any) -> Iterator[None]:
    """transformers' notes on generation settings and its loading bars, which would mix with the answer on a
    terminal, off while the body runs (what torchao says when transformers imports it is filtered by ``tune``
    itself: ``observability.third_party_noise``)."""
    verbosity, bars = transformers.logging.get_verbosity(), transformers.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            transformers.logging.enable_progress_bar()


def _encode(tokenizer: Any, request: GenerateRequest, checkpoint: Path) -> list[int]:
    """The prompt's token ids, laid out as the request asks (see the module docstring)."""
    if request.chat:
        if not tokenizer.chat_template:
            # A run's checkpoint ends with its manifest; anything else came from elsewhere, often a base model.
            # (A LoRA run's merged model is in its checkpoint's merged/ folder.)
            by_run = (checkpoint / MANIFEST_FILE).is_file() or (
                checkpoint.name == MERGED_DIR and (checkpoint.parent / MANIFEST_FILE).is_file())
            origin = "the run that wrote it had no chat template" if by_run else "base models usually ship without one"
            raise UserError(f"--chat: the tokenizer in {checkpoint} has no chat template ({origin}); generate "
                            "without --chat, or fine-tune on chat data with tokenizer.chat_template set")
        messages = [{"role": "user", "content": request.prompt}]
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # The template writes BOS itself where it wants one, as in training (see torchtune_ac.data.tokenizer).
        ids = tokenizer(rendered, add_special_tokens=False).input_ids
    else:
        text = format_alpaca_prompt(request.prompt, "") if request.alpaca else request.prompt
        ids = tokenizer(text, add_special_tokens=False).input_ids
    bos = tokenizer.bos_token_id
    if bos is not None and (not ids or ids[0] != bos):
        ids = [bos, *ids]
    return ids


def _load(auto_class: Any, checkpoint: Path, what: str, **kwargs: Any) -> Any:
    try:
        return auto_class.from_pretrained(checkpoint, **kwargs)
    except (OSError, ValueError, KeyError) as err:
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        raise UserError(f"checkpoint {checkpoint}: transformers cannot load its {what} "
                        f"({lines[0] if lines else type(err).__name__})") from None


def _resolve_device(device: str, torch: Any) -> Any:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UnavailableError("--device cuda: CUDA is not available on this machine (use --device cpu or auto)")
    return torch.device(device)
