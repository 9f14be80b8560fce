"""One line, not a traceback per kernel, when torch cannot analyse a Triton kernel's writes.

Why: when vLLM's engine first compiles a model (a cold compile cache), torch's Inductor asks, for
each user Triton kernel in the graph, which of its arguments the kernel writes. Under a Triton
that torch's analysis does not follow (torch 2.11 with the Triton 3.7.1 that flash-linear-attention
needs beside it; seen for vLLM's ``_fused_qk_rmsnorm_rope_gate_kernel``), that analysis raises, and
torch logs a warning with the whole ``CompilationError`` traceback, once per kernel and per
compiled shape: 28 tracebacks on the hybrid's engine. torch then treats every argument of that
kernel as written, which is correct (it only orders and keeps more buffers than it needs), and
generation is unchanged (atlas_lightning/bench/README.md, "The 27B hybrid through `fit`", its
thirteenth attempt).

Contract: ``summarise_kernel_analysis_failures()`` (idempotent) installs a filter on the logger
torch uses (``torch._dynamo``). The first such warning of the process passes as one line naming
the kernel analysis, the exception (its last line) and what torch does instead; later ones pass
no more. Every other record, of that logger or any other, passes unchanged.
"""

from __future__ import annotations

import logging

#: the logger torch's ``triton_kernel_wrap`` writes to (torch 2.11 and 2.13)
TORCH_LOGGER = "torch._dynamo"
#: the start of torch's warning: "... in identify_mutated_tensors" (2.11), "... identify_accessed_tensors" (2.13)
FAILURE_PREFIX = "Encountered an exception in identify_"


class KernelAnalysisSummary(logging.Filter):
    """The filter of the module doc; ``count`` is how many such warnings it has seen."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(FAILURE_PREFIX):
            return True
        self.count += 1
        if self.count > 1:
            return False
        record.msg = ("torch could not analyse which arguments a Triton kernel writes (%s), so it treats "
                      "every argument as written: correct, if less frugal. Further such warnings of this "
                      "process are not shown.")
        record.args = (_last_line(record.exc_info[1] if record.exc_info else None),)
        record.exc_info = None
        record.exc_text = None
        return True


def _last_line(error: BaseException | None) -> str:
    """``error``'s type and the last line of its message (a ``CompilationError`` quotes source first)."""
    if error is None:
        return "no exception recorded"
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[-1]}" if lines else type(error).__name__


def summarise_kernel_analysis_failures() -> KernelAnalysisSummary:
    """Install the module doc's filter on torch's logger, once; returns the installed filter."""
    logger = logging.getLogger(TORCH_LOGGER)
    for existing in logger.filters:
        if isinstance(existing, KernelAnalysisSummary):
            return existing
    summary = KernelAnalysisSummary()
    logger.addFilter(summary)
    return summary
