"""GRPO's pieces apart from TRL (``test_grpo_trl_parity.py`` holds the parity): the chunked per-token
log-probabilities at a temperature, with a soft cap and the entropy, against the whole logits; the config's
refusals."""

import pytest
import torch
import torch.nn.functional as F
from numerics import assert_close

from torchtune_ac.errors import UserError
from torchtune_ac.training.grpo import GRPOConfig
from torchtune_ac.training.objective import IGNORE_INDEX
from torchtune_ac.training.sequence_logps import ChunkedTokenLogProbs


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("n_chunks", [1, 4])
def test_chunked_token_logps_equal_the_whole_logits(softcap, n_chunks):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 7, 16, generator=g).requires_grad_()
    weight = torch.randn(50, 16, generator=g).requires_grad_()
    labels = torch.randint(0, 50, (3, 7), generator=g)
    labels[0, :3] = IGNORE_INDEX
    labels[2, 5:] = IGNORE_INDEX
    upstream = torch.randn(3, 7, generator=g)
    temperature = 0.6
    entropy = torch.zeros(3, 7)

    ours = ChunkedTokenLogProbs(labels, n_chunks, temperature=temperature, entropy=entropy)(hidden, weight,
                                                                                         softcap=softcap)
    (ours * upstream).sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    logits = hidden.double() @ weight.double().T
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    log_probs = F.log_softmax(logits / temperature, dim=-1)
    kept = labels != IGNORE_INDEX
    expected = log_probs.gather(2, labels.clamp(min=0)[..., None]).squeeze(-1) * kept
    (expected * upstream).sum().backward()
    expected_entropy = -(log_probs.exp() * log_probs).sum(-1) * kept

    assert_close(ours, expected.float(), terms=16 + 50, what="log-probabilities")
    # The entropy is log Z - sum p x logit: a cancellation of terms as large as the scaled logits.
    assert_close(entropy, expected_entropy.float(), terms=16 + 50, magnitude=float((logits / temperature).abs().max()),
                 what="entropy")
    assert_close(grads[0], hidden.grad.float(), terms=16 + 50 + 21, what="hidden gradient")
    assert_close(grads[1], weight.grad.float(), terms=16 + 50 + 21, what="weight gradient")
    assert float(ours.detach()[0, :3].abs().sum()) == 0.0


@pytest.mark.parametrize("keys, message", [
    ({"epsilon": -0.1}, "grpo.epsilon=-0.1"),
    ({"epsilon_high": -1.0}, "grpo.epsilon_high=-1"),
    ({"num_generations": 1}, "grpo.num_generations=1"),
])
def test_config_refuses(keys, message):
    with pytest.raises(UserError, match=message):
        GRPOConfig(**keys)
