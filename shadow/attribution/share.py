"""``shadow.attribute``: the share of a target's drift each op class, module or call site causes.

The target's drift is D = T_device - T_float64 (the shadow of T). Each call's error is split in two: removable,
y - round(r), what its kernel adds beyond rounding its float64 result r to the output's dtype, and rounding,
round(r) - r, which no kernel in that dtype avoids (``shadow.attribution.adjoint.split_error``). A key's two
shares are the parts of D its calls cause by each, projected on D: share = <D_k, D> / <D, D>, signed fractions
that add up over every key, with ``residual``, to 1:

- ``linear`` (one run): D_k = sum over the key's forward calls of <adjoint, error>, the adjoint being the float64
  derivative of the target with respect to the call's output (``shadow.attribution.adjoint``), once per part of
  the error. Covers the forward calls whose results have an autograd node (a loss does not depend on the backward
  and optimizer ops that follow it).
- ``ablation`` (two runs per key at most, after the first): the share is D - D with the key's calls made exact
  (each result its float64 reference correctly rounded to the device dtype), the rounding share the rest of what
  disappears with the key's calls making no error at all (their float64 results kept). Covers every phase: the
  only method for targets an optimizer step computes (parameters after it). State is restored between runs
  (``shadow.attribution.state``).

  The replacement happens in the shadow, never on the device: each run is a float64 world in which every other
  call makes exactly the error the device made in it (its shadow plus the device's error on its own inputs, so
  that with no call changed the world is the device's trajectory), and the key's calls make only the error of
  rounding their float64 result to the device dtype, or none. Errors are held fixed: rewriting the device's
  results instead would change the inputs of every later call, whose roundings would be drawn again, and at the
  rounding level (a correct fp32 or bf16 step) that noise is as large as the drift itself (measured: shares of
  +-200 % for ops with 1 % of it). Held fixed, the worlds agree with the linear method to first order and add
  what it leaves out: the nonlinear propagation, the calls without autograd node (dropout's mask scaled by
  1/(1-p), autocast's casts of the inputs), and the backward and optimizer calls.

Both methods leave the user's objects as they found them: the modules' parameters and buffers, the optimizers'
state and torch's generators are put back after the last run (``StepState.as_found``), so that attributing a step
takes no optimizer step. By module, a key is a module's own calls (its submodules' are theirs): keys are disjoint,
so that shares add up; a row of a model is the calls it runs itself (the loss, in Hugging Face models).

``residual`` = 1 - shares - rounding shares: what neither explains (second-order effects; ops outside the
coverage; calls left out). A value non-finite in the float64 world too (a mask's -inf) carries no error; a share
whose arithmetic still meets one (linear's first order of an overflow, a non-finite adjoint where a call erred, an
ablation world whose target is not finite) is shadow's own failure: left out of the rows, named in ``left_out``
and counted in ``report.coverage.internal_errors``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable

import torch

from ..engine import EngineHooks
from ..errors import ShadowOptionError
from ..modes.shadow import ShadowMode
from ..records import Phase, Record
from ..report import Report
from .adjoint import Adjoints, Errors, leaves, split_rounding
from .state import StepState
from ..scratch import copy

# attribute's own arithmetic reaches no mode: not its ShadowMode's, nor an emulated device's or a fault's around it
_own = torch._C._DisableTorchDispatch
BY = ("op", "module", "callsite")
# what a row is, the table's first line: keys are disjoint, so that shares add up (a module's row is not its subtree)
_ROWS = {"op": "rows: every call of one op overload",
         "module": "rows: a module's own calls, not its submodules' (disjoint rows: the shares and the residual "
                   "add up to 1)",
         "callsite": "rows: the calls made from one line of code"}
METHODS = ("linear", "ablation")
# an error beyond rounding: more than half an ulp (with room for the reference's own last bit)
_ROUNDED_ULP = 0.5 + 1e-6


@dataclasses.dataclass(frozen=True, slots=True)
class Share:
    """One key's part of the target's drift."""

    key: str  # an op overload ("aten.gelu.default"), a module path ("Net.fc1") or a call site ("model.py:42")
    share: float  # the fraction of the target's drift its errors beyond a correct rounding cause (negative: cancels)
    rounding_share: float  # ... its results' correct rounding to their dtype causes
    introduced: float | None  # the largest local error (rel_norm) of its calls: what it adds itself
    amplification: float | None  # the largest factor by which its calls magnify the drift they receive
    calls: int

    @property
    def total(self) -> float:
        """The fraction of the drift the key's calls cause, removable and rounding together (what ranks rows)."""
        return self.share + self.rounding_share


