"""A precision plan: which parts run in which precision, chosen from an audit, applied on the real device, checked
against float64.

``choose`` goes from the cheapest precision up (fewer mantissa bits first) and moves parts while the sum of their
sensitivities stays within half the tolerance: parts moved together interact (each one's roundings are drawn again
on the others' outputs), and their joint change has measured up to 1.2x the sum. By module subtrees it moves the
largest subtrees that fit: from the model down, a subtree that fits moves whole (one line of the plan), one that
does not is split into its submodules (its own calls stay), siblings the least costly first; a subtree costs the
larger of its change and the sum of its submodules' costs (``_costs``). Otherwise (a
module's own calls, op classes) the least sensitive parts first. The calls outside any module (the loss, the
optimizer) never move.
``Plan.apply(model)`` returns a dispatch mode (``PlanMode``, entered outside ShadowMode) that computes each chosen
part's ops in its precision as the audit did: bfloat16 and float16 held in the format on the device's own kernels
(``shadow.precision.held``), TF32 through the device's TF32 switch on CUDA; where the device has no such arithmetic
(TF32 on a CPU, FP8 anywhere here) the part's ops run on the emulated device. ``Plan.check(step)`` runs the step with the plan under
a ShadowMode and returns the measured relative change of the target against its float64 shadow.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ..attribution.tracking import Tracker
from ..errors import ShadowOptionError
from ..modes.emulate import computes, require_outside_shadow
from ..plan import plan_of
from .precisions import PRECISIONS
from .upcasts import Upcasts

if TYPE_CHECKING:
    from . import AuditReport, AuditRow

FORMAT = "shadow-precision-plan"
VERSION = 2  # 2: subtrees by module (``own``), ``target_at``


@dataclasses.dataclass
class Plan:
    """``parts``: part -> precision ("bf16", ...); parts not named stay in the model's own precision. By module a
    part is a module with its submodules, or with ``own`` the calls it runs itself; ``target_at``: the module
    whose own calls compute the target (the loss; "" outside any module), as the audit found it."""

    by: str
    tolerance: float
    parts: dict[str, str]
    estimate: float  # the sum of the chosen parts' costs (sensitivities; by subtrees ``_costs``): a bound to expect
    own: bool = False
    target_at: str | None = None
    _mode: PlanMode | None = dataclasses.field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        tree = self.by == "module" and not self.own
        what = "module subtree (a module with its submodules)" if tree else \
            "module's own calls" if self.by == "module" else self.by
        lines = [f"precision plan by {what}, tolerance {self.tolerance:.3g} (estimated change {self.estimate:.3g}):"]
        lines += [f"  {self.name(k)}: {p}" for k, p in sorted(self.parts.items())] or ["  (every part stays as it is)"]
        if self.by == "module":
            stays = ["the calls outside any module"]
            if self.target_at and not self.covers(self.target_at):
                stays.insert(0, f"the loss (in {self.target_at}'s own calls)")
            elif self.target_at == "":
                stays[0] += ", the loss among them"
            lines.append(f"  stays as it is: {', '.join(stays)}")
        return "\n".join(lines)

    def name(self, key: str) -> str:
        """How the plan names a part: a module subtree by its path, a module's own calls as such; where the target
        (the loss) is computed, it says so."""
        if self.by != "module":
            return key
        if self.own:
            return f"{key} (own calls{', the loss among them' if key == self.target_at else ''})"
        if self.target_at and (self.target_at == key or self.target_at.startswith(key + ".")):
            return f"{key} (with the loss)"
        return key

    def covers(self, module: str) -> str | None:
        """The precision the plan gives the calls ``module`` runs itself (None: they stay)."""
        if self.by != "module" or self.own:
            return self.parts.get(module)
        return next((self.parts[m] for m in _enclosing(module) if m in self.parts), None)

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump({"format": FORMAT, "version": VERSION, "by": self.by, "own": self.own,
                       "target_at": self.target_at, "tolerance": self.tolerance, "estimate": self.estimate,
                       "parts": self.parts}, f, indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        """A saved plan; version 1 (before subtrees) planned a module's own calls."""
        with open(path) as f:
            d = json.load(f)
        if not isinstance(d, dict) or d.get("format") != FORMAT or d.get("version") not in (1, VERSION):
            raise ShadowOptionError(f"{path}: not a shadow precision plan (format {FORMAT!r}, version 1 or {VERSION})")
        own = d.get("own", d["by"] == "module")
        return cls(d["by"], d["tolerance"], dict(d["parts"]), d["estimate"], own, d.get("target_at"))

    def apply(self, model: torch.nn.Module | None = None) -> PlanMode:
        """The mode that runs the plan: ``with plan.apply(model), ShadowMode(): step()`` (the plan outside, as an
        emulated device). ``model``: checks that every planned module is one of its modules."""
        if model is not None and self.by == "module":
            names = {type(model).__name__ + (f".{n}" if n else "")
                     for n, _ in model.named_modules(remove_duplicate=False)}
            unknown = sorted(k for k in self.parts if k and k not in names)
            if unknown:
                raise ShadowOptionError(f"plan.apply: {', '.join(unknown)} not modules of this "
                                        f"{type(model).__name__} (its modules: {', '.join(sorted(names)[:8])}...)")
        self._mode = PlanMode(self)
        return self._mode

    def check(self, step: Callable[[], Any], target: Any = None) -> float:
        """Run ``step`` once with the plan (as ``apply`` made it) under a ShadowMode: the relative change of the
        target against its float64 shadow. The user's objects are left as after that step."""
        from ..attribution.share import read_targets, step_targets
        from ..modes.shadow import ShadowMode

        if self._mode is None:
            raise ShadowOptionError("plan.check: apply the plan first (plan.apply(model)), then check the step")
        with self._mode, ShadowMode(spot_checks="off", budgets=False) as sm:
            values = step_targets(step(), target)
            t_dev, t_64 = read_targets(values, sm)
        with torch._C._DisableTorchDispatch():  # shadow's own arithmetic: no mode sees it
            diff, norm = float(torch.linalg.vector_norm(t_dev - t_64)), float(torch.linalg.vector_norm(t_64))
        return diff / norm if norm else (math.inf if diff else 0.0)


