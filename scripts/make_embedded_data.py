"""Generate the small dataset and tokenizer that ship inside ``torchtune_ac/data/embedded/``.

    python scripts/make_embedded_data.py                 # rewrite the committed files
    python scripts/make_embedded_data.py --out-dir /tmp/x  # write elsewhere (the tests compare the two)

Outputs:
    instruct.jsonl          synthetic Alpaca-style records whose answers follow from the question
                            (arithmetic, word reversal, counting, sorting, ...), with a ``task`` field naming the kind
    preference/train.jsonl  preference pairs made from those records: the Alpaca prompt, the bare answer chosen, the
    preference/validation.jsonl  answer wrapped in a hedge rejected ("Maybe 7?"); the held-out pairs (the last
                            ``PREFERENCE_HELD_OUT`` records) use hedges the training pairs never show
    tokenizer.json          byte-level BPE trained on those records, exactly ``VOCAB_SIZE`` tokens
    tokenizer_config.json   special tokens and a Llama-3-style chat template

Everything is derived from fixed seeds, so running the script twice gives byte-identical files.
"""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path
from typing import Callable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from torchtune_ac.data.datasets import format_alpaca_prompt
from torchtune_ac.data.embedded import EMBEDDED_DIR

NUM_RECORDS = 3000
VOCAB_SIZE = 512
# Preference pairs: the rule is "answer bare, without hedging"; held-out pairs hedge in words training never shows.
PREFERENCE_HELD_OUT = 200
TRAIN_HEDGES = ("The answer is {}.", "I think it is {}.", "{}, probably.", "Maybe {}?", "Hmm, {}.",
                "It should be {}, I guess.")
HELD_OUT_HEDGES = ("Well, {}.", "My answer: {}", "{}. I am not sure.", "Perhaps {}.")
BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
START_HEADER, END_HEADER, END_OF_TURN = "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, START_HEADER, END_HEADER, END_OF_TURN]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

WORDS = """
apple river stone cloud green table paper bread light water music horse tiger lemon grape chair plant
house glass sugar train piano ocean candle forest garden pencil window rabbit basket planet silver yellow
orange purple summer winter spring autumn monkey rocket castle bridge dragon button jacket pocket marble
cookie butter honey salad pepper carrot tomato potato cherry banana melon peach olive onion garlic
circle square triangle number letter simple random little bottle camera kitten puppy turtle
island valley desert meadow canyon harbor market street school friend family mother father sister
brother doctor farmer singer dancer sailor pilot driver writer artist player hunter keeper builder
shadow thunder rain snow wind storm sun moon star sky field road path door wall roof floor lamp
clock phone book pen cup bowl plate fork spoon knife bed sofa shelf box bag hat shoe sock coat
""".split()


def pick_numbers(rng: random.Random, count: int, high: int) -> list[int]:
    """Draw ``count`` integers in ``[0, high]``."""
    return [rng.randint(0, high) for _ in range(count)]


def make_add(rng: random.Random) -> tuple[str, str, str]:
    a, b = pick_numbers(rng, 2, 99)
    if rng.random() < 0.5:
        return f"What is {a} + {b}?", "", str(a + b)
    return "Add the two numbers.", f"{a}, {b}", str(a + b)


def make_subtract(rng: random.Random) -> tuple[str, str, str]:
    a, b = sorted(pick_numbers(rng, 2, 99), reverse=True)
    if rng.random() < 0.5:
        return f"What is {a} - {b}?", "", str(a - b)
    return "Subtract the second number from the first.", f"{a}, {b}", str(a - b)


def make_multiply(rng: random.Random) -> tuple[str, str, str]:
    a, b = pick_numbers(rng, 2, 12)
    return f"What is {a} times {b}?", "", str(a * b)


def make_reverse(rng: random.Random) -> tuple[str, str, str]:
    word = rng.choice(WORDS)
    if rng.random() < 0.5:
        return f'Reverse the word "{word}".', "", word[::-1]
    return "Spell the word backwards.", word, word[::-1]


def make_length(rng: random.Random) -> tuple[str, str, str]:
    word = rng.choice(WORDS)
    return f'How many letters are in the word "{word}"?', "", str(len(word))


def make_count_letter(rng: random.Random) -> tuple[str, str, str]:
    word = rng.choice(WORDS)
    # Mostly letters that occur, so answers are not nearly always zero.
    letter = rng.choice(word) if rng.random() < 0.8 else rng.choice(string.ascii_lowercase)
    return f'How many times does the letter "{letter}" appear in "{word}"?', "", str(word.count(letter))


def make_sort(rng: random.Random) -> tuple[str, str, str]:
    numbers = pick_numbers(rng, rng.randint(3, 6), 99)
    descending = rng.random() < 0.3
    order = "largest to smallest" if descending else "smallest to largest"
    answer = ", ".join(str(n) for n in sorted(numbers, reverse=descending))
    return f"Sort these numbers from {order}.", ", ".join(str(n) for n in numbers), answer


def make_uppercase(rng: random.Random) -> tuple[str, str, str]:
    word = rng.choice(WORDS)
    return f'Write "{word}" in capital letters.', "", word.upper()


def make_next_letter(rng: random.Random) -> tuple[str, str, str]:
    index = rng.randint(0, 24)
    letter = string.ascii_lowercase[index]
    if rng.random() < 0.5:
        return f'Which letter comes after "{letter}" in the alphabet?', "", string.ascii_lowercase[index + 1]
    following = string.ascii_lowercase[index + 1]
    return f'Which letter comes before "{following}" in the alphabet?', "", letter