@dataclasses.dataclass
class AttributionResult:
    """What ``attribute`` found. ``rows``: worst first (by |total| = |share + rounding_share|); ``report``: the
    first run's Report."""

    method: str
    by: str
    drift: float  # the target's drift, ||D|| / ||T_float64|| (inf: a float64 target of exactly 0)
    rows: list[Share]
    rounding: float  # the rounding shares' sum: rounding every result to its dtype, which no kernel can avoid
    residual: float  # 1 - shares - rounding
    phases: tuple[str, ...]  # the phases whose calls the method covers
    runs: int  # how many times the step ran
    report: Report
    left_out: dict[str, int]  # key -> its calls whose share came out non-finite (shadow's own failure), left out

    def table(self, top: int | None = None) -> str:
        """The rows as text, under a line saying what a row is (by module: a module's own calls, not its
        submodules'), with the drift, the rounding share and the residual below them.

        columns: the shares of the target's drift (signed) the key's errors beyond a correct rounding and its
        correct rounding cause, the largest local error rel_norm of its calls, the largest amplification of the
        drift its calls receive (``-``: none received any), calls."""
        rows = self.rows if top is None else self.rows[:top]
        name_w = max([len(self.by)] + [len(r.key or "(none)") for r in rows])
        head = (f"{self.by:<{name_w}}  {'share':>8}  {'rounding':>8}  {'introduced':>10}  {'amplif.':>8}  "
                f"{'calls':>6}")
        lines = [_ROWS[self.by], head, "-" * len(head)]
        for r in rows:
            lines.append(f"{r.key or '(none)':<{name_w}}  {_pct(r.share):>8}  {_pct(r.rounding_share):>8}  "
                         f"{_num(r.introduced):>10}  {_num(r.amplification):>8}  {r.calls:>6}")
        lines.append("-" * len(head))
        lines.append(f"target drift (rel_norm) {_num(self.drift)}; rounding results to their dtype "
                     f"{_pct(self.rounding)}; residual {_pct(self.residual)}")
        if self.left_out:
            lines.append("left out, their share not finite in shadow's own arithmetic (coverage.internal_errors): "
                         + ", ".join(f"{k or '(none)'} ({n} call{'s' if n != 1 else ''})"
                                     for k, n in sorted(self.left_out.items())))
        lines.append(f"method {self.method} ({self.runs} run{'s' if self.runs != 1 else ''}), covering "
                     f"{', '.join(self.phases)} calls")
        return "\n".join(lines)


def attribute(step: Callable[[], Any], *, by: str = "op", method: str = "linear", target: Any = None,
              **shadow_options: Any) -> AttributionResult:
    """The share of the drift of ``step``'s target that each op class (``by="op"``), module or call site causes.

    ``step``: a zero-argument callable running the computation (a training step) and returning the target: the
    loss, a tensor or tensors. ``target``: what to measure instead, read after the step: a tensor, tensors, an
    ``nn.Module`` (its parameters) or a zero-argument callable returning them (parameters after an optimizer
    step: use ``method="ablation"``, since only it covers backward and optimizer calls). ``shadow_options``: for
    the ShadowMode of the first run (``result.report``).

    Each row has two shares: ``share``, what its calls' errors beyond a correct rounding cause (a kernel less
    accurate than its dtype allows), and ``rounding_share``, what their correct rounding causes (on a correct step,
    whose rounding drives the drift); rows rank by their sum (docs/attribution.md).

    >>> res = shadow.attribute(lambda: train_step(model, batch), by="module", method="ablation")  # doctest: +SKIP
    >>> print(res.table(top=5))                                                                  # doctest: +SKIP
    >>> res.rows[0].key, res.rows[0].share, res.rows[0].rounding_share                           # doctest: +SKIP
    """
    if by not in BY:
        raise ShadowOptionError(f"attribute(by={by!r}): expected one of {', '.join(map(repr, BY))}")
    if method not in METHODS:
        raise ShadowOptionError(f"attribute(method={method!r}): expected one of {', '.join(map(repr, METHODS))}")
    if not callable(step):
        raise ShadowOptionError(f"attribute(step={step!r}): expected a zero-argument callable that runs the "
                                "computation and returns the target (the loss)")
    if shadow_options.get("callsites") is False:
        raise ShadowOptionError("attribute(callsites=False): attribution follows outputs through their autograd "
                                "nodes, which the call-site tracking provides: leave callsites on")
    if shadow_options.get("local") is False:
        raise ShadowOptionError("attribute(local=False): shares are built from each call's own (local) error: "
                                "leave local on")
    return (_linear if method == "linear" else _ablation)(step, by, target, shadow_options)


