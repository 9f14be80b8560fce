"""fla's autotuning keyed on shapes only (``models/fla_tuning.py``): after ``pin_token_keys`` no
autotuned fla kernel on the Gated DeltaNet path keys on a length-derived value, so a new
micro-batch length finds its config tuned. Runs where flash-linear-attention imports (its
modules load without a GPU); skipped with the reason elsewhere."""

from __future__ import annotations

import importlib

import pytest

from atlas_lightning.models.linear_kernels import FLA_MODULES, fla_problem

pytestmark = pytest.mark.skipif(fla_problem() is not None, reason=str(fla_problem()))


def test_no_fla_autotuner_keys_on_the_row_length_after_pinning():
    from atlas_lightning.models.fla_tuning import TOKEN_KEYS, autotuners, pin_token_keys

    for name in FLA_MODULES:
        importlib.import_module(name)
    tuners = dict(autotuners())
    # kernels the packed Gated DeltaNet runs (the first two key on NB = cdiv(T x heads, 65536) unpinned)
    assert {"l2norm_fwd_kernel", "layer_norm_gated_fwd_kernel", "chunk_fwd_kernel_o"} <= set(tuners)
    pin_token_keys()  # (an earlier test in this process may have pinned them already)
    assert not any(TOKEN_KEYS & set(t.keys) for _, t in autotuners())
    assert pin_token_keys() == 0  # idempotent
    assert "D" in tuners["l2norm_fwd_kernel"].keys  # the shape part of the key stays
