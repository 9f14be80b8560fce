"""Reading (and checking) a runtime event log: the only input of the reward.

``episode`` is the record's ``episode`` field (``Episode.to_record_episode()``, or the same dict
read back from a record file). Its ``events`` are described in ``atlas_lightning.env.episode``.
A log that breaks the runtime's guarantees raises ``ValueError`` naming the event and the fault,
so a corrupted record cannot silently produce a reward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from atlas_lightning.env.terminal import TERMINAL_REASON_CODES

EVENT_TYPES = ("explore", "explore_over_quota", "submit", "terminal")


@dataclass(frozen=True)
class EventLog:
    """The events of one episode, by kind, in order."""

    explores: tuple[dict, ...]  # charged explores, explore_k = 1, 2, ...
    over_quota: tuple[dict, ...]
    submit: dict | None
    terminal: dict
    max_explores: int
    num_turns: int


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_span(value: Any, where: str) -> None:
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(_is_index(v) for v in value)
            and value[1] > value[0]):
        raise ValueError(f"{where}: offsets must be [start, end] with 0 <= start < end, got {value!r}")


def read_event_log(episode: Mapping[str, Any]) -> EventLog:
    """Split and check ``episode["events"]``; ``ValueError`` naming the first fault."""
    if not isinstance(episode, Mapping):
        raise ValueError(f"episode must be a mapping (the record's 'episode' field), got {type(episode).__name__}")
    name = f"episode {episode.get('question_id', '?')!s}"
    events = episode.get("events")
    if not isinstance(events, (list, tuple)) or not events:
        raise ValueError(f"{name}: 'events' must be a non-empty list")
    explores: list[dict] = []
    over_quota: list[dict] = []
    submit = None
    for i, event in enumerate(events):
        where = f"{name}: events[{i}]"
        kind = event.get("type") if isinstance(event, Mapping) else None
        if kind not in EVENT_TYPES:
            raise ValueError(f"{where}: type {kind!r} is not one of {', '.join(EVENT_TYPES)}")
        if kind == "terminal":
            if i != len(events) - 1:
                raise ValueError(f"{where}: the terminal event must be the last event")
            continue
        _check_span(event.get("offsets"), where)
        if kind == "explore":
            k = event.get("explore_k")
            if k != len(explores) + 1:
                raise ValueError(f"{where}: explore_k={k!r}, expected {len(explores) + 1} (explores count 1, 2, ...)")
            cost = event.get("charged_cost_usd")
            if not isinstance(cost, (int, float)) or isinstance(cost, bool) or not math.isfinite(cost) or cost < 0:
                raise ValueError(f"{where}: charged_cost_usd={cost!r} must be a finite number >= 0")
            if not isinstance(event.get("is_correct"), bool):
                raise ValueError(f"{where}: is_correct must be a bool, got {event.get('is_correct')!r}")
            explores.append(event)
        elif kind == "explore_over_quota":
            if event.get("charged_cost_usd") != 0:
                raise ValueError(f"{where}: an explore beyond the quota must charge 0, got {event.get('charged_cost_usd')!r}")
            over_quota.append(event)
        else:
            if submit is not None:
                raise ValueError(f"{where}: a second submit (the first one ends the episode)")
            if event.get("acc") not in (0, 1) or isinstance(event.get("acc"), float):
                raise ValueError(f"{where}: acc must be 0 or 1, got {event.get('acc')!r}")
            submit = event
    terminal = events[-1]
    if terminal.get("type") != "terminal":
        raise ValueError(f"{name}: the last event must be the terminal event, got {terminal.get('type')!r}")
    reason = terminal.get("terminal_reason")
    if not isinstance(reason, str) or TERMINAL_REASON_CODES.get(reason) != terminal.get("terminal_reason_code"):
        raise ValueError(
            f"{name}: terminal reason {reason!r} with code {terminal.get('terminal_reason_code')!r} "
            f"does not match the known codes {TERMINAL_REASON_CODES}"
        )
    if (submit is not None) != (reason == "submitted"):
        raise ValueError(f"{name}: terminal reason {reason!r} disagrees with the presence of a submit event")
    last = terminal.get("last_generated")
    if last is not None and not _is_index(last):
        raise ValueError(f"{name}: terminal last_generated={last!r} must be an int >= 0 or null")
    if last is None and (explores or submit or over_quota):
        raise ValueError(f"{name}: terminal last_generated is null although turns were generated")
    max_explores = episode.get("max_explores", 8)
    if not _is_index(max_explores) or len(explores) > max_explores:
        raise ValueError(f"{name}: {len(explores)} charged explores exceed max_explores={max_explores!r}")
    return EventLog(
        explores=tuple(explores), over_quota=tuple(over_quota), submit=submit, terminal=terminal,
        max_explores=max_explores, num_turns=int(episode.get("num_turns", 0) or 0),
    )