# --- linear ---
@dataclasses.dataclass
class AdjointPass:
    """One run with each forward call's error weighted by the float64 adjoint of the target."""

    report: Report
    values: list[torch.Tensor]  # the target tensors
    t_dev: torch.Tensor  # the target's device values, flattened (float64)
    t_64: torch.Tensor  # ... and its shadow
    contributions: dict[int, list[float]]  # record index -> sum(adjoint * error), per channel of the errors
    records: dict[int, Record]  # record index -> the record of each call with a contribution
    factor: float  # contribution * factor = the change it causes in <along, T> (``adjoint_pass``)


def adjoint_pass(step: Callable[[], Any], target: Any, options: dict,
                 along: Callable[[torch.Tensor], torch.Tensor | None], errors: Errors = split_rounding,
                 also: Callable[..., None] | None = None,
                 ready: Callable[[ShadowMode], None] | None = None) -> AdjointPass:
    """Run ``step`` under a ShadowMode (``options``) collecting each forward call's ``errors`` weighted by the
    float64 adjoint of <along(D), T>, where D is the target's drift (``along`` returns None: no weighting needed);
    ``also``: another observer of every judged call, called before the errors are asked for; ``ready``: called
    with the ShadowMode before the step."""
    def observe(rec: Record, outputs: list, p: Any) -> None:
        if also is not None:
            also(rec, outputs, p)
        adjoints.observe(rec, outputs, p)

    sm = ShadowMode(**options, hooks=EngineHooks(observe=observe))
    if ready is not None:
        ready(sm)
    adjoints = Adjoints(sm.shadow_of, errors)
    sm._attr.callsites.on_bind = adjoints.bind
    try:
        with sm:
            out = step()
            sm._attr.callsites.bind()  # the step's last op: its outputs have their autograd nodes now
            values = step_targets(out, target)
            t_dev, t_64 = read_targets(values, sm)
            with _own():
                direction = along(t_dev - t_64)
            factor = _linear_factor(values, adjoints, sm, direction) if direction is not None else 0.0
    finally:
        adjoints.close()
    return AdjointPass(sm.report, values, t_dev, t_64, adjoints.contributions, adjoints.records, factor)


def _linear(step: Callable[[], Any], by: str, target: Any, options: dict) -> AttributionResult:
    state = StepState()
    with state.as_found():
        with state.learning():
            # along D's direction, of norm 1: a seed the target's dtype holds (1 / D overflows float16 for D < 2e-5)
            run = adjoint_pass(step, target, options,
                               lambda d: d / math.sqrt(_dot(d, d)) if _finite_drift(d) else None)
    with _own():
        d = run.t_dev - run.t_64
    dd = _dot(d, d)
    shares = _Shares(run.report, by)
    if _finite_drift(d):
        scale = run.factor / math.sqrt(dd)  # a sum of adjoint * error -> its share, <D_k, D> / <D, D>
        for index, c in run.contributions.items():
            shares.add(_key(run.records[index], by), c[0] * scale, c[1] * scale,
                       lambda: f"a non-finite sum of adjoint * error in call {index} (removable {c[0]}, rounding "
                               f"{c[1]})")
    return _result("linear", by, run.report, run.t_64, d, dd, shares, ("forward", "other"), 1)


def _dot(a: torch.Tensor, b: torch.Tensor) -> float:
    with _own():
        return float(torch.dot(a, b))


