"""Each forward op's error weighted by the float64 adjoint of a target (the linear method of ``shadow.attribute``).

To first order, the drift of a target T is the sum over ops i of <dT/dy_i, e_i>, where e_i is op i's own error
on its output y_i (ADAPT, CHEF-FP: there the errors are modelled; here they are measured). The adjoints come
for free under ShadowMode: autograd's backward computes dT/dy_i on the device, and shadow replays every backward
op in float64 on shadow values, so the shadow of the gradient entering y_i's autograd node is the float64
adjoint at the float64 point. A hook before that node runs reads it; no gradient the user sees changes.

The errors weighted are the caller's (``Adjoints(errors=...)``, in channels). ``shadow.attribute`` splits the
device's error in two: ``removable`` = y - round(r), what the kernel adds beyond rounding the float64 result r to
the output's dtype (what making the op exact removes, as the ablation method does), and ``rounding`` =
round(r) - r, which no kernel in that dtype can avoid. ``shadow.audit`` weights the error each candidate
precision would make on the float64 inputs.

Covered: the ops between the inputs and the target that autograd differentiates (forward ops whose outputs have
an autograd node). Not covered: ops under no_grad or on tensors that need no gradient, backward and optimizer
ops (a loss computed before them does not depend on them); their share falls into the residual.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Callable

import torch

from ..records import Phase, Record
from ..scratch import copy

_no_dispatch = torch._C._DisableTorchDispatch


Errors = Callable[[Record, Any, Any], "tuple[torch.Tensor, ...] | None"]  # (record, output, Prepared) -> channels


def split_rounding(rec: Record, o: Any, p: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The device's error on one output in two channels: removable (y - round(r)) and rounding (round(r) - r)."""
    d, r = o.device, o.reference
    if not isinstance(r, torch.Tensor) or r.shape != d.shape:
        return None
    return split_error(copy(d, torch.float64, r.device), r, d.dtype)


def split_error(y: torch.Tensor, r: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The error of a result y (upcast to float64 from ``dtype``) against its float64 reference r, in two parts
    that add up to y - r: removable, y - round(r), and rounding, round(r) - r.

    A part between two equal non-finite values is 0, where the subtraction reads NaN: a mask's -inf, the same in
    the float64 world, carries no error, and a result that overflows as its correct rounding does (exp(12) in
    float16) has no removable part. What is left non-finite (the rounding of that overflow, a NaN or infinity
    only the device has) is an error no share expresses, which the caller counts apart."""
    rounded = correctly_rounded(y, r, dtype)
    removable, rounding = y - rounded, rounded - r
    if not (bool(removable.isfinite().all()) and bool(rounding.isfinite().all())):
        removable.masked_fill_(_same(y, rounded), 0.0)
        rounding.masked_fill_(_same(rounded, r), 0.0)
    return removable, rounding


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a == b) | (a.isnan() & b.isnan())


class Adjoints:
    """Hooks into one ShadowMode run: ``observe`` (the engine's, per judged call) keeps each forward output's
    errors, in the channels ``errors`` gives (``split_rounding``: removable and rounding); ``bind`` (the
    call-site tracker's, once the outputs have autograd nodes) hooks those nodes; ``contributions`` (record
    index -> one sum(adjoint * error) per channel) fills in as backward runs."""

    def __init__(self, shadow_of: Callable[[torch.Tensor], torch.Tensor], errors: Errors = split_rounding) -> None:
        self._shadow_of = shadow_of
        self._errors_of = errors
        self._errors: dict[int, dict[int, tuple[torch.Tensor, ...]]] = {}  # index -> id(out) -> errors
        self.records: dict[int, Record] = {}  # the records of the calls with errors kept (the report may keep none)
        self._scalars: list[tuple[weakref.ref, int]] = []  # one-element outputs: (the tensor, its record index)
        self.seeds: dict[int, float] = {}  # record index -> the float64 adjoint of its one-element output
        self.contributions: dict[int, list[float]] = {}
        self.missed = 0  # adjoints that could not be read (a gradient made where shadow could not see it)
        self._handles: list = []

    def observe(self, rec: Record, outputs: list, p: Any) -> None:
        if rec.phase in (Phase.BACKWARD, Phase.OPTIMIZER):
            return
        errors = {}
        with _no_dispatch():
            for o in outputs:
                # inside the dispatch no output has autograd metadata yet: ``bind`` drops those that get no node
                if isinstance(o.device, torch.Tensor) and o.device.is_floating_point():
                    e = self._errors_of(rec, o, p)
                    if e is not None:
                        errors[id(o.device)] = e
        if errors:
            self._errors[rec.index] = errors
            self.records[rec.index] = rec

    def bind(self, index: int, outputs: list[torch.Tensor]) -> None:
        errors = self._errors.pop(index, None)
        if errors is not None and not outputs:
            self.records.pop(index, None)
        for t in outputs:
            if t.numel() == 1:
                self._scalars.append((weakref.ref(t), index))
            e = errors.get(id(t)) if errors is not None else None
            if e is None and t.numel() != 1:
                continue
            self._handles.append(t.grad_fn.register_prehook(self._hook(index, t.output_nr, e, t.numel() == 1)))

    def _hook(self, index: int, nr: int, errors: tuple[torch.Tensor, ...] | None, scalar: bool) -> Any:
        def hook(grad_outputs: tuple) -> None:
            g = grad_outputs[nr] if nr < len(grad_outputs) else None
            if g is None:
                return
            try:
                adj = self._shadow_of(g)
            except (KeyError, TypeError):  # a gradient shadow never saw: this call stays uncovered (the residual)
                self.missed += 1
                return
            with _no_dispatch():  # shadow's own arithmetic: no mode (shadow's, an emulated device's) sees it
                if scalar:
                    self.seeds[index] = float(adj.reshape(-1)[0])
                if errors is not None and adj.shape == errors[0].shape:
                    adj = adj.to(errors[0].device)
                    sums = self.contributions.setdefault(index, [0.0] * len(errors))
                    for i, e in enumerate(errors):
                        sums[i] += weighted(adj, e)

        return hook

    def index_of(self, t: torch.Tensor) -> int | None:
        """The record index of the forward call that produced the one-element tensor t (None: not seen)."""
        return next((i for ref, i in reversed(self._scalars) if ref() is t), None)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._errors.clear()


def weighted(adjoint: torch.Tensor, error: torch.Tensor) -> float:
    """sum(adjoint * error), where an element without error weighs nothing whatever its adjoint: a masked score's
    adjoint may be NaN or infinite in the float64 world (0 * inf), and its error is 0. Not finite: an error that
    is itself not finite, or a non-finite adjoint where the call made an error."""
    total = float(torch.sum(adjoint * error))
    if math.isfinite(total):
        return total
    return float(torch.sum(torch.where(error == 0, 0.0, adjoint * error)))


def correctly_rounded(y: torch.Tensor, r: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """r rounded to ``dtype`` (as float64), or the device's y where y is as close to r: at a tie both neighbours
    are correct roundings (round-to-nearest-even picks one, a kernel may pick the other: no error of its own)."""
    rounded = r.to(dtype).to(r.dtype)
    return torch.where((y - r).abs() <= (rounded - r).abs(), y, rounded)


def leaves(t: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors requiring grad that t's autograd graph reaches (what ``torch.autograd.grad`` is asked for:
    it runs every node on the way, and accumulates into no ``.grad``)."""
    found: dict[int, torch.Tensor] = {}
    stack, seen = [t.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            found.setdefault(id(variable), variable)
        stack.extend(n for n, _ in node.next_functions)
    return list(found.values())
