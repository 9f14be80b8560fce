"""The uid a question's trajectories carry: request ids, record file names and step folders
are all formed from it, so two questions of a split must never share one.

``trajectory_uid(benchmark, question_id)`` keeps a readable id where it can: ``gpqa-0017`` for
``gpqa-0017`` or ``0017`` in a gpqa file (an id that already starts with the benchmark is kept
as it is), characters outside ``[A-Za-z0-9._-]`` replaced, long ids cut, with a hash of the
full name appended whenever the name changed. ``7`` and ``gpqa-7`` in one gpqa file therefore
map to the same uid: the loader refuses such a file (``loader.load_questions``, naming both
rows), with this very function, which the rollout layer uses to name trajectories.
"""

from __future__ import annotations

import hashlib
import re

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def trajectory_uid(benchmark: str, question_id: str) -> str:
    """A file-name-safe uid for a question (shared by its samples), unique across benchmarks
    (ids are unique within a benchmark only); readable when possible."""
    name = question_id if question_id.startswith(benchmark) else f"{benchmark}-{question_id}"
    safe = _UNSAFE.sub("_", name)[:96] or "q"
    if safe != name:
        safe += "-" + hashlib.sha1(name.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    if not safe[0].isalnum():
        safe = "q" + safe
    return safe
