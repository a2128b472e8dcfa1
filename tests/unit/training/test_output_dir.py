"""Creating ``output_dir`` late in set-up (after every check) fails with a ``UserError``, not an ``OSError``."""

import pytest

from torchtune_ac.checkpoint import create_output_dir
from torchtune_ac.errors import UserError


def test_creates_missing_parents(tmp_path):
    assert create_output_dir(tmp_path / "a" / "b").is_dir()
    assert create_output_dir(tmp_path / "a" / "b").is_dir()  # already there: fine


@pytest.mark.parametrize("make_blocker", [lambda p: p.write_text("x"), lambda p: (p.write_text("x"), p.chmod(0o755))])
def test_a_file_in_the_way_is_a_user_error(tmp_path, make_blocker):
    make_blocker(tmp_path / "blocker")
    with pytest.raises(UserError, match=r"output_dir .*blocker/run: cannot create it \(Not a directory"):
        create_output_dir(tmp_path / "blocker" / "run")
