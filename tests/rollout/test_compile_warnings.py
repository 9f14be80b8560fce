"""torch's per-kernel tracebacks when it cannot analyse a Triton kernel's writes become one line."""

import logging

import pytest

from atlas_lightning.rollout.engines import compile_warnings
from atlas_lightning.rollout.engines.compile_warnings import summarise_kernel_analysis_failures


class Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(self.format(record))


@pytest.fixture
def torch_logger():
    logger = logging.getLogger(compile_warnings.TORCH_LOGGER)
    handler, filters, propagate, level = Collect(), list(logger.filters), logger.propagate, logger.level
    logger.addHandler(handler)
    logger.propagate = False
    yield logger, handler
    logger.removeHandler(handler)
    logger.filters[:] = filters
    logger.propagate = propagate
    logger.setLevel(level)


def _torch_warns(logger, message="Encountered an exception in identify_mutated_tensors, assuming every input is mutated"):
    try:  # as triton.compiler.errors.CompilationError renders: the source first, the cause last
        raise RuntimeError("at 1:0:\ndef _fused_qk_rmsnorm_rope_gate_kernel(\n^\nIndexError('Function argument index out of range')")
    except RuntimeError:
        logger.warning(message, exc_info=True)


def test_the_first_failure_is_one_line_naming_the_cause_and_later_ones_are_dropped(torch_logger):
    logger, handler = torch_logger
    summary = summarise_kernel_analysis_failures()
    for _ in range(28):
        _torch_warns(logger)
    _torch_warns(logger, "Encountered an exception in identify_accessed_tensors, assuming every input is mutated")
    assert summary.count == 29
    assert len(handler.lines) == 1
    line = handler.lines[0]
    assert "\n" not in line and "Traceback" not in line
    assert "RuntimeError: IndexError('Function argument index out of range')" in line
    assert "every argument as written" in line


def test_other_records_pass_unchanged_with_their_tracebacks(torch_logger):
    logger, handler = torch_logger
    summarise_kernel_analysis_failures()
    try:
        raise ValueError("graph break")
    except ValueError:
        logger.warning("something else broke", exc_info=True)
    logger.info("recompiling")
    logger.setLevel(logging.INFO)
    logger.info("recompiling")
    assert handler.lines[0].startswith("something else broke") and "Traceback" in handler.lines[0]
    assert handler.lines[-1] == "recompiling"


def test_installing_twice_keeps_one_filter(torch_logger):
    logger, _ = torch_logger
    first = summarise_kernel_analysis_failures()
    assert summarise_kernel_analysis_failures() is first
    assert sum(isinstance(f, compile_warnings.KernelAnalysisSummary) for f in logger.filters) == 1
