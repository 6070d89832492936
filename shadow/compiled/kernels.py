"""Each fused C++ kernel of a compiled graph judged alone (torch 2.13; docs/compiled.md).

While a ShadowMode is active Inductor shows shadow each C++ kernel as it writes its call
(``shadow._compat.show_cpp_kernels``): its name and, per argument, the post-grad graph's node whose value the
buffer holds before and after the call. At a graph's call the compiled module's kernel globals are wrapped for the
call's duration (``capture``): each kernel runs on the arguments it was given, as it does without shadow; its
arguments' values are copied before and after. Each kernel call is then judged like a graph: the nodes it fuses
(the graph's nodes from the values it reads to the values it writes) replayed in float64 on its own input values
upcast exactly, its outputs held to the budget composed from those nodes (``shadow.compiled.budget``), with its
effective bits. Its record goes to ``report.meta[KERNELS_KEY]`` (a saved record, ``Record.from_dict`` reads it):
kept apart from the report's records, its error is already the graph's, so no total or coverage counts it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from typing import Any, Iterator

import torch

from ..errors import Unsupported
from ..metrics import compare
from ..mirror import SHADOW_DTYPES
from ..opsets import Family
from ..records import KERNELS_KEY, BudgetInfo, Kind, Record
from .budget import GraphBudget
from .trace import Traced

# the replay and the comparison are shadow's own work: no mode below sees them
_no_dispatch = torch._C._DisableTorchDispatch
PREFIX = "inductor."  # a kernel record's op: "inductor.cpp_fused_add_div_exp_0"


@dataclasses.dataclass(frozen=True, slots=True)
class Kernel:
    """A C++ kernel as Inductor wrote its call: its name; per argument the node whose value it reads (None: an
    output only) and the node whose value it writes (None: an input only, or a value no node holds)."""

    name: str
    reads: tuple[str | None, ...]
    writes: tuple[str | None, ...]


def _signature(gm: torch.fx.GraphModule, shapes: list) -> tuple:
    """What ties a graph Inductor lowered to the graph a compiled call carries: its nodes and its input shapes."""
    return tuple((n.name, str(n.target)) for n in gm.graph.nodes), tuple(shapes)


def _shape(t: Any) -> Any:
    return (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else None


class Kernels:
    """The C++ kernels Inductor generated while a ShadowMode was active, by the graph they belong to."""

    def __init__(self) -> None:
        self._by_graph: dict[tuple, dict[str, Kernel | None]] = {}

    def shown(self, gm: torch.fx.GraphModule, name: str, arguments: list | None) -> None:
        """``shadow._compat.show_cpp_kernels``'s sink."""
        shapes = [_shape(n.meta.get("val")) for n in gm.graph.nodes if n.op == "placeholder"]
        kernels = self._by_graph.setdefault(_signature(gm, shapes), {})
        kernels[name] = None if arguments is None else Kernel(name, tuple(r for r, _ in arguments),
                                                              tuple(w for _, w in arguments))

    def of(self, source: torch.fx.GraphModule, inputs: tuple) -> dict[str, Kernel | None]:
        """The kernels of ``source`` compiled for inputs like ``inputs`` (empty: none shown)."""
        return self._by_graph.get(_signature(source, [_shape(t) for t in inputs]), {})


@dataclasses.dataclass(slots=True)
class Call:
    """One kernel call: its arguments' values before and after (copies)."""

    kernel: Kernel | None
    name: str
    before: list
    after: list


@contextlib.contextmanager
def capture(compiled: Any, kernels: dict[str, Kernel | None]) -> Iterator[list[Call]]:
    """For the block, each of ``kernels`` in the compiled module behind ``compiled`` (a bound ``call`` of its
    Runner, or the module's ``call``) is wrapped: it runs on its arguments unchanged, their values copied before
    and after into the yielded list, in call order."""
    calls: list[Call] = []
    function = getattr(compiled, "__func__", compiled)
    module = sys.modules.get(getattr(function, "__module__", None) or "")
    space = getattr(function, "__globals__", None)
    if module is None or space is None or space is not vars(module):
        yield calls
        return
    originals = {name: space[name] for name in kernels if callable(space.get(name))}

    def wrapped(name: str, kernel: Any) -> Any:
        def call(*args: Any) -> Any:
            before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            result = kernel(*args)
            calls.append(Call(kernels[name], name, before,
                              [a.clone() if isinstance(a, torch.Tensor) else a for a in args]))
            return result
        return call

    space.update({name: wrapped(name, kernel) for name, kernel in originals.items()})
    try:
        yield calls
    finally:
        space.update(originals)


