"""The TorchDispatchModes: the full shadow, and emulated devices."""

from .shadow import ShadowMode

__all__ = ["ShadowMode"]
