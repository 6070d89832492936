"""ShadowMode options: keyword-only, validated and parsed once into frozen values, with errors that list
the valid values."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .errors import ShadowOptionError
from .mirror import parse_shadow_device
from .spot import SpotConfig

FOLLOW = ("device", "reference")
MAX_REPRO_BYTES = 64 << 20  # the default cap on the inputs kept of calls over budget (shadow repro)


@dataclasses.dataclass(frozen=True, slots=True)
class Options:
    local: bool = True  # record each op's own error (replay on the device's own inputs)
    drift: bool = True  # record the error accumulated since the start (device vs shadow)
    follow: str = "device"  # discrete results (indices, masks) downstream: the device's or the shadow's own
    max_records: int | None = None  # keep at most this many per-call records (aggregates cover all calls)
    spot_checks: Any = "default"  # mpmath spot checks, parsed into a SpotConfig (shadow.spot.SpotConfig.parse)
    budgets: bool = True  # hold each local error to the op's a-priori error budget (shadow.budgets)
    compare_cpu: bool = False  # also run each op on the CPU in the device's dtype: device error / CPU error
    callsites: bool = True  # record each call's line in the user's code (Record.callsite, Report.by_callsite)
    scope: Any = None  # modules whose calls (forward, backward, their parameters' optimizer calls) are shadowed
    max_shadow_bytes: int | None = None  # a cap on the bytes of float64 shadows held
    # where shadows live and replays run: "auto" (a CUDA tensor's on its GPU when it has the memory, every other
    # on the CPU), "cpu", or a device that computes float64 ("cuda", "cuda:1"); parsed into "auto" or a device
    shadow_device: Any = "auto"
    # the bytes of inputs kept of the worst calls over budget, for `shadow repro` (0: none kept)
    max_repro_bytes: int = MAX_REPRO_BYTES

    def __post_init__(self) -> None:
        for name in ("local", "drift", "budgets", "compare_cpu", "callsites"):
            if not isinstance(getattr(self, name), bool):
                raise ShadowOptionError(f"{name}={getattr(self, name)!r}: expected True or False")
        if self.follow not in FOLLOW:
            raise ShadowOptionError(f"follow={self.follow!r}: expected one of {', '.join(map(repr, FOLLOW))}")
        if self.max_records is not None and (
            isinstance(self.max_records, bool) or not isinstance(self.max_records, int) or self.max_records < 0
        ):
            raise ShadowOptionError(f"max_records={self.max_records!r}: expected None (keep all) or an int >= 0")
        object.__setattr__(self, "spot_checks", SpotConfig.parse(self.spot_checks))  # frozen: parsed once, here
        if self.scope is not None:
            modules = [self.scope] if isinstance(self.scope, torch.nn.Module) else self.scope
            if not isinstance(modules, (list, tuple)) or not modules or \
                    not all(isinstance(m, torch.nn.Module) for m in modules):
                raise ShadowOptionError(f"scope={self.scope!r}: expected None (everything) or a list of the "
                                        "nn.Modules to shadow (their calls, backward and optimizer calls included)")
            object.__setattr__(self, "scope", tuple(modules))
        if self.max_shadow_bytes is not None and (isinstance(self.max_shadow_bytes, bool) or not isinstance(
                self.max_shadow_bytes, int) or self.max_shadow_bytes <= 0):
            raise ShadowOptionError(f"max_shadow_bytes={self.max_shadow_bytes!r}: expected None (no cap) or a "
                                    "number of bytes > 0 (8 GiB: 8 << 30)")
        if isinstance(self.max_repro_bytes, bool) or not isinstance(self.max_repro_bytes, int) or \
                self.max_repro_bytes < 0:
            raise ShadowOptionError(f"max_repro_bytes={self.max_repro_bytes!r}: expected a number of bytes >= 0 "
                                    "(0 keeps no inputs; 64 MiB: 64 << 20)")
        object.__setattr__(self, "shadow_device", parse_shadow_device(self.shadow_device))
