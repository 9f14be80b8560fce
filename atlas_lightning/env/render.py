"""Text of the tool responses: what goes inside ``<tool_response>...</tool_response>``.

The rollout layer wraps these strings with the chat format; this module only writes their content.
An explore's response lists, in this order: the candidate's answer (GPQA) or code (LCB), the
solver's approach, its confidence, its cost (``Cost: $0.12``), then the budget line
(``Explore budget: 3/8 used, 5 remaining.``).
"""

from __future__ import annotations

import math

from atlas_lightning.questions.schema import Candidate


def format_usd(amount: float) -> str:
    """Dollars with two significant digits at least, and two decimals at least: ``$0.12``,
    ``$1.50``, ``$0.012``, ``$0.0035``, ``$0.00`` (a cheap candidate must not read as free)."""
    if not math.isfinite(amount) or amount < 0:
        raise ValueError(f"a cost must be a finite number >= 0 dollars, got {amount!r}")
    if amount == 0:
        return "$0.00"
    decimals = min(10, max(2, 1 - math.floor(math.log10(amount))))
    return f"${amount:.{decimals}f}"


def budget_line(used: int, quota: int) -> str:
    return f"Explore budget: {used}/{quota} used, {quota - used} remaining."


def render_candidate(benchmark: str, explore_k: int, candidate: Candidate, used: int, quota: int) -> str:
    """The response to the ``explore_k``-th explore, which revealed ``candidate``."""
    if benchmark == "lcb":
        body = f"Code:\n```python\n{candidate.answer.strip()}\n```"
    else:
        body = f"Answer: {candidate.answer.strip()}"
    return "\n".join(
        [
            f"Candidate #{explore_k}",
            body,
            f"Approach: {candidate.approach.strip()}",
            f"Confidence: {candidate.confidence:.2f}",
            f"Cost: {format_usd(candidate.cost_usd)}",
            budget_line(used, quota),
        ]
    )


def render_quota_spent(quota: int) -> str:
    """The response to an explore beyond the quota: nothing revealed, nothing charged."""
    return "\n".join(
        [
            f"Explore quota spent: all {quota} explores are used. Nothing was revealed and nothing was "
            "charged. Submit your answer.",
            budget_line(quota, quota),
        ]
    )


def ignored_calls_note(count: int) -> str:
    """Appended when a turn held more than one call: only the first was executed."""
    plural = "call was" if count == 1 else "calls were"
    return f"Note: one tool call per turn; {count} further {plural} ignored."
