"""The TorchDispatchModes: the full shadow, emulated devices and injected faults (enter them outside ShadowMode:
``with TF32Mode(), ShadowMode() as sm:``; ``shadow.modes.emulate.emulate("tf32")`` builds one by name;
``with FaultMode(rel=1e-3, op="gelu"), ShadowMode() as sm:``)."""

from .emulate import BF16Mode, EmulationOrderError, FP8Mode, FP16AccumMode, FP16Mode, FTZMode, TF32Mode
from .faults import FaultMode
from .select import Scoped
from .shadow import ShadowMode

__all__ = ["ShadowMode", "TF32Mode", "BF16Mode", "FP16Mode", "FP8Mode", "FP16AccumMode", "FTZMode", "FaultMode",
           "Scoped", "EmulationOrderError"]
