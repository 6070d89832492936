"""ShadowMode: the public object. A small private TorchDispatchMode only forwards to the engine."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..attribution.tracking import Attribution
from .. import _compat
from ..compiled import hooks
from ..compiled.kernels import Kernels
from ..engine import Engine, EngineHooks
from ..errors import ShadowWarning
from ..options import MAX_REPRO_BYTES, Options
from ..plan import OpPlan
from ..report import Report
from ..trajectory import Trajectory


_GLOBAL_HOOKS_WARNING = r"Using `torch.compile\(module\)` when there are global hooks on modules"


class ShadowDispatch(TorchDispatchMode):
    def __init__(self, engine: Engine, graphs: hooks.Graphs):
        super().__init__()
        self._engine = engine
        self._graphs = graphs

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # torch 2.13: dynamo compiles through the mode (off while it compiles, on while the compiled code runs),
        # and each compiled graph's call comes to graph_call; without that path, dynamo skips compiled frames
        # under the mode and the code runs eagerly
        return _GRAPHS_SHOWN

    def graph_call(self, compiled: Any, source: torch.fx.GraphModule, inputs: list) -> Any:
        """A compiled graph's call (shadow.compiled.hooks), with this mode off: judged as one op."""
        prior = _set_eval_frame(None)  # as in __torch_dispatch__: no frame of shadow's is traced by dynamo
        try:
            graph = self._graphs.get(compiled, source)
            return graph.boxed(self._engine.graph_call(graph, tuple(inputs)))
        finally:
            if prior is not None:
                _set_eval_frame(prior)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # False: torch (2.6 on) does not wrap __torch_dispatch__ in torch._disable_dynamo; __torch_dispatch__ does
        # its one job below (torch 2.4.1 asks nothing, wraps nothing)
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # no frame of shadow's is traced by a torch.compile running around the mode: its frame callback is off
        # until the call returns, as torch._disable_dynamo would have it
        prior = _set_eval_frame(None)
        try:
            if types not in _PLAIN_TYPES:
                if any(t.__torch_dispatch__ is not _PLAIN for t in types):
                    if any(issubclass(t, FakeTensor) for t in types):  # metadata only (DTensor's sharding propagation)
                        return func(*args, **(kwargs or {}))
                    return NotImplemented  # a wrapper subclass (DTensor) unwraps: its calls on plain tensors come back
                _PLAIN_TYPES.add(types)
            return self._engine.dispatch(func, args, kwargs or {})
        finally:
            if prior is not None:
                _set_eval_frame(prior)


_set_eval_frame = torch._C._dynamo.eval_frame.set_eval_frame
_GRAPHS_SHOWN = hooks.install(ShadowDispatch)  # this torch runs compiled graphs through Inductor's operator


class _Scope:
    """ShadowMode(scope=[module, ...]) as the engine asks it (``EngineHooks.shadows``): a call of a scoped module
    (its forward or backward), or an optimizer call on one of its parameters."""

    def __init__(self, modules: tuple[torch.nn.Module, ...], attribution: Attribution):
        self.modules, self.attribution = modules, attribution

    def __call__(self, plan: OpPlan, args: tuple, kwargs: dict) -> bool:
        attribution = self.attribution
        names = attribution.module_names(self.modules)
        if not names:
            return False
        if attribution.stepping:
            name = attribution.parameter_of([t for _, t in plan.tensors(args, kwargs)])
            return any(name == n or name.startswith(n + ".") for n in names)
        parents = attribution.parents
        return any(n in parents for n in names)


_PLAIN = torch.Tensor.__torch_dispatch__
_PLAIN_TYPES: set[tuple[type, ...]] = set()  # the types tuples seen with no subclass dispatch of their own


