"""Which module, phase and line of the user's code each op call belongs to.

Modules and forward/backward come from ``Tracker``, hooks of shadow's own on every module and on the autograd graph
(modules named as ``torch.utils.module_tracker.ModuleTracker`` names them; pass-through modules and leaf inputs
handled); the optimizer phase from the optimizer step hooks, where parameter (and gradient, optimizer state)
storages are mapped to the parameter's dotted name so optimizer ops are charged to it; each op of a step (``where``,
from all of its arguments and its outputs) names its fresh outputs too. Call sites (``_Callsites``) are the first
frame outside torch and shadow; a backward op takes the call site of the forward op whose autograd node runs it.
"""

from __future__ import annotations

import itertools
import os
import sys
import weakref
from typing import Any, Callable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.autograd.graph import register_multi_grad_hook
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._pytree import tree_flatten

from ..plan import ArgType, flat_returns, plan_of
from ..records import Phase

# frames in these directories are not the user's: the first frame outside them is an op's call site
_INTERNAL = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.dirname(__file__)) + os.sep)
_NODE_KEY = "shadow.callsite"  # the key under which a forward op's call site is kept in its autograd node
_graph_task_id = torch._C._current_graph_task_id  # the running backward's id, -1 outside any backward
# the phases ``where`` returns at every op, as module globals: an Enum member's lookup on its class is slower
_FORWARD, _BACKWARD, _OPTIMIZER, _OTHER = Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER, Phase.OTHER