class _Reference:
    """A kernel call's replay, as ``GraphBudget`` reads a graph's: ``reference`` (the traced nodes, their values)."""

    def __init__(self, reference: tuple) -> None:
        self.reference = reference


def judge(call: Call, source: torch.fx.GraphModule, graph: Record) -> Record:
    """The record of one kernel call of the graph whose record is ``graph``: its written values against the float64
    replay of the nodes it fuses, on its read values upcast exactly; unsupported (with the reason) where its
    nodes cannot be told or replayed."""
    base = dict(index=graph.index, op=PREFIX + call.name, module=graph.op, phase=graph.phase)
    try:
        # the device's generator is never drawn from (the kernel's nodes may hold the dropout's draws)
        with torch.random.fork_rng(devices=[]):
            return _judged(call, source, base)
    except Exception as exc:  # a kernel shadow cannot judge alone: the graph's record still judges it
        reason = exc.reason if isinstance(exc, Unsupported) else f"{type(exc).__name__}: {exc}"
        return Record(kind=Kind.UNSUPPORTED, reason=reason[:300], **base)


def _judged(call: Call, source: torch.fx.GraphModule, base: dict) -> Record:
    kernel = call.kernel
    if kernel is None:
        raise Unsupported(base["op"], "its buffers are not all the graph's nodes' values (a buffer it reads, "
                          "or one it writes into another's memory)")
    inputs = {r: v for r, v in zip(kernel.reads, call.before) if r is not None}
    outputs = [(w, v) for w, v in zip(kernel.writes, call.after) if w is not None]
    sub, order = _fused(source, list(inputs), [w for w, _ in outputs])
    values = [inputs[n] for n in order]
    traced = Traced(sub, tuple(values))  # traced on fake copies: dispatch stays on
    with _no_dispatch():
        return _compared(traced, values, [v for _, v in outputs], base)


def _compared(traced: Traced, values: list, device: list, base: dict) -> Record:
    # a value random draws alone decide (a dropout mask the kernel writes) is the device's, as in a graph's replay
    references, replayed = traced.run([v.to(SHADOW_DTYPES.get(v.dtype) or v.dtype) for v in values], device)
    references = [r.reshape(d.shape) if r.shape != d.shape else r for r, d in zip(references, device)]
    floating = [k for k, d in enumerate(device) if d.is_floating_point()]  # discrete outputs: the graph's record
    if not floating:
        raise Unsupported(base["op"], "it writes no floating values")
    dtype = device[floating[0]].dtype
    budget = GraphBudget(_Reference((traced, replayed))).budget(references, dtype)
    bounds = budget.divisors
    stats = None
    for k in floating:
        one = compare(device[k], references[k], device[k].dtype, bounds[k] if k < len(bounds) else None)
        if stats is None:
            stats = one
        else:
            stats.merge(one)
    if stats.norm > 0:
        stats.effective_bits = budget.bits(stats)
    return Record(kind=Kind.REPLAYED, local=stats, budget=BudgetInfo(Family.GRAPH, stats.budget_used or 0.0),
                  dtype=str(dtype), shape=tuple(device[floating[0]].shape), **base)


def _fused(source: torch.fx.GraphModule, reads: list[str], writes: list[str]) -> tuple[torch.fx.GraphModule, list]:
    """The graph of the nodes a kernel fuses: every node of ``source`` the written nodes depend on, back to the read
    ones (its inputs, in first-use order; a read node it does not need is left out)."""
    nodes = {n.name: n for n in source.graph.nodes}
    reads_set, fused, seen, used = set(reads), [], set(), []

    def visit(n: torch.fx.Node) -> None:
        if n.name in seen:
            return
        seen.add(n.name)
        if n.name in reads_set:
            used.append(n.name)
            return
        if n.op != "call_function":
            raise Unsupported(n.name, f"the kernel's nodes reach {n.op} {n.name}, which it does not read")
        for a in n.all_input_nodes:
            visit(a)
        fused.append(n)

    for w in writes:
        visit(nodes[w])
    graph = torch.fx.Graph()
    env = {name: graph.placeholder(name) for name in used}
    for n in fused:
        env[n.name] = graph.node_copy(n, lambda a: env[a.name])
    graph.output(tuple(env[w] for w in writes))
    return torch.fx.GraphModule(torch.nn.Module(), graph), used
