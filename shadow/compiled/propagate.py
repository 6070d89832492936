"""How an error on an op's inputs reaches its outputs, to first order: the rules that compose a compiled graph's
budget from its ops' budgets (``shadow.compiled.budget``).

For an op y = f(x_1, ..., x_k) and a bound E_i >= |e_i| on the error of each input, the error it passes on is at
most sum_i |J_i| E_i elementwise, J_i the Jacobian of f in x_i. A rule computes sum_i |J_i|**p E_i for p = 1
(the worst case, which the budget sums) and p = 2 (the mean square of independent errors, the scale of the
graph's effective bits: E then holds variances). Every rule is exact or an upper bound, except the default (an
op no rule knows), which is an estimate: |J (E**(1/p))|**p, below |J|**p E where J has entries of both signs.

Lookup order (``shadow.rules.RuleTable``): the exact op, then predicates on its plan (data movement, sums,
matmuls, pointwise ops), then the default. Rules are pure functions of a ``Flow``: the float64 values the op
read and returned, the input bounds in the same places (None: no error), and p.

>>> x = torch.tensor([1.0, 2.0], dtype=torch.float64)
>>> f = Flow(plan_of(aten.exp.default), [x], {}, [torch.full_like(x, 1e-7)], {}, 1, [x.exp()])
>>> torch.allclose(propagate(f)[0], x.exp() * 1e-7)
True
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Any, Callable

import torch
from torch.func import jvp

from ..opsets import CONVOLUTIONS, DATA_MOVEMENT, MATMULS, PARTIAL_WRITES, VIEW_COPIES
from ..plan import ArgType, OpPlan, plan_of
from ..rules import RuleTable

aten = torch.ops.aten


@dataclasses.dataclass(slots=True)
class Flow:
    """A rule's input: the op's plan, the float64 arguments it read, the bounds on their errors in the same
    places (a tensor argument's bound has its shape; None where it carries no error), the power p (1: worst
    case, 2: variances), the op's outputs, flattened, and the derivatives rules computed for the node."""

    plan: OpPlan
    args: list
    kwargs: dict
    errors: list
    error_kwargs: dict
    power: int
    outputs: list
    derivatives: dict = dataclasses.field(default_factory=dict)  # shared by a node's flows of either power

    def arg(self, name: str, default: Any = None) -> Any:
        return self.plan.arg(self.args, self.kwargs, name, default)

    def error(self, name: str) -> torch.Tensor | None:
        return self.plan.arg(self.errors, self.error_kwargs, name)

    def magnitude(self, v: Any) -> Any:
        """|v|**p: a factor's weight in the sum (a mask's as 0 or 1)."""
        if isinstance(v, torch.Tensor):
            if not (v.is_floating_point() or v.is_complex()):
                v = v.to(torch.float64)
            return v.abs() if self.power == 1 else v * v
        return abs(v) ** self.power if isinstance(v, (int, float)) and not isinstance(v, bool) else v


Rule = Callable[[Flow], Any]  # -> one bound per output (a tensor, or None: no error), or NotImplemented


def _floating(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())


def _flat(out: Any) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _call(f: Flow, replace: Callable[[Any, Any], Any]) -> list:
    """The op on its arguments with each argument v (its error bound e) replaced by ``replace(v, e)``."""
    written = f.plan.write_args
    args = [replace(v, e.clone() if i in written and isinstance(e, torch.Tensor) else e)
            for i, (v, e) in enumerate(zip(f.args, f.errors))]
    kwargs = {k: replace(v, f.error_kwargs.get(k)) for k, v in f.kwargs.items()}
    return _flat(f.plan.func(*args, **kwargs))


