"""The built-in rewards' values, and the one-line refusals of a reward that raises, miscounts or is not finite."""

import pytest

from torchtune_ac.training.rewards import (
    RewardError,
    final_number,
    format_match,
    length_penalty,
    math_answer,
    score_completions,
)


def test_builtin_rewards():
    assert final_number("so 3 + 4 = 7\n#### 1,234") == 1234.0
    assert final_number("no number") is None
    assert math_answer(["The answer is 42.", "It is 41", "none"], answer=["#### 42", "#### 42", "42"]) == [1.0, 0.0,
                                                                                                         0.0]
    assert format_match(["<think>a</think> 5", "5"], pattern=r"<think>.*</think>.*") == [1.0, 0.0]
    assert length_penalty(["ab", ""], completion_lengths=[8, 0], max_new_tokens=16) == [-0.5, 0.0]


def test_weighted_sum_and_table():
    table, total = score_completions({"a": lambda completions, **_: [1.0, 0.0], "b": lambda completions, **_: [2, 4]},
                                     [1.0, 0.5], ["x", "y"], {})
    assert table.tolist() == [[1.0, 2.0], [0.0, 4.0]]
    assert total.tolist() == [2.0, 2.0]


def _raises(completions, **_):
    raise KeyError("answer")


@pytest.mark.parametrize("function, message", [
    (_raises, "reward bad raised KeyError: 'answer'"),
    (lambda completions, **_: [1.0], "reward bad returned 1 scores for 2 completions"),
    (lambda completions, **_: [1.0, float("nan")], "reward bad returned nan for completion 1"),
    (lambda completions, **_: ["x", 1], "reward bad must return one float per completion"),
])
def test_a_failing_reward_is_named(function, message):
    with pytest.raises(RewardError, match=message.replace("(", r"\(")):
        score_completions({"ok": lambda completions, **_: [0.0, 0.0], "bad": function}, [1.0, 1.0], ["x", "y"], {})
