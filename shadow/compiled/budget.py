"""A compiled graph's error budget, composed from its ops' budgets.

A correct implementation of the graph in the device's dtypes may round every op's result (each within its op's
budget, ``shadow.budgets``) and pass every error on through the ops after it. To first order the error of an
output is then at most

    B1 = sum over the graph's ops n of |J_n| b_n

with b_n the bound of op n's own error and J_n the derivative of the output in op n's result: each op's bound
plus what it receives, ``|J| E`` by ``shadow.compiled.propagate``, op by op in graph order. Through a deep graph
that worst case grows by the ratio |A| |B| / |A B| at every matmul (about sqrt(K) on random data): after a few
layers it bounds nothing. Rounding errors of different ops are independent: by Hoeffding's inequality their sum
exceeds ``HOEFFDING * sqrt(sum_n J_n**2 b_n**2)`` with probability at most ``DELTA`` (each b_n still a worst
case), and the budget is the smaller of the two. Compiled code that keeps intermediates in registers rounds
less, and may reorder sums within their bounds: it stays within it. Code that rounds to fewer bits than the
dtypes say (bfloat16 intermediates, approximate transcendentals) does not.

Effective bits follow the model of ``shadow.budgets.effective_bits``: every op's result rounded once, at the
unit roundoff that explains the error, independent errors adding in mean square through the same derivatives
(the scale T**2 = sum over ops of J_n**2 r_n**2, with each sum's accumulation counted as its rule counts it).
docs/compiled.md.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..budgets import Budget, budget_for
from ..opsets import Family
from .trace import Node, Traced, Values, remap
from .propagate import Flow, propagate, within

# Hoeffding: a sum of independent errors e_n, each within +-b_n, exceeds lambda * sqrt(sum b_n**2) with probability
# at most 2 exp(-lambda**2 / 2); DELTA = 1e-9 per element (docs/compiled.md)
DELTA = 1e-9
HOEFFDING = math.sqrt(2.0 * math.log(2.0 / DELTA))
_MOVES = frozenset({Family.MOVEMENT, Family.EMPTY})  # budget families of ops that move values, rounding only in a cast


class GraphBudget:
    """The budget rule of a graph (``Graph.budget``), as the engine asks an op's budget that reads no argument:
    ``budget(references, dtype)``, the graph's outputs replayed on the device's inputs. It reads the node values
    of that replay (``Graph.reference``)."""

    def __init__(self, graph: Any):  # a shadow.compiled.Graph
        self.graph = graph

    def budget(self, references: list, dtype: torch.dtype) -> Budget:
        traced, values = self.graph.reference
        scale: list[float] = []

        def make() -> list:
            bounds, sq = compose(traced, values, references)
            scale.append(sq)
            self.graph.reference = None  # every node's value of the replay: read, let go
            return bounds

        return Budget(Family.GRAPH, make, outputs=references, dtype=dtype, scale_sq=lambda: (scale[0], 0.0))


def compose(traced: Traced, values: Values, references: list) -> tuple[list, float]:
    """(the bound of each graph output (None where it is discrete), the sum of the squared scales T**2 over the
    floating outputs)."""
    worst: dict[torch.fx.Node, list] = {}  # node -> per output: the bound of its error (None: none)
    spread: dict[torch.fx.Node, list] = {}  # ... the sum of the squares of the ops' bounds passed on
    square: dict[torch.fx.Node, list] = {}  # ... the mean square scale of its error
    for item in traced.nodes:
        n = item.node
        if item.plan is None:  # getitem
            parent, i = n.args
            for found in (worst, spread, square):
                found[n] = [_at(found, parent, i)]
            continue
        outs = values.outputs(n)
        if outs is None:  # a random draw, or decided by random draws alone: the device's own values, exact
            worst[n] = spread[n] = square[n] = [None] * _outputs(item)
            continue
        args, kwargs = remap(*torch.fx.node.map_arg((n.args, n.kwargs), lambda a: values.env[a]), _device(outs))
        derivatives: dict = {}
        own, own_sq = _own(item, args, kwargs, outs)
        for p, found, seed in ((1, worst, own), (2, spread, [b * b if b is not None else None for b in own]),
                               (2, square, own_sq)):
            flow = Flow(item.plan, list(args), dict(kwargs), *_errors(n, found), p, outs, derivatives)
            found[n] = _add(seed, propagate(flow))
    bounds, total = [], 0.0
    for k, v in enumerate(traced.output.args[0]):
        r = references[k] if k < len(references) else None
        if not isinstance(r, torch.Tensor) or not (r.is_floating_point() or r.is_complex()):
            bounds.append(None)
            continue
        b, s2, q = (_at(worst, v, 0), _at(spread, v, 0), _at(square, v, 0)) if isinstance(v, torch.fx.Node) \
            else (None, None, None)
        if b is None:
            bounds.append(torch.zeros_like(r, dtype=torch.float64))
        else:  # the worst case, or where less, the deviation independent errors exceed with probability DELTA
            bounds.append(within(torch.broadcast_to(torch.minimum(b, HOEFFDING * s2.sqrt()), r.shape)))
        if q is not None:
            q = torch.broadcast_to(q, r.shape)
            total += float(q[torch.isfinite(q)].sum())
    return bounds, total


def _own(item: Node, args: Any, kwargs: Any, outs: list) -> tuple[list, list]:
    """The node's own error: its budget's bound per output, and the mean square scale of one rounding of each
    result (with its sum's accumulation where its rule counts one); none for views and for data movement within
    one dtype (exact: its budget's ulp is for a cast)."""
    floating = [o if isinstance(o, torch.Tensor) and (o.is_floating_point() or o.is_complex()) else None
                for o in outs]
    dtype = next((d for d, o in zip(item.dtypes, floating) if o is not None and d is not None), None)
    if item.plan.is_view or dtype is None:
        return [None] * len(outs), [None] * len(outs)
    budget = budget_for(item.plan.func, args, kwargs, outs, dtype)
    if budget.family in _MOVES and not item.casts:
        return [None] * len(outs), [None] * len(outs)
    bounds = list(budget.bound) + [None] * (len(outs) - len(budget.bound))
    acc = budget.scales()[1]
    finite = [torch.isfinite(o) if o is not None else None for o in floating]
    squares = [torch.where(m, o.square(), 0.0) if o is not None else None for o, m in zip(floating, finite)]
    r_sq = sum(float(q.sum()) for q in squares if q is not None)
    share = 1.0 + acc / r_sq if r_sq > 0 and math.isfinite(acc) else 1.0
    # an element whose value is not finite (a masked score's -inf) is counted apart, as the device's would be:
    # no bound of its own, which the ops after it would multiply by a zero derivative (exp at -inf) into NaN
    return ([torch.where(m, b, 0.0) if b is not None and m is not None else None for b, m in zip(bounds, finite)],
            [q * share if q is not None else None for q in squares])


def _errors(n: torch.fx.Node, errors: dict) -> tuple[list, dict]:
    """The node's arguments with every node replaced by the bound of its error (None: none)."""
    args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: _at(errors, a, 0))
    return list(args), dict(kwargs)


def _at(errors: dict, node: Any, i: int) -> Any:
    found = errors.get(node)
    return found[i] if found is not None and i < len(found) else None


def _add(a: list, b: list) -> list:
    return [x if y is None else y if x is None else x + y for x, y in zip(a, b + [None] * (len(a) - len(b)))]


def _outputs(item: Node) -> int:
    return max(len(item.dtypes), 1)


def _device(outs: list) -> torch.device:
    return next((o.device for o in outs if isinstance(o, torch.Tensor)), torch.device("cpu"))
