"""The cards the benchmarks ran on or project to, by the name CUDA gives them: HBM bandwidth (the
vendor's figure, TB/s) and the bf16 matmul rate used where a card was not measured. Plain data,
so that the step report (``step.py``, which records its card's HBM) and the projection
(``projection.py``, which reads it back) agree without importing each other."""

from __future__ import annotations

from typing import Optional

#: HBM bandwidth in TB/s of each card, by a fragment of ``torch.cuda.get_device_name`` (first
#: match wins: the longer names first).
HBM_TBS: tuple[tuple[str, float], ...] = (
    ("H200", 4.8),
    ("H100 80GB HBM3", 3.35),  # the SXM card
    ("H100 NVL", 3.9),
    ("H100 PCIe", 2.0),
    ("A100-SXM4-80GB", 2.04),
    ("A100 80GB PCIe", 1.94),
)

H200_HBM_TBS, A100_HBM_TBS = dict(HBM_TBS)["H200"], dict(HBM_TBS)["A100-SXM4-80GB"]
#: the bf16 matmul rate the step benchmark measured on the H200 (step run 3's LoRA step; its runs
#: measured 743-761 TFLOP/s), the rate a projection to H200s divides by when it was measured elsewhere
H200_MEASURED_TFLOPS = 747.0
#: the A100's nominal dense bf16 rate (no A100 was measured)
A100_TFLOPS = 312.0


def hbm_tbs(device_name: Optional[str]) -> Optional[float]:
    """The HBM bandwidth (TB/s) of the card CUDA names ``device_name``; None when unknown."""
    for fragment, tbs in HBM_TBS:
        if device_name and fragment in device_name:
            return tbs
    return None
