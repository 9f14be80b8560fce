"""The runtime reads model output in time linear in its length: a valid call followed by a
megabyte of unclosed ``<tool_call>`` tags parses to the right result with one pass over the
text, and the graders' regular expressions do not backtrack on long whitespace runs.

No wall-clock assertions: the parser's tag scan is counted (characters handed to the one
regular expression that finds tags), and sizes 1x and 4x are compared by that count."""

from __future__ import annotations

import re

import pytest

from atlas_lightning.env import parsing
from atlas_lightning.env.episode import Episode, RuntimeConfig
from atlas_lightning.env.grading import normalize_code, read_candidate_reference, read_choice_letter
from atlas_lightning.env.parsing import CALL, MAX_RECORDED_IGNORED, OPEN_TAG, parse_turn

TAGS = parsing._TAGS
VALID = '<tool_call>{"name": "explore", "arguments": {}}</tool_call>'
MEGABYTE = 1 << 20


class _CountingTags:
    """Stands in for ``parsing._TAGS``: counts the calls and the characters scanned."""

    def __init__(self, pattern: re.Pattern):
        self.pattern = pattern
        self.calls = 0
        self.scanned = 0

    def finditer(self, text, *args):
        self.calls += 1
        self.scanned += len(text)
        return self.pattern.finditer(text, *args)


def _flood(size: int) -> str:
    return VALID + OPEN_TAG * (size // len(OPEN_TAG))


def _scan(monkeypatch, text: str):
    counter = _CountingTags(TAGS)
    monkeypatch.setattr(parsing, "_TAGS", counter)
    return parse_turn(text), counter


def test_a_megabyte_of_unclosed_tags_after_a_valid_call_is_one_pass(monkeypatch):
    text = _flood(MEGABYTE)
    parsed, counter = _scan(monkeypatch, text)
    tags = (len(text) - len(VALID)) // len(OPEN_TAG)
    assert parsed.kind == CALL and parsed.call.name == "explore" and parsed.call.arguments == {}
    assert parsed.ignored_count == tags  # every ignored call counted
    assert len(parsed.ignored_bodies) == MAX_RECORDED_IGNORED and set(parsed.ignored_bodies) == {""}
    assert (counter.calls, counter.scanned) == (1, len(text))


def test_work_grows_with_the_input_not_its_square(monkeypatch):
    small, counter_small = _scan(monkeypatch, _flood(MEGABYTE // 4))
    large, counter_large = _scan(monkeypatch, _flood(MEGABYTE))
    assert counter_large.scanned / counter_small.scanned == pytest.approx(4, rel=1e-3)
    assert large.ignored_count / small.ignored_count == pytest.approx(4, rel=1e-3)
    # what is kept for the record does not grow at all
    assert len(large.ignored_bodies) == len(small.ignored_bodies) == MAX_RECORDED_IGNORED


def test_the_record_counts_what_it_does_not_copy(build):
    episode = Episode(build.question(), sample_index=0, config=RuntimeConfig(max_explores=8, max_turns=9))
    response = episode.on_assistant_turn(_flood(MEGABYTE // 8), 0, 10)
    tags = (MEGABYTE // 8) // len(OPEN_TAG)
    assert f"{tags} further calls were ignored" in response
    ignored = [c for c in episode.proposed_calls if c["status"].startswith("ignored")]
    assert len(ignored) == MAX_RECORDED_IGNORED + 1
    assert ignored[-1] == {"turn": 1, "status": "ignored_unrecorded", "count": tags - MAX_RECORDED_IGNORED}


@pytest.mark.parametrize("text", [
    "A" + " " * MEGABYTE + "x",             # a letter, a long run of spaces, then more text
    "(" + " " * MEGABYTE + "x y",
    "option" + " " * MEGABYTE + "xy",
    "The answer is" + " " * MEGABYTE + "1",
    "candidate" + " " * MEGABYTE + "x",
    "#" + " " * MEGABYTE + "x",
])
def test_graders_read_megabytes_of_whitespace(text):
    # quadratic backtracking here took 11 s at 20 KB: a megabyte would not finish in a day
    assert read_choice_letter(text) is None
    assert read_candidate_reference(text) is None


def test_code_framed_by_a_megabyte_of_blank_lines():
    code = "\n" * MEGABYTE + "```python\n" + "\n" * MEGABYTE + "print(1)\n" + "\n" * MEGABYTE + "```" + "\n" * MEGABYTE
    assert normalize_code(code) == "print(1)"


def test_the_rewritten_graders_read_what_they_read_before():
    for text, letter in [("B", "B"), ("(b)", "B"), ("Option C.", "C"), ("[ D ]", "D"), ("A )", "A"),
                         ("The answer is (B).", "B"), ("answer is: C", "C"), ("Answer = D", "D")]:
        assert read_choice_letter(text) == letter, text
    for text, k in [("#3", 3), ("candidate # 2", 2), ("candidate 4.", 4), ("  7 ", 7), ("# 12", 12)]:
        assert read_candidate_reference(text) == k, text
