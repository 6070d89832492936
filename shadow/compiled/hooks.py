"""How each compiled graph's call reaches ShadowMode, with the aten graph it runs.

torch 2.13: Inductor wraps a compiled graph in the ``inductor_compiled_code`` higher-order operator when it is
called under a dispatch mode, if ``torch._inductor.config.wrap_inductor_compiled_regions`` was set when the graph
was compiled (the operator carries the aten graph Inductor lowered). ShadowMode sets it while it is active and
handles the operator (``install``): the mode is off while dynamo and Inductor compile (``ignore_compile_internals``)
and on while the compiled code runs. torch 2.4: no such operator; Inductor's ``compile_fx`` is wrapped while the
mode is active, so that each graph it compiles comes back as a ``Compiled`` callable holding its aten graph
(``shadow._compat.show_compiled_graphs``).

Either way only graphs compiled while a ShadowMode is active are seen: a ``torch.compile(model)`` module first
called in a ShadowMode block has the code dynamo compiled for it before dropped (``Watch.compiled_module``), so
that the call compiles it again. A compiled plain function, a module compiled with ``model.compile()`` (whose
module hooks dynamo compiles too) and the functions a compiled module calls across a graph break keep code
compiled before the block: it runs unseen (compile them inside the block, or call ``torch._dynamo.reset()``
before it). So does a plain function compiled with Inductor in a block that began before Inductor was first
loaded in the process (a compiled module loads it before its call).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily
from torch.utils.weak import WeakIdKeyDictionary

from .. import _compat
from .graph import Graph
from .kernels import Kernels

GRAPHS_KEY = "compiled_graphs"  # report.meta[GRAPHS_KEY]: name -> {"ops", "inputs", "outputs"} of each graph seen


class Graphs:
    """The compiled graphs one ShadowMode has seen, numbered in the order of their first call: "compiled.graph0",
    "compiled.graph1", ... (the same program names them alike in every run). Each graph's facts go to the
    report's meta (``GRAPHS_KEY``)."""

    def __init__(self, meta: dict, kernels: Kernels):
        self._by_code = WeakIdKeyDictionary()  # compiled callable -> Graph (a CompiledFxGraph has no hash)
        self._meta = meta
        self._kernels = kernels

    def get(self, compiled: Any, source: torch.fx.GraphModule) -> Graph:
        graph = self._by_code.get(compiled)
        if graph is None:
            graph = Graph(compiled, source, f"compiled.graph{len(self._meta.setdefault(GRAPHS_KEY, {}))}",
                          self._kernels.of)
            self._by_code[compiled] = graph
            self._meta[GRAPHS_KEY][graph.name] = {"ops": graph.ops, "inputs": len(graph.plan.tensor_args),
                                                  "outputs": len(graph.plan.returns)}
        return graph

    def release(self) -> None:
        """At the block's end: no graph keeps its last call's tensors."""
        for graph in self._by_code.values():
            graph.release()


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


class Watch:
    """What a ShadowMode block does so that compiled graphs reach ``mode``: ``start`` and ``stop`` with the block
    (graphs Inductor compiles in between come back shown: torch 2.13's flag, or 2.4's ``compile_fx`` wrapped), and
    ``compiled_module`` before a torch.compile'd module's call."""

    def __init__(self, mode: type, kernels: Kernels):
        self._mode = mode
        self._kernels = kernels
        self._undo: list[Callable[[], None]] = []
        self._recompiled: weakref.WeakSet = weakref.WeakSet()  # the compiled modules this block compiled again

    def start(self) -> None:
        self._recompiled = weakref.WeakSet()
        self._show(load=False)

    def stop(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _show(self, load: bool) -> bool:
        """Set it up (``load``: where Inductor was not loaded yet at the start: loading it takes seconds, paid
        only before a compiled module's call); whether compiled graphs are shown."""
        if not self._undo:
            restore = _compat.show_compiled_graphs(lambda compiled, source: Compiled(compiled, source, self._mode),
                                                   load)
            if restore is not None:
                self._undo.append(restore)
                kernels = _compat.show_cpp_kernels(self._kernels.shown)
                if kernels is not None:
                    self._undo.append(kernels)
        return bool(self._undo)

    def compiled_module(self, module: torch.nn.Module) -> bool:
        """A torch.compile'd module is about to run in the block: whether its graphs are shown. Its first call in
        the block compiles it again (the code dynamo compiled for it before is dropped): code compiled outside a
        block shows nothing, and dynamo compiles the module again outside a block after one (its code in the
        block is guarded on the module hooks ShadowMode registers), each time the calls move in or out."""
        if not self._show(load=True):
            return False
        if module not in self._recompiled:
            self._recompiled.add(module)
            _compat.drop_compiled_code(module)
        return True


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

