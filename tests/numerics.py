"""How the tests compare floating-point results: the rule, once, and the helpers that apply it.

PyTorch, MKL and oneDNN pick their kernels by the CPU's instruction set (``ATEN_CPU_CAPABILITY``,
``MKL_ENABLE_INSTRUCTIONS``), and each kernel adds in its own order. Two computations of the same value agree
bit for bit only when they run the same kernels in the same order; otherwise they agree to within rounding,
and a tolerance tighter than rounding holds on one CPU and fails on the next.

1. Bit-exact (``torch.equal``) only where both sides run the same kernels in the same order: AC against no AC
   in one process (the same ops, replayed), a save and load round trip, a resume against the run it resumes.
   Say at the assertion why both sides add in the same order.
2. Otherwise bound the difference by the arithmetic: ``assert_close(actual, expected, terms=...)`` checks
   ``|actual - expected| <= rounding_bound(terms, max|expected|)`` entry by entry, where

   - ``terms`` is the length of the chain of additions behind one value: the sum of the reduction lengths
     along the computation (a matmul's inner dimension, a softmax's row, the tokens summed into a loss or a
     weight gradient). ``llama_terms`` counts them for a forward (and backward) of a Llama;
   - the magnitude is the largest ``|expected|`` of the compared tensor, not each entry's own: a small entry
     is a cancellation of terms as large as the big entries, and carries their absolute rounding error;
   - the bound grows with ``sqrt(terms)``, not ``terms``: rounding errors take random signs, so they add like
     a random walk (Higham and Mary, "A new approach to probabilistic rounding error analysis", 2019). The
     worst case, ``terms * eps``, needs adversarial data. ``SIGMAS`` standard deviations cover the largest
     entry of a tensor.

3. Training runs that add in another order (2 processes against 1, micro-batches against one batch):
   ``assert_steps_alike`` and ``assert_weights_trained_alike``. One step's gradient differs by ``rho = rounding_bound(terms, 1)`` relative. Adam
   divides each update by the gradient's running size, so where an entry's gradient is within rounding of
   zero its update's sign is a coin toss: that weight may differ by up to ``2 * c * lr`` per step (``c`` is
   Adam's largest update, ``adam_update_bound``), whatever ``eps`` is. So the weights are compared twice: every
   entry within ``sum over steps of 2 * c * lr`` (``adam_weight_bound``), and in norm within that times
   ``sqrt(8 * rho * n)``, since only about a fraction ``4 * rho`` of ``n`` entries lie that close to zero (a
   bell-shaped gradient; the rest differ by ``rho`` relative). A real fault (a lost micro-batch, one rank's
   gradient not reduced, the weights of another step saved) moves a large share of the entries by an update
   and fails the norm; it also changes the losses and gradient norms, which are compared step by step: step
   ``k`` within ``rho * (|x_k| + sum of |x_{t+1} - x_t| for t < k)``, one step's rounding of the value itself
   plus, for each earlier step, the same relative rounding of what that step changed.
4. A value stored as float32 (TensorBoard's scalars) is its float64 original rounded to nearest: within
   ``FLOAT32_STORAGE`` relative.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch

from torchtune_ac.models import LlamaArgs

# Relative error of rounding a float64 to the nearest float32 (half a float32 eps).
FLOAT32_STORAGE = torch.finfo(torch.float32).eps / 2
# Standard deviations of that random walk the bound allows. The largest difference measured in the `numerics`
# tests (PyTorch's default, AVX2 and AVX-512 kernels, MKL limited to SSE4.2) was about 1 of a 4.5-sigma bound until
# 2026-12-07, when one entry of a LoRA A gradient against PEFT's (Qwen2, the grouped rank-first adapter products,
# PyTorch's default kernels) reached 1.07 of it (4.8 sigmas); 5 keeps that within the bound, and a 0.1 % error in
# one chunk of a loss (about 8,400 float32 eps, against this bound's 185 eps for 1,368 terms) still exceeds it many
# times over.
SIGMAS = 5.0


def rounding_bound(terms: int, magnitude: float, dtype: torch.dtype = torch.float32) -> float:
    """The largest difference rounding alone can make between two orders of the same computation.

    Args:
        terms: length of the chain of additions behind one value (see the module docstring).
        magnitude: size of the values compared (the largest ``|expected|`` of a tensor).
        dtype: the dtype the computation ran in.

    Returns:
        ``SIGMAS * sqrt(terms) * eps(dtype) * magnitude``.
    """
    return SIGMAS * math.sqrt(terms) * torch.finfo(dtype).eps * magnitude


def assert_close(actual: torch.Tensor | float, expected: torch.Tensor | float, *, terms: int,
                 magnitude: float | None = None, dtype: torch.dtype | None = None, what: str = "") -> None:
    """Assert ``|actual - expected| <= rounding_bound(terms, magnitude, dtype)`` entry by entry.

    Args:
        actual: a tensor or a float.
        expected: the reference, of the same shape.
        terms: length of the chain of additions behind one value.
        magnitude: the size of the values added; by default the largest ``|expected|``. Give it where the whole
            result is a cancellation (a gradient that is zero in exact arithmetic).
        dtype: the dtype the values were computed in; by default ``expected``'s, float32 for a Python float
            (a float32 result read back from a log).
        what: names the compared value in the failure message.

    Raises:
        AssertionError: naming the largest difference and the bound.
    """
    if dtype is None:
        dtype = expected.dtype if isinstance(expected, torch.Tensor) else torch.float32
    actual_t, expected_t = (torch.as_tensor(x, dtype=torch.float64).detach() for x in (actual, expected))
    if magnitude is None:
        magnitude = float(expected_t.abs().max()) if expected_t.numel() else 0.0
    bound = rounding_bound(terms, magnitude, dtype)
    torch.testing.assert_close(actual_t, expected_t, rtol=0, atol=bound,
                               msg=lambda m: f"{what}: beyond the rounding of {terms} terms ({bound:.3g}): {m}")


def assert_all_close(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], *, terms: int,
                     what: str = "") -> None:
    """``assert_close`` on every tensor of two dicts with the same names (gradients, state dicts), each
    against its own magnitude."""
    assert sorted(actual) == sorted(expected), f"{what}: different names: {sorted(set(actual) ^ set(expected))}"
    for name, tensor in expected.items():
        assert_close(actual[name], tensor, terms=terms, what=f"{what} {name}".strip())


def llama_terms(args: LlamaArgs, seq_len: int, tokens: int, *, backward: bool = True) -> int:
    """The chain of additions behind a Llama's loss (``backward=False``) or its weight gradients.

    Per block: the two RMS norms, the q/k/v, output and gate/up projections (``dim`` each), the attention
    scores (``head_dim``), the softmax and the weighted sum of values (``seq_len`` each) and the down
    projection (``intermediate_dim``); then the final norm, the output projection and the softmax over the
    vocabulary. Backward runs the same reductions again, transposed, and sums each weight gradient over the
    tokens; the loss sums over the tokens too.

    Args:
        args: the model's shape.
        seq_len: the longest sequence attended over.
        tokens: the tokens of the batch (summed into the loss and into each weight gradient).
        backward: count the backward pass too.
    """
    block = 5 * args.dim + args.resolved_head_dim + 2 * seq_len + args.intermediate_dim
    forward = args.n_layers * block + 2 * args.dim + args.vocab_size
    return (2 * forward if backward else forward) + tokens


def adam_update_bound(steps: int, betas: tuple[float, float] = (0.9, 0.999)) -> float:
    """The largest ``|m_hat / sqrt(v_hat)|`` Adam can take in its first ``steps`` steps, whatever the gradients.

    With bias correction, ``m_hat = sum_i a_i g_i`` and ``v_hat = sum_i b_i g_i^2`` (weights ``a_i``, ``b_i``
    summing to 1), so by Cauchy-Schwarz ``|m_hat| / sqrt(v_hat) <= sqrt(sum_i a_i^2 / b_i)``: 1 at the first
    step, about 1.01 over 5 steps, 7.3 in the limit.

    Args:
        steps: the number of steps taken.
        betas: Adam's ``(beta1, beta2)``.
    """
    beta1, beta2 = betas
    largest = 0.0
    for t in range(1, steps + 1):
        total = 0.0
        for i in range(1, t + 1):
            a = (1 - beta1) * beta1 ** (t - i) / (1 - beta1**t)
            b = (1 - beta2) * beta2 ** (t - i) / (1 - beta2**t)
            total += a * a / b
        largest = max(largest, math.sqrt(total))
    return largest


def adam_weight_bound(lrs: Sequence[float], betas: tuple[float, float] = (0.9, 0.999)) -> float:
    """The largest difference Adam(W) steps at learning rates ``lrs`` can make to one weight between two runs
    whose gradients differ only by rounding: an update of at most ``c * lr`` each way, per step (weight decay
    only shrinks a difference)."""
    return 2 * adam_update_bound(len(lrs), betas) * sum(lrs)


def assert_steps_alike(actual: Sequence[float], expected: Sequence[float], *, terms: int, what: str) -> None:
    """Assert that a value logged at each step (loss, gradient norm) of two training runs that add in different
    orders stays within rounding (rule 3): step ``k`` within ``rho * (|x_k| + sum over t < k of |x_{t+1} - x_t|)``.

    Args:
        actual: the value at each step.
        expected: the reference run's value at each step.
        terms: the chain of additions behind one step's gradients (``llama_terms``).
        what: names the value in the failure message.

    Raises:
        AssertionError: naming the step, both values and the bound.
    """
    assert len(actual) == len(expected), f"{what}: {len(actual)} steps against {len(expected)}"
    rho = rounding_bound(terms, 1.0)
    moved = 0.0
    for k, (a, b) in enumerate(zip(actual, expected)):
        bound = rho * (abs(b) + moved)
        assert abs(a - b) <= bound, f"{what} of step {k + 1}: {a} against {b}, beyond {bound:.3g}"
        if k + 1 < len(expected):
            moved += abs(expected[k + 1] - b)


def assert_weights_trained_alike(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], *,
                                 lrs: Sequence[float], terms: int) -> None:
    """Assert that the weights of two Adam(W) runs that add in different orders are alike (rule 3): each entry
    within ``adam_weight_bound(lrs)``, and the whole within that times ``sqrt(8 * rho * n)``.

    Args:
        actual: the final weights of one run.
        expected: the final weights of the reference run.
        lrs: the learning rate of each step taken.
        terms: the chain of additions behind one step's gradients (``llama_terms``).

    Raises:
        AssertionError: naming the tensor or the norm, and the bound.
    """
    assert sorted(actual) == sorted(expected), f"different tensor names: {sorted(set(actual) ^ set(expected))}"
    entry_bound = adam_weight_bound(lrs)
    n = sum(t.numel() for t in expected.values())
    norm_bound = entry_bound * math.sqrt(8 * rounding_bound(terms, 1.0) * n)
    squares = 0.0
    for name, tensor in expected.items():
        diff = actual[name].double() - tensor.double()
        largest = float(diff.abs().max()) if diff.numel() else 0.0
        assert largest <= entry_bound, f"{name}: a weight differs by {largest:.3g}, beyond Adam's {entry_bound:.3g}"
        squares += float(diff.square().sum())
    assert math.sqrt(squares) <= norm_bound, (
        f"the weights differ by {math.sqrt(squares):.3g} in norm, beyond {norm_bound:.3g}")
