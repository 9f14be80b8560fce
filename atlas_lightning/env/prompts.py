"""The episode's opening messages: a system message (the orchestrator's role, its two tools, the
budget) and a user message (the problem, "You have up to N explores.", how to submit).

Kept to about two hundred tokens before the problem: the chat template adds the tools' JSON
schemas on top, and the tiny CPU model's prompt budget is 1,024 tokens.
"""

from __future__ import annotations

_SUBMIT_RULE = {
    "gpqa": 'Submit the letter of the correct choice: submit with {"answer": "B"}.',
    "lcb": (
        'Submit the code of one revealed candidate by naming it: submit with {"answer": "#k"} for the '
        "k-th candidate you revealed (e.g. \"#2\"). Only revealed candidates can be submitted."
    ),
}


def system_message(benchmark: str, explore_quota: int, max_turns: int) -> str:
    if benchmark not in _SUBMIT_RULE:
        raise ValueError(f"benchmark {benchmark!r} has no prompt; known: {', '.join(_SUBMIT_RULE)}")
    return (
        "You are an orchestrator. You answer a question without solving it yourself: cached candidate "
        "answers, written earlier by solver models of different strength and price, are available "
        "one at a time.\n\n"
        "Tools:\n"
        "- explore: reveals the next candidate (its answer or code, the solver's approach and "
        "confidence) and charges its cost in dollars. Candidates come in a random order.\n"
        "- submit: gives your final answer and ends the episode.\n\n"
        "Rules:\n"
        f"- At most {explore_quota} explores; an explore beyond that reveals nothing.\n"
        "- Exactly one tool call per turn, written as "
        '<tool_call>{"name": ..., "arguments": {...}}</tool_call>. A turn without a valid tool call '
        f"ends the episode without an answer, and so does reaching {max_turns} turns.\n"
        "- A correct answer is what counts most; every dollar spent on candidates lowers your "
        "score, so explore only while it is worth the price.\n"
        f"- {_SUBMIT_RULE[benchmark]}"
    )


def user_message(benchmark: str, problem: str, explore_quota: int) -> str:
    if benchmark not in _SUBMIT_RULE:
        raise ValueError(f"benchmark {benchmark!r} has no prompt; known: {', '.join(_SUBMIT_RULE)}")
    return f"{problem.strip()}\n\nYou have up to {explore_quota} explores. {_SUBMIT_RULE[benchmark]}"
