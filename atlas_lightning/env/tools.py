"""The orchestrator's two tools as OpenAI/Hermes-style JSON function schemas.

``tool_schemas(benchmark)`` is what the rollout layer passes to the tokenizer's chat template as
``tools=`` (Qwen3's template renders them inside ``<tools></tools>`` in the system turn). The
parser (``parsing.py``) checks a call's arguments against exactly these shapes:

- ``explore``: no arguments (``{}``); reveals the next candidate of this trajectory's order.
- ``submit``: ``{"answer": <string>}``, nothing else; ends the episode.
"""

from __future__ import annotations

EXPLORE = "explore"
SUBMIT = "submit"
TOOL_NAMES = (EXPLORE, SUBMIT)

_SUBMIT_ANSWER_HELP = {
    "gpqa": "The letter of the correct choice, e.g. \"B\".",
    "lcb": "The revealed candidate whose code you submit, as \"#k\" (k-th revealed, e.g. \"#2\").",
}


def tool_schemas(benchmark: str) -> list[dict]:
    """The ``tools=`` list for a question of ``benchmark`` (``gpqa`` or ``lcb``); a fresh copy."""
    if benchmark not in _SUBMIT_ANSWER_HELP:
        raise ValueError(f"benchmark {benchmark!r} has no tool schema; known: {', '.join(_SUBMIT_ANSWER_HELP)}")
    explore = {
        "type": "function",
        "function": {
            "name": EXPLORE,
            "description": (
                "Reveal the next cached candidate answer (its answer or code, the solver's approach "
                "and confidence) and pay its cost in dollars. Takes no arguments."
            ),
            "parameters": {"type": "object", "properties": {}, "required": [], "additionalProperties": False},
        },
    }
    submit = {
        "type": "function",
        "function": {
            "name": SUBMIT,
            "description": "Submit your final answer. Ends the episode.",
            "parameters": {
                "type": "object",
                "properties": {"answer": {"type": "string", "description": _SUBMIT_ANSWER_HELP[benchmark]}},
                "required": ["answer"],
                "additionalProperties": False,
            },
        },
    }
    return [explore, submit]
