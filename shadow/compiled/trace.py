"""A compiled graph's aten graph, traced for the replay and run on float64 values.

The aten graph is the one Inductor lowered (AOTAutograd's forward, backward or inference graph; each graph of a
graph break apart), traced once more through Inductor's decompositions on fake copies of the call's inputs
(``Traced``): what reaches the replay is the same small set of ops on either torch version, each node with its
device dtype.

Random numbers drawn inside the compiled code (dropout) are never replayed: the values of the nodes that depend
on random draws alone (the dropout mask) are the device's own where the graph returns them (AOTAutograd saves
the mask for the backward), and a graph that uses such a value without returning it is recorded as unsupported.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..errors import Unsupported
from ..mirror import SHADOW_DTYPES
from ..plan import OpPlan, plan_of
from ..records import Kind
from ..replay import REPLAY, Replay
from ..replay.noncompute import random_rule
from ..rules import run_chain
from ..scratch import copy

_RANDOM = object()  # a node's value that only the device's random draws decide, unknown to the replay


@dataclasses.dataclass(slots=True)
class Node:
    """A node of the traced graph, read once: its op's plan and replay chain, and its device dtypes."""

    node: torch.fx.Node
    plan: OpPlan | None  # None: not an aten or prims op (getitem)
    chain: tuple
    dtypes: list  # the device dtype of each output (None where not a tensor)
    casts: bool  # some floating input has another device dtype than the first floating output


class Traced:
    """The graph traced through Inductor's decompositions on fake copies of one call's inputs: its nodes in order,
    with what the replay and the budget read of each."""

    def __init__(self, source: torch.fx.GraphModule, inputs: tuple):
        self.gm = decomposed(source, inputs)
        self.placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        self.output = next(n for n in self.gm.graph.nodes if n.op == "output")
        self.constants = {n: getattr(self.gm, n.target) for n in self.gm.graph.nodes if n.op == "get_attr"}
        self.nodes: list[Node] = []
        for n in self.gm.graph.nodes:
            if n.op != "call_function":
                continue
            plan = plan_of(n.target) if isinstance(n.target, torch._ops.OpOverload) else None
            dtypes = _dtypes(n)
            first = next((d for d in dtypes if d is not None and (d.is_floating_point or d.is_complex)), None)
            inputs = [d for a in n.all_input_nodes for d in _dtypes(a)
                      if d is not None and (d.is_floating_point or d.is_complex)]
            self.nodes.append(Node(n, plan, REPLAY.chain(n.target) if plan is not None else (), dtypes,
                                   any(d != first for d in inputs)))

    def run(self, inputs: list, device_out: Any) -> tuple[list, Values]:
        """The graph on float64 ``inputs`` (the shadows, or the device's inputs upcast): its outputs and the value
        of every node. ``device_out``: the compiled code's outputs, where random-only values come from."""
        outputs = list(self.output.args[0])
        returned = {id(n): i for i, n in enumerate(outputs) if isinstance(n, torch.fx.Node)}
        device = next((t.device for t in inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))
        env: dict[torch.fx.Node, Any] = dict(zip(self.placeholders, inputs))
        env.update((n, _upcast(t, device)) for n, t in self.constants.items())
        drawn: set[torch.fx.Node] = set()
        for item in self.nodes:
            n = item.node
            args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
            if _reads((args, kwargs), _RANDOM):
                if not _random_only((args, kwargs)):
                    raise Unsupported(str(n.target), "uses values drawn at random inside the compiled code that "
                                      "the graph does not return: shadow cannot replay them")
                value = _RANDOM
            elif item.plan is None:  # getitem of a multi-output node
                value = n.target(*args, **kwargs)
            else:
                value = _replay_node(item, *remap(args, kwargs, device))
            if value is _RANDOM:
                drawn.add(n)
                if id(n) in returned:  # a random-only value the graph returns: the device's
                    value = _upcast(device_out[returned[id(n)]], device)
            env[n] = value
        outs = [env[n] if isinstance(n, torch.fx.Node) else n for n in outputs]
        missing = [i for i, v in enumerate(outs) if v is _RANDOM]
        if missing:
            raise Unsupported("graph", f"outputs {missing} are random draws the replay cannot see")
        return outs, Values(env, drawn)


@dataclasses.dataclass(slots=True)
class Values:
    """A replay's node values, and the nodes that only random draws decide (their values, where known, are the
    device's: exact, no error of theirs to bound)."""

    env: dict
    drawn: set

    def outputs(self, n: torch.fx.Node) -> list | None:
        """The node's outputs as a list (None: a random draw, or decided by random draws alone)."""
        if n in self.drawn:
            return None
        v = self.env[n]
        return list(v) if isinstance(v, (tuple, list)) else [v]


def _dtypes(n: torch.fx.Node) -> list:
    """The device dtype of each of a traced node's outputs (None where not a tensor)."""
    vals = n.meta.get("val")
    vals = list(vals) if isinstance(vals, (tuple, list)) else [vals]
    return [v.dtype if isinstance(v, torch.Tensor) else None for v in vals]


def decomposed(gm: torch.fx.GraphModule, inputs: tuple) -> torch.fx.GraphModule:
    """``gm`` traced through Inductor's decompositions on fake copies of ``inputs``: every node's
    ``meta["val"]`` holds its fake result (the device dtypes), and the ops are those Inductor lowers."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    with torch.no_grad():
        return make_fx(torch.fx.Interpreter(gm).run, decomposition_table=select_decomp_table(),
                       tracing_mode="fake")(*inputs)


def _replay_node(item: Node, args: tuple, kwargs: dict) -> Any:
    """One node in float64: a random draw is marked (its value is the device's, where the graph returns it);
    views and uninitialized memory are the op itself on float64 values; every other op goes through its replay
    chain (its own CPU kernel, a decomposition, a rule for device-only kernels)."""
    plan = item.plan
    if torch.Tag.nondeterministic_seeded in plan.tags and \
            random_rule(Replay(plan, list(args), kwargs, None)) is not NotImplemented:
        return _RANDOM
    kind, out = run_chain(item.chain, Replay(plan, list(args), dict(kwargs), None))
    if out is None:  # a view, or empty memory: nothing to recompute
        out = plan.func(*args, **kwargs)
    return out


def _values(value: Any) -> list:
    """The leaves of a node's arguments (lists and dicts walked)."""
    found: list = []
    torch.fx.node.map_aggregate(value, found.append)
    return found


def _reads(value: Any, marker: object) -> bool:
    return any(a is marker for a in _values(value))


def _random_only(value: Any) -> bool:
    """Every tensor the node reads is a random-only value: so is its result."""
    return all(a is _RANDOM for a in _values(value) if a is _RANDOM or isinstance(a, torch.Tensor))


def remap(args: Any, kwargs: Any, device: torch.device) -> tuple:
    """A node's dtype and device arguments for the float64 replay: floating dtypes become float64 (complex:
    complex128), devices the shadows' own."""
    def one(a: Any) -> Any:
        if isinstance(a, torch.dtype):
            return SHADOW_DTYPES.get(a) or a
        if isinstance(a, torch.device):
            return device
        return a
    return torch.fx.node.map_aggregate(args, one), torch.fx.node.map_aggregate(kwargs, one)


def _upcast(t: Any, device: torch.device) -> Any:
    """A device value (a constant of the graph, an output it returns) for the replay: exactly, in float64."""
    return copy(t, SHADOW_DTYPES.get(t.dtype) or t.dtype, device) if isinstance(t, torch.Tensor) else t


