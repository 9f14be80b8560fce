"""Reading the one Hermes tool call of one assistant turn.

The runtime sees only the decoded text of the turn's generated tokens: a ``str`` that may hold
U+FFFD replacement characters, lone surrogates, NUL bytes or megabytes of text; none of that is
special here. ``parse_turn`` decides between three outcomes: a call to execute (``CALL``), no call
(``NO_CALL``: terminal reason ``no_tool_call``) and a malformed call (``MALFORMED``: terminal
reason ``malformed_call``). The rules, applied in this order:

1. Reasoning is not a call. Every ``<think>...</think>`` block is removed first. A ``</think>``
   with no ``<think>`` before it (templates that open the block in the generation prompt) hides
   everything before it; an unclosed ``<think>`` hides everything after it.
2. Neither ``<tool_call>`` nor ``</tool_call>`` in what remains: ``NO_CALL``. Any other text,
   including a bare JSON object, "Candidate #3 ... Cost: $0.00" or a ``<tool_response>`` the model
   typed itself, is only text.
3. A ``</tool_call>`` before the first ``<tool_call>``: ``MALFORMED`` (stray closing tag).
4. The first call's body runs from the first ``<tool_call>`` to the next ``</tool_call>``; a second
   ``<tool_call>`` inside it: ``MALFORMED`` (nested tags).
5. An unclosed first ``<tool_call>`` is accepted only when what follows it is one JSON object and
   then nothing but whitespace and end-of-turn markers (``<|im_end|>``, ``<|endoftext|>``): that is
   what an engine stop string of ``</tool_call>`` leaves behind. Anything else: ``MALFORMED``.
6. The body, stripped of whitespace, must be exactly one JSON object: no duplicate keys, no
   ``NaN``/``Infinity``, no nesting deep enough to exhaust the recursion limit; else ``MALFORMED``.
7. The object holds ``name`` (a string) and optionally ``arguments``, nothing else. ``arguments`` is
   an object, or a string holding one JSON object (OpenAI style); absent means ``{}``.
8. ``name`` must be a known tool (``explore``, ``submit``), else ``MALFORMED`` (unknown tool). The
   arguments must fit the tool's schema exactly (``explore``: ``{}``; ``submit``:
   ``{"answer": <string>}``), else ``MALFORMED`` (bad arguments). An empty answer string is a valid
   call: it is graded wrong, not refused.
9. Text before and after the call is ignored. Calls after the first one are never executed (one
   call a turn): they are counted (``ignored_count``, which the tool response states) and the
   first ``MAX_RECORDED_IGNORED`` of their bodies are returned as ``ignored_bodies`` for the record.

Cost: linear in the length of the text. Tags are found by one pass of one regular expression
over the visible text (``_TAGS``); every later step walks that list of tag positions or
decodes one body once. A megabyte of unclosed ``<tool_call>`` tags after a valid call is one
pass, not one scan to the end of the text per tag.

Nothing here executes or evaluates model output; it only reads JSON.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from atlas_lightning.env.tools import EXPLORE, SUBMIT, TOOL_NAMES

CALL = "call"
NO_CALL = "no_call"
MALFORMED = "malformed"

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
END_OF_TURN_MARKERS = ("<|im_end|>", "<|endoftext|>")

#: Raw call bodies kept in the record are cut to this many characters (the full text of the
#: turn is in the record's ``generations`` anyway).
MAX_RECORDED_BODY_CHARS = 2000
#: Bodies of ignored calls kept in the record (all of them are counted).
MAX_RECORDED_IGNORED = 16

#: Every opening or closing call tag, found in one pass.
_TAGS = re.compile(re.escape(OPEN_TAG) + "|" + re.escape(CLOSE_TAG))


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass(frozen=True)
class ParsedTurn:
    """What one assistant turn asked for. ``call`` is set iff ``kind == CALL``; ``error`` (a short
    reason naming the rule) iff ``kind == MALFORMED``; ``body`` is the first call's raw body."""

    kind: str
    call: ToolCall | None = None
    error: str | None = None
    body: str | None = None
    ignored_bodies: tuple[str, ...] = field(default_factory=tuple)
    #: Calls after the first one (never executed); ``ignored_bodies`` keeps the first few.
    ignored_count: int = 0


class _RejectedJson(ValueError):
    pass


def _unique_pairs(pairs: list[tuple[str, object]]) -> dict:
    # A duplicated "answer" key would make the call mean whatever json's last-wins rule says.
    result: dict = {}
    for key, value in pairs:
        if key in result:
            raise _RejectedJson(f"duplicate key {_short(key)}")
        result[key] = value
    return result


def _reject_constant(name: str) -> object:
    raise _RejectedJson(f"{name} is not valid JSON")


_DECODER = json.JSONDecoder(object_pairs_hook=_unique_pairs, parse_constant=_reject_constant)


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _clip(body: str) -> str:
    return body if len(body) <= MAX_RECORDED_BODY_CHARS else body[:MAX_RECORDED_BODY_CHARS] + "...[cut]"


def strip_reasoning(text: str) -> str:
    """``text`` without its reasoning (rule 1)."""
    first_open = text.find(THINK_OPEN)
    first_close = text.find(THINK_CLOSE)
    if first_close != -1 and (first_open == -1 or first_close < first_open):
        text = text[first_close + len(THINK_CLOSE):]
    kept: list[str] = []
    position = 0
    while True:
        start = text.find(THINK_OPEN, position)
        if start == -1:
            kept.append(text[position:])
            break
        kept.append(text[position:start])
        end = text.find(THINK_CLOSE, start + len(THINK_OPEN))
        if end == -1:  # unclosed: the rest is reasoning
            break
        position = end + len(THINK_CLOSE)
    return "".join(kept)


