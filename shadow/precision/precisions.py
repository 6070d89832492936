"""The candidate precisions an audit tries (``PRECISIONS``) and the order the plan tries them in (``ORDER``)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

from ..modes.emulate import FP8Mode, TF32Mode
from ..modes.emulate.formats import BF16, E4M3, FP16, TF32, Format
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


PRECISIONS: dict[str, Precision] = {  # mode(upcasts): the emulated device of a run whose upcasts are watched
    "fp8": Precision("fp8", lambda upcasts: FP8Mode(), E4M3, True, 3),
    "bf16": Precision("bf16", functools.partial(Held, BF16), BF16, False, 7),
    "fp16": Precision("fp16", functools.partial(Held, FP16), FP16, False, 10),
    "tf32": Precision("tf32", lambda upcasts: TF32Mode(), TF32, False, 10),
}
# the plan tries cheaper precisions first: fewer mantissa bits, then the narrower range (fp16 before tf32)
ORDER = ("fp8", "bf16", "fp16", "tf32")
