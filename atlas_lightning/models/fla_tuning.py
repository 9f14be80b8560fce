"""flash-linear-attention's autotuning: once per kernel and head shape, never per micro-batch.

fla's Triton kernels are autotuned at their first call for each value of their autotune key
(Triton times every listed config; the Gated DeltaNet forward and backward of the 27B shape
took ~114 s the first time on an H200, ``bench/NOTES.md``). Most keys are head counts and dims, fixed for
a model; a few also hold a count derived from the row length (``NB = cdiv(T x heads, 65536)``
in the l2norm and gated-norm kernels, ``T``/``NT``/``B`` elsewhere). A packed micro-batch has a
new length nearly every time, so those kernels would be timed again on most micro-batches.

``pin_token_keys`` drops those names (``TOKEN_KEYS``) from the key of every autotuner in the
loaded fla modules: the config tuned at the first length serves every later one (each config
is valid at any length: the kernels mask their tails; only its speed was tuned). Triton's
per-process cache then holds one entry per kernel and head shape; ``tuned_entries`` counts them,
which is how the benchmark shows a new length re-tunes nothing. With fla's default
``FLA_CACHE_RESULTS=1`` Triton also keeps the timings on disk, so a second process on the same
machine skips the tuning (keys without the token counts match across lengths there too).

Who calls it: ``linear_attention.install_packed_linear_attention`` (kernel ``fla``), the benchmark.
"""

from __future__ import annotations

import sys
from typing import Iterator

#: Autotune key names that follow the row length or the number of sequences, not the model.
TOKEN_KEYS = frozenset({"T", "NT", "NB", "B", "N"})


def autotuners() -> Iterator[tuple[str, object]]:
    """``(kernel name, Triton Autotuner)`` for every autotuned kernel in the loaded fla modules
    (heuristics wrappers unwrapped), each once."""
    from triton.runtime.autotuner import Autotuner

    seen = set()
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("fla.") or module is None:
            continue
        for value in list(vars(module).values()):
            for _ in range(4):  # Heuristics(Autotuner(JITFunction)) and similar chains
                if isinstance(value, Autotuner):
                    if id(value) not in seen:
                        seen.add(id(value))
                        yield getattr(value.base_fn, "__name__", module_name), value
                    break
                value = getattr(value, "fn", None)
                if value is None:
                    break


def pin_token_keys() -> int:
    """Remove ``TOKEN_KEYS`` from every fla autotuner's key (module doc). Idempotent; returns
    how many autotuners had such names."""
    changed = 0
    for _, tuner in autotuners():
        kept = [name for name in tuner.keys if name not in TOKEN_KEYS]
        if len(kept) != len(tuner.keys):
            tuner.keys = kept
            changed += 1
    return changed


def tuned_entries() -> int:
    """Configs chosen so far in this process, over all fla autotuners (one per kernel and key)."""
    return sum(len(tuner.cache) for _, tuner in autotuners())
