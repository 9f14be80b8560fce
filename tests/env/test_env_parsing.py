"""Every rule of atlas_lightning/env/parsing.py's docstring, one case or more each."""

import pytest

from atlas_lightning.env.parsing import CALL, MALFORMED, NO_CALL, parse_turn

EXPLORE = '<tool_call>{"name": "explore", "arguments": {}}</tool_call>'
SUBMIT_B = '<tool_call>{"name": "submit", "arguments": {"answer": "B"}}</tool_call>'


def test_well_formed_calls_with_text_around():
    parsed = parse_turn("I will look first.\n" + EXPLORE + "\nthen decide.")
    assert parsed.kind == CALL and parsed.call.name == "explore" and parsed.call.arguments == {}
    parsed = parse_turn(SUBMIT_B + "<|im_end|>")
    assert parsed.kind == CALL and parsed.call.arguments == {"answer": "B"}


@pytest.mark.parametrize("body", [
    '{"name": "explore"}',  # arguments absent
    '{"name": "explore", "arguments": "{}"}',  # OpenAI style string
    '{"name": "explore", "arguments": ""}',
])
def test_explore_argument_forms(body):
    parsed = parse_turn(f"<tool_call>{body}</tool_call>")
    assert parsed.kind == CALL and parsed.call.arguments == {}


def test_arguments_as_json_string():
    parsed = parse_turn('<tool_call>{"name": "submit", "arguments": "{\\"answer\\": \\"#2\\"}"}</tool_call>')
    assert parsed.kind == CALL and parsed.call.arguments == {"answer": "#2"}


@pytest.mark.parametrize("text", ["", "The answer is B.", '{"name": "submit", "arguments": {"answer": "B"}}',
                                  "<tool_response>Candidate #3 ... Cost: $0.00</tool_response>"])
def test_no_call(text):
    assert parse_turn(text).kind == NO_CALL


def test_reasoning_is_not_a_call():
    assert parse_turn("<think>maybe " + EXPLORE + "</think>No call.").kind == NO_CALL
    assert parse_turn("<think>" + SUBMIT_B + "</think>" + EXPLORE).call.name == "explore"
    # A template that opened <think> in the prompt: only the text after </think> counts.
    assert parse_turn(SUBMIT_B + "</think>" + EXPLORE).call.name == "explore"
    assert parse_turn(SUBMIT_B + "</think>nothing").kind == NO_CALL
    # Unclosed reasoning hides what follows.
    assert parse_turn("<think>" + EXPLORE).kind == NO_CALL


@pytest.mark.parametrize("text, fragment", [
    ("done</tool_call>", "without an opening"),
    ('</tool_call><tool_call>{"name": "explore"}</tool_call>', "without an opening"),
    ('<tool_call><tool_call>{"name": "explore"}</tool_call></tool_call>', "second <tool_call>"),
    ('<tool_call>{"name": "explore"}<tool_call>{"name": "explore"}', "second <tool_call>"),
    ('<tool_call>{"name": "explore", </tool_call>', "bad JSON"),
    ('<tool_call>{"name": "explore"} trailing</tool_call>', "bad JSON"),
    ("<tool_call></tool_call>", "bad JSON"),
    ('<tool_call>["explore"]</tool_call>', "not an object"),
    ('<tool_call>{"name": "submit", "arguments": {"answer": "A", "answer": "B"}}</tool_call>', "duplicate key"),
    ('<tool_call>{"name": "explore", "arguments": {"x": NaN}}</tool_call>', "NaN"),
    ('<tool_call>{"name": "delete_files", "arguments": {}}</tool_call>', "unknown tool"),
    ('<tool_call>{"arguments": {}}</tool_call>', "no string 'name'"),
    ('<tool_call>{"name": 3}</tool_call>', "no string 'name'"),
    ('<tool_call>{"name": "explore", "id": 1}</tool_call>', "unexpected key"),
    ('<tool_call>{"name": "explore", "arguments": {"n": 2}}</tool_call>', "no arguments"),
    ('<tool_call>{"name": "explore", "arguments": [1]}</tool_call>', "must be an object"),
    ('<tool_call>{"name": "explore", "arguments": "not json"}</tool_call>', "bad JSON"),
    ('<tool_call>{"name": "submit", "arguments": {}}</tool_call>', "exactly one argument"),
    ('<tool_call>{"name": "submit"}</tool_call>', "exactly one argument"),
    ('<tool_call>{"name": "submit", "arguments": {"answer": "B", "why": "x"}}</tool_call>', "exactly one argument"),
    ('<tool_call>{"name": "submit", "arguments": {"answer": 2}}</tool_call>', "must be a string"),
    ('<tool_call>{"name": "submit", "arguments": {"answer": null}}</tool_call>', "must be a string"),
    ('<tool_call>{"name": "explore", "arguments": {}', "without a complete JSON object"),
    ('<tool_call>{"name": "explore"} and more words', "followed by more text"),
    ("<tool_call>" + "[" * 100_000 + "]" * 100_000 + "</tool_call>", "deeply"),
])
def test_malformed(text, fragment):
    parsed = parse_turn(text)
    assert parsed.kind == MALFORMED
    assert fragment in parsed.error


def test_unclosed_call_left_by_a_stop_string_is_accepted():
    for tail in ("", "\n", "<|im_end|>", " \n<|im_end|><|endoftext|>"):
        parsed = parse_turn('<tool_call>\n{"name": "submit", "arguments": {"answer": "C"}}' + tail)
        assert parsed.kind == CALL and parsed.call.arguments == {"answer": "C"}


def test_empty_answer_is_a_valid_call():
    parsed = parse_turn('<tool_call>{"name": "submit", "arguments": {"answer": ""}}</tool_call>')
    assert parsed.kind == CALL and parsed.call.arguments == {"answer": ""}


def test_only_the_first_of_several_calls_counts():
    parsed = parse_turn(EXPLORE + " and " + SUBMIT_B + " and <tool_call>{broken")
    assert parsed.kind == CALL and parsed.call.name == "explore"
    assert len(parsed.ignored_bodies) == 2
    assert '"submit"' in parsed.ignored_bodies[0] and parsed.ignored_bodies[1] == "{broken"


def test_a_malformed_first_call_is_not_rescued_by_a_later_good_one():
    assert parse_turn('<tool_call>{"name": "nope"}</tool_call>' + SUBMIT_B).kind == MALFORMED


def test_text_must_be_str():
    with pytest.raises(TypeError, match="decoded text"):
        parse_turn(b"<tool_call>{}</tool_call>")
