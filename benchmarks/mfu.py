"""Model FLOPs utilisation: a bench's counted FLOPs over seconds, as a share of the GPU's dense bf16 peak.

The peaks are the vendors' datasheet numbers for dense bf16 tensor-core math (without the 2:4 sparsity the
datasheets headline), per GPU model as ``torch.cuda.get_device_name()`` names it. A GPU that no entry names (or a
name that leaves the model's form factor open, where the peaks differ) gets no MFU and a reason, never a guess.
"""

from __future__ import annotations

import re

import torch

# (pattern on the lower-cased device name, model, dense bf16 TFLOP/s); the first match wins, so the specific
# names come before the general ones.
BF16_PEAKS: tuple[tuple[str, str, float], ...] = (
    (r"\bgh200\b", "GH200", 989.0),
    (r"\bh200 nvl\b", "H200 NVL", 835.0),
    (r"\bh200\b", "H200 SXM", 989.0),
    (r"\bh100 nvl\b", "H100 NVL", 835.0),
    (r"\bh100 pcie\b", "H100 PCIe", 756.0),
    (r"\bh100\b.*\b(hbm3|sxm\d?)\b", "H100 SXM", 989.0),
    (r"\bb200\b", "B200", 2250.0),
    (r"\ba100\b", "A100", 312.0),
    (r"\bl40s\b", "L40S", 362.0),
    (r"\bl4\b", "L4", 121.0),
    (r"\ba10\b", "A10", 125.0),
)


def bf16_peak(device_name: str | None) -> tuple[float | None, str]:
    """The dense bf16 peak in TFLOP/s of the GPU ``device_name`` names (None: a CPU) and the model it was read as;
    ``(None, reason)`` when no entry of :data:`BF16_PEAKS` names it."""
    if not device_name:
        return None, "no GPU: MFU is a share of a GPU's bf16 peak"
    name = device_name.lower()
    for pattern, model, peak in BF16_PEAKS:
        if re.search(pattern, name):
            return peak, f"{model}: {peak:g} TFLOP/s dense bf16"
    if re.search(r"\bh100\b", name):
        return None, f"{device_name!r} does not say whether it is an H100 SXM (989 TFLOP/s) or PCIe (756)"
    return None, f"no dense bf16 peak is on record for {device_name!r} (benchmarks/mfu.py's BF16_PEAKS)"


def this_gpu_peak() -> dict[str, float | str | None]:
    """bench.json's machine keys for MFU: this process's first GPU's peak and the note on how it was read."""
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    peak, note = bf16_peak(name)
    return {"bf16_peak_tflops": peak, "peak_note": note}


def mfu(tflops_per_s: float | None, peak_tflops: float | None) -> float | None:
    """The share of ``peak_tflops`` that ``tflops_per_s`` reaches (None if either is unknown)."""
    if tflops_per_s is None or peak_tflops is None:
        return None
    return tflops_per_s / peak_tflops


def mfu_cell(share: float | None) -> str:
    """A table's MFU cell: a percentage, or blank (the footnote says why)."""
    return "" if share is None else f"{100 * share:.1f}%"


def mfu_footnote(machine: dict) -> str:
    """The line under a table with an MFU column: the peak it divides by, or why the column is blank."""
    if machine.get("bf16_peak_tflops") is None:
        return f"\nMFU is blank: {machine.get('peak_note', 'no peak on record')}.\n"
    return (f"\nMFU = counted FLOPs / (seconds x the GPU's dense bf16 peak); {machine['peak_note']} "
            "(benchmarks/mfu.py).\n")
