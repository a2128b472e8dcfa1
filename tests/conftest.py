"""All tests: this folder is on ``sys.path`` (pytest puts a conftest's folder there), so unit and integration
tests share ``hf_families`` (tiny random checkpoints made with transformers' own classes)."""

import pytest

pytest.register_assert_rewrite("hf_families")