class ShadowMode:
    """Replay every aten op in float64 (on the CPU, or on a GPU that computes float64 natively: ``shadow_device``)
    and record each op's error and the drift since the start.

    >>> with ShadowMode() as sm:
    ...     loss = model(x).sum(); loss.backward(); opt.step()      # doctest: +SKIP
    >>> print(sm.report.table())                                     # doctest: +SKIP
    >>> sm.shadow_of(loss)   # the float64 value the program would have computed  # doctest: +SKIP

    The device computes exactly what it computes without shadow; ops shadow cannot replay are recorded
    (``report.coverage``) and their device results adopted. State persists across ``with`` blocks;
    ``reset()`` clears it.
    """

    def __init__(
        self,
        *,
        local: bool = True,  # each op's own error: replay on the device's own inputs
        drift: bool = True,  # the error accumulated since the start: device vs shadow
        follow: str = "device",  # discrete results downstream: "device" (default) or "reference" (the shadow's own)
        max_records: int | None = None,  # cap on per-call records; aggregates always cover every call
        spot_checks: Any = "default",  # mpmath checks of the float64 reference: "off", "default", n, {op: n}, "all"
        budgets: bool = True,  # hold each op's local error to its a-priori error budget
        compare_cpu: bool = False,  # also run each op on the CPU in the device dtype: record.cpu, record.cpu_ratio
        callsites: bool = True,  # record each call's line in the user's code: record.callsite, report.by_callsite
        scope: Any = None,  # [module, ...]: shadow only their calls (forward, backward, optimizer); adopt the rest
        max_shadow_bytes: int | None = None,  # fail (ShadowMemoryError) before shadows would exceed this
        shadow_device: Any = "auto",  # where shadows live and replay: "auto", "cpu", or a float64 device ("cuda")
        max_repro_bytes: int = MAX_REPRO_BYTES,  # inputs kept of the worst calls over budget (shadow repro; 0: none)
        hooks: EngineHooks | None = None,  # how shadow.attribute and shadow.audit take part in each op call
    ):
        self.options = Options(local=local, drift=drift, follow=follow, max_records=max_records,
                               spot_checks=spot_checks, budgets=budgets, compare_cpu=compare_cpu,
                               callsites=callsites, scope=scope, max_shadow_bytes=max_shadow_bytes,
                               shadow_device=shadow_device, max_repro_bytes=max_repro_bytes)
        if hooks is not None and not isinstance(hooks, EngineHooks):
            raise TypeError(f"ShadowMode(hooks={hooks!r}): expected a shadow.engine.EngineHooks")
        if hooks is not None and (hooks.shadows is not None or hooks.recorded is not None):
            raise ValueError("ShadowMode(hooks=...): its shadows and recorded hooks are ShadowMode's own (scope=, "
                             "the trajectory); give world or observe only")
        self._hooks = hooks if hooks is not None else EngineHooks()
        self._active = 0
        self.reset()

    def reset(self) -> None:
        """Forget every shadow and record (not allowed inside the ``with`` block)."""
        if self._active:
            raise RuntimeError("ShadowMode.reset() inside its `with` block: call it after the block exits")
        self.report = Report(max_records=self.options.max_records, meta=self._meta())
        self._attr = Attribution(on_compiled=self._compiled_module, callsites=self.options.callsites)
        self._adopting: dict = {}  # compiled modules whose outputs are adopted -> their hook
        kernels = Kernels()  # the C++ kernels Inductor generates in the block (torch 2.13), judged one by one
        self._graphs = hooks.Graphs(self.report.meta, kernels)  # the compiled graphs seen, by their compiled code
        self._watch = hooks.Watch(ShadowDispatch, kernels)  # what the block does so compiled graphs reach the mode
        self._trajectory = Trajectory(self._attr.parameter_names)
        self.report.trajectory = self._trajectory.steps
        own = EngineHooks(recorded=self._trajectory.seen,
                          shadows=_Scope(self.options.scope, self._attr) if self.options.scope is not None else None)
        self._engine = Engine(self.options, self.report, self._attr, own.merged(self._hooks))
        self.report.kept = self._engine.keeper.kept if self._engine.keeper is not None else None
        self._mode = None

    def _compiled_module(self, module: str, mod: torch.nn.Module) -> None:
        """A torch.compile'd module is about to run inside the mode. Where this torch shows each compiled graph's
        call to the mode (``shadow.compiled.hooks``; Inductor is loaded now if it was not: the call compiles),
        every graph is judged as one op. Elsewhere torch skips compiled frames while a dispatch mode is active
        (the module runs eagerly and its figures are the eager kernels'), or runs compiled code whose fused
        kernels shadow never sees (its outputs are adopted from the device after it returns). Counted; warned
        once per run."""
        if self._watch.compiled_module(mod):
            return
        eager = _compat.compile_skips_dispatch_modes()
        if not eager and mod not in self._adopting:
            self._adopting[mod] = mod.register_forward_hook(self._adopt_outputs)
        first = not self.report.coverage.compiled
        self.report.compiled_module(module, eager)
        if first:
            what = ("runs eagerly inside ShadowMode (torch.compile skips frames while a dispatch mode is active): "
                    "its figures describe the eager kernels, not the compiled ones") if eager else (
                    "runs as compiled code inside ShadowMode (this torch does not skip compiled frames under a "
                    "dispatch mode): shadow sees only the ops it dispatches, not its fused kernels, so its outputs "
                    "are adopted from the device and their drift restarts there")
            warnings.warn(f"shadow: the compiled module {module} {what}. report.coverage.compiled lists such "
                          "modules.", ShadowWarning, stacklevel=2)

    def _adopt_outputs(self, mod: torch.nn.Module, inputs: Any, output: Any) -> None:
        self._engine.adopt([t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)])

    def _meta(self) -> dict:
        from .. import __version__

        from ..devices import numerics_settings

        meta = {"shadow": __version__, "torch": torch.__version__, "numerics": numerics_settings(), "options": {
            "local": self.options.local, "drift": self.options.drift, "follow": self.options.follow,
            "spot_checks": self.options.spot_checks.option, "callsites": self.options.callsites,
            "max_repro_bytes": self.options.max_repro_bytes}}
        return meta

    def __enter__(self) -> ShadowMode:
        if self._active:
            raise RuntimeError("this ShadowMode is already active: nest a different instance, or exit first")
        # torch warns on every call of a compiled module while global module hooks exist: shadow's (the module
        # tracker's) are the cause, so that warning is shadow's to silence, and only while it is active
        warnings.filterwarnings("ignore", message=_GLOBAL_HOOKS_WARNING, category=UserWarning)
        self._filter = warnings.filters[0]
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():  # per-rank reports say whose they are (merge_reports)
            self.report.meta.update(rank=dist.get_rank(), world_size=dist.get_world_size())
        self._attr.__enter__()
        self._stepped = register_optimizer_step_post_hook(lambda opt, a, kw: self._trajectory.stepped(opt,
                                                                                                      self._engine))
        self._watch.start()
        if self._engine.keeper is not None:
            self._engine.keeper.entered()
        self._mode = ShadowDispatch(self._engine, self._graphs)
        self._mode.__enter__()
        self._active = 1
        return self

    def __exit__(self, *exc) -> None:
        self._active = 0
        try:
            self._engine.settle()  # calls judged when their outputs are first read (collectives): the rest, now
        except Exception as err:  # never raise into the user's program
            self.report.internal_error("settle", f"internal error: {type(err).__name__}: {err}"[:240])
        try:
            self._mode.__exit__(*exc)
        finally:
            self._stepped.remove()
            self._watch.stop()
            self._graphs.release()
            self._engine.scratch.clear()  # working memory of op calls: none runs outside the block
            self._engine.copies.clear()  # device values read over: writes outside the block go unseen
            self._attr.__exit__(*exc)
            self._mode = None
            for handle in self._adopting.values():
                handle.remove()
            self._adopting.clear()
            if self._filter in warnings.filters:
                warnings.filters.remove(self._filter)
                warnings._filters_mutated()
        self.report.mirror_counts(self._engine.mirror.adopted, self._engine.mirror.reinterpreted)

    def shadow_of(self, t: torch.Tensor) -> torch.Tensor:
        """The shadow value of any tensor seen: a float64 (complex128) CPU copy.

        >>> sm.shadow_of(loss).item()   # doctest: +SKIP
        """
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"shadow_of expects a torch.Tensor, got {type(t).__name__}")
        return self._engine.shadow_of(t)

    def memory(self) -> dict[str, int]:
        """Bytes held by live shadows, the device bytes they mirror, and the idle memory kept for the large
        tensors of later op calls (``shadow.scratch``)."""
        with torch._C._DisableTorchDispatch():
            self._engine.mirror.sweep()
            self._engine.trim_scratch()  # the sweep may have let shadows in pooled memory go: now idle
            return {"shadow_bytes": self._engine.mirror.shadow_bytes(), "device_bytes": self._engine.mirror.device_bytes(),
                    "scratch_bytes": self._engine.scratch.idle}