def _linear_factor(values: list[torch.Tensor], adjoints: Adjoints, sm: ShadowMode, along: torch.Tensor) -> float:
    """The factor that turns sum(adjoint * error) into the change of <along, T> (along: float64, T's size).

    The step's own backward (``loss.backward()``) left adjoints of the loss times its seed (a GradScaler's scale):
    for a one-element target, divide by that seed. Without a backward through the target, one is run here on
    <along, T> (``torch.autograd.grad``, into no ``.grad``), along rounded to the target's dtype and the sums
    scaled back."""
    single = len(values) == 1 and values[0].numel() == 1
    index = adjoints.index_of(values[0]) if single else None
    if index is not None and index in adjoints.seeds:  # the step's backward went through the target
        seed = adjoints.seeds[index]
        if seed == 0.0:
            raise ShadowOptionError("linear attribution: the step's backward reached the target with a zero "
                                    "gradient: call backward on the target itself (loss.backward())")
        with _own():
            return float(along[0]) / seed
    if adjoints.contributions:
        raise ShadowOptionError(
            "linear attribution: the step ran a backward that did not start from the target (or the target has "
            f"{sum(v.numel() for v in values)} elements): the adjoints it left are of another function. Return "
            "the loss the step calls backward on, or use method='ablation' for other targets")
    if any(v.grad_fn is None for v in values):
        raise ShadowOptionError(
            "linear attribution: the target is not computed by autograd (a parameter after an optimizer step, or "
            "a tensor computed without gradients): the linear method weights forward errors by the target's "
            "derivatives; use method='ablation', which covers backward and optimizer calls")
    inputs = [leaf for v in values for leaf in leaves(v)]
    if not inputs:
        return 0.0
    seeds, applied, offset = [], 0.0, 0
    with _own():
        for v in values:
            part = along[offset:offset + v.numel()]
            seed = part.reshape(v.shape).to(v.dtype)
            # the seeds are rounded to the target's dtype: the sums are of <seeds, dT>, scaled back to <along, dT>
            applied += float(torch.dot(seed.to(torch.float64).reshape(-1), part))
            seeds.append(seed.to(v.device))
            offset += v.numel()
        norm2 = float(torch.dot(along, along))
    sm._engine.adopt(seeds)  # made where no mode sees them: their shadows are their own (exact) values
    torch.autograd.grad(values, inputs, grad_outputs=seeds, allow_unused=True)  # under ShadowMode: shadowed
    return norm2 / applied if applied else 0.0


# --- ablation ---
def _ablation(step: Callable[[], Any], by: str, target: Any, options: dict) -> AttributionResult:
    state = StepState()
    sm = ShadowMode(**options)
    with state.as_found():
        with state.learning(), sm:
            values = step_targets(step(), target)
            t_dev, t_64 = read_targets(values, sm)
        rep = sm.report
        with _own():
            d = t_dev - t_64
        dd = _dot(d, d)
        shares = _Shares(rep, by)
        runs = 1
        if _finite_drift(d):
            removable, erring = _erring_keys(rep, by)
            for key in erring:
                # the key's calls exact (correctly rounded), then making no error at all (float64): what
                # disappears with each is its share, and with the second its rounding share too
                removed = _share_removed(step, target, state, _world(by, key, "exact"), t_64, d, dd) \
                    if key in removable else 0.0
                total = _share_removed(step, target, state, _world(by, key, None), t_64, d, dd)
                runs += 1 + (key in removable)
                shares.add(key, removed, total - removed,
                           lambda: f"a non-finite target in the world without its error (share {removed}, with "
                                   f"its rounding {total})", calls=erring[key])
    return _result("ablation", by, rep, t_64, d, dd, shares, tuple(p.value for p in Phase), runs)


def _world(by: str, key: str, how: str | None) -> Callable[..., str | None]:
    """An ablation world: the key's calls rewritten as ``how`` says ("exact": correctly rounded; None: their float64
    results), every other call making the error the device made (``shadow.engine.commit.in_world``)."""
    return lambda op, module, phase, callsite: how if _key_of(by, op, module, callsite) == key else "device"


def _share_removed(step: Callable[[], Any], target: Any, state: StepState, world: Callable[..., str | None],
                   t_64: torch.Tensor, d: torch.Tensor, dd: float) -> float:
    """<D - D_world, D> / <D, D>: the share of the drift that disappears in ``world``. The step runs again from the
    start; the device computes exactly what it did, and the world is the shadow of the target."""
    state.restore(state.start)
    sm = ShadowMode(spot_checks="off", budgets=False, max_records=0, hooks=EngineHooks(world=world))
    with sm:
        values = step_targets(step(), target)
        t_world = read_targets(values, sm)[1]
    with _own():
        return float(torch.dot(d - (t_world - t_64), d)) / dd


def _erring_keys(rep: Report, by: str) -> tuple[set[str], dict[str, int]]:
    """The keys with a call whose device result is not its float64 reference correctly rounded (their share needs
    a run: the others' is 0), and those with a call that made any error at all (their rounding share needs one),
    with their calls' count."""
    removable: set[str] = set()
    erring: dict[str, int] = {}
    for rec in rep.records:
        if rec.local is None:
            continue
        key = _key(rec, by)
        if rec.local.max_ulp > _ROUNDED_ULP:
            removable.add(key)
        if rec.local.max_abs > 0 or rec.local.nonfinite:
            erring[key] = erring.get(key, 0) + 1
    return removable, erring


