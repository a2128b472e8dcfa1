"""What the data tests share: the embedded tokenizer, loaded once per module."""

from __future__ import annotations

import pytest

from torchtune_ac.data import EMBEDDED_TOKENIZER_DIR, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(EMBEDDED_TOKENIZER_DIR)
