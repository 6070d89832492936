"""A precision plan: which parts run in which precision, chosen from an audit, applied on the real device, checked
against float64.

``choose`` goes from the cheapest precision up (fewer mantissa bits first) and moves the least sensitive parts while
the sum of their sensitivities stays within half the tolerance: parts moved together interact (each one's roundings
are drawn again on the others' outputs), and their joint change has measured up to 1.2x the sum.
``Plan.apply(model)`` returns a dispatch mode (``PlanMode``, entered outside ShadowMode) that computes each chosen
part's ops in its precision: bfloat16 and float16 natively (the op run on inputs cast to that dtype, its results
cast back), TF32 through the device's TF32 switch on CUDA; where the device has no such arithmetic (TF32 on a CPU,
FP8 anywhere here) the part's ops run on the emulated device. ``Plan.check(step)`` runs the step with the plan under
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
from torch.utils._pytree import tree_map

from ..attribution.tracking import _innermost, _Tracker
from ..errors import ShadowOptionError
from ..modes.emulate._mode import require_outside_shadow
from ..modes.emulate._utils import computes
from ..plan import plan_of

if TYPE_CHECKING:
    from . import AuditReport

FORMAT = "shadow-precision-plan"
_NATIVE = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass
class Plan:
    """``parts``: part -> precision ("bf16", ...); parts not named stay in the model's own precision."""

    by: str
    tolerance: float
    parts: dict[str, str]
    estimate: float  # the sum of the chosen parts' sensitivities (an estimate of the target's relative change)
    _mode: PlanMode | None = dataclasses.field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        lines = [f"precision plan by {self.by}, tolerance {self.tolerance:.3g} (estimated change {self.estimate:.3g}):"]
        lines += [f"  {k or '(none)'}: {p}" for k, p in sorted(self.parts.items())] or ["  (every part stays as it is)"]
        return "\n".join(lines)

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump({"format": FORMAT, "version": 1, "by": self.by, "tolerance": self.tolerance,
                       "estimate": self.estimate, "parts": self.parts}, f, indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        with open(path) as f:
            d = json.load(f)
        if not isinstance(d, dict) or d.get("format") != FORMAT or d.get("version") != 1:
            raise ShadowOptionError(f"{path}: not a shadow precision plan (format {FORMAT!r}, version 1)")
        return cls(d["by"], d["tolerance"], dict(d["parts"]), d["estimate"])

    def apply(self, model: torch.nn.Module | None = None) -> PlanMode:
        """The mode that runs the plan: ``with plan.apply(model), ShadowMode(): step()`` (the plan outside, as an
        emulated device). ``model``: checks that every planned module is one of its modules."""
        if model is not None and self.by == "module":
            names = {type(model).__name__ + (f".{n}" if n else "") for n, _ in model.named_modules()}
            unknown = sorted(k for k in self.parts if k and k not in names)
            if unknown:
                raise ShadowOptionError(f"plan.apply: {', '.join(unknown)} not modules of this "
                                        f"{type(model).__name__} (its modules: {', '.join(sorted(names)[:8])}...)")
        self._mode = PlanMode(self)
        return self._mode

    def check(self, step: Callable[[], Any], target: Any = None) -> float:
        """Run ``step`` once with the plan (as ``apply`` made it) under a ShadowMode: the relative change of the
        target against its float64 shadow. The user's objects are left as after that step."""
        from ..attribution.share import _own, _read, _targets
        from ..modes.shadow import ShadowMode

        if self._mode is None:
            raise ShadowOptionError("plan.check: apply the plan first (plan.apply(model)), then check the step")
        with self._mode, ShadowMode(spot_checks="off", budgets=False) as sm:
            values = _targets(step(), target)
            t_dev, t_64 = _read(values, sm)
        with _own():
            diff, norm = float(torch.linalg.vector_norm(t_dev - t_64)), float(torch.linalg.vector_norm(t_64))
        return diff / norm if norm else (math.inf if diff else 0.0)


def choose(report: AuditReport, tolerance: float) -> Plan:
    from . import ORDER

    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance >= 0:
        raise ShadowOptionError(f"plan(tolerance={tolerance!r}): expected a relative change >= 0 (1e-3: 0.1 %)")
    chosen: dict[str, str] = {}
    total = 0.0
    for precision in (p for p in ORDER if p in report.precisions):
        # "" (calls outside any module: the loss, the optimizer) is never moved
        rows = sorted((r for r in report.rows if r.precision == precision and r.key not in chosen and r.applies
                       and r.key and math.isfinite(r.sensitivity)), key=lambda r: (r.sensitivity, r.key))
        for r in rows:
            if total + r.sensitivity <= tolerance / 2:
                chosen[r.key] = precision
                total += r.sensitivity
    return Plan(report.by, float(tolerance), chosen, total)


class PlanMode(TorchDispatchMode):
    """Computes each planned part's ops in its precision (see the module's docstring). Enter it outside ShadowMode."""

    def __init__(self, plan: Plan):
        super().__init__()
        from . import PRECISIONS

        self.plan = plan
        self._tracker = _Tracker() if plan.by == "module" else None
        self._emulations = {p: PRECISIONS[p].mode() for p in set(plan.parts.values())}
        self._stepping = 0  # optimizer steps running: their calls keep the optimizer's own precision
        self._handles: list = []

    def __enter__(self):
        require_outside_shadow("plan.apply(...)")
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

    def _step(self, delta: int) -> None:
        self._stepping += delta

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        plan = plan_of(func)
        key = _innermost(self._tracker.parents) if self._tracker is not None else plan.name
        precision = self.plan.parts.get(key) if not self._stepping else None
        if precision is None or not computes(plan):
            out = func(*args, **kwargs)
        else:
            out = self._native(precision, plan, args, kwargs)
            if out is NotImplemented:
                out = self._emulations[precision].__torch_dispatch__(func, types, args, kwargs)
        for emulation in self._emulations.values():
            emulation.seen(func, args, kwargs, out)
        return out

    def _native(self, precision: str, plan: Any, args: tuple, kwargs: dict) -> Any:
        """The op in the device's own arithmetic of that precision, or NotImplemented where it has none (an op
        that writes its arguments is left to the emulation, whose numbers are the same for one op)."""
        tensors = [t for _, t in plan.tensors(args, kwargs)]
        device = next((t.device for t in tensors), None)
        if precision == "tf32" and device is not None and device.type == "cuda":
            old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
            try:
                return plan.func(*args, **kwargs)
            finally:
                torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
        dtype = _NATIVE.get(precision)
        if dtype is None or plan.writes or not plan.fresh_returns:
            return NotImplemented
        back = next((t.dtype for t in tensors if t.is_floating_point()), None)
        if back is None or back.itemsize <= dtype.itemsize:
            return NotImplemented
        cast_args, cast_kwargs = plan.map_tensors(args, kwargs,
                                                  lambda t, _: t.to(dtype) if t.is_floating_point() else t)
        try:
            out = plan.func(*cast_args, **cast_kwargs)
        except (RuntimeError, NotImplementedError):  # no kernel in that dtype on this device
            return NotImplemented
        return tree_map(lambda t: t.to(back) if isinstance(t, torch.Tensor) and t.dtype == dtype else t, out)
