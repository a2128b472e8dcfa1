"""The decode state's masks: stepping one slot at a time (``point_at``, three columns written in place) gives the
masks ``point`` builds from scratch, for full and sliding windows over left-padded rows; the additive masks are 0
where the boolean ones are True and -inf elsewhere; a decode step's one-query attention equals SDPA."""

import pytest
import torch
import torch.nn.functional as F

from tests.numerics import assert_close
from torchtune_ac.generation.kv_cache import DecodeState, _one_query_attention

WIDTH, NEW = 4, 7
VALID = torch.tensor([[False, False, True, True] + [True] * NEW,
                      [True, True, True, True] + [True] * NEW,
                      [False, False, False, True] + [True] * NEW])


@pytest.mark.parametrize("filled_from", [None, WIDTH])
@pytest.mark.parametrize("windows", [[None], [1], [2], [3], [None, 2, 5]])
def test_stepping_one_slot_equals_pointing_from_scratch(windows, filled_from):
    stepped = DecodeState(VALID, windows, torch.float32, filled_from=filled_from)
    stepped.point(torch.arange(WIDTH))
    for slot in range(WIDTH, WIDTH + NEW):
        stepped.point_at(slot)
        fresh = DecodeState(VALID, windows, torch.float32)
        fresh.point(torch.tensor([slot]))
        assert torch.equal(stepped.index, fresh.index), slot
        for window in fresh.windows:
            assert torch.equal(stepped.masks[window], fresh.masks[window]), (slot, window)
            assert torch.equal(stepped.biases[window], fresh.biases[window]), (slot, window)
            expected = torch.zeros(fresh.masks[window].shape).masked_fill(~fresh.masks[window], float("-inf"))
            assert torch.equal(fresh.biases[window], expected), (slot, window)


def test_a_state_without_a_dtype_keeps_no_additive_masks():
    state = DecodeState(VALID, [None])
    state.point(torch.arange(WIDTH))
    state.point_at(WIDTH)
    state.point_at(WIDTH + 1)
    assert state.biases == {} and state.masks[None].shape == (3, 1, 1, WIDTH + NEW)


@pytest.mark.parametrize("additive", [False, True])
def test_one_query_attention_equals_sdpa_over_grouped_heads(additive):
    """A compiled decode step's attention (two bmms around a softmax) computes what SDPA computes for one query."""
    torch.manual_seed(0)
    b, n_heads, n_kv, total, hd = 3, 4, 2, 11, 8
    q = torch.randn(b, n_heads, 1, hd)
    k, v = torch.randn(b, n_kv, total, hd), torch.randn(b, n_kv, total, hd)
    state = DecodeState(VALID, [None], torch.float32, filled_from=WIDTH)
    state.point(torch.tensor([WIDTH + 2]))
    mask = state.biases[None] if additive else state.masks[None]
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert_close(_one_query_attention(q, k, v, mask, scale=None), expected, terms=total + hd,
                 what="one-query attention")
    # A softmax over the wrong slots moves every row by far more than rounding.
    wrong = _one_query_attention(q, k, v, torch.ones_like(state.masks[None]), scale=None)
    assert (wrong - expected).abs().max() > 1e-3
