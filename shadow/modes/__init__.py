"""The TorchDispatchModes: the full shadow, and emulated devices (enter an emulation outside ShadowMode:
``with TF32Mode(), ShadowMode() as sm:``)."""

from .emulate import BF16Mode, EmulationOrderError, FP16AccumMode, FTZMode, TF32Mode, emulate
from .shadow import ShadowMode

__all__ = ["ShadowMode", "TF32Mode", "BF16Mode", "FP16AccumMode", "FTZMode", "emulate", "EmulationOrderError"]
