"""How each compiled graph's call reaches ShadowMode, with the aten graph it runs.

torch 2.13: Inductor wraps a compiled graph in the ``inductor_compiled_code`` higher-order operator when it is
called under a dispatch mode, if ``torch._inductor.config.wrap_inductor_compiled_regions`` was set when the graph
was compiled (the operator carries the aten graph Inductor lowered). ShadowMode sets it while it is active and
handles the operator (``install``): the mode is off while dynamo and Inductor compile (``ignore_compile_internals``)
and on while the compiled code runs. torch 2.4: no such operator; Inductor's ``compile_fx`` is wrapped while the
mode is active, so that each graph it compiles comes back as a ``Compiled`` callable holding its aten graph
(``shadow._compat.wrap_inductor_graphs``).

Either way only graphs compiled while a ShadowMode is active are seen: a ``torch.compile(model)`` module first
called under a ShadowMode has the code dynamo compiled for it before dropped (``recompile``), so that the call
compiles it again. A compiled plain function, a module compiled with ``model.compile()`` (whose module hooks
dynamo compiles too) and the functions a compiled module calls across a graph break keep code compiled before
the block: it runs unseen (compile them inside the block, or call ``torch._dynamo.reset()`` before it).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily
from torch.utils.weak import WeakIdKeyDictionary

from .. import _compat
from .graph import Graph

GRAPHS_KEY = "compiled_graphs"  # report.meta[GRAPHS_KEY]: name -> {"ops", "inputs", "outputs"} of each graph seen


class Graphs:
    """The compiled graphs one ShadowMode has seen, numbered in the order of their first call: "compiled.graph0",
    "compiled.graph1", ... (the same program names them alike in every run). Each graph's facts go to the
    report's meta (``GRAPHS_KEY``)."""

    def __init__(self, meta: dict):
        self._by_code = WeakIdKeyDictionary()  # compiled callable -> Graph (a CompiledFxGraph has no hash)
        self._meta = meta

    def get(self, compiled: Any, source: torch.fx.GraphModule) -> Graph:
        graph = self._by_code.get(compiled)
        if graph is None:
            graph = Graph(compiled, source, f"compiled.graph{len(self._meta.setdefault(GRAPHS_KEY, {}))}")
            self._by_code[compiled] = graph
            self._meta[GRAPHS_KEY][graph.name] = {"ops": graph.ops, "inputs": len(graph.plan.tensor_args),
                                                  "outputs": len(graph.plan.returns)}
        return graph


# --- torch 2.13: the higher-order operator ---
def install(mode: type) -> bool:
    """Route the ``inductor_compiled_code`` operator to ``mode.graph_call`` (once per process); False where this
    torch has no such operator."""
    op = _compat.compiled_graph_operator()
    if op is None:
        return False
    if mode not in op.python_key_table:
        op.py_impl(mode)(lambda m, func, inputs, *, name=None: m.graph_call(func.compiled_callable,
                                                                             func.original_gm, inputs))
    return True


@contextlib.contextmanager
def watching(mode: type) -> Iterator[Callable[[], bool]]:
    """While a ShadowMode is active: graphs compiled now come back visible to ``mode`` (torch 2.13: Inductor's
    flag; 2.4: ``compile_fx`` wrapped). Yields ``ensure``, which sets it up where Inductor was not loaded yet at
    the start (called before a compiled module runs: loading Inductor takes seconds, only paid where it is used)
    and says whether compiled graphs are shown."""
    undo: list[Callable[[], None]] = []

    def ensure(load: bool = True) -> bool:
        if not undo:
            restore = _compat.show_compiled_graphs(lambda compiled, source: Compiled(compiled, source, mode), load)
            if restore is not None:
                undo.append(restore)
        return bool(undo)

    ensure(load=False)
    try:
        yield ensure
    finally:
        for restore in undo:
            restore()


class Compiled:
    """torch 2.4: a graph Inductor compiled while a ShadowMode was active, with its aten graph. Called under that
    mode (the innermost one), the call goes to ``mode.graph_call`` with the mode off, as the operator's would;
    otherwise the compiled code runs as it is."""

    def __init__(self, compiled: Callable[[list], Any], source: torch.fx.GraphModule, mode: type):
        self.compiled, self.source, self._mode = compiled, source, mode
        # AOTAutograd passes the inputs as one list; an instance attribute: its wrappers copy __dict__ (wraps)
        self._boxed_call = True

    def __call__(self, inputs: list) -> Any:
        if isinstance(_get_current_dispatch_mode(), self._mode):
            with _pop_mode_temporarily() as mode:
                return mode.graph_call(self.compiled, self.source, inputs)
        return self.compiled(inputs)


_RECOMPILED: weakref.WeakSet = weakref.WeakSet()  # compiled modules whose code dynamo dropped under a ShadowMode


def recompile(module: torch.nn.Module) -> None:
    """Before a torch.compile'd module's first call under a ShadowMode (once per module and process): drop the code
    dynamo compiled for it (and for the modules whose compiled entry function it shares), so that this call compiles
    it again, its graphs shown. What the block compiles is reused outside it, where it runs as the earlier code
    did (the same Inductor code: a graph shown to the mode runs as it is when no mode is active)."""
    if module not in _RECOMPILED:
        _RECOMPILED.add(module)
        _compat.drop_compiled_code(module)
