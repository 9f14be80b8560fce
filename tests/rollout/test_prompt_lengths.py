"""``step_questions.prompt_lengths``: the length of each question's prompt, as ``fitting`` keeps or
drops it, is ``len(prompt_ids(...))`` exactly, for every question of the sample under the tiny
model's and the shipped orchestrator's tokenizers; the shared start of the prompts (the system
prompt and the tools) is tokenized once there, and a tokenizer for which that cut is not proven
gets each prompt tokenized whole, with the same numbers."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from atlas_lightning.env.episode import Episode, RuntimeConfig
from atlas_lightning.questions.loader import load_splits
from atlas_lightning.rollout import step_questions
from atlas_lightning.rollout.chat import ChatFormat
from atlas_lightning.rollout.step_questions import prompt_ids, prompt_lengths


@pytest.fixture(scope="module")
def episodes(sample_data_dir):
    from atlas_lightning.config import compose

    cfg = compose(["experiment=tiny-cpu", f"data.root={sample_data_dir}"])
    splits = load_splits(cfg.data)
    limits = RuntimeConfig(max_explores=cfg.rollout.max_explores, max_turns=cfg.rollout.max_turns)
    return [Episode(q, 0, limits) for q in [*splits.train, *splits.val]]


def _cuts(monkeypatch) -> list:
    """The shared starts ``prompt_lengths`` checks, and what the check said of each."""
    seen, check = [], step_questions._splits_after

    def recording(tokenizer, head, boundary):
        seen.append(check(tokenizer, head, boundary))
        return seen[-1]

    monkeypatch.setattr(step_questions, "_splits_after", recording)
    return seen


@pytest.mark.parametrize("folder", ["tiny_model_dir", "orchestrator_dir"])
def test_every_prompt_length_is_that_of_its_prompt_ids(folder, request, episodes, monkeypatch):
    chat = ChatFormat(AutoTokenizer.from_pretrained(request.getfixturevalue(folder)))
    cuts = _cuts(monkeypatch)
    assert prompt_lengths(chat, episodes) == [len(prompt_ids(chat, episode)) for episode in episodes]
    # the few system prompts and tools the prompts share (by benchmark and limits), each cut proven
    # and tokenized once
    assert 2 <= len(cuts) <= len(episodes) // 8 and all(isinstance(n, int) and n > 100 for n in cuts), cuts


def _edited(source, tmp_path, edit):
    """A copy of the tokenizer folder ``source`` with ``edit`` applied to its tokenizer.json."""
    folder = tmp_path / "tokenizer"
    shutil.copytree(source, folder)
    data = json.loads((folder / "tokenizer.json").read_text())
    edit(data)
    (folder / "tokenizer.json").write_text(json.dumps(data))
    return AutoTokenizer.from_pretrained(folder)


def _strip_after_im_start(data):
    for token in data["added_tokens"]:
        if token["content"] == "<|im_start|>":
            token["rstrip"] = True  # the match takes the spaces after it: a cut there is not the text's


def _straddling_token(data):
    taken = {token["id"] for token in data["added_tokens"]} | set(data["model"]["vocab"].values())
    data["added_tokens"].append({"id": max(taken) + 1, "content": "|>user", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True})


@pytest.mark.parametrize("edit", [_strip_after_im_start, _straddling_token], ids=["rstrip", "straddling"])
def test_a_cut_that_is_not_proven_tokenizes_each_prompt_whole(edit, tiny_model_dir, tmp_path, episodes, monkeypatch):
    chat = ChatFormat(_edited(tiny_model_dir, tmp_path, edit))
    cuts = _cuts(monkeypatch)
    some = episodes[::8]
    assert prompt_lengths(chat, some) == [len(prompt_ids(chat, episode)) for episode in some]
    assert all(n is None for n in cuts)  # refused (straddling) or never tried (rstrip)


def test_fitting_keeps_and_drops_by_those_lengths(tiny_model_dir, sample_data_dir, tmp_path, episodes):
    from atlas_lightning.config import compose

    chat = ChatFormat(AutoTokenizer.from_pretrained(tiny_model_dir))
    some = episodes[::4]
    lengths = [len(prompt_ids(chat, episode)) for episode in some]
    limit = sorted(lengths)[len(lengths) // 2]
    cfg = compose(["experiment=tiny-cpu", f"data.root={sample_data_dir}", f"rollout.max_prompt_length={limit}"])
    questions = [episode.question for episode in some]
    said = []
    kept, kept_lengths = step_questions.fitting(questions, "train", chat, cfg, said.append)
    expected = [(e.question, n) for e, n in zip(some, lengths) if n <= limit]
    assert list(zip(kept, kept_lengths)) == expected and 0 < len(kept) < len(questions)
    assert said == [f"{len(questions) - len(kept)} of {len(questions)} train questions have prompts over "
                    f"rollout.max_prompt_length={limit} and are skipped"]
