"""Triton kernels of kvpass and their launchers (no FX, no graph passes here)."""

from kvpass.kernels.attention import attention
from kvpass.kernels.quantize import quantize

__all__ = ["attention", "quantize"]
