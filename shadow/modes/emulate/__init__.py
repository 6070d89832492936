"""Emulated devices: dispatch modes that make CPU ops compute with another device's numerics, so that
shadow can be tested against defects whose size is known in advance (and a user can ask "what would
TF32 do to my model?").

==========================  ===========================================================================
``TF32Mode()``              float32 matmul and convolution: operands rounded to TF32, float32 accumulation
``BF16Mode()``              float32 storage, bfloat16 arithmetic: floating inputs and outputs rounded
``FP16AccumMode()``         float16 sums, means, cumsums and matmuls through a float16 accumulator
``FTZMode()``               flush-to-zero: subnormal inputs and outputs become signed zeros
``FP16Mode()``              float32 storage, float16 arithmetic: inputs and outputs rounded (inf above 65504)
``FP8Mode()``               float32 matmuls on FP8 operands (E4M3, gradients E5M2), per-tensor amax scaling
``StochasticMode()``        a correct implementation with random rounding: float64 results, rounded stochastically
``StochasticBudgetMode()``  ... and sums' results moved within a fraction of their budget (``shadow.envelope``)
==========================  ===========================================================================

``shadow.modes.Scoped(mode, op=..., module=...)`` applies one to part of a program only.

Stacking order: enter the emulation FIRST (outermost ``with``), so that ShadowMode sees each op first
and the emulation computes it as the device: ``with TF32Mode(), ShadowMode() as sm:``. Entering an
emulation while a ShadowMode is active raises ``EmulationOrderError``.

>>> from shadow.modes.emulate import TF32Mode, emulate
>>> from shadow import ShadowMode
>>> with TF32Mode(), ShadowMode() as sm:       # the emulation OUTSIDE, ShadowMode inside
...     y = a @ b                              # doctest: +SKIP
>>> with emulate("fp16_accum", block=16):     # the same modes by name
...     s = x.half().sum()                     # doctest: +SKIP

A device is one module: its rule table, options and mode class, registered by name with ``@register``.
What each mode claims and passes through, and the hardware measurements behind the rounding rules:
docs/hardware-numerics.md.
"""

from ...errors import EmulationOrderError
from ._mode import EMULATIONS, Emulation, emulate
# for the modes built on the emulations' machinery elsewhere in shadow (modes.select, modes.faults, precision)
from ._mode import Rule, require_outside_shadow  # noqa: F401
from ._utils import computes, is_floating, overloads, transform_io  # noqa: F401
from .bf16 import BF16Mode
from .formats import BF16, E4M3, E5M2, FP16, TF32, Format, Rounding, flush_subnormals, round_to, to_tf32
from .fp8 import FP8Mode
from .fp16 import FP16Mode
from .fp16_accum import FP16AccumMode
from .ftz import FTZMode
from .stochastic import StochasticBudgetMode, StochasticMode
from .tf32 import TF32Mode

__all__ = [
    "Emulation",
    "TF32Mode",
    "BF16Mode",
    "FP16AccumMode",
    "FTZMode",
    "FP16Mode",
    "FP8Mode",
    "StochasticMode",
    "StochasticBudgetMode",
    "emulate",
    "EMULATIONS",
    "EmulationOrderError",
    "Format",
    "TF32",
    "BF16",
    "FP16",
    "E4M3",
    "E5M2",
    "Rounding",
    "round_to",
    "to_tf32",
    "flush_subnormals",
]
