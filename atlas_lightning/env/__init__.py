"""The explore-cost runtime (README, "An episode"): tools, parsing, grading, terminal reasons, events.

Pure Python; no torch. ``Episode`` is the one object the rollout layer drives; the reward
(``atlas_lightning.reward``) reads only the event log it records.

Modules: ``tools`` (JSON schemas), ``prompts`` (system/user messages), ``parsing`` (one Hermes
call a turn), ``render`` (tool-response text), ``permutation`` (reveal order, fingerprint),
``grading`` (offline grading of a submit), ``terminal`` (reasons and codes), ``episode``.
"""

from atlas_lightning.env.episode import Episode, RuntimeConfig
from atlas_lightning.env.grading import grade_gpqa, grade_lcb, read_candidate_reference, read_choice_letter
from atlas_lightning.env.parsing import ParsedTurn, ToolCall, parse_turn
from atlas_lightning.env.permutation import candidate_fingerprint, choose_permutation
from atlas_lightning.env.terminal import TERMINAL_REASON_CODES, TERMINAL_REASONS, terminal_reason_code
from atlas_lightning.env.tools import tool_schemas

__all__ = [
    "Episode", "RuntimeConfig", "ParsedTurn", "ToolCall", "parse_turn", "grade_gpqa", "grade_lcb",
    "read_choice_letter", "read_candidate_reference", "candidate_fingerprint", "choose_permutation",
    "TERMINAL_REASON_CODES", "TERMINAL_REASONS", "terminal_reason_code", "tool_schemas",
]
