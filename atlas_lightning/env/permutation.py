"""The order in which one trajectory reveals a question's candidates.

- ``question.permutations`` non-empty: trajectory ``sample_index`` uses
  ``permutations[sample_index % len(permutations)]`` and ``permutation_id`` is that index.
- Otherwise the order is derived from ``(seed, question_id, sample_index)`` by a Fisher-Yates
  shuffle whose draws are SHA-256 digests (stable across Python and numpy versions and processes,
  unlike ``hash()``), and ``permutation_id`` is ``-1`` (``DERIVED_PERMUTATION_ID``): derived orders
  are told apart by ``candidate_fingerprint``.

``candidate_fingerprint`` is the first 16 hex digits of the SHA-1 of the permuted candidates'
identities ``[(solver_model, cost_usd, answer), ...]`` as JSON: two trajectories with equal
fingerprints saw the same candidates in the same order.
"""

from __future__ import annotations

import hashlib
import json
import operator
from typing import Sequence

from atlas_lightning.questions.schema import Candidate, Question

DERIVED_PERMUTATION_ID = -1


def derived_permutation(n: int, seed: int, question_id: str, sample_index: int) -> tuple[int, ...]:
    """A permutation of ``range(n)`` that depends only on its arguments."""
    order = list(range(n))
    key = f"{seed}\x1f{question_id}\x1f{sample_index}".encode("utf-8", "surrogatepass")
    for i in range(n - 1, 0, -1):
        digest = hashlib.sha256(key + b"\x1f" + str(i).encode()).digest()
        # 64-bit draw: the modulo bias is below 1e-17 for any realistic n.
        j = int.from_bytes(digest[:8], "big") % (i + 1)
        order[i], order[j] = order[j], order[i]
    return tuple(order)


def check_permutation(permutation: Sequence[int], n: int, where: str) -> tuple[int, ...]:
    """``permutation`` as a tuple if it orders ``range(n)``; ``ValueError`` naming ``where`` if not."""
    try:
        values = tuple(operator.index(v) for v in permutation)
    except TypeError:
        values = None
    if values is None or sorted(values) != list(range(n)):
        raise ValueError(f"{where}: {list(permutation)[:20]} is not a permutation of 0..{n - 1}")
    return values


def choose_permutation(question: Question, sample_index: int, seed: int = 0) -> tuple[int, tuple[int, ...]]:
    """``(permutation_id, permutation)`` for trajectory ``sample_index`` of ``question``."""
    if not isinstance(sample_index, int) or sample_index < 0:
        raise ValueError(f"question {question.question_id}: sample_index must be an int >= 0, got {sample_index!r}")
    n = len(question.candidates)
    if question.permutations:
        permutation_id = sample_index % len(question.permutations)
        where = f"question {question.question_id}: permutations[{permutation_id}]"
        return permutation_id, check_permutation(question.permutations[permutation_id], n, where)
    return DERIVED_PERMUTATION_ID, derived_permutation(n, seed, question.question_id, sample_index)


def candidate_fingerprint(candidates: Sequence[Candidate], permutation: Sequence[int]) -> str:
    """16 hex digits identifying the permuted candidate list (see the module docstring)."""
    identities = [[candidates[i].solver_model, float(candidates[i].cost_usd), candidates[i].answer] for i in permutation]
    # ensure_ascii: lone surrogates in cached text must not make hashing fail.
    payload = json.dumps(identities, ensure_ascii=True, separators=(",", ":")).encode("ascii")
    return hashlib.sha1(payload).hexdigest()[:16]
