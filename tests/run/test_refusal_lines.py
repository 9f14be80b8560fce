"""A refusal is one line, and a damaged file's refusal quotes the reading library's own words in at
most ``errors.QUOTED_CHARS`` characters: torch's text for a truncated ``state.ckpt`` ran to 556
characters over several sentences, which buried the checkpoint's name and what to do."""

from __future__ import annotations

import io
import re
import zipfile

import pytest
import torch

from atlas_lightning.config import ConfigError
from atlas_lightning.errors import QUOTED_CHARS, InputError
from atlas_lightning.run.exit_codes import exit_code_and_line
from atlas_lightning.run.resume_state import ResumeStateError, check_resume_state

#: what a message may hold besides the quoted library text: the folder's path and our own words
_OURS = 260


def _damaged_state(folder, how: str) -> None:
    state = folder / "lightning" / "state.ckpt"
    state.parent.mkdir(parents=True)
    buffer = io.BytesIO()
    torch.save({"a": torch.zeros(1000), "b": list(range(500))}, buffer)
    whole = buffer.getvalue()
    if how == "cut":  # a copy that stopped part-way
        state.write_bytes(whole[: len(whole) // 2])
    elif how == "zip of something else":  # a zip archive torch cannot read as its own
        with zipfile.ZipFile(state, "w") as archive:
            archive.writestr("readme.txt", "not a torch file " * 200)
    else:  # bytes of nothing
        state.write_bytes(b"\x00\xff" * 4096)


@pytest.mark.parametrize("how", ["cut", "zip of something else", "garbage"])
def test_a_damaged_state_is_refused_on_one_short_line_naming_the_checkpoint(how, tmp_path):
    folder = tmp_path / "global_step_3"
    _damaged_state(folder, how)
    with pytest.raises(ResumeStateError) as caught:
        check_resume_state(folder)
    message = str(caught.value)
    assert message.startswith(f"checkpoint {folder}: state.ckpt cannot be read: ")
    assert "\n" not in message
    quoted = message.split("cannot be read: ", 1)[1]
    assert len(quoted) <= QUOTED_CHARS + len("... (99999 more characters)")
    assert len(message) <= len(str(tmp_path)) + _OURS


def test_the_exit_line_folds_a_message_of_several_lines_onto_one():
    code, line = exit_code_and_line("atlas-lightning fit", ConfigError("trainer.resume=auto: none verifies:\n  a\n  b"))
    assert code == 2
    assert line == "atlas-lightning fit: config error: trainer.resume=auto: none verifies: a b"
    code, line = exit_code_and_line("atlas-lightning fit", InputError("one\r\ntwo\tthree"))
    assert (code, line) == (2, "atlas-lightning fit: one two three")


def test_a_long_library_message_is_cut_and_says_how_much_was_left_out(tmp_path):
    from atlas_lightning.store.files import read_json_object

    bad = tmp_path / "checkpoint.json"
    bad.write_bytes(b"\xff" * 5000)  # not UTF-8: the decoder's message names the byte and position
    with pytest.raises(ValueError) as caught:
        read_json_object(bad, ValueError, "checkpoint x")
    message = str(caught.value)
    assert message.startswith("checkpoint x: checkpoint.json is not readable JSON (UnicodeDecodeError: ")
    assert "\n" not in message and len(message) <= _OURS
    long = tmp_path / "long.json"
    long.write_text("{" + '"k": 1, ' * 20 + "oops" * 100)
    with pytest.raises(ValueError) as caught:
        read_json_object(long, ValueError, "where")
    assert re.search(r"^where: long\.json is not readable JSON \(JSONDecodeError: .+\)$", str(caught.value))
