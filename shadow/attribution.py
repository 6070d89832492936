"""Which module and phase each op call belongs to.

Modules and forward/backward come from ``torch.utils.module_tracker.ModuleTracker``; the optimizer
phase from the optimizer step hooks, where parameter (and gradient, optimizer state) storages are
mapped to the parameter's dotted name so optimizer ops are charged to it.
"""

from __future__ import annotations

import sys
from typing import Callable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten
from torch.utils.module_tracker import ModuleTracker

from .records import Phase


class _Tracker(ModuleTracker):
    """ModuleTracker, except that a module's backward exit is hooked on its non-leaf inputs only: torch's own
    hooks leaf inputs too, and ``torch.autograd.grad`` with such a leaf then raises into the user's program
    ("A leaf node was passed to _will_engine_execute_node", pytorch/pytorch#131753). Cost: a module whose
    inputs are all leaves stays among ``parents`` until the engine's end-of-backward callback clears them."""

    on_compiled: Callable[[str], None] | None = None  # called with the name of a compiled module about to run

    def _fw_pre_hook(self, mod, input) -> None:
        name = self._get_mod_name(mod)
        if self.on_compiled is not None and _compiled(mod):
            self.on_compiled(name)
        self._get_append_fn(name, False)()
        args, _ = tree_flatten(input)
        tensors = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad and a.grad_fn is not None]
        if tensors:
            handle = register_multi_grad_hook(tensors, self._get_pop_fn(name, True))
            if hasattr(self, "_hooks"):  # torch >= 2.5 removes them on exit; 2.4 keeps none
                self._hooks.append(handle)


def _compiled(mod: torch.nn.Module) -> bool:
    """``torch.compile(model)`` (an OptimizedModule) or ``model.compile()``: dynamo skips frames while a dispatch
    mode is active, so under shadow the module runs eagerly."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # never imported: nothing was compiled
    optimized = getattr(eval_frame, "OptimizedModule", None)
    return (optimized is not None and isinstance(mod, optimized)) or getattr(mod, "_compiled_call_impl", None) is not None


def _innermost(parents: set[str]) -> str:
    names = [p for p in parents if p != "Global"]
    if not names:
        return ""
    return max(names, key=lambda s: (s.count("."), s))


def _common_prefix(names: list[str]) -> str:
    parts = [n.split(".") for n in names]
    out = []
    for level in zip(*parts):
        if any(p != level[0] for p in level):
            break
        out.append(level[0])
    return ".".join(out)


class Attribution:
    """Tracks the current module and phase while a ShadowMode is active."""

    def __init__(self, on_compiled: Callable[[str], None] | None = None) -> None:
        self._tracker = _Tracker()
        self._tracker.on_compiled = on_compiled
        self._optimizer_depth = 0
        self._param_names: dict[int, str] = {}  # storage address -> parameter name, during a step
        self._handles: list = []

    def __enter__(self) -> Attribution:
        self._tracker.__enter__()
        self._handles = [
            register_optimizer_step_pre_hook(self._step_pre),
            register_optimizer_step_post_hook(self._step_post),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._tracker.__exit__(*exc)

    def _step_pre(self, opt: torch.optim.Optimizer, args, kwargs) -> None:
        self._optimizer_depth += 1
        self._param_names = self._names_for(opt)

    def _step_post(self, opt: torch.optim.Optimizer, args, kwargs) -> None:
        self._optimizer_depth = max(0, self._optimizer_depth - 1)
        if not self._optimizer_depth:
            self._param_names = {}

    def _names_for(self, opt: torch.optim.Optimizer) -> dict[int, str]:
        known = getattr(self._tracker, "_known_modules", {})  # module -> dotted name, from forward passes
        by_param: dict[int, str] = {}
        for mod, fqn in list(known.items()):
            for pname, p in mod.named_parameters(recurse=False):
                by_param.setdefault(id(p), f"{fqn}.{pname}")
        names: dict[int, str] = {}
        for group in opt.param_groups:
            for p in group["params"]:
                name = by_param.get(id(p))
                if name is None:
                    continue
                related = [p, p.grad] + [v for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
                for t in related:
                    if isinstance(t, torch.Tensor) and t.device.type != "meta":
                        names[t.untyped_storage()._cdata] = name
        return names

    def where(self, tensors) -> tuple[str, Phase]:
        """(module, phase) of the op being dispatched; ``tensors`` its tensor arguments (optimizer naming)."""
        if self._optimizer_depth:
            found = sorted(
                {self._param_names[k] for k in (t.untyped_storage()._cdata for t in tensors) if k in self._param_names}
            )
            return (_common_prefix(found) if len(found) > 1 else (found[0] if found else "")), Phase.OPTIMIZER
        module = _innermost(self._tracker.parents)
        if torch._C._current_graph_task_id() != -1:
            return module, Phase.BACKWARD
        return module, (Phase.FORWARD if module else Phase.OTHER)
