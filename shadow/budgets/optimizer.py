"""Optimizer budgets: add and sub with alpha, rsub, addcmul, addcdiv, lerp (ulps of the result plus the
rounding of the scaled operand before the add, added in place by one fused op: they run for every
parameter, every step) and the ``_foreach_X`` ops, whose elements go to X's rule.

>>> from shadow.budgets import budget_for
>>> p, g = torch.ones(3, dtype=torch.float64), torch.full((3,), 0.5, dtype=torch.float64)
>>> budget_for(torch.ops.aten._foreach_add_.List, ([p], [g]), {"alpha": -0.1}, [p - 0.1 * g], torch.float32).family
'elementwise'
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, Callable

import torch

from ..metrics import fused_bounds
from ..opsets import Family
from ..plan import OpPlan
from .core import (Budget, BudgetCall, budget_for, coefficient, foreach_base, magnitude, overloads,
                   register_budget, register_budget_predicate)
from .elementwise import ULPS, register_ulps, with_operand_term
from .rounded import constant, exact

ARITH_ULPS = ULPS["arith"]


def _same(a: Any, b: Any) -> bool:
    """a and b are the same values: one tensor, or two views of the same memory with one layout."""
    return a is b or (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                      and a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
                      and a.is_conj() == b.is_conj() and a.is_neg() == b.is_neg())


@register_budget(*overloads("add", "sub"), family=Family.ELEMENTWISE, reads_overwritten=False)
def add_budget(c: BudgetCall) -> Budget:
    """a + alpha*b: ulps of the result, plus the rounding of alpha*b (or of a Python scalar b) before the add."""
    other, alpha = c.a.get("other"), coefficient(c.a.get("alpha"))
    if isinstance(other, torch.Tensor) and alpha == 1:
        return c.ulps(ARITH_ULPS)
    k = 2 * c.u * abs(alpha)
    return with_operand_term(c, ARITH_ULPS, lambda: other, k, "abs")


@register_budget(*overloads("rsub"), family=Family.ELEMENTWISE)
def rsub_budget(c: BudgetCall) -> Budget:
    """other - alpha*self: as add, with the roles of the operands swapped."""
    self_, other, alpha = c.a["self"], c.a.get("other"), coefficient(c.a.get("alpha"))
    return with_operand_term(c, ARITH_ULPS, lambda: 2 * c.u * (magnitude(alpha) * magnitude(self_) + magnitude(other)))


@register_budget(*overloads("addcmul"), family=Family.ELEMENTWISE, reads_overwritten=False)
def addcmul_budget(c: BudgetCall) -> Budget:
    """self + value*t1*t2: the product is rounded (twice, value included) before the add."""
    t1, t2 = c.a["tensor1"], c.a["tensor2"]
    k = 3 * c.u * abs(coefficient(c.a["value"]))
    if _same(t1, t2) and not t1.is_complex():  # Adam's g * g: non-negative, no |.| temporaries
        return with_operand_term(c, ARITH_ULPS, lambda: t1, k, "square")
    return with_operand_term(c, ARITH_ULPS, lambda: t1, k, "mul", t2)


@register_budget(*overloads("addcdiv"), family=Family.ELEMENTWISE, reads_overwritten=False)
def addcdiv_budget(c: BudgetCall) -> Budget:
    """self + value*t1/t2: the quotient is rounded (twice, value included) before the add."""
    a = c.a
    k = 3 * c.u * abs(coefficient(a["value"]))
    return with_operand_term(c, ARITH_ULPS, lambda: a["tensor1"], k, "div", a["tensor2"])


@register_budget(*overloads("lerp"), family=Family.ELEMENTWISE)
def lerp_budget(c: BudgetCall) -> Budget:
    """start + w*(end - start) (or end - (1-w)*(end - start)): the difference and its product are rounded."""
    a = c.a
    w = a["weight"]
    if isinstance(w, torch.Tensor):
        return with_operand_term(
            c, ARITH_ULPS, lambda: 3 * c.u * (w.abs() + (1 - w).abs()) * (a["end"] - a["self"]).abs())
    k = 3 * c.u * (abs(w) + abs(1 - w))
    return with_operand_term(c, ARITH_ULPS, lambda: a["end"], k, "sub", a["self"])


# --- foreach ops: each list element under the rule of the op the name says ---
def foreach_ops(plan: OpPlan) -> bool:
    return foreach_base(plan.func) is not None


@register_budget_predicate(foreach_ops, family=Family.FOREACH)
def foreach_budget(c: BudgetCall) -> Budget:
    """``_foreach_X``: element i of every list argument (tensor or scalar list) goes to X's rule; the budget is
    of X's family where every element's is the same."""
    base = foreach_base(c.func)
    schema = c.func._schema.arguments
    args = [c.a[arg.name] for arg in schema if not arg.kwarg_only]
    # keyword-only arguments (alpha of _foreach_add_.List) go by name: positions would drop them
    base_kw = {a.name for a in base._schema.arguments if a.kwarg_only}
    kwargs = {arg.name: c.a[arg.name] for arg in schema if arg.kwarg_only and arg.name in base_kw}
    n = len(c.outputs)
    subs = []
    for i in range(n):
        elems = [v[i] if isinstance(v, (list, tuple)) and len(v) == n else v for v in args]
        if c.plan.base == "_foreach_norm":  # (self[], ord, dtype) -> linalg_vector_norm(self, ord)
            elems = elems[:2]
        kw = {k: (v[i] if isinstance(v, (list, tuple)) and len(v) == n else v) for k, v in kwargs.items()}
        subs.append(budget_for(base, elems[: len(base._schema.arguments)], kw, [c.outputs[i]], c.dtype,
                               scratch=c.scratch))
    families = {b.family for b in subs}
    ulps = {b.ulps for b in subs}
    return Budget(families.pop() if len(families) == 1 else c.family, lambda: [b.bound[0] for b in subs],
                  outputs=c.outputs, dtype=c.dtype, is_default=any(b.is_default for b in subs),
                  ulps=ulps.pop() if len(ulps) == 1 else None,
                  scale_sq=lambda: tuple(map(sum, zip(*(b.scales() for b in subs)))),
                  formulas=lambda: [b.divisors[0] for b in subs])


# --- fused optimizers (Adam(W), SGD, Adagrad with fused=True): one elementwise step per parameter, bounded by its
# chain of roundings. Each step as aten's CPU kernel orders it (aten/src/ATen/native/cpu/Fused{Adam,SGD,Adagrad}
# Kernel.cpp, the vectorized loop), written once on numbers: ``k(x)`` is a constant x as the kernel holds it in the
# compute type, ``ks(x)`` one it rounds to the parameter's dtype first (``fVec(scalar_t(momentum))``). The budget
# runs the steps on ``Rounded`` values; on float64 tensors they are the float64 kernel (tests check it).
def adam_constants(*, lr, beta1, beta2, weight_decay, eps, step) -> dict[str, float]:
    """The numbers of an Adam(W) step as its kernel computes them before the loop, in double, by the names of
    ``shadow._fused_bounds.ADAM_CONSTANTS``."""
    return {"decay": 1 - lr * weight_decay, "weight_decay": weight_decay, "w": 1 - beta1, "beta2": beta2,
            "one_minus_beta2": 1 - beta2, "correction2": math.sqrt(1 - beta2 ** step), "eps": eps,
            "step": -lr / (1 - beta1 ** step)}


def adam_step(p, g, m, v, vmax, k, *, lr, beta1, beta2, weight_decay, eps, step, amsgrad, maximize, adamw,
              grad_scale=None):
    """(param, grad or None where unscaled, exp_avg, exp_avg_sq, max_exp_avg_sq) after one Adam(W) step.
    ``shadow._fused_bounds.adam`` is this chain on ``Rounded`` values, one element at a time."""
    q = adam_constants(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, step=step)
    if grad_scale is not None:
        g = g / grad_scale
    g_out = None if grad_scale is None else g
    if maximize:
        g = -g
    if weight_decay != 0:
        if adamw:
            p = p * k(q["decay"])
        else:
            g = g + p * k(q["weight_decay"])
    w = q["w"]  # exp_avg.lerp_(grad, w), from the nearer end
    m = m + k(w) * (g - m) if abs(w) < 0.5 else g - (g - m) * (1 - k(w))
    v = v * k(q["beta2"]) + k(q["one_minus_beta2"]) * g * g
    if amsgrad:
        vmax = vmax.maximum(v)
    denom = (vmax if amsgrad else v).sqrt() / k(q["correction2"]) + k(q["eps"])
    return p + k(q["step"]) * m / denom, g_out, m, v, vmax


def sgd_step(p, g, buf, k, ks, *, weight_decay, momentum, lr, dampening, nesterov, maximize, is_first_step,
             grad_scale=None):
    """(param, grad or None where unscaled, momentum buffer or None without momentum) after one SGD step."""
    if grad_scale is not None:
        g = g / grad_scale
    g_out = None if grad_scale is None else g
    if maximize:
        g = -g
    if weight_decay != 0:
        g = g + p * ks(weight_decay)
    if momentum != 0:
        buf = g if is_first_step else buf * ks(momentum) + g * ks(1 - dampening)
        g = g + buf * ks(momentum) if nesterov else buf
    else:
        buf = None
    return p + g * ks(-lr), g_out, buf


def adagrad_step(p, g, state_sum, k, ks, *, lr, lr_decay, weight_decay, eps, step, maximize, grad_scale=None):
    """(param, grad or None where unscaled, state_sum) after one Adagrad step."""
    if grad_scale is not None:
        g = g / grad_scale
    g_out = None if grad_scale is None else g
    if maximize:
        g = -g
    if weight_decay != 0:
        g = g + p * ks(weight_decay)
    state_sum = state_sum + g * g
    clr = lr / (1 + (step - 1) * lr_decay)
    return p - ks(clr) * g / (state_sum.sqrt() + ks(eps)), g_out, state_sum


def _adam_arguments(c: BudgetCall, i: int) -> dict[str, Any]:
    """The hyper-parameters of ``adam_step`` on parameter i."""
    a = c.a
    return {"lr": float(a["lr"]), "beta1": a["beta1"], "beta2": a["beta2"], "weight_decay": a["weight_decay"],
            "eps": a["eps"], "step": float(a["state_steps"][i])}


def _adam(c: BudgetCall, i: int, k: Callable, ks: Callable, grad_scale: float | None, adamw: bool) -> tuple:
    a = c.a
    vmax = exact(a["max_exp_avg_sqs"][i], c.ua) if a["amsgrad"] else None
    return adam_step(*(exact(a[n][i], c.ua) for n in ("self", "grads", "exp_avgs", "exp_avg_sqs")), vmax, k,
                     amsgrad=a["amsgrad"], maximize=a["maximize"], adamw=adamw, grad_scale=grad_scale,
                     **_adam_arguments(c, i))


def _adam_pass(c: BudgetCall, i: int, grad_scale: float | None, adamw: bool, take: Callable) -> list | None:
    """The bounds ``_adam``'s chain gives on parameter i, in the order it returns them (None for what it leaves
    out), from ``shadow._fused_bounds.adam``'s one pass, into memory from ``take(like)``; None where the pass
    cannot read the tensors."""
    a = c.a
    amsgrad = a["amsgrad"]
    ins = [a[n][i] for n in ("self", "grads", "exp_avgs", "exp_avg_sqs")] + \
        [a["max_exp_avg_sqs"][i] if amsgrad else None]
    q = adam_constants(**_adam_arguments(c, i))
    constants = {name: (float(x), c.ua * abs(float(x))) for name, x in q.items()}  # k(x): constant(x, ua, ua)
    if grad_scale is not None:
        constants["scale"] = (grad_scale, 0.0)  # a Python number: exact
    decays = a["weight_decay"] != 0
    flags = {name for name, on in (("scaled", grad_scale is not None), ("maximize", a["maximize"]),
                                   ("decoupled", decays and adamw), ("coupled", decays and not adamw),
                                   ("near", abs(q["w"]) < 0.5), ("amsgrad", amsgrad)) if on}
    writes = (True, grad_scale is not None, True, True, amsgrad)
    outs = [take(ins[0]) if w else None for w in writes]
    if not fused_bounds.adam(ins, outs, constants, flags, c.ua, c.u if c.u > c.ua else 0.0):
        return None
    return outs


def _sgd(c: BudgetCall, i: int, k: Callable, ks: Callable, grad_scale: float | None) -> tuple:
    a = c.a
    bufs = a["momentum_buffer_list"]
    return sgd_step(exact(a["self"][i], c.ua), exact(a["grads"][i], c.ua), exact(bufs[i], c.ua) if bufs else None,
                    k, ks, weight_decay=a["weight_decay"], momentum=a["momentum"], lr=float(a["lr"]),
                    dampening=a["dampening"], nesterov=a["nesterov"], maximize=a["maximize"],
                    is_first_step=a["is_first_step"], grad_scale=grad_scale)


def _adagrad(c: BudgetCall, i: int, k: Callable, ks: Callable, grad_scale: float | None) -> tuple:
    a = c.a
    return adagrad_step(*(exact(a[n][i], c.ua) for n in ("self", "grads", "state_sums")), k, ks, lr=float(a["lr"]),
                        lr_decay=a["lr_decay"], weight_decay=a["weight_decay"], eps=a["eps"],
                        step=float(a["state_steps"][i]), maximize=a["maximize"], grad_scale=grad_scale)


# packet -> (its step on element i of the lists, the lists the step returns in order)
_ADAM_LISTS = ("self", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs")
_FUSED_STEPS = {
    "_fused_adam": (functools.partial(_adam, adamw=False), _ADAM_LISTS),
    "_fused_adamw": (functools.partial(_adam, adamw=True), _ADAM_LISTS),
    "_fused_sgd": (_sgd, ("self", "grads", "momentum_buffer_list")),
    "_fused_adagrad": (_adagrad, ("self", "grads", "state_sums")),
}


def left_as_read(plan: OpPlan, args: Sequence, kwargs: dict) -> frozenset[str]:
    """The lists an in-place fused optimizer step declares it writes but leaves as it read them: its grads, unless
    a ``grad_scale`` unscales them (the steps' bounds give them 0, ``_exact``)."""
    return frozenset() if plan.arg(args, kwargs, "grad_scale") is not None else frozenset({"grads"})


def _written_lists(c: BudgetCall) -> list[str]:
    """The argument lists whose tensors ``c.outputs`` holds, in order: the functional variants' returns, or the
    written arguments (an out= variant's ``out`` holds the parameters)."""
    if c.func._schema.returns:
        return [r.name.removesuffix("_out") for r in c.func._schema.returns]
    return ["self" if spec.name == "out" else spec.name for spec in c.plan.writes]


def _exact() -> torch.Tensor:
    """The bound of a tensor the step leaves as it read it (grads it does not unscale, Adagrad's state_steps, a
    skipped call's): 0, one element broadcast over it (a bound is broadcastable to its result), not a tensor of zeros
    as large as a parameter."""
    return torch.zeros((), dtype=torch.float64)


def _pooled(c: BudgetCall, params: list, per_param: int) -> Callable:
    """``take(like)``: memory for one bound of ``like``'s shape, cut in turn from one buffer of ``per_param`` bounds
    per parameter, in the call's reused memory (``BudgetCall.scratch``): the optimizer's bounds, every parameter
    every step, are written into pages written before, where fresh tensors fault their pages in (twice the pass's
    time on a 1M-element parameter)."""
    total = per_param * sum(p.numel() for p in params)
    flat = torch.empty(total, dtype=torch.float64) if c.scratch is None else \
        c.scratch.empty_strided((total,), (1,), torch.float64)
    used = 0

    def take(like: torch.Tensor) -> torch.Tensor:
        nonlocal used
        n = like.numel()
        used += n
        return flat[used - n:used].view(like.shape)

    return take


@register_budget(*overloads(*_FUSED_STEPS), family=Family.ELEMENTWISE, early=True)
def fused_optimizer_budget(c: BudgetCall) -> Budget:
    """Each written tensor's bound carried element by element through the step's roundings, each at ``ua`` (the
    compute type's unit roundoff, float32 for the halves), the square root and the division as one rounding each,
    the constants as the kernel rounds them; then one rounding to the parameter's dtype where it is narrower. A
    call that ``found_inf`` skips writes what it read: bound 0."""
    a = c.a
    step, returned = _FUSED_STEPS[c.plan.base.removesuffix("_")]
    names = _written_lists(c)

    def bounds() -> list:
        found_inf, scale = a.get("found_inf"), a.get("grad_scale")
        skipped = found_inf is not None and float(found_inf) != 0
        k = functools.partial(constant, u=c.ua, ua=c.ua)
        ks = functools.partial(constant, u=c.u, ua=c.ua)
        chains: dict[str, list] = {n: [] for n in names}
        grad_scale = None if scale is None else float(scale)
        adamw = {"_fused_adam": False, "_fused_adamw": True}.get(c.plan.base.removesuffix("_"))
        one_pass = adamw is not None and not skipped and fused_bounds is not None and \
            all(t.device.type == "cpu" for t in a["self"])
        take = _pooled(c, a["self"], 3 + (grad_scale is not None) + bool(a.get("amsgrad"))) if one_pass else None
        for i, param in enumerate(a["self"]):
            fast = _adam_pass(c, i, grad_scale, adamw, take) if one_pass else None
            if fast is None:
                results = (None,) * len(returned) if skipped else step(c, i, k, ks, grad_scale)
                fast = [None if r is None else r.bound(c.u, c.ua) for r in results]
            for name, b in zip(returned, fast):
                if name in chains and i < len(a[name]):
                    chains[name].append(_exact() if b is None else b)
        for name in names:  # lists the step never writes (Adagrad's state_steps): as read
            if name not in returned:
                chains[name] = [_exact() for _ in a[name]]
        return [b for n in names for b in chains[n]]

    return c.budget(bounds)


# GradScaler's bookkeeping (shadow.replay.amp): the gradients times inv_scale, the scale times its growth or backoff
# factor, one rounding each; found_inf and the growth tracker as the device set them
register_ulps(overloads("_amp_foreach_non_finite_check_and_unscale", "_amp_update_scale"), Family.ELEMENTWISE,
              ULPS["arith"])
