"""The typed values one op call hands from step to step (``shadow.engine``): each is built once and never changed.

prepare -> ``Prepared``; the replays -> ``Replayed``; the outputs read -> ``Outputs`` of ``Output``; the spot
check -> ``SpotCheck`` with its ``Correction``s; judging -> ``Judged`` of ``Compared``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..budgets import Budget, InUlps
from ..metrics import ErrorStats
from ..plan import ArgSpec, OpPlan
from ..records import BudgetInfo, Kind
from ..spot import SpotStats


class Args(NamedTuple):
    """One set of an op's arguments (positional and keyword)."""

    args: list
    kwargs: dict

    def get(self, spec: ArgSpec) -> Any:
        return spec.get(self.args, self.kwargs)


class Prepared(NamedTuple):
    """What preparation built before the device op ran."""

    plan: OpPlan
    chain: tuple  # the op's replay rules
    shadow: Args  # the shadow inputs: the replay that drift is measured against
    local: Args | None  # the device's own inputs, upcast (None: every input is exact, the shadow serves)
    pre: Args | None  # the local reference's inputs as before the op (budget rules that read them, spot checks)
    cpu: Args | None  # compare_cpu: the device's inputs on the CPU, in their own dtypes
    exact: bool  # every shadow input equals the device's: local error = drift
    nonfinite_in: bool  # some input's storage holds a NaN or an infinity
    inputs_drift: float  # the largest drift rel_norm of an input's storage
    inputs: list[torch.Tensor]  # the floating device tensors read
    storages: set[int]  # shadow storages of the inputs (an output aliasing one is copied when kept)
    spot: bool  # this call is spot-checked
    budget: bool  # its local error is held to the op's budget
    fixed: InUlps | None  # the op's budget where it reads no argument (``shadow.budgets.fixed_budget``)
    direct: bool  # its outputs are read by the direct builder (``shadow.engine.outputs.takes_direct_path``)
    # (its budget, or None where the rule failed), built before the replays overwrote the inputs it reads, which
    # then were not copied (``shadow.budgets.builds_early``); None: built when judged
    early: tuple | None = None
    # a large call of a list op judged in pieces (``shadow.engine.pieces``): its inputs as the device had them
    # before the op, those it writes copied in their own dtypes (``local`` is then None)
    before: Args | None = None

    @property
    def reference(self) -> Args:
        """The inputs the local error's reference is computed from."""
        return self.local if self.local is not None else self.shadow


class Replayed(NamedTuple):
    """The replays of a call: how it was replayed, the outputs from the shadow inputs and from the device's own."""

    kind: Kind
    shadow: Any  # as the op returns them
    local: Any  # None: the local replay did not run (every input exact: the shadow's serve)

    @property
    def reference(self) -> Any:
        """The outputs the local error is measured against."""
        return self.local if self.local is not None else self.shadow


class Output(NamedTuple):
    """One compared result of an op call: a written argument (in-place, out=) or a fresh return."""

    device: Any  # the device's tensor, or a Python number (.item(), equal)
    shadow: Any  # the drift replay's value
    local: Any  # the local replay's value (None: the shadow serves)
    written: bool
    # the output's place in the op's budgets and spot checks: its position among the op's flattened returns (a
    # written argument: the return aliasing it), or among its written arguments where it returns nothing; None
    # for numbers
    slot: int | None

    @property
    def reference(self) -> Any:
        """What the local error is measured against."""
        return self.local if isinstance(self.local, torch.Tensor) else self.shadow


class Outputs(NamedTuple):
    """Every output of a call to compare, in order: written arguments, then fresh returns, then a number."""

    items: tuple[Output, ...]
    slots: int  # how many output slots the op has (budgets get one entry each, None where absent)
    item: tuple[Any, Any] | None  # an .item()-like (device, shadow) number pair
    dtype: torch.dtype  # the device dtype errors are measured in (a cast is held to its target's rounding)
    defined: list | None  # per slot, the elements the op defines (``shadow.replay.defined``; None: all)
    # every item is a floating strided tensor its shadow reproduces in shape and dtype (the direct builder's
    # outputs): judging goes straight to the comparison
    plain: bool


class Correction(NamedTuple):
    """An element of a float64 reference the spot check found untrusted, and its exact value rounded to float64."""

    slot: int
    index: tuple[int, ...]
    value: float


class SpotCheck(NamedTuple):
    """A call's spot check: its figures and the corrections of its reference (judging applies them)."""

    stats: SpotStats | None  # None: the check failed (counted as an internal error)
    corrections: tuple[Correction, ...]
    budget: Budget | None  # the budget the comparisons use (None where building the bound of a sum failed)


class Compared(NamedTuple):
    """One output's figures, and what the mirror keeps of it."""

    drift: ErrorStats | None = None
    local: ErrorStats | None = None
    flips: int = 0
    local_flips: int = 0
    mismatch: int = 0  # 1: a shape the shadow did not reproduce (the device's value is adopted)
    exact: bool = False  # the shadow equals the device's value: the mirror entry stays exact
    keep: Any = None  # the shadow value to commit (None: nothing to commit)
    nonfinite: bool = False  # the device's value holds a NaN or an infinity
    skipped: int = 0  # elements not compared: the op leaves them undefined


class Judged(NamedTuple):
    """The judged call: merged figures over every output."""

    local: ErrorStats | None
    drift: ErrorStats | None
    flips: int
    local_flips: int
    mismatch: int
    budget: BudgetInfo | None
    spot: SpotStats | None
    compared: tuple[Compared, ...]
    skipped: int  # elements not compared: the op leaves them undefined
