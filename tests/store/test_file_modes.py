"""Every file the run or a ``data`` verb writes has a new file's ordinary permissions (``0o666``
less the umask), whoever wrote it: safetensors' ``save_file`` alone would leave a checkpoint's
adapter weights readable by their owner only, and a folder built aside would be ``mkdtemp``'s."""

from __future__ import annotations

import os
import stat

import torch
from peft import LoraConfig

from atlas_lightning.models.adapters import AdapterCopy, write_adapter_copy
from atlas_lightning.store.atomic import FILE_MODE, FOLDER_MODE, give_ordinary_modes
from atlas_lightning.store.staging import replace_folder, staging_folder


def _modes(folder) -> dict[str, int]:
    """Each path below ``folder`` (and itself, as ".") -> its permission bits."""
    found = {".": stat.S_IMODE(os.stat(folder).st_mode)}
    for root, folders, files in os.walk(folder):
        for name in folders + files:
            path = os.path.join(root, name)
            found[os.path.relpath(path, folder)] = stat.S_IMODE(os.stat(path).st_mode)
    return found


def test_an_adapter_folder_is_readable_as_any_new_file_is(tmp_path):
    copied = AdapterCopy(name="critic", config=LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]),
                         state={"base_model.model.q_proj.lora_A.weight": torch.zeros(2, 4)},
                         value_head={"weight": torch.zeros(1, 4)}, identity={"fingerprint": "x"})
    folder = write_adapter_copy(copied, tmp_path / "step" / "critic" / "lora_adapter")
    modes = _modes(folder)
    assert {"adapter_model.safetensors", "value_head.safetensors", "adapter_config.json"} <= set(modes)
    assert {path: mode for path, mode in modes.items() if mode != (FOLDER_MODE if path == "." else FILE_MODE)} == {}


def test_a_folder_built_aside_moves_in_with_ordinary_modes(tmp_path):
    out = tmp_path / "model"
    with staging_folder(tmp_path, "model") as work:
        built = work / "built"
        (built / "below").mkdir(parents=True)
        (built / "below" / "weights").write_bytes(b"w")
        os.chmod(built / "below" / "weights", 0o600)  # as safetensors writes it
        os.chmod(built, 0o700)  # as mkdtemp makes it
        replace_folder(built, out, work)
    assert _modes(out) == {".": FOLDER_MODE, "below": FOLDER_MODE, "below/weights": FILE_MODE}


def test_links_are_left_as_they_are(tmp_path):
    (tmp_path / "target").write_text("t")
    os.chmod(tmp_path / "target", 0o600)
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "link").symlink_to(tmp_path / "target")
    give_ordinary_modes(folder)
    assert stat.S_IMODE(os.stat(tmp_path / "target").st_mode) == 0o600
