"""Packed rows: positions and the oracle's attention mask agree on what a document is (a contiguous run of equal ids)."""

import pytest
import torch
from attention_oracle import document_causal_mask
from numerics import assert_close, llama_terms

from torchtune_ac.models import llama_tiny
from torchtune_ac.models.llama import positions_from_document_ids


def test_positions_restart_and_the_mask_stays_within_each_run():
    ids = torch.tensor([[0, 0, 1, 1, 0, 0]])
    assert positions_from_document_ids(ids).tolist() == [[0, 1, 0, 1, 0, 1]]
    mask = document_causal_mask(ids)[0, 0].int().tolist()
    assert mask == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 0],  # the second run of id 0 does not see the first
        [0, 0, 0, 0, 1, 1],
    ]


@pytest.mark.numerics
def test_a_repeated_id_is_a_new_document_for_the_model_too():
    torch.manual_seed(0)
    model = llama_tiny()
    model.init_weights()
    tokens = torch.randint(0, model.args.vocab_size, (1, 12))
    repeated = torch.tensor([[0] * 4 + [1] * 4 + [0] * 4])
    distinct = torch.tensor([[0] * 4 + [1] * 4 + [2] * 4])
    with torch.no_grad():
        # Bit for bit: both id layouts make the same runs of 4 tokens, so the same kernels run in the same order.
        torch.testing.assert_close(model(tokens, repeated), model(tokens, distinct), rtol=0, atol=0)
        alone = model(tokens[:, 8:])
        # A batch of 4 tokens, not 12: the matmuls add in other blocks, so within rounding.
        assert_close(model(tokens, repeated)[:, 8:], alone, terms=llama_terms(model.args, 4, 0, backward=False),
                     what="logits")