def choose(report: AuditReport, tolerance: float) -> Plan:
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance >= 0:
        raise ShadowOptionError(f"plan(tolerance={tolerance!r}): expected a relative change >= 0 (1e-3: 0.1 %)")
    chosen: dict[str, str] = {}
    total = 0.0
    tree = report.by == "module" and not report.own
    children = _children({r.key for r in report.rows if r.key}) if tree else {}
    for precision in (p for p in PRECISIONS if p in report.precisions):  # cheapest first
        # "" (calls outside any module: the loss, the optimizer) is never moved
        rows = {r.key: r for r in report.rows if r.precision == precision and r.key}
        cost = _costs(rows, children) if tree else {k: r.sensitivity for k, r in rows.items()}

        def fits(k: str) -> bool:
            return rows[k].applies and math.isfinite(cost[k]) and total + cost[k] <= tolerance / 2

        if not tree:
            for k in sorted((k for k in rows if k not in chosen), key=lambda k: (cost[k], k)):
                if fits(k):
                    chosen[k] = precision
                    total += cost[k]
            continue
        level = children[""]
        while level:  # the model down, one depth at a time: the largest subtrees that fit
            deeper = []
            for k in sorted(level, key=lambda k: (cost[k], k)):
                if k in chosen:
                    continue
                if fits(k) and not any(m.startswith(k + ".") for m in chosen):
                    chosen[k] = precision
                    total += cost[k]
                else:
                    deeper += children.get(k, [])
            level = deeper
    return Plan(report.by, float(tolerance), chosen, total, report.own, report.target_at)


