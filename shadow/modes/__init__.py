"""The TorchDispatchModes: the full shadow, and emulated devices (enter an emulation outside ShadowMode:
``with TF32Mode(), ShadowMode() as sm:``; ``shadow.modes.emulate.emulate("tf32")`` builds one by name)."""

from .emulate import BF16Mode, EmulationOrderError, FP16AccumMode, FTZMode, TF32Mode
from .shadow import ShadowMode

__all__ = ["ShadowMode", "TF32Mode", "BF16Mode", "FP16AccumMode", "FTZMode", "EmulationOrderError"]