def _decode_object(text: str) -> dict:
    """Exactly one JSON object (rule 6); ``_RejectedJson`` with the reason otherwise."""
    try:
        value = _DECODER.decode(text.strip())
    except _RejectedJson:
        raise
    except RecursionError:
        raise _RejectedJson("JSON nested too deeply") from None
    except ValueError as err:
        raise _RejectedJson(f"bad JSON ({str(err).splitlines()[0][:120]})") from None
    if not isinstance(value, dict):
        raise _RejectedJson(f"the call is a JSON {type(value).__name__}, not an object")
    return value


def _decode_unclosed(rest: str) -> dict:
    """Rule 5: one JSON object, then only whitespace and end-of-turn markers."""
    stripped = rest.lstrip()
    try:
        value, end = _DECODER.raw_decode(stripped)
    except _RejectedJson:
        raise
    except RecursionError:
        raise _RejectedJson("JSON nested too deeply") from None
    except ValueError:
        raise _RejectedJson("unclosed <tool_call> without a complete JSON object") from None
    tail = stripped[end:]
    for marker in END_OF_TURN_MARKERS:
        tail = tail.replace(marker, "")
    if tail.strip():
        raise _RejectedJson("unclosed <tool_call> followed by more text")
    if not isinstance(value, dict):
        raise _RejectedJson(f"the call is a JSON {type(value).__name__}, not an object")
    return value


def _check_call(obj: dict) -> ToolCall:
    """Rules 7 and 8: name, arguments, schema."""
    extra = sorted(set(obj) - {"name", "arguments"})
    if extra:
        raise _RejectedJson(f"unexpected key(s) {', '.join(_short(k) for k in extra)} beside name/arguments")
    name = obj.get("name")
    if not isinstance(name, str):
        raise _RejectedJson("the call has no string 'name'")
    if name not in TOOL_NAMES:
        raise _RejectedJson(f"unknown tool {_short(name)}; tools: {', '.join(TOOL_NAMES)}")
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):
        arguments = _decode_object(arguments) if arguments.strip() else {}
    if not isinstance(arguments, dict):
        raise _RejectedJson(f"{name}: arguments must be an object, got {type(arguments).__name__}")
    if name == EXPLORE and arguments:
        raise _RejectedJson(f"explore takes no arguments, got {', '.join(_short(k) for k in sorted(arguments))}")
    if name == SUBMIT:
        if set(arguments) != {"answer"}:
            raise _RejectedJson(
                f"submit takes exactly one argument 'answer', got {', '.join(_short(k) for k in sorted(arguments)) or 'none'}"
            )
        if not isinstance(arguments["answer"], str):
            raise _RejectedJson(f"submit: answer must be a string, got {type(arguments['answer']).__name__}")
    return ToolCall(name=name, arguments=arguments)


def _later_bodies(text: str, tags: list[tuple[int, str]], start: int) -> tuple[tuple[str, ...], int]:
    """Rule 9: (the first ``MAX_RECORDED_IGNORED`` raw bodies, the count) of the calls whose
    ``<tool_call>`` is at or after ``tags[start]``, closed or not. A body runs to the next tag of
    either kind, or to the end of the text. One walk over ``tags``."""
    bodies: list[str] = []
    count = 0
    for i in range(start, len(tags)):
        position, tag = tags[i]
        if tag != OPEN_TAG:
            continue
        count += 1
        if len(bodies) < MAX_RECORDED_IGNORED:
            stop = tags[i + 1][0] if i + 1 < len(tags) else len(text)
            bodies.append(_clip(text[position + len(OPEN_TAG):stop]))
    return tuple(bodies), count


def parse_turn(text: str) -> ParsedTurn:
    """Apply the module's rules to one assistant turn's decoded text. Never raises on content;
    ``TypeError`` if ``text`` is not a ``str`` (the rollout layer decodes bytes first)."""
    if not isinstance(text, str):
        raise TypeError(f"parse_turn takes the decoded text (str), got {type(text).__name__}")
    visible = strip_reasoning(text)
    tags = [(m.start(), m.group()) for m in _TAGS.finditer(visible)]
    if not tags:
        return ParsedTurn(kind=NO_CALL)
    if tags[0][1] == CLOSE_TAG:
        return ParsedTurn(kind=MALFORMED, error="</tool_call> without an opening <tool_call>")
    body_start = tags[0][0] + len(OPEN_TAG)
    following = tags[1] if len(tags) > 1 else None
    if following is not None and following[1] == OPEN_TAG:
        end = next((pos for pos, tag in tags[2:] if tag == CLOSE_TAG), len(visible))
        return ParsedTurn(kind=MALFORMED, error="a second <tool_call> before the first one is closed",
                          body=_clip(visible[body_start:end]))
    closed = following is not None
    body = visible[body_start:following[0]] if closed else visible[body_start:]
    try:
        obj = _decode_object(body) if closed else _decode_unclosed(body)
        call = _check_call(obj)
    except _RejectedJson as err:
        return ParsedTurn(kind=MALFORMED, error=str(err), body=_clip(body))
    ignored, count = _later_bodies(visible, tags, 2) if closed else ((), 0)
    return ParsedTurn(kind=CALL, call=call, body=_clip(body), ignored_bodies=ignored, ignored_count=count)
