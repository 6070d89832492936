"""The candidate precisions an audit tries (``PRECISIONS``), cheapest first: the order the plan tries them in."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Mapping
from typing import Any, Callable

from ..modes.emulate import EMULATIONS, Emulation
from ..modes.emulate.formats import Format
from .held import Held
from .upcasts import Upcasts


@dataclasses.dataclass(frozen=True)
class Precision:
    """A candidate precision: the emulated device a part runs on in it (bf16, fp16: held in the format, on the
    device's kernels for it, ``shadow.precision.held``), its format (range risks), whether tensors are scaled
    into it per tensor (FP8: no overflow), and its mantissa bits (the plan prefers fewer)."""

    name: str
    mode: Callable[[Upcasts], Any]
    format: Format
    scaled: bool
    bits: int


def _device(mode: type[Emulation], upcasts: Upcasts) -> Emulation:
    return mode()


class Precisions(Mapping[str, Precision]):
    """The candidate precisions by name: every emulated device registered with an ``AuditFormat``
    (``shadow.modes.emulate.register(..., audit=...)``), read from that registry at each use. Iterated cheapest
    first, the order the plan tries them in: fewer mantissa bits, then the narrower range (fp16 before tf32).

    >>> list(PRECISIONS)
    ['fp8', 'bf16', 'fp16', 'tf32']
    """

    def _all(self) -> dict[str, Precision]:
        found = []
        for name, mode in EMULATIONS.items():
            a = mode.audit
            if a is not None:  # mode(upcasts): the emulated device of a run whose upcasts are watched
                run = functools.partial(Held, a.format) if a.held else functools.partial(_device, mode)
                found.append(Precision(name, run, a.format, a.scaled, a.bits))
        return {p.name: p for p in sorted(found, key=lambda p: (p.bits, p.format.emax))}

    def __getitem__(self, name: str) -> Precision:
        return self._all()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())

    def __repr__(self) -> str:
        return f"PRECISIONS({', '.join(self)})"


PRECISIONS = Precisions()
