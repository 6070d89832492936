"""Range risks of narrow formats: per part, the largest activation and gradient against the format's largest value,
and the share of values below its smallest normal (subnormal there, or flushed to zero). The largest finite values
of a result's dtype are masks (``finfo(dtype).min`` added to scores), not values: a model run in a narrower format
builds its own (``shadow.precision.held.round_stored``)."""

from __future__ import annotations

import dataclasses

import torch

from ..modes.emulate.formats import Format
from ..records import Phase, Record
from ..scratch import copy

_no_dispatch = torch._C._DisableTorchDispatch


@dataclasses.dataclass
class Range:
    """The values one part produced in the first run (its own dtype's values)."""

    max_activation: float = 0.0  # the largest |value| of a forward (or other) result
    max_gradient: float = 0.0  # ... of a backward result
    values: int = 0  # nonzero finite values seen
    tiny: dict[str, int] = dataclasses.field(default_factory=dict)  # format -> values below its smallest normal

    def overflow(self, fmt: Format, scaled: bool) -> bool:
        """A value beyond the format's largest (never, for per-tensor scaled formats such as FP8)."""
        return not scaled and max(self.max_activation, self.max_gradient) > fmt.max

    def underflow(self, fmt: Format) -> float:
        """The share of nonzero values that would be subnormal or flushed to zero in the format."""
        return self.tiny.get(fmt.name, 0) / self.values if self.values else 0.0


class Ranges:
    """An observer of the engine (``EngineHooks.observe``): folds each judged call's floating results into the Range of
    each of its parts. ``formats``: name -> (Format, per-tensor scaled)."""

    def __init__(self, formats: dict[str, tuple[Format, bool]]) -> None:
        self._formats = formats
        self.parts: dict[str, Range] = {}

    def observe(self, rec: Record, outputs: list, parts: tuple[str, ...]) -> None:
        if rec.phase is Phase.OPTIMIZER:
            return
        ranges = [self.parts.setdefault(part, Range()) for part in parts]
        with _no_dispatch():
            for o in outputs:
                d = o.device
                if not isinstance(d, torch.Tensor) or not d.is_floating_point() or not d.numel():
                    continue
                a = copy(d, torch.float64, "cpu").abs_()
                a = a[torch.isfinite(a) & (a > 0) & (a != torch.finfo(d.dtype).max)]
                if not a.numel():
                    continue
                amax = float(a.max())
                # scaled formats map the tensor's largest magnitude to the format's: tiny relative to it
                tiny = {name: int((a < fmt.tiny * (amax / fmt.max if scaled else 1.0)).sum())
                        for name, (fmt, scaled) in self._formats.items()}
                for r in ranges:
                    if rec.phase is Phase.BACKWARD:
                        r.max_gradient = max(r.max_gradient, amax)
                    else:
                        r.max_activation = max(r.max_activation, amax)
                    r.values += a.numel()
                    for name, n in tiny.items():
                        r.tiny[name] = r.tiny.get(name, 0) + n
