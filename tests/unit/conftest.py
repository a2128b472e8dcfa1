"""Unit tests: this folder is on ``sys.path`` (pytest puts a conftest's folder there), so test files in every
sub-folder can import the shared ``gloo_testlib`` and ``models_testlib``."""

import pytest

pytest.register_assert_rewrite("gloo_testlib", "models_testlib", "compile_testlib", "vision_testlib")
