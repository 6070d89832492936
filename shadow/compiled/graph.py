"""A compiled graph as the engine judges it: one op whose arguments are the graph's inputs, whose device kernel is
the compiled code, whose float64 replay is its aten graph run op by op on float64 values (``shadow.compiled.trace``),
and whose budget is composed from its ops' budgets (``shadow.compiled.budget``)."""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch

from ..errors import Unsupported
from ..plan import ArgSpec, ArgType, OpPlan, Param, ReturnSpec, plan_of
from ..records import Kind
from ..replay import Replay
from .budget import GraphBudget
from .kernels import Call, Kernel, capture
from .trace import Traced, Values


class Graph:
    """One compiled graph (``compiled``, a boxed callable: it takes a list of inputs, which it may clear) and its
    aten graph ``source``, as one op named ``name`` for the engine (``Engine.graph_call``): calling the graph runs
    the compiled code (the device's computation); ``plan`` (an argument per input, a return per output, the inputs
    the graph writes; its ``func`` is ``replayed``, the aten graph on float64 values, as an op's is its kernel,
    which shadow.audit runs on its worlds' values), ``chain`` (the replay rule), ``budget`` (its composed budget,
    which reads the reference replay's values)."""

    def __init__(self, compiled: Callable[[list], Any], source: torch.fx.GraphModule, name: str,
                 kernels: Callable[[torch.fx.GraphModule, tuple], dict[str, Kernel | None]] = lambda gm, inputs: {}):
        self.compiled = compiled
        self._kernels = kernels  # the C++ kernels Inductor showed for this graph (shadow.compiled.kernels)
        self.calls: list[Call] = []  # the last call's kernel calls
        self.source = source
        self.name = name
        self.ops = sum(1 for n in source.graph.nodes if n.op == "call_function" and n.target is not operator.getitem)
        self.plan = _graph_plan(self, source, name)
        self.chain = (self._replay,)
        self.budget = GraphBudget(self)
        self._traced: dict[tuple, Traced | Exception] = {}
        self._call: Traced | Exception | None = None  # the traced graph of the last call
        self._out: Any = None  # the last call's device outputs (random-only values come from there)
        self.reference: tuple[Traced, Values] | None = None  # the last replay's graph and node values

    def __call__(self, *inputs: Any) -> Any:
        """The device's computation: the compiled code, on the call's inputs; its outputs as the plan returns them
        (a graph of one output returns it alone: ``boxed`` makes the list the compiled code returns again)."""
        self._call, self.reference = self._trace(inputs), None
        with capture(self.compiled, self._kernels(self.source, inputs)) as self.calls:
            out = self.compiled(list(inputs))
        self._out = out[0] if len(self.plan.returns) == 1 else out
        return self._out

    def release(self) -> None:
        """Let go of the last call's tensors (its outputs, its replay's values)."""
        self._out = self.reference = None
        self.calls = []

    def boxed(self, out: Any) -> Any:
        """What the compiled code returns, from what ``__call__`` returned."""
        return [out] if len(self.plan.returns) == 1 else out

    def _trace(self, inputs: tuple) -> Traced | Exception:
        key = tuple((tuple(t.shape), t.dtype, t.device) if isinstance(t, torch.Tensor) else t for t in inputs)
        traced = self._traced.get(key)
        if traced is None:
            try:
                traced = Traced(self.source, inputs)
            except Exception as exc:  # never raise into the user's program: the call is recorded unsupported
                traced = exc
            self._traced[key] = traced
        return traced

    def _replay(self, r: Replay) -> tuple[Kind, Any]:
        """The replay rule: the traced graph on float64 inputs; its node values are kept for the budget (the
        engine replays on the shadows first, then on the device's inputs where they differ: the last replay is
        the one the local error is measured against)."""
        outs, self.reference = self._run(r.args, r.device_out)
        return Kind.REPLAYED, outs

    def replayed(self, *inputs: Any) -> Any:
        """The aten graph of the last call on float64 ``inputs``: the graph as an op's float64 kernel."""
        return self._run(inputs, self._out)[0]

    def _run(self, inputs: Any, device_out: Any) -> tuple[Any, tuple[Traced, Values]]:
        traced = self._call
        if not isinstance(traced, Traced):
            raise Unsupported(self.name, f"its aten graph could not be traced: {type(traced).__name__}: "
                              f"{str(traced).splitlines()[0][:160] if str(traced) else ''}")
        if device_out is not None and len(self.plan.returns) == 1:
            device_out = [device_out]
        try:
            outs, values = traced.run(list(inputs), device_out)
        except Unsupported as exc:
            raise Unsupported(self.name, f"{exc.op}: {exc.reason}") from exc
        return outs[0] if len(self.plan.returns) == 1 else outs, (traced, values)


def _graph_plan(graph: Graph, gm: torch.fx.GraphModule, name: str) -> OpPlan:
    """The op plan of a graph: one tensor argument per input (written where the graph mutates it), one return
    per output (an alias of an input where it is one, or a view of one)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    index = {n: i for i, n in enumerate(placeholders)}
    written = _written_inputs(gm, index)
    specs = tuple(ArgSpec(i, n.name, ArgType.TENSOR, i in written, False) for i, n in enumerate(placeholders))
    output = next(n for n in gm.graph.nodes if n.op == "output")
    returns = []
    for v in output.args[0]:
        base = _viewed_input(v, index)
        returns.append(ReturnSpec(tensors=False, is_tensor=True, aliases_write=base is not None and base in written,
                                  aliases_read=base is not None and base not in written))
    writes = tuple(s for s in specs if s.write)
    op_name = name.split(".", 1)[-1]
    return OpPlan(func=graph.replayed, call=graph.replayed, name=name, op_name=op_name, base=op_name,
                  positions={n.name: i for i, n in enumerate(placeholders)},
                  params=tuple(Param(n.name, False, False, None) for n in placeholders), tensor_args=specs,
                  remap_args=(), returns=tuple(returns), tags=frozenset(), writes=writes,
                  write_args=frozenset(s.index for s in writes), out_args=frozenset(),
                  # AOTAutograd moves the version counter of each input the graph mutates, once per call
                  declared_writes=frozenset(s.index for s in writes), is_view=False,
                  fresh_returns=any(not (r.aliases_read or r.aliases_write) for r in returns))


def _viewed_input(v: Any, index: dict) -> int | None:
    """The input a graph output is, or is a view of (through view ops only); None for a computed value."""
    while isinstance(v, torch.fx.Node):
        if v in index:
            return index[v]
        if v.op != "call_function" or not isinstance(v.target, torch._ops.OpOverload) or not plan_of(v.target).is_view:
            return None
        v = v.args[0]
    return None


def _written_inputs(gm: torch.fx.GraphModule, index: dict) -> set[int]:
    """The inputs the graph writes in place (BatchNorm's running statistics): the written argument of every
    in-place op, through views, that is an input."""
    written = set()
    for n in gm.graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        plan = plan_of(n.target)
        for spec in plan.writes:
            base = _viewed_input(spec.get(n.args, n.kwargs), index)
            if base is not None:
                written.add(base)
    return written