class Tracker:
    """The modules whose forward or backward is running (``parents``, ``innermost``) and whether autograd's
    backward runs (``is_bw``), kept by hooks of its own while entered: forward pre- and post-hooks on every module
    (``register_module_forward_pre_hook``, ``register_module_forward_hook``), gradient hooks on a call's outputs (its
    backward starts) and inputs (its backward ends: ``register_multi_grad_hook``), and a callback at the end of each
    backward (``queue_callback`` on autograd's engine), which empties ``parents``: the backward exits of modules that
    never fire one (below) do not outlive their backward.

    >>> with Tracker() as tracker:
    ...     model(x).sum().backward()   # inside: tracker.parents == {"Global", "Net", "Net.fc1"}  # doctest: +SKIP

    Names are ``torch.utils.module_tracker.ModuleTracker``'s: a module is named when it first runs, by the name its
    parent's first run gave it, else (no parent of it ran) by its class name ("Net"), and its submodules after it by
    their dotted path from it ("Net.fc1", "Net.blocks.0.attn"); a module found under two parents keeps the name of
    the last found. ``torch.compile(model)`` is named as the model it compiles, and the model's modules as in an
    eager run ("Block.up", not "OptimizedModule._orig_mod.up").

    A module's backward exit is hooked on its non-leaf inputs only: a hook on a leaf makes ``torch.autograd.grad``
    with that leaf raise into the user's program ("A leaf node was passed to _will_engine_execute_node",
    pytorch/pytorch#131753). A module whose inputs are all leaves stays among ``parents`` until its backward ends.

    A pass-through (``nn.Identity``, ``nn.Dropout(p=0)``, a residual's skip) returns its input's own autograd edge:
    hooks of its backward's entry and exit on that one edge fire at once, exit first, so the module would be entered
    and never left, and every backward op upstream charged to it. An output is hooked only where its edge is not an
    input's, and a module with no such output has no backward at all: its exit hook is removed.

    Every gradient hook is removed, never only forgotten: a multi-grad hook keeps the autograd nodes it watches in
    its own closure, which those nodes hold, a cycle through C++ that Python's collector cannot see. A hook left
    registered keeps its nodes alive, and through its callback this tracker, its ShadowMode and every shadow (a
    dropped ShadowMode of a 4-layer MLP kept its 0.18 GB). A hook that fired is removed at the next forward (the
    backward that fired it is over then) or on exit; one that never fired, on exit."""

    def __init__(self) -> None:
        self.parents: set[str] = {"Global"}  # the running modules' names, and "Global" (outside any module too)
        self.innermost = ""  # the innermost of ``parents`` ("" outside any module): both read at every op
        self.on_compiled: Callable[[str, torch.nn.Module], None] | None = None  # a compiled module about to run
        self._names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> its dotted name
        self._named: weakref.WeakSet = weakref.WeakSet()  # modules whose submodules are named after them
        # module -> per running call (nested calls stack): its exit hook and its inputs' autograd edges
        self._calls: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._waiting: dict[int, Any] = {}  # key -> handle of a gradient hook that has not fired
        self._keys = itertools.count()
        self._fired: list = []  # handles of hooks that fired, removed at the next forward or on exit
        self._backward_end_queued = False
        self._handles: list = []  # the global module hooks

    def __enter__(self) -> Tracker:
        self._handles = [register_module_forward_pre_hook(self._forward_pre),
                         register_module_forward_hook(self._forward)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._remove_fired()
        for h in self._waiting.values():
            h.remove()
        self._waiting.clear()

    @property
    def is_bw(self) -> bool:
        """Autograd's engine is running a backward: asked of autograd, as no hook can tell (a backward's first calls,
        the loss's, run before any module's backward starts)."""
        return _graph_task_id() != -1

    def name_of(self, module: torch.nn.Module) -> str | None:
        """The dotted name of a module that ran or lies under one that ran (None: neither)."""
        return self._names.get(module)

    def names(self) -> list[tuple[torch.nn.Module, str]]:
        """(module, dotted name) of every module that ran or lies under one that ran."""
        return list(self._names.items())

    def _name(self, mod: torch.nn.Module) -> str:
        """A module's name, naming it and its submodules at its first run (class docstring)."""
        orig = getattr(mod, "_orig_mod", None)  # torch.compile(model): an OptimizedModule
        if isinstance(orig, torch.nn.Module):
            if mod not in self._named:
                name = self._names.get(mod) or self._names.get(orig) or type(orig).__name__
                self._names[mod] = self._names[orig] = name
                self._named.add(mod)
            mod = orig
        name = self._names.get(mod)
        if name is None:
            name = self._names[mod] = type(mod).__name__
        if mod not in self._named:
            self._named.add(mod)
            for child_name, child in mod.named_children():
                self._names[child] = f"{name}.{child_name}"
                self._name(child)
        return name

    def _enter(self, name: str) -> None:
        self.parents.add(name)
        innermost = self.innermost
        if name != "Global" and (not innermost or _depth(name) > _depth(innermost)):
            self.innermost = name

    def _leave(self, name: str) -> None:
        self.parents.discard(name)
        if name == self.innermost:
            self.innermost = _innermost_of(self.parents)

    def _enter_backward(self, name: str) -> None:
        if not self._backward_end_queued:  # one backward at a time, as ModuleTracker assumes
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
            self._backward_end_queued = True
        self._enter(name)

    def _backward_ended(self) -> None:
        self.parents = {"Global"}
        self.innermost = ""
        self._backward_end_queued = False

    def _remove_fired(self) -> None:
        for h in self._fired:
            h.remove()
        self._fired.clear()

    def _forward_pre(self, mod: torch.nn.Module, args: Any) -> None:
        if compiling():  # a compiled module's modules run while torch.compile traces them: not the program's calls
            return
        if self._fired:
            self._remove_fired()
        name = self._name(mod)
        if self.on_compiled is not None and _compiled(mod):
            self.on_compiled(name, mod)
        self._enter(name)
        inputs = _needing_grad(args)
        exit_hook = self._hook([a for a in inputs if a.grad_fn is not None], lambda: self._leave(name))
        self._calls.setdefault(mod, []).append((exit_hook, {_edge(a) for a in inputs}))

    def _forward(self, mod: torch.nn.Module, args: Any, output: Any) -> None:
        if compiling():
            return
        name = self._name(mod)
        self._leave(name)
        calls = self._calls.get(mod)  # none: the tracker was entered during this module's forward
        exit_hook, inputs = calls.pop() if calls else (None, set())
        fresh = [a for a in _needing_grad(output) if _edge(a) not in inputs]
        if self._hook(fresh, lambda: self._enter_backward(name)) is None and exit_hook is not None:
            handle = self._waiting.pop(exit_hook, None)
            if handle is not None:
                handle.remove()

    def _hook(self, tensors: list[torch.Tensor], fn: Callable[[], None]) -> int | None:
        """``fn`` once the gradients of ``tensors`` are computed; the hook's key in ``_waiting`` (None: no
        tensors, no hook). Its handle waits there until it fires, then in ``_fired`` until it is removed
        (class docstring)."""
        if not tensors:
            return None
        key = next(self._keys)

        def fire(grads: Any) -> None:
            fn()
            handle = self._waiting.pop(key, None)
            if handle is not None:
                self._fired.append(handle)

        self._waiting[key] = register_multi_grad_hook(tensors, fire)
        return key


def compiling() -> bool:
    """torch.compile is tracing: dynamo (which compiles the hooks into its graph: nothing of shadow's goes there),
    or AOTAutograd on torch 2.4 (which runs the modules of dynamo's graph on fake tensors, and their backward)."""
    return torch.compiler.is_compiling() or torch._guards.TracingContext.try_get() is not None


def _needing_grad(value: Any) -> list[torch.Tensor]:
    return [a for a in tree_flatten(value)[0] if isinstance(a, torch.Tensor) and a.requires_grad]


def _edge(t: torch.Tensor) -> tuple:
    """The autograd edge a tensor's gradient flows into: an in-place op gives the same tensor a new one."""
    return (t.grad_fn, t.output_nr) if t.grad_fn is not None else (None, id(t))


def _compiled(mod: torch.nn.Module) -> bool:
    """``torch.compile(model)`` (an OptimizedModule) or ``model.compile()``: ShadowMode is told before its call
    (``on_compiled``), to show it its graphs or, where this torch cannot, to say how it ran."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # never imported: nothing was compiled
    optimized = getattr(eval_frame, "OptimizedModule", None)
    return (optimized is not None and isinstance(mod, optimized)) or getattr(mod, "_compiled_call_impl", None) is not None


def _depth(name: str) -> tuple[int, str]:
    """How deep a module's dotted name lies (the innermost running module is the deepest; names break ties)."""
    return name.count("."), name


def _innermost_of(parents: set[str]) -> str:
    names = [p for p in parents if p != "Global"]
    return max(names, key=_depth) if names else ""


def _common_prefix(names: list[str]) -> str:
    if len(names) == 1:  # an optimizer op on one parameter's tensors: most of them
        return names[0]
    parts = [n.split(".") for n in names]
    out = []
    for level in zip(*parts):
        if any(p != level[0] for p in level):
            break
        out.append(level[0])
    return ".".join(out)


class _StepNames:
    """Storage -> parameter name while optimizer steps run, so that each op of a step is charged to the parameter
    it updates. Known at the step's start: each parameter, its gradient and its optimizer state. Learnt during the
    step: state the step creates (the first step creates it all), and every fresh output, which takes the name
    of the op that made it, so temporaries (``exp_avg_sq.sqrt()``, then ``.add_(eps)`` on it) and foreach
    intermediate lists (element by element) keep their parameter's name. An op that touches no named storage
    (a constant such as a new step counter) is charged to the common prefix of the stepping optimizers'
    parameters."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.optimizers: list[torch.optim.Optimizer] = []  # whose step() is running (a step may call another's)
        self.current = ""  # the name of the op being dispatched
        self._params: dict[int, str] = {}  # id(parameter) -> its name
        self._storages: dict[int, str] = {}  # storage -> parameter name
        self._state_sizes: dict[int, int] = {}  # id(parameter) -> entries of its state when last read
        self._fallback = ""

    def begin(self, opt: torch.optim.Optimizer, by_param: dict[int, str]) -> None:
        """``by_param``: id(parameter) -> its dotted name (``Attribution.parameter_names``)."""
        self.optimizers.append(opt)
        for group in opt.param_groups:
            for p in group["params"]:
                name = by_param.get(id(p))
                if name is not None:
                    self._params[id(p)] = name
                    self._name([p, p.grad], name)
        self._read_state()
        self._fallback = _common_prefix(sorted(set(self._params.values())))

    def end(self, opt: torch.optim.Optimizer) -> None:
        self.optimizers.remove(opt)
        if not self.optimizers:
            self.reset()

    def call(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: Any) -> None:
        """Name an op of the step (``current``) by its tensor arguments, and its fresh outputs after it."""
        self.current = self._fallback  # until named: kept if naming fails
        plan = plan_of(func)
        name = self.lookup([t for _, t in plan.tensors(args, kwargs)])
        self.current = name or self._fallback
        if not plan.fresh_returns:
            return
        lists = [v for spec in plan.tensor_args if spec.type is ArgType.TENSORS and (v := spec.get(args, kwargs))]
        index: dict[int, int] = {}  # id(return spec) -> position in its list
        for spec, t in flat_returns(plan, out):
            if spec.aliases_write or spec.aliases_read or not isinstance(t, torch.Tensor):
                continue
            own = name
            if spec.tensors and lists:  # a foreach op's i-th output: its i-th inputs' parameter
                i = index[id(spec)] = index.get(id(spec), -1) + 1
                own = self.lookup([x[i] for x in lists if i < len(x) and isinstance(x[i], torch.Tensor)]) or name
            key = _storage(t)
            if key is not None:
                if own:
                    self._storages[key] = own
                else:  # a constant's output, or a storage reused: learnt from the state when first read
                    self._storages.pop(key, None)

    def lookup(self, tensors: list[torch.Tensor]) -> str:
        keys = [k for k in map(_storage, tensors) if k is not None]
        found = {self._storages[k] for k in keys if k in self._storages}
        if not found and keys and self._read_state():
            found = {self._storages[k] for k in keys if k in self._storages}
        return _common_prefix(sorted(found))

    def _read_state(self) -> bool:
        """Name the optimizer state added since it was last read; True if any was."""
        grew = False
        for opt in self.optimizers:
            for p, state in opt.state.items():
                name = self._params.get(id(p))
                if name is not None and len(state) != self._state_sizes.get(id(p)):
                    self._state_sizes[id(p)] = len(state)
                    self._name(list(state.values()), name)
                    grew = True
        return grew

    def _name(self, values: list, name: str) -> None:
        for t in values:
            key = _storage(t) if isinstance(t, torch.Tensor) else None
            if key is not None:
                self._storages[key] = name


def _any_requires_grad(tensors: list[torch.Tensor]) -> bool:
    for t in tensors:  # a loop: any() of a generator costs more than the one or two inputs most calls have
        if t.requires_grad:
            return True
    return False


def _storage(t: torch.Tensor) -> int | None:
    """A tensor's storage (None: meta, sparse or nested tensors, which have none to name)."""
    if t.is_meta or t.layout != torch.strided or t.is_nested:
        return None
    return t.untyped_storage()._cdata


class _Callsites:
    """The call site of an op: ``file:line`` of the first frame outside torch and shadow (relative to the working
    directory when under it). Frames are classified once per code object and names formatted once per line, so
    the per-op cost is a walk over the few torch frames above the user's.

    A backward op runs from the autograd engine, where the user's frame is the ``loss.backward()`` line: it takes
    the call site of the forward op that built its autograd node instead. A forward op's outputs get their node
    only after the op returns (autograd wraps the dispatch), so the call site is written into the node's
    ``metadata`` when the next op is seen (``bind``)."""

    def __init__(self) -> None:
        # keyed by id(code): a code object's hash is computed from its contents at every lookup (0.35 us, a dozen
        # frames per op inside a model); the code is held here, so its id names no other while the entry lives
        self._internal: dict[int, tuple[Any, bool]] = {}
        self._names: dict[tuple[int, int], str] = {}  # (id(code), line) of a code held in _internal
        self._cwd = os.getcwd() + os.sep
        self._pending: tuple[tuple, str, int] | None = None  # the last forward op's (outputs, call site, index)
        # (record index, its outputs that have an autograd node now), once per forward op (shadow.attribution.adjoint)
        self.on_bind: Callable[[int, list[torch.Tensor]], None] | None = None

    def here(self, skip: int = 0) -> str:
        """The call site of the op being dispatched: the first frame outside torch and shadow, walking up from the
        caller of ``here``'s caller, ``skip`` frames above it (frames of shadow's own the walk need not classify)."""
        f = sys._getframe(2 + skip)
        internal, names = self._internal, self._names
        while f is not None:
            code = f.f_code
            known = internal.get(id(code))
            if known is None:
                known = internal[id(code)] = (code, code.co_filename.startswith(_INTERNAL))
            if not known[1]:
                key = (id(code), f.f_lineno)
                name = names.get(key)
                if name is None:
                    path = code.co_filename
                    name = names[key] = f"{path[len(self._cwd):] if path.startswith(self._cwd) else path}:{key[1]}"
                return name
            f = f.f_back
        return ""

    def backward(self) -> str:
        self.bind()
        node = torch._C._current_autograd_node()
        site = node.metadata.get(_NODE_KEY) if node is not None else None
        return site if site is not None else self.here()

    def forward(self, out: Any, site: str, index: int) -> None:
        self.bind()
        # weak references: a strong one makes a factory function (torch.ones) detach its result to return it
        if isinstance(out, torch.Tensor):
            outs = (weakref.ref(out),)
        elif isinstance(out, (tuple, list)):
            outs = tuple(weakref.ref(t) for t in out if isinstance(t, torch.Tensor))
        else:
            outs = ()
        self._pending = (outs, site, index) if outs else None

    def bind(self) -> None:
        """Write the last forward op's call site into the autograd nodes its outputs now have."""
        if self._pending is None:
            return
        outs, site, index = self._pending
        self._pending = None
        bound = []
        for ref in outs:
            t = ref()
            if t is not None and t.grad_fn is not None:
                t.grad_fn.metadata.setdefault(_NODE_KEY, site)
                bound.append(t)
        if self.on_bind is not None:
            self.on_bind(index, bound)


class Attribution:
    """Tracks the current module, phase and call site while a ShadowMode is active."""

    def __init__(self, on_compiled: Callable[[str, torch.nn.Module], None] | None = None,
                 callsites: bool = True) -> None:
        self._tracker = Tracker()
        self._tracker.on_compiled = on_compiled
        self._steps = _StepNames()
        self._handles: list = []
        self.callsites = _Callsites() if callsites else None

    def __enter__(self) -> Attribution:
        self._tracker.__enter__()
        self._handles = [
            register_optimizer_step_pre_hook(lambda opt, args, kwargs: self._steps.begin(opt, self.parameter_names())),
            register_optimizer_step_post_hook(lambda opt, args, kwargs: self._steps.end(opt)),
        ]
        return self

    def __exit__(self, *exc) -> None:
        if self.callsites is not None:
            self.callsites.bind()
        for h in self._handles:
            h.remove()
        self._handles = []
        self._tracker.__exit__(*exc)

    @property
    def parents(self) -> set[str]:
        """The modules whose forward or backward is running."""
        return self._tracker.parents

    @property
    def stepping(self) -> bool:
        """An optimizer step is running."""
        return bool(self._steps.optimizers)

    def parameter_of(self, tensors: list[torch.Tensor]) -> str:
        """The parameter an optimizer call's tensors belong to ("" if none is known)."""
        return self._steps.lookup(tensors)

    def module_names(self, modules: tuple[torch.nn.Module, ...]) -> list[str]:
        """The dotted names of ``modules`` that ran a forward so far."""
        names = [self._tracker.name_of(m) for m in modules]
        return [n for n in names if n is not None]

    def parameter_names(self) -> dict[int, str]:
        """id(parameter) -> its dotted name ("Net.fc1.weight"), for the modules that ran a forward."""
        names: dict[int, str] = {}
        for mod, fqn in self._tracker.names():
            for pname, p in mod.named_parameters(recurse=False):
                names.setdefault(id(p), f"{fqn}.{pname}")
        return names

    def where(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: Any,
              index: int = -1, inputs: list[torch.Tensor] | None = None, skip: int = 0) -> tuple[str, Phase, str]:
        """(module, phase, call site) of the op call that just ran on the device (``index``: its record's):
        inside an optimizer step, the module is the parameter its arguments belong to (its fresh outputs then take
        that name); the call site is "" with ``callsites=False``. ``inputs``: the call's floating inputs, when the
        caller knows them: where grad mode is off or none of them requires grad, autograd gives the outputs no node,
        and no forward call site waits to be written into one (unless an observer of the bindings asks for every
        call). ``skip``: frames of shadow's own above the caller that the call-site walk may jump over."""
        sites = self.callsites
        if self._steps.optimizers:
            try:
                self._steps.call(func, args, kwargs, out)
            except Exception:  # never raise into the user's program: the call keeps the fallback name
                pass
            return self._steps.current, _OPTIMIZER, sites.here(skip) if sites is not None else ""
        module = self._tracker.innermost
        if _graph_task_id() != -1:
            return module, _BACKWARD, sites.backward() if sites is not None else ""
        if sites is None:
            return module, (_FORWARD if module else _OTHER), ""
        site = sites.here(skip)
        if inputs is None or sites.on_bind is not None or (torch.is_grad_enabled() and _any_requires_grad(inputs)):
            sites.forward(out, site, index)
        else:
            sites.bind()  # the last forward call's outputs have their nodes by now; this one's will have none
        return module, (_FORWARD if module else _OTHER), site
