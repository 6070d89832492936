"""Which devices torch can use on this machine, why the others cannot be used, and what runs where.

- ``discovery``: ``discover()`` probes each backend and never raises, ``choose()`` and ``best_device()``
  pick the one ``shadow demo`` uses; ``python -m shadow doctor`` renders them. ``holds_dtype(device, dtype)``:
  whether a device type has a dtype at all (DirectML: no float64, no bfloat16).
- ``dispatch``: ``kernel_source(func, device)`` and ``cpu_fallback(func, device)``: whether an op has a
  kernel of the device's own or runs through the backend's CPU fallback.
- ``numerics``: ``numerics_settings()``, the process-wide switches that change a device's arithmetic.
"""

from .discovery import BACKENDS, PREFERENCE, Backend, best_device, choose, discover, holds_dtype
from .dispatch import KernelSource, cpu_fallback, kernel_source
from .numerics import numerics_settings

__all__ = [
    "BACKENDS",
    "PREFERENCE",
    "Backend",
    "discover",
    "choose",
    "best_device",
    "holds_dtype",
    "KernelSource",
    "kernel_source",
    "cpu_fallback",
    "numerics_settings",
]
