"""One variant of a parametrized test in ``make test``, the others in ``make test-e2e``."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import pytest


def first_variant_in_make_test(cases: Sequence[Any], id_of: Optional[Callable[[Any], str]] = None) -> list:
    """``cases`` as ``pytest.param``s: the first as it is, the others marked ``e2e`` (deselected
    unless ``--e2e``: ``make test-e2e``). A tuple is unpacked into the test's arguments; ``id_of(case)``
    names a case (default: pytest's id)."""
    return [pytest.param(*(case if isinstance(case, tuple) else (case,)), id=id_of(case) if id_of else None,
                         marks=() if index == 0 else pytest.mark.e2e)
            for index, case in enumerate(cases)]