def _listwise(fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """``fn`` applied element by element to list arguments (cat's, index's)."""
    def replace(v: Any, e: Any) -> Any:
        if isinstance(v, (list, tuple)):
            es = e if isinstance(e, (list, tuple)) else [None] * len(v)
            return type(v)(fn(x, ex) for x, ex in zip(v, es))
        return fn(v, e)
    return replace


def _discrete_none(f: Flow, outs: list) -> list:
    """Bounds of the outputs: None for discrete ones (they carry no error to first order)."""
    return [o if _floating(r) else None for o, r in zip(outs, f.outputs)]


def _has_error(f: Flow) -> bool:
    def some(e: Any) -> bool:
        return isinstance(e, torch.Tensor) or (isinstance(e, (list, tuple)) and any(some(x) for x in e))
    return any(some(e) for e in f.errors) or any(some(e) for e in f.error_kwargs.values())


PROPAGATE: RuleTable[Rule] = RuleTable("propagate")


def propagate(f: Flow) -> list:
    """One bound per output of the error the op passes on (None: none); ``[None, ...]`` where no input carries
    error. Ops with no rule of their own take ``estimate``."""
    if not _has_error(f):
        return [None] * len(f.outputs)
    out = PROPAGATE.run(f.plan.func, f)
    return estimate(f) if out is NotImplemented else out


# --- data movement: each result element is one input element (or a fill value) ---
_MOVEMENT = DATA_MOVEMENT | VIEW_COPIES | {"convert_element_type"}  # prims' cast, as Inductor's graphs have it


def _movement(plan: OpPlan) -> bool:
    return plan.is_view or torch.Tag.inplace_view in plan.tags or torch.Tag.view_copy in plan.tags \
        or plan.base in _MOVEMENT


@PROPAGATE.register_predicate(_movement)
def movement_rule(f: Flow) -> Any:
    """The op moves the bounds as it moves the values; a fill value (a Python float: masked_fill's, a pad's)
    carries no error in from outside: its own rounding is the op's, in the op's budget."""
    def replace(v: Any, e: Any) -> Any:
        if _floating(v):
            return e if e is not None else torch.zeros_like(v)
        return 0.0 if isinstance(v, float) else v
    return _discrete_none(f, _call(f, _listwise(replace)))


# --- sums with coefficients of 1: each result is a sum of input elements (index_put with accumulate) ---
_SUMS = PARTIAL_WRITES | {"sum", "nansum", "cumsum", "_unsafe_masked_index_put_accumulate", "embedding_dense_backward"}


@PROPAGATE.register_predicate(lambda plan: plan.base in _SUMS)
def sum_rule(f: Flow) -> Any:
    """Sums of input elements (scatter and index_put overwrite or add): the op on the bounds, a scalar factor
    (index_add's alpha) at |alpha|**p."""
    def replace(v: Any, e: Any) -> Any:
        if _floating(v):
            return e if e is not None else torch.zeros_like(v)
        return f.magnitude(v) if isinstance(v, float) else v
    return _discrete_none(f, _call(f, _listwise(replace)))


@PROPAGATE.register(aten.mean.default, aten.mean.dim)
def mean_rule(f: Flow) -> Any:
    """sum(x) / n: the mean of the bounds, over n**(p-1)."""
    x, e = f.arg("self"), f.error("self")
    out = f.plan.func(e, *f.args[1:], **f.kwargs)
    n = x.numel() // max(f.outputs[0].numel(), 1)
    return [out / n ** (f.power - 1)]


# --- matmuls and convolutions: bilinear in their factors ---
_BILINEAR = {**{k: v for k, v in MATMULS.items() if k != "_addmm_activation"}, **CONVOLUTIONS}


@PROPAGATE.register_predicate(lambda plan: plan.base in _BILINEAR)
def bilinear_rule(f: Flow) -> Any:
    """out = beta * bias + alpha * (a @ b) (or a convolution of a by b): |alpha|**p (E_a @ |b|**p + |a|**p @ E_b)
    + |beta|**p E_bias, each product the op itself with the other factor's magnitude and no bias."""
    roles = _BILINEAR[f.plan.base]
    scalars = {n: f.magnitude(f.arg(n)) for n in ("alpha",) if f.plan.has(n)}
    if roles.bias:
        scalars.update({"beta": 0} if f.plan.has("beta") else {roles.bias: None})
    total = None
    for factor, other in ((roles.a, roles.b), (roles.b, roles.a)):
        e = f.error(factor)
        if e is None:
            continue
        args, kwargs = f.plan.replace(f.args, f.kwargs, **{factor: e, other: f.magnitude(f.arg(other))}, **scalars)
        t = f.plan.func(*args, **kwargs)
        total = t if total is None else total + t
    e = f.error(roles.bias) if roles.bias else None
    if e is not None:
        beta = f.magnitude(f.arg("beta", 1)) if f.plan.has("beta") else 1
        out = f.outputs[0]
        if roles in CONVOLUTIONS.values():  # one bias per output channel (dim 1)
            e = e.reshape([1, -1] + [1] * (out.dim() - 2))
        t = torch.broadcast_to(e * beta, out.shape)
        total = t if total is None else total + t
    return [total]


# --- pointwise ops: each output element a function of one element of each input ---
def _pointwise(plan: OpPlan) -> bool:
    return torch.Tag.pointwise in plan.tags or plan.base in DERIVATIVES  # torch 2.4's prims.fma has no tags


def _div(f: Flow) -> dict:
    if f.arg("rounding_mode") is not None:  # trunc, floor: piecewise constant
        return {}
    b = f.arg("other")
    return {"self": 1.0 / b, "other": -f.outputs[0] / b}


_SQRT_PI = math.sqrt(math.pi)
# d out / d argument of the common single-output pointwise ops, by base name and argument name, from the op's
# float64 arguments and result (an argument not named: derivative 0); the other pointwise ops by forward-mode AD
DERIVATIVES: dict[str, Callable[[Flow], dict[str, Any]]] = {
    "add": lambda f: {"self": 1.0, "other": f.arg("alpha", 1)},
    "sub": lambda f: {"self": 1.0, "other": -f.arg("alpha", 1)},
    "rsub": lambda f: {"self": -f.arg("alpha", 1), "other": 1.0},
    "mul": lambda f: {"self": f.arg("other"), "other": f.arg("self")},
    "div": _div,
    "fma": lambda f: {"a": f.arg("b"), "b": f.arg("a"), "c": 1.0},  # Inductor's prim: a * b + c
    "neg": lambda f: {"self": -1.0},
    "exp": lambda f: {"self": f.outputs[0]},
    "log": lambda f: {"self": 1.0 / f.arg("self")},
    "sqrt": lambda f: {"self": 0.5 / f.outputs[0]},
    "rsqrt": lambda f: {"self": -0.5 * f.outputs[0] ** 3},
    "reciprocal": lambda f: {"self": -f.outputs[0] ** 2},
    "erf": lambda f: {"self": 2.0 / _SQRT_PI * torch.exp(-f.arg("self") ** 2)},
    "tanh": lambda f: {"self": 1.0 - f.outputs[0] ** 2},
    "sigmoid": lambda f: {"self": f.outputs[0] * (1.0 - f.outputs[0])},
    "relu": lambda f: {"self": (f.arg("self") > 0).to(f.outputs[0].dtype)},
}


@PROPAGATE.register_predicate(_pointwise)
def pointwise_rule(f: Flow) -> Any:
    """sum_i |df/dx_i|**p E_i, the derivatives from ``DERIVATIVES``, else by forward-mode AD along ones (exact:
    J_i is diagonal), computed once for both powers (``Flow.derivatives``)."""
    total: list = [None] * len(f.outputs)
    formula = DERIVATIVES.get(f.plan.base) if len(f.outputs) == 1 else None
    for where, v, e in _tensor_inputs(f):
        if e is None or not _floating(v):
            continue
        key = (where[0].index, where[1])
        d = f.derivatives.get(key)
        if d is None:
            if formula is not None:
                known = f.derivatives.setdefault("formula", formula(f))
                d = [known.get(where[0].name, 0.0)]
            else:
                d = _derivative(f, where, v, torch.ones(v.shape, dtype=v.dtype, device=v.device))
            f.derivatives[key] = d
        for k, dk in enumerate(d):
            if dk is None or not _floating(f.outputs[k]):
                continue
            t = f.magnitude(dk) * e
            total[k] = t if total[k] is None else total[k] + t
    return total


# --- reductions that select: max, min, logsumexp (weights of one total) ---
@PROPAGATE.register(aten.amax.default, aten.amin.default, aten.max.dim, aten.min.dim, aten.max.default,
                    aten.min.default, aten.logsumexp.default)
def max_rule(f: Flow) -> Any:
    """The result moves with one input element (logsumexp: a weighted mean of them, weights summing to 1): at
    most the largest bound over the reduced elements."""
    e = f.error("self")
    if f.plan.has("dim"):
        dim, keepdim = f.arg("dim"), f.arg("keepdim", False)
        out = torch.amax(e, dim=dim if dim is not None else (), keepdim=bool(keepdim))
    else:
        out = e.max()
    return [out] + [None] * (len(f.outputs) - 1)


# --- variance and its mean ---
@PROPAGATE.register(aten.var_mean.correction, aten.var.correction, aten.std.correction, aten.std_mean.correction)
def variance_rule(f: Flow) -> Any:
    """var = sum (x - m)**2 / (N - c): dvar/dx_i = 2 (x_i - m) / (N - c) (m's own derivative cancels); std =
    sqrt(var): dstd = dvar / (2 std); the mean: 1 / N."""
    x, e = f.arg("self"), f.error("self")
    dim, keepdim = f.arg("dim"), bool(f.arg("keepdim", False))
    correction = f.arg("correction")
    dims = dim if dim is not None else list(range(x.dim()))
    m = x.mean(dim=dims, keepdim=True)
    n = x.numel() // max(m.numel(), 1)
    c = 1 if correction is None else correction
    dvar = f.magnitude(2 * (x - m) / max(n - c, 1))
    spread = torch.sum(dvar * e, dim=dims, keepdim=keepdim)
    name = f.plan.base
    outs = []
    for k, r in enumerate(f.outputs):
        is_mean = name.endswith("_mean") and k == 1
        if is_mean:
            outs.append(torch.sum(e, dim=dims, keepdim=keepdim) / n ** f.power)
        elif name.startswith("std"):
            outs.append(spread / f.magnitude(2 * r).clamp_min(torch.finfo(r.dtype).tiny))
        else:
            outs.append(spread)
    return outs


# --- softmax: weights that sum to 1 ---
@PROPAGATE.register(aten._softmax.default)
def softmax_rule(f: Flow) -> Any:
    """J = diag(s) - s s^T: |J|**p E <= s**p E + s**p sum(s**p E) along the dim."""
    s, e, dim = f.outputs[0], f.error("self"), f.arg("dim")
    sp = f.magnitude(s)
    return [sp * e + sp * torch.sum(sp * e, dim=dim, keepdim=True)]


@PROPAGATE.register(aten._log_softmax.default)
def log_softmax_rule(f: Flow) -> Any:
    """J = I - 1 s^T: |J|**p E <= E + sum(s**p E) along the dim."""
    s, e, dim = f.outputs[0].exp(), f.error("self"), f.arg("dim")
    return [e + torch.sum(f.magnitude(s) * e, dim=dim, keepdim=True)]


# --- the default: an estimate by forward-mode AD along the bounds ---
def estimate(f: Flow) -> list:
    """|J_i E_i**(1/p)|**p summed over the inputs: exact where J_i has no entries of opposite signs in a row,
    below |J_i|**p E_i where it has (an op no rule knows)."""
    total: list = [None] * len(f.outputs)
    for where, v, e in _tensor_inputs(f):
        if e is None or not _floating(v):
            continue
        d = _derivative(f, where, v, e if f.power == 1 else e.sqrt())
        for k, dk in enumerate(d):
            if dk is None or not _floating(f.outputs[k]):
                continue
            t = f.magnitude(dk)
            total[k] = t if total[k] is None else total[k] + t
    return total


def _tensor_inputs(f: Flow):
    """(where, value, bound) of every tensor argument (lists element by element); ``where`` finds it again."""
    for spec in f.plan.tensor_args:
        v, e = spec.get(f.args, f.kwargs), spec.get(f.errors, f.error_kwargs)
        if spec.type is ArgType.TENSOR:
            if isinstance(v, torch.Tensor):
                yield (spec, None), v, e
        elif isinstance(v, (list, tuple)):
            es = e if isinstance(e, (list, tuple)) else [None] * len(v)
            for i, (x, ex) in enumerate(zip(v, es)):
                if isinstance(x, torch.Tensor):
                    yield (spec, i), x, ex


def _derivative(f: Flow, where: tuple, v: torch.Tensor, tangent: torch.Tensor) -> list:
    """The outputs' derivatives along ``tangent`` in the argument at ``where`` (None for discrete outputs)."""
    spec, i = where

    def fn(x: torch.Tensor) -> Any:
        args, kwargs = list(f.args), dict(f.kwargs)
        if i is None:
            spec.put(args, kwargs, x)
        else:
            items = list(spec.get(args, kwargs))
            items[i] = x
            spec.put(args, kwargs, items)
        out = _flat(f.plan.func(*args, **kwargs))
        return tuple(o if _floating(o) else torch.zeros(()) for o in out)

    _load_forward_ad()
    _, d = jvp(fn, (v.contiguous(),), (tangent.to(v.dtype).contiguous(),))  # an expanded primal refuses its tangent
    return [dk if _floating(r) else None for dk, r in zip(d, f.outputs)]


@functools.cache
def _load_forward_ad() -> None:
    """Forward-mode AD loads its decompositions at its first use, scripting them with torch.jit, which warns
    (DeprecationWarning on torch 2.13): loaded here once, so that no warning of shadow's reaches the program."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from torch.autograd.forward_ad import _maybe_load_decompositions

        _maybe_load_decompositions()


def within(bound: torch.Tensor) -> torch.Tensor:
    """A bound with its NaNs (0 * inf where an input is infinite) read as infinite: no error is excluded."""
    return torch.nan_to_num(bound, nan=math.inf)
