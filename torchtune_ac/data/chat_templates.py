"""Chat templates shipped with torchtune_ac, for tokenizers that come without one (many base models do).

Chat data is rendered with the tokenizer's chat template. A tokenizer without one is refused for chat data
rather than given a silent default: the template decides what the fine-tuned model learns to read and write,
and the same template must be used at inference. ``tokenizer.chat_template`` in a config names one of these,
or gives a Jinja template of its own (Hugging Face's ``chat_template`` syntax); the run saves it with the
tokenizer in every checkpoint, so ``apply_chat_template`` on the fine-tuned model renders what it was trained on.

Each template starts with the tokenizer's BOS token when it has one (training starts every sample with it, and
``apply_chat_template`` adds no special token of its own), and is prefix stable, as assistant masking needs.
"""

from __future__ import annotations

import difflib

from torchtune_ac.errors import UserError

_BOS = "{{ bos_token or '' }}"


def _generation_prompt(header: str) -> str:
    return "{% if add_generation_prompt %}{{ '" + header + "' }}{% endif %}"


CHAT_TEMPLATES = {
    # ChatML, as Qwen2.5 and many others write it: <|im_start|>user\nhi<|im_end|>\n
    "chatml": (
        _BOS + "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
        "'<|im_end|>\\n' }}{% endfor %}" + _generation_prompt("<|im_start|>assistant\\n")
    ),
    # Llama 3's turns: <|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>
    "llama3": (
        _BOS + "{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' "
        "+ message['content'] + '<|eot_id|>' }}{% endfor %}"
        + _generation_prompt("<|start_header_id|>assistant<|end_header_id|>\\n\\n")
    ),
    # Plain text, for tokenizers without chat tokens: "user: hi\n\nassistant: yo\n\n"
    "plain": (
        _BOS + "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\\n\\n' }}{% endfor %}"
        + _generation_prompt("assistant: ")
    ),
}


def resolve_chat_template_setting(value: str) -> tuple[str, str]:
    """The template a ``chat_template`` setting names, and where it came from (for messages).

    Args:
        value: a name of :data:`CHAT_TEMPLATES`, or a Jinja template (it holds ``{{`` or ``{%``).

    Returns:
        ``(template, source)``.

    Raises:
        UserError: neither a built-in name nor a Jinja template, or a Jinja template that does not parse
            (naming its line).
    """
    if value in CHAT_TEMPLATES:
        return CHAT_TEMPLATES[value], f"the built-in chat template {value!r}"
    names = ", ".join(CHAT_TEMPLATES)
    if "{{" not in value and "{%" not in value:
        close = difflib.get_close_matches(value, CHAT_TEMPLATES, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise UserError(f"chat_template={value!r}: not a built-in template ({names}){hint}, nor a Jinja template "
                        "(one with {{ ... }} or {% ... %})")
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        # Hugging Face's environment: loop controls ({% break %}) are allowed.
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(value)
    except TemplateSyntaxError as err:
        shown = value if len(value) <= 40 else value[:37] + "..."
        raise UserError(f"chat_template={shown!r}: not a valid Jinja template (line {err.lineno}: {err.message})"
                        ) from None
    return value, "the config's chat_template"
