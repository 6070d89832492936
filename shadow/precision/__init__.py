"""``shadow.audit``: which parts of a model (module subtrees, a module's own calls, or op classes) can run in bf16,
fp16, TF32 or FP8.

For every part and candidate precision: the estimated relative change of the target (the loss) if that part alone
ran in that precision and everything else in float64. By module, a part is a module with everything its forward
runs (its submodules included: "can this block run in bf16?"), or with ``own=True`` only the calls it runs itself.
One pass, for every precision at once: the step runs as usual under a ShadowMode, each forward call is computed
again by each precision's emulated device (``shadow.modes``) on the inputs it would have if each part containing it
ran alone in that precision (``onepass``), and that error is weighted by the float64 adjoint of the target
(``shadow.attribution.adjoint``, as ``shadow.attribute(method="linear")``). The ``verify`` most sensitive parts per
precision are then run again one at a time, only that part emulated on the device (``shadow.modes.Scoped``), and
measured in a float64 world where only that part's calls carry their error (``shadow.engine.commit.in_world``). Range
risks come from the same first run (``shadow.precision.ranges``). ``AuditReport.plan(tolerance)`` picks a precision
per part (``shadow.precision.lowering``). docs/audit.md: what each figure means, and how they compare with direct runs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import torch

from ..attribution.share import adjoint_pass, read_targets, step_targets
from ..attribution.state import StepState
from ..engine import EngineHooks
from ..errors import ShadowOptionError
from ..modes.select import Scoped
from ..modes.shadow import ShadowMode
from ..records import Phase, Record
from .onepass import Emulated
from .lowering import Plan, choose
from .precisions import PRECISIONS, Precision
from .upcasts import Upcasts
from .ranges import Ranges

BY = ("module", "op")
OUTSIDE = "(outside any module)"  # how tables name the part "": the calls outside any module (the loss, often)
_no_dispatch = torch._C._DisableTorchDispatch



@dataclasses.dataclass(frozen=True, slots=True)
class AuditRow:
    """One part under one precision."""

    key: str  # a module path ("Net.fc1"; "": the calls outside any module) or an op overload ("aten.gelu.default")
    precision: str
    estimate: float  # the estimated relative change of the target (inf: the part overflows to inf/NaN there)
    verified: float | None  # the measured change with only this part in this precision (None: not re-run)
    overflow: bool  # a value of the part (activation or gradient) beyond the format's largest
    underflow: float  # the share of its nonzero values below the format's smallest normal
    applies: bool = True  # the precision changes some call of the part (TF32, FP8: matmuls only)

    @property
    def sensitivity(self) -> float:
        """What the plan and the ranking go by: the measured change where there is one, else the estimate."""
        return math.inf if self.overflow else (self.verified if self.verified is not None else self.estimate)


@dataclasses.dataclass
class AuditReport:
    """What ``audit`` found: ``rows`` for every part and precision; ``target`` (the target's float64 value),
    ``by``, ``own`` (by module: rows of a module's own calls, not of its subtree), ``runs``, ``target_at`` (the
    part whose own calls computed the target: a module path, "" outside any module, None where unknown)."""

    by: str
    precisions: tuple[str, ...]
    rows: list[AuditRow]
    target: float
    runs: int
    dropped: tuple[tuple[str, str], ...] = ()  # (precision, part): later calls estimated on float64 inputs (memory)
    own: bool = False
    target_at: str | None = None

    def ranking(self, precision: str) -> list[str]:
        """The parts, most sensitive to ``precision`` first."""
        if precision not in self.precisions:
            raise ShadowOptionError(f"ranking({precision!r}): this audit has {', '.join(map(repr, self.precisions))}")
        rows = [r for r in self.rows if r.precision == precision]
        return [r.key for r in sorted(rows, key=lambda r: (-r.sensitivity, r.key))]

    def row(self, key: str, precision: str) -> AuditRow:
        return next(r for r in self.rows if r.key == key and r.precision == precision)

    def plan(self, tolerance: float) -> Plan:
        """The lowest precision per part such that the changes of the parts moved add up to at most half of
        ``tolerance`` (a relative change of the target; half: parts moved together interact), never a precision
        a part overflows, never the calls outside any module (the loss, the optimizer). By module subtrees: the
        largest subtrees that fit, one line each (``shadow.precision.lowering``)."""
        return choose(self, tolerance)

    def table(self, top: int | None = None) -> str:
        """Under a line saying what a row is (by module: a module with its submodules, or with ``own`` its own
        calls), parts (most sensitive to the first precision first) by precision: the estimated relative change of the
        target, the measured one in brackets where verified, ``-`` where the precision changes none of the part's
        calls (TF32 and FP8 touch matmuls only), ``O`` where it overflows the format, ``U`` where over 1 % of its
        values fall below the format's smallest normal."""
        keys = self.ranking(self.precisions[0])
        keys = keys if top is None else keys[:top]
        name_w = max([len(self.by)] + [len(k or OUTSIDE) for k in keys])
        cell_w = 22
        head = f"{self.by:<{name_w}}" + "".join(f"  {p:>{cell_w}}" for p in self.precisions)
        what = "every call of one op overload" if self.by == "op" else \
            "a module's own calls, not its submodules'" if self.own else \
            "a module with its submodules (a parent includes its children)"
        lines = [f"rows: {what}", head, "-" * len(head)]
        for key in keys:
            cells = []
            for p in self.precisions:
                r = self.row(key, p)
                text = "-" if not r.applies else \
                    _num(r.estimate) + (f" ({_num(r.verified)})" if r.verified is not None else "")
                flags = ("O" if r.overflow else "") + ("U" if r.underflow > 0.01 else "")
                cells.append(f"  {(text + (' ' + flags if flags else '')):>{cell_w}}")
            lines.append(f"{key or OUTSIDE:<{name_w}}" + "".join(cells))
        part = "part" if self.by == "op" else "module's own calls" if self.own else "module (with its submodules)"
        lines.append(f"relative change of the target (float64 value {self.target:.6g}) if the {part} alone ran in "
                     "the precision; (measured); - not touched; O overflow, U >1% below the smallest normal; "
                     f"{self.runs} runs")
        if self.dropped:
            ended = ", ".join(f"{k or OUTSIDE} ({p})" for p, k in self.dropped)
            lines.append(f"estimated on float64 inputs after their first call (memory bound): {ended}")
        return "\n".join(lines)


def audit(step: Callable[[], Any], *, precisions: tuple[str, ...] = ("bf16", "fp16", "tf32"), by: str = "module",
          own: bool = False, target: Any = None, verify: int = 5, **shadow_options: Any) -> AuditReport:
    """How much each part (``by="module"`` or ``"op"``) would move ``step``'s target in each precision.

    ``step``: a zero-argument callable running the computation and returning the target (the loss: a one-element
    tensor); ``target``: something else to read after the step (a one-element tensor, or a callable returning
    one). ``precisions``: any of "fp8", "bf16", "fp16", "tf32". By module, a row covers the module with its
    submodules ("transformer.h.0.mlp": the MLP), or with ``own=True`` only the calls the module runs itself (its
    residual adds, where the loss is computed). ``verify``: how many of the most sensitive parts per precision
    are re-run alone. ``shadow_options``: for the first (unemulated) run. The user's objects are left as they
    were found (parameters, buffers, optimizer state, torch's generators: ``StepState.as_found``).

    >>> aud = shadow.audit(lambda: train_step(model, batch), precisions=("bf16", "fp16"))   # doctest: +SKIP
    >>> print(aud.table()); plan = aud.plan(tolerance=1e-3)                                 # doctest: +SKIP
    """
    if by not in BY:
        raise ShadowOptionError(f"audit(by={by!r}): expected one of {', '.join(map(repr, BY))}")
    if not isinstance(own, bool) or (own and by != "module"):
        raise ShadowOptionError(f"audit(own={own!r}, by={by!r}): own=True (a module's own calls, not its "
                                "submodules') goes with by='module'")
    unknown = [p for p in precisions if p not in PRECISIONS] if isinstance(precisions, (tuple, list)) else [precisions]
    if unknown or not precisions:
        raise ShadowOptionError(f"audit(precisions={precisions!r}): expected a tuple of "
                                f"{', '.join(map(repr, PRECISIONS))}")
    if isinstance(verify, bool) or not isinstance(verify, int) or verify < 0:
        raise ShadowOptionError(f"audit(verify={verify!r}): expected an int >= 0 (parts re-run per precision)")
    if not callable(step):
        raise ShadowOptionError(f"audit(step={step!r}): expected a zero-argument callable that runs the "
                                "computation and returns the target (the loss)")
    precisions = tuple(precisions)
    state = StepState()
    ranges = Ranges({p: (PRECISIONS[p].format, PRECISIONS[p].scaled) for p in precisions})
    upcasts = Upcasts()
    emulated = Emulated(precisions, [PRECISIONS[p].mode(upcasts) for p in precisions], upcasts)
    running: list = []  # the ShadowMode's module tracking (``Attribution``), once the run starts

    def ready(sm: ShadowMode) -> None:
        emulated.attach(sm)
        running.append(sm._engine.attribution)

    def observe(rec: Record, outputs: list, p: Any) -> None:
        parts = _parts(rec, by, own, running[0].parents)
        ranges.observe(rec, outputs, parts)
        emulated.observe(rec, outputs, p, parts)

    with state.as_found():  # the user's objects as found: an audit takes no optimizer step
        with state.learning(), upcasts, emulated.before():
            run = adjoint_pass(step, target, shadow_options, torch.ones_like, errors=emulated, also=observe,
                               ready=ready)
        return _rows(step, target, state, run, emulated, ranges, precisions, by, own, verify)


def _rows(step: Callable[[], Any], target: Any, state: StepState, run: Any, emulated: Emulated, ranges: Ranges,
          precisions: tuple[str, ...], by: str, own: bool, verify: int) -> AuditReport:
    """The report of an audit's first run (``run``), its most sensitive parts verified by runs of their own."""
    tree = by == "module" and not own
    if run.t_64.numel() != 1:
        raise ShadowOptionError(f"audit: the target has {run.t_64.numel()} elements: the audit measures the relative "
                                "change of one number (the loss); pass target= a one-element tensor")
    truth = float(run.t_64[0])
    scale = abs(truth) if truth else 1.0
    sums: dict[tuple[str, str], float] = {}  # (precision, part) -> the change of the target
    for index, c in run.contributions.items():
        for channel, v in zip(emulated.channels(index), c):
            sums[channel] = sums.get(channel, 0.0) + v * run.factor
    # where a part's world reached the target: its value there, the part's own run (else the first-order sum)
    sums.update({w: v - truth for w, v in emulated.in_worlds(run.values[0]).items()})
    at = emulated.computed_in(run.values[0])
    runs = 1
    rows: list[AuditRow] = []
    for name in precisions:
        applies = {part for index in emulated.claimed[name] if index in run.records
                   for part in emulated.parts[index]}
        found = {k: (abs(v) / scale if math.isfinite(v) else math.inf) for (p, k), v in sums.items() if p == name}
        parts = sorted(set(found) | set(ranges.parts))
        fmt, scaled = PRECISIONS[name].format, PRECISIONS[name].scaled
        suspects = sorted((k for k in parts if k in applies), key=lambda k: (-found.get(k, 0.0), k))[:verify]
        for k in parts:
            r = ranges.parts.get(k)
            verified = _verified(step, target, state, PRECISIONS[name], by, tree, k, truth) \
                if k in suspects else None
            runs += k in suspects
            rows.append(AuditRow(k, name, found.get(k, 0.0), verified, r is not None and r.overflow(fmt, scaled),
                                 r.underflow(fmt) if r is not None else 0.0, k in applies))
    return AuditReport(by, precisions, rows, truth, runs, tuple(sorted(emulated.dropped)), own,
                       at[-1] if at else None)


def _parts(rec: Record, by: str, own: bool, parents: set[str]) -> tuple[str, ...]:
    """The parts a call belongs to, outermost first: its op class; its module (``own``); or every module whose
    forward (or backward) is running ("" outside any)."""
    if by == "op":
        return (rec.op,)
    if own or rec.phase is Phase.OPTIMIZER:
        return (rec.module,)
    return tuple(sorted((m for m in parents if m != "Global"), key=lambda m: (m.count("."), m))) or ("",)


def _verified(step: Callable[[], Any], target: Any, state: StepState, precision: Precision, by: str, tree: bool,
              part: str, truth: float) -> float:
    """The step again with only ``part`` emulated, measured in a float64 world where only the part's calls make
    their (emulated) error: |T_world - T_64| / |T_64|."""
    state.restore(state.start)
    if by == "op":
        scope = dict(op=part)
        inside = lambda op, module: op == part  # noqa: E731
    elif tree and part:
        scope = dict(module=part)
        inside = lambda op, module: part in sm._attr.parents  # noqa: E731
    else:  # a module's own calls, or those outside any module
        scope = dict(module=part, innermost=True)
        inside = lambda op, module: module == part  # noqa: E731
    world = (lambda op, m, ph, s: "device" if ph is not Phase.OPTIMIZER and inside(op, m) else None)  # noqa: E731
    sm = ShadowMode(spot_checks="off", budgets=False, drift=False, max_records=0, hooks=EngineHooks(world=world))
    upcasts = Upcasts()
    with upcasts, Scoped(precision.mode(upcasts), **scope), sm:
        values = step_targets(step(), target)
        t_world = read_targets(values, sm)[1]
    with _no_dispatch():  # shadow's own arithmetic: no mode sees it
        change = float(t_world[0]) - truth
    if not math.isfinite(change):
        return math.inf
    return abs(change) / (abs(truth) if truth else 1.0)


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    return "0" if x == 0 else ("inf" if math.isinf(x) else f"{x:.2e}")