def _costs(rows: dict[str, AuditRow], children: dict[str, list[str]]) -> dict[str, float]:
    """What moving each subtree costs: the larger of its change and the sum of its submodules' costs. Errors of
    submodules that cancel in one step's change need not cancel in the next (measured: a whole model's FP8 change
    1.7e-4 where its parts' were up to 9.4e-4; the plan moving it whole changed the next step by 3e-3)."""
    cost: dict[str, float] = {}

    def of(k: str) -> float:
        if k not in cost:
            parts = sum(of(c) for c in children.get(k, []) if c in rows)
            cost[k] = max(rows[k].sensitivity, parts)
        return cost[k]

    for k in rows:
        of(k)
    return cost


def _enclosing(module: str) -> list[str]:
    """A module path and its ancestors' paths, innermost first ("A.b.c", "A.b", "A")."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)] if module else []


def _children(keys: set[str]) -> dict[str, list[str]]:
    """The module tree of ``keys`` (paths): each key under its nearest ancestor among them; "" holds the roots."""
    tree: dict[str, list[str]] = {"": []}
    for k in sorted(keys):
        parent = next((m for m in _enclosing(k)[1:] if m in keys), "")
        tree.setdefault(parent, []).append(k)
    return tree


class PlanMode(TorchDispatchMode):
    """Computes each planned part's ops in its precision (see the module's docstring). Enter it outside ShadowMode."""

    def __init__(self, plan: Plan):
        super().__init__()
        self.plan = plan
        self._tracker = Tracker() if plan.by == "module" else None
        self._tree = plan.by == "module" and not plan.own
        self._upcasts = Upcasts()  # what the model holds in float32 stays there in a part held in bf16 or fp16
        self._emulations = {p: PRECISIONS[p].mode(self._upcasts) for p in set(plan.parts.values())}
        self._stepping = 0  # optimizer steps running: their calls keep the optimizer's own precision
        self._handles: list = []

    def __enter__(self):
        require_outside_shadow("plan.apply(...)")
        self._upcasts.__enter__()
        if self._tracker is not None:
            self._tracker.__enter__()
        self._handles = [register_optimizer_step_pre_hook(lambda *a: self._step(1)),
                         register_optimizer_step_post_hook(lambda *a: self._step(-1))]
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        try:
            super().__exit__(*exc)
        finally:
            for h in self._handles:
                h.remove()
            self._handles = []
            if self._tracker is not None:
                self._tracker.__exit__(*exc)
            self._upcasts.__exit__(*exc)

    def _step(self, delta: int) -> None:
        self._stepping += delta

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        plan = plan_of(func)
        precision = None if self._stepping else self._precision(plan)
        out = self._tf32(plan, args, kwargs) if precision == "tf32" else NotImplemented
        if out is NotImplemented:
            out = func(*args, **kwargs) if precision is None else \
                self._emulations[precision].__torch_dispatch__(func, types, args, kwargs)
        for emulation in self._emulations.values():
            emulation.seen(func, args, kwargs, out)
        return out

    def _precision(self, plan: Any) -> str | None:
        """The precision the plan gives a call: its op's; its innermost module's; or, by subtrees, that of the
        innermost planned module whose forward (or backward) is running."""
        if self._tracker is None:
            return self.plan.parts.get(plan.name)
        if not self._tree:
            return self.plan.parts.get(self._tracker.innermost)
        planned = [m for m in self._tracker.parents if m in self.plan.parts]
        return self.plan.parts[max(planned, key=lambda m: m.count("."))] if planned else None

    def _tf32(self, plan: Any, args: tuple, kwargs: dict) -> Any:
        """A matmul or convolution through the device's TF32 switch on CUDA (NotImplemented elsewhere: the
        emulated device computes it)."""
        device = next((t.device for _, t in plan.tensors(args, kwargs)), None)
        if device is None or device.type != "cuda" or not computes(plan):
            return NotImplemented
        old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        try:
            return plan.func(*args, **kwargs)
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
