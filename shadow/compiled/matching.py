"""Comparing a run with compiled graphs against a run of the same program without them (``shadow compare`` of an
eager and a compiled run): a graph's call in one stands for the calls of its module in the same phase in the
other, so each such run of calls is matched as one with the graph's call, and what compiling changed is named
graph by graph (``GraphChange``): the compiled code's own error against the eager kernels' worst, and the drift
of the module's result.

>>> spans([("aten.mm.default", "Net.fc", "forward", (2, 2))], [("compiled.graph0", "Net", "forward", (2, 2))])
([('compiled', 'Net', 'forward')], [[0]], [('compiled', 'Net', 'forward')], [[0]])
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Any, Callable

GRAPH_PREFIX = "compiled.graph"  # a compiled graph's record: its op names the graph (shadow.compiled.hooks.Graphs)


def is_graph(op: str) -> bool:
    return op.startswith(GRAPH_PREFIX)


def spans(a: list[tuple], b: list[tuple]) -> tuple[list, list, list, list]:
    """The sequences to align, from two runs' call tokens (op, module, phase, shape): each run of consecutive
    calls inside the module of a graph (the module or below it) in the graph's phase, the graph's calls among
    them, is one token ("compiled", module, phase); every other call is its own token. Returns (tokens of a, per
    token the indices of a's calls it stands for, the same for b)."""
    keys = {(t[1], str(t[2])) for t in a + b if is_graph(t[0])}
    return (*_collapse(a, keys), *_collapse(b, keys))


def _collapse(tokens: list[tuple], keys: set[tuple[str, str]]) -> tuple[list, list]:
    out: list = []
    at: list[list[int]] = []
    for i, t in enumerate(tokens):
        key = _key(t, keys)
        if key is None:
            out.append(t)
            at.append([i])
        elif out and out[-1] == key and len(at[-1]) and at[-1][-1] == i - 1:
            at[-1].append(i)  # the run of calls inside the module in the phase goes on
        else:
            out.append(key)
            at.append([i])
    return out, at


def _key(t: tuple, keys: set[tuple[str, str]]) -> tuple | None:
    """("compiled", module, phase) of the graph whose module holds this call, the innermost; None if none."""
    op, module, phase = t[0], t[1], str(t[2])
    if is_graph(op):
        return ("compiled", module, phase)
    found = [m for m, p in keys if p == phase and (m == module or not m or module.startswith(m + "."))]
    return ("compiled", max(found, key=len), phase) if found else None


@dataclasses.dataclass(frozen=True)
class GraphChange:
    """A compiled graph's call in one run matched with the calls of the other it stands for: the own error (the
    worst budget use) and the drift of the last result, on each side, ``a`` and ``b``."""

    module: str
    phase: str
    graph: str  # the graphs' names (in whichever run has them; "" where neither has: eager calls on both sides)
    calls_a: int  # calls on each side (the graph's: 1)
    calls_b: int
    worst_a: str  # each side's call of the worst own error
    worst_b: str
    own_a: float  # its budget use (nan: no call held to a budget)
    own_b: float
    drift_a: float  # the drift (rel_norm) of each side's last call (a graph's: over all its outputs)
    drift_b: float

    def worse(self, factor: float) -> bool:
        """B's own error is over its budget, and ``factor`` times A's or more."""
        return self.own_b > 1.0 and not self.own_b < factor * self.own_a

    def __str__(self) -> str:
        return (f"{self.module or '(no module)'} ({self.phase}) {self.graph}: "
                f"{_side(self.calls_a, self.worst_a, self.own_a)} -> {_side(self.calls_b, self.worst_b, self.own_b)}; "
                f"drift of the last call {self.drift_a:.3g} -> {self.drift_b:.3g}")


def _side(calls: int, worst: str, own: float) -> str:
    what = worst if calls == 1 else f"{calls} calls"
    if math.isnan(own):
        return what
    return f"{what}: budget {own:.3g}" + (f" ({worst})" if calls > 1 else "")


def graph_change(key: tuple, records_a: list[Any], records_b: list[Any]) -> GraphChange:
    """The change between the calls ``records_a`` and ``records_b`` (``Record``s) that one token stands for."""
    def worst(records: list[Any]) -> tuple[str, float]:
        held = [r for r in records if r.budget is not None and not r.budget.is_default]
        if not held:
            return (records[-1].op, math.nan)
        r = max(held, key=lambda r: r.budget.used)
        return r.op, r.budget.used

    def drift(records: list[Any]) -> float:
        last = next((r for r in reversed(records) if r.drift is not None), None)
        return last.drift.rel_norm if last is not None else math.nan

    graph = ", ".join(dict.fromkeys(r.op for r in records_a + records_b if is_graph(r.op)))
    (wa, oa), (wb, ob) = worst(records_a), worst(records_b)
    return GraphChange(key[1], key[2], graph, len(records_a), len(records_b), wa, wb, oa, ob, drift(records_a),
                       drift(records_b))


def match_calls(a: list[Any], b: list[Any], token: Callable[[Any], tuple],
                align: Callable[[list, list], list[tuple[int, int]]]) -> tuple | None:
    """Two runs' records (``Record``s) matched in order (``align``, on the ``token`` of each call, a graph's call
    and the calls it stands for as one): (index pairs of the other matched calls, the share of tokens matched,
    the ops of each run's unmatched calls counted, the matched graphs' ``GraphChange``s, the ops whose every call
    a matched graph's call is or stands for); None where a run kept no records."""
    seq_a, at_a, seq_b, at_b = spans([token(r) for r in a], [token(r) for r in b])
    if not seq_a or not seq_b:
        return None
    pairs = [(i, i) for i in range(len(seq_a))] if seq_a == seq_b else align(seq_a, seq_b)
    ia, ib = {i for i, _ in pairs}, {j for _, j in pairs}
    only_a = Counter(a[k].op for i in range(len(seq_a)) if i not in ia for k in at_a[i])
    only_b = Counter(b[k].op for j in range(len(seq_b)) if j not in ib for k in at_b[j])
    graphs = tuple(g for i, j in pairs if _spans(seq_a[i])
                   if (g := graph_change(seq_a[i], [a[k] for k in at_a[i]], [b[k] for k in at_b[j]])).graph)
    inside, outside = set(), set()
    for records, seq, at in ((a, seq_a, at_a), (b, seq_b, at_b)):
        for t, ks in zip(seq, at):
            (inside if _spans(t) else outside).update(records[k].op for k in ks)
    calls = [(at_a[i][0], at_b[j][0]) for i, j in pairs if not _spans(seq_a[i])]
    return calls, 2 * len(pairs) / (len(seq_a) + len(seq_b)), only_a, only_b, graphs, frozenset(inside - outside)


def _spans(t: tuple) -> bool:
    return t[0] == "compiled"
