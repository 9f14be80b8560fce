"""Why an episode ended, with stable integer codes (README, "An episode").

The codes are part of the on-disk contract (``reward.terminal_reason_code`` in every record and
the ``terminal_reasons.json`` history): never renumber, only append.

Who ends an episode with which reason:

- the runtime itself (``Episode.on_assistant_turn``): ``submitted``, ``no_tool_call``,
  ``malformed_call``, ``max_turns``;
- the rollout layer (``Episode.stop``): ``response_length`` (the response token budget is
  spent) and ``context_overflow`` (prompt + response would exceed the engine's context).
"""

from __future__ import annotations

TERMINAL_REASON_CODES: dict[str, int] = {
    "submitted": 0,
    "no_tool_call": 1,
    "malformed_call": 2,
    "max_turns": 3,
    "response_length": 4,
    "context_overflow": 5,
}

#: The reasons only the rollout layer can know about (passed to ``Episode.stop``).
EXTERNAL_REASONS = ("response_length", "context_overflow")

TERMINAL_REASONS = tuple(TERMINAL_REASON_CODES)


def terminal_reason_code(reason: str) -> int:
    """The stable integer code of ``reason``; ``ValueError`` naming the known reasons otherwise."""
    try:
        return TERMINAL_REASON_CODES[reason]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown terminal reason {reason!r}; known: {', '.join(TERMINAL_REASONS)}"
        ) from None
