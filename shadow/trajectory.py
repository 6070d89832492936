"""Trajectories: over a multi-step run, the drift of the loss and of the parameters after every optimizer step,
kept in the report as a few numbers per step (no per-call records needed), so that a user sees whether drift
grows, saturates or is washed out by training.

The loss of a step is the last one-element floating result computed before its backward began (``loss`` or a
GradScaler's scaled loss: the relative drift is the same); the parameters are those the optimizer stepped.
"""

from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING, Any

import torch

from .metrics import compare
from .records import Phase, Record, StepDrift, loss_candidate

if TYPE_CHECKING:
    from .engine import Engine

_no_dispatch = torch._C._DisableTorchDispatch


class Trajectory:
    """Fed by the engine (``seen``, its ``EngineHooks.recorded``: each record, with its first tensor result) and by
    the optimizer step hook (``stepped``)."""

    def __init__(self, names: Any) -> None:
        self._names = names  # () -> {id(parameter): name}
        self._last: weakref.ref | None = None  # the last one-element forward result
        self._loss: weakref.ref | None = None  # ... frozen when the step's backward begins
        self.steps: list[StepDrift] = []

    def seen(self, rec: Record, result: Any) -> None:
        if rec.phase is Phase.BACKWARD:
            if self._loss is None and self._last is not None:
                self._loss = self._last
        elif isinstance(result, torch.Tensor) and loss_candidate(rec.op, rec.phase, result.numel(),
                                                                 result.is_floating_point()):
            self._last = weakref.ref(result)

    def stepped(self, opt: torch.optim.Optimizer, engine: Engine) -> None:
        """An optimizer step ended: the loss's and the stepped parameters' drift, read from ``engine``'s shadows."""
        with _no_dispatch():
            loss = self._loss() if self._loss is not None else None
            value = drift = None
            if loss is not None:
                value, drift = _relative(engine, loss)
            names = self._names()
            total = norm = 0.0
            worst, worst_drift = "", 0.0
            stepped = [p for group in opt.param_groups for p in group["params"]]
            for p in stepped:
                try:
                    diff, size = _distance(engine, p, stepped)
                except (KeyError, TypeError):  # never seen (a frozen parameter): no shadow to compare
                    continue
                total, norm = total + diff * diff, norm + size * size
                own = diff / size if size else (math.inf if diff else 0.0)
                if own > worst_drift:
                    worst, worst_drift = names.get(id(p), ""), own
        params = math.sqrt(total) / math.sqrt(norm) if norm else (math.inf if total else 0.0)
        self.steps.append(StepDrift(len(self.steps) + 1, value, drift, params, worst, worst_drift))
        self._last = self._loss = None


def _distance(engine: Engine, p: torch.Tensor, params: list[torch.Tensor]) -> tuple[float, float]:
    """(||p - shadow||, ||shadow||) from one comparison pass over the parameter and its shadow where the shadow lies
    (a step of a large model: copies of both cost more than the step's own optimizer ops): p's values there are
    those the optimizer step's comparisons read over, or they cross now with the other ``params`` that must
    (``Engine.near``); NaN distance where either holds a NaN or an infinity, as their difference would."""
    shadow = engine.shadow_view(p)
    stats = compare(engine.near(p.detach(), params), shadow, p.dtype)
    if stats.nonfinite or stats.nonfinite_agreed:
        return math.nan, float(torch.linalg.vector_norm(shadow))
    if stats.norm == 0.0 or not stats.rel_norm < math.inf:  # ||shadow|| is not norm / rel_norm: computed apart
        return stats.norm, float(torch.linalg.vector_norm(shadow))
    return stats.norm, stats.norm / stats.rel_norm


def _relative(engine: Engine, t: torch.Tensor) -> tuple[float | None, float | None]:
    try:
        shadow = float(engine.shadow_of(t).reshape(-1)[0])
    except (KeyError, TypeError):
        return None, None
    value = float(engine.near(t.detach()).reshape(-1)[0])  # the copy its comparison read over, if it crossed
    diff = abs(value - shadow)
    return value, diff / abs(shadow) if shadow else (math.inf if diff else 0.0)