# --- shared ---
def step_targets(out: Any, target: Any) -> list[torch.Tensor]:
    """The target tensors, read after the step: ``target`` if given, else the step's return."""
    what = target if target is not None else out
    if callable(what) and not isinstance(what, torch.nn.Module):
        what = what()
    if isinstance(what, torch.nn.Module):
        what = list(what.parameters())
    if isinstance(what, torch.Tensor):
        what = [what]
    values = list(what) if isinstance(what, Iterable) else None
    if not values or not all(isinstance(v, torch.Tensor) and v.is_floating_point() for v in values):
        source = "target=" if target is not None else "the step's return"
        raise ShadowOptionError(f"attribute: {source} gave {type(what).__name__}: expected a floating tensor (the "
                                "loss), tensors, an nn.Module (its parameters) or a callable returning them")
    return values


def read_targets(values: list[torch.Tensor], sm: ShadowMode | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's device values and (with ``sm``) its shadow, flattened to one float64 vector each."""
    with _own():
        dev = torch.cat([copy(v, torch.float64, "cpu").reshape(-1) for v in values])
        shadow = torch.cat([sm.shadow_of(v).reshape(-1) for v in values]) if sm is not None else None
    return dev, shadow


def _key(rec: Record, by: str) -> str:
    return _key_of(by, rec.op, rec.module, rec.callsite)


def _key_of(by: str, op: str, module: str, callsite: str) -> str:
    return op if by == "op" else module if by == "module" else callsite


class _Shares:
    """Each key's share and rounding share as they are found, and the keys' calls left out where one is not finite
    (shadow's own failure: counted in the report's coverage, never a share)."""

    def __init__(self, report: Report, by: str) -> None:
        self.report, self.by = report, by
        self.share: dict[str, float] = {}
        self.rounding: dict[str, float] = {}
        self.left_out: dict[str, int] = {}

    def add(self, key: str, share: float, rounding: float, why: Callable[[], str], calls: int = 1) -> None:
        if math.isfinite(share) and math.isfinite(rounding):
            self.share[key] = self.share.get(key, 0.0) + share
            self.rounding[key] = self.rounding.get(key, 0.0) + rounding
            return
        self.left_out[key] = self.left_out.get(key, 0) + calls
        self.report.internal_error(f"attribution of {self.by} {key}", why())


def _finite_drift(d: torch.Tensor) -> bool:
    """Whether the target drifted and its drift can be shared: finite on the device and in float64 (a target that
    is not finite has its origin in ``report.nonfinite_origin()``, not in a share)."""
    with _own():
        return bool(d.any()) and bool(d.isfinite().all())


def _result(method: str, by: str, rep: Report, t_64: torch.Tensor, d: torch.Tensor, dd: float, shares: _Shares,
            phases: tuple[str, ...], runs: int) -> AttributionResult:
    """Rows for every key with calls (0 where nothing was found), the rounding and the residual."""
    introduced: dict[str, float] = {}
    amplified: dict[str, float] = {}
    for rec in rep.records:
        key = _key(rec, by)
        if rec.introduced is not None:
            introduced[key] = max(introduced.get(key, 0.0), rec.introduced)
        if rec.amplification is not None:
            amplified[key] = max(amplified.get(key, 0.0), rec.amplification)
    calls = {k: a.calls for k, a in rep.view(by).items()}
    shared = _finite_drift(d)
    rows = [Share(k, shares.share.get(k, 0.0) if shared else 0.0, shares.rounding.get(k, 0.0) if shared else 0.0,
                  introduced.get(k), amplified.get(k), n)
            for k, n in calls.items() if k in shares.share or (k in introduced and k not in shares.left_out)]
    rows.sort(key=lambda r: (-abs(r.total), r.key))
    with _own():
        norm = float(torch.linalg.vector_norm(t_64))
    drift = math.sqrt(dd) / norm if norm and math.isfinite(dd) else (math.inf if dd else 0.0)
    rounding = sum(r.rounding_share for r in rows)
    residual = 1.0 - sum(r.share for r in rows) - rounding if shared else 0.0
    return AttributionResult(method, by, drift, rows, rounding, residual, phases, runs, rep, dict(shares.left_out))


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    return "0" if x == 0 else f"{x:.3g}"
