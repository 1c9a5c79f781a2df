"""Triton kernels of kvpass and their launchers (no FX, no graph passes here)."""

from kvpass.kernels.attention import attention
from kvpass.kernels.quantize import quantize, quantize_refined

__all__ = ["attention", "quantize", "quantize_refined"]
