"""``--config-dir`` reaches hydra as a quoted search path: a folder whose name holds letters beyond
ASCII, parentheses, brackets, quotes or backslashes loads the user's experiment like any other,
where hydra's grammar used to refuse the bare path with a lexer error naming neither the option
nor the folder."""

from __future__ import annotations

import pytest

from atlas_lightning.config import compose

_EXPERIMENT = "# @package _global_\ndefaults:\n  - tiny-cpu\nname: mine-loaded\n"


@pytest.mark.parametrize("folder", ["ücnf", "paren(1)", "it's [x]", "back\\slash", "ends in\\", "q\\'x", "a b,c=d"])
def test_a_config_dir_of_any_name_loads_its_experiment(folder, tmp_path):
    root = tmp_path / folder
    (root / "experiment").mkdir(parents=True)
    (root / "experiment" / "mine.yaml").write_text(_EXPERIMENT)
    assert compose(["experiment=mine"], user_config_dir=str(root)).name == "mine-loaded"