def make_extreme(rng: random.Random) -> tuple[str, str, str]:
    numbers = pick_numbers(rng, rng.randint(2, 5), 99)
    if rng.random() < 0.5:
        return "Which number is the largest?", ", ".join(map(str, numbers)), str(max(numbers))
    return "Which number is the smallest?", ", ".join(map(str, numbers)), str(min(numbers))


def make_parity(rng: random.Random) -> tuple[str, str, str]:
    n = rng.randint(0, 999)
    return f"Is {n} even or odd?", "", "even" if n % 2 == 0 else "odd"


def make_first_last_letter(rng: random.Random) -> tuple[str, str, str]:
    word = rng.choice(WORDS)
    if rng.random() < 0.5:
        return f'What is the first letter of "{word}"?', "", word[0]
    return f'What is the last letter of "{word}"?', "", word[-1]


TASKS: dict[str, Callable[[random.Random], tuple[str, str, str]]] = {
    "add": make_add,
    "subtract": make_subtract,
    "multiply": make_multiply,
    "reverse": make_reverse,
    "length": make_length,
    "count_letter": make_count_letter,
    "sort": make_sort,
    "uppercase": make_uppercase,
    "next_letter": make_next_letter,
    "extreme": make_extreme,
    "parity": make_parity,
    "first_last_letter": make_first_last_letter,
}


def generate_records(num_records: int, seed: int = 0) -> list[dict[str, str]]:
    """Build ``num_records`` Alpaca-style records, cycling through the task kinds in a seeded random order.

    Args:
        num_records: How many records to make.
        seed: Seed of the ``random.Random`` that draws every choice.

    Returns:
        Dicts with ``instruction``, ``input`` (often empty), ``output`` and ``task``.
    """
    rng = random.Random(seed)
    names = sorted(TASKS)
    records = []
    for _ in range(num_records):
        name = rng.choice(names)
        instruction, input_text, output = TASKS[name](rng)
        records.append({"instruction": instruction, "input": input_text, "output": output, "task": name})
    return records


def generate_preference_pairs(records: list[dict[str, str]], seed: int = 1) -> tuple[list[dict], list[dict]]:
    """Preference pairs from instruction records: ``prompt`` (the Alpaca prompt), ``chosen`` (the answer as it is),
    ``rejected`` (the answer in a hedge); the last ``PREFERENCE_HELD_OUT`` records make the held-out pairs, hedged
    with ``HELD_OUT_HEDGES`` only.

    Returns:
        The training pairs and the held-out pairs.
    """
    rng = random.Random(seed)
    pairs = []
    for index, record in enumerate(records):
        hedges = TRAIN_HEDGES if index < len(records) - PREFERENCE_HELD_OUT else HELD_OUT_HEDGES
        pairs.append({"prompt": format_alpaca_prompt(record["instruction"], record["input"]),
                      "chosen": record["output"], "rejected": rng.choice(hedges).format(record["output"]),
                      "task": record["task"]})
    return pairs[:-PREFERENCE_HELD_OUT], pairs[-PREFERENCE_HELD_OUT:]


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=True) + "\n" for r in records), encoding="ascii")


def train_tokenizer(texts: list[str]) -> Tokenizer:
    """Train a byte-level BPE with exactly ``VOCAB_SIZE`` tokens (special tokens included).

    Digits are split one per token before the byte-level step, so arithmetic answers are written digit by digit.

    Args:
        texts: AssembledModel corpus.

    Returns:
        The trained tokenizer; special tokens take ids 0.. in ``SPECIAL_TOKENS`` order.

    Raises:
        RuntimeError: if the corpus is too small to reach ``VOCAB_SIZE``.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size != VOCAB_SIZE:
        raise RuntimeError(f"trained tokenizer has {size} tokens, expected {VOCAB_SIZE}: the corpus is too small")
    return tokenizer


def build_corpus(records: list[dict[str, str]]) -> list[str]:
    """Texts the tokenizer is trained on: each record as the Alpaca prompt followed by its answer."""
    return [format_alpaca_prompt(r["instruction"], r["input"]) + r["output"] for r in records]


def write_embedded_files(out_dir: Path) -> list[Path]:
    """Write ``instruct.jsonl``, ``preference/{train,validation}.jsonl``, ``tokenizer.json`` and
    ``tokenizer_config.json`` into ``out_dir``.

    Args:
        out_dir: Destination folder (created if missing).

    Returns:
        The paths written.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    records = generate_records(NUM_RECORDS, seed=0)
    data_path = out_dir / "instruct.jsonl"
    write_jsonl(data_path, records)
    (out_dir / "preference").mkdir(exist_ok=True)
    preference_paths = [out_dir / "preference" / "train.jsonl", out_dir / "preference" / "validation.jsonl"]
    for path, pairs in zip(preference_paths, generate_preference_pairs(records)):
        write_jsonl(path, pairs)

    tokenizer = train_tokenizer(build_corpus(records))
    tokenizer_path = out_dir / "tokenizer.json"
    tokenizer_path.write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
    }
    config_path = out_dir / "tokenizer_config.json"
    config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return [data_path, *preference_paths, tokenizer_path, config_path]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out-dir", type=Path, default=Path(EMBEDDED_DIR), help="where to write (default: the package)"
    )
    args = parser.parse_args(argv)
    for path in write_embedded_files(args.out_dir):
        print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
