"""The per-op engine behind ShadowMode: prepare shadow arguments, let the device run, replay, judge, commit.

One op call goes through four named steps: ``_prepare`` (before the device op: the shadow, local, pre-op
and CPU argument sets, ``Prepared``), the replays (``shadow.replay``), ``_judge`` (the error figures of
every ``Output``: comparisons, the budget, effective bits, the spot check: a ``Verdict``) and ``_commit``
(the shadows kept in the mirror). Most calls conclude on the direct path (``_conclude_direct``), which skips
``_judge``'s walk over every kind of output and shares its pieces. Ground rules (README): the device's
computation is never changed (shadow only reads device tensors and works on its own copies with Python dispatch
disabled, so no mode below sees it); no op it cannot replay and no error of its own ever reaches the user's
program; every op is seen and recorded.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import torch

from .attribution.adjoint import correctly_rounded
from .attribution.tracking import Attribution
from .budgets import Budget, InUlps, budget_for, fixed_budget, reads_overwritten
from .devices import cpu_fallback
from .errors import ShadowMemoryError, Unsupported
from .metrics import _fused  # the numba kernels (None without numba)
from .metrics import ErrorStats, compare, compare_pair, count_flips
from .mirror import CPU, SHADOW_DTYPES, Mirror, Placement, any_nonfinite
from .options import Options
from .plan import ArgSpec, ArgType, OpPlan, flat_returns, plan_of
from .records import BudgetInfo, Event, Kind, Record
from .replay import DEFINED, REPLAY, Replay, defined_regions, view_rule
from .replay.table import Deferred
from .report import Report, merged
from .rules import run_chain
from .scratch import Scratch
from .spot import SpotPolicy, SpotStats
from .spot.sampling import top_positions
from .transfer import HostCopies

_INF = math.inf
# the engine's frames below __torch_dispatch__ on the direct path (_conclude_direct, _finish, dispatch): its call of
# Attribution.where starts the call-site walk above them (tests/test_engine.py holds its call sites to the general
# path's, which walks every frame)
_DIRECT_FRAMES = 3
_COPIES_FLOOR = 8 << 20  # bytes of device values read over that may be kept however few the shadows' (shadow.transfer)
# Shadow's own work must reach no dispatch mode (none below sees it, the engine records none of its ops). It
# records no autograd graph either: every tensor it makes is a detached copy (mirror.upcast; copying a lazy
# module's uninitialized parameter with autograd on created its gradient accumulator with the wrong shape).
_no_dispatch = torch._C._DisableTorchDispatch
_COPY = torch.ops.aten.copy_.default
# Nested tensors have a shape per component and no strides: the mirror cannot hold their shadows (test_nested.py)
_NESTED = ("nested tensor {}: shadow mirrors dense tensors only (nested tensors come from torch.nested, or from "
           "nn.TransformerEncoder's fast path for padded batches in eval mode); build the encoder with "
           "enable_nested_tensor=False, or run it in training mode or without src_key_padding_mask, to shadow it")


class _NoValues(Exception):
    """The call runs on meta tensors: shapes only, no values to shadow."""


@dataclasses.dataclass(slots=True)
class Args:
    """One set of an op's arguments (positional and keyword)."""

    args: list
    kwargs: dict

    def get(self, spec: ArgSpec) -> Any:
        return spec.get(self.args, self.kwargs)


@dataclasses.dataclass(slots=True)
class Prepared:
    """What ``_prepare`` built before the device op ran."""

    plan: OpPlan
    chain: tuple
    shadow: Args | None = None  # the shadow inputs: the replay that drift is measured against
    local: Args | None = None  # the device's own inputs, upcast (None: every input is exact, the shadow serves)
    pre: Args | None = None  # the local reference's inputs as before the op (budget rules that read them, spot checks)
    cpu: Args | None = None  # compare_cpu: the device's inputs on the CPU, in their own dtypes
    exact: bool = True  # every shadow input equals the device's: local error = drift
    nonfinite_in: bool = False  # some input's storage holds a NaN or an infinity
    inputs_drift: float = 0.0  # the largest drift rel_norm of an input's storage
    inputs: list[torch.Tensor] | None = None  # device tensors read (naming)
    storages: set[int] | None = None  # shadow storages of the inputs (an output aliasing one is copied)
    spot: bool = False  # this call is spot-checked
    budget: bool = False  # its local error is held to the op's budget
    fixed: InUlps | None = None  # the op's budget rule where it reads no argument (``shadow.budgets.fixed_budget``)
    direct: bool = False  # the op's calls may conclude on the direct path (``_direct``)

    @property
    def reference(self) -> Args:
        """The inputs the local error's reference is computed from."""
        return self.local if self.local is not None else self.shadow


@dataclasses.dataclass(slots=True)
class Output:
    """One compared result of an op call: a written argument (in-place, out=) or a fresh return."""

    device: Any  # the device's tensor, or a Python number (.item(), equal)
    shadow: Any  # the drift replay's value
    local: Any  # the local replay's value (None: the shadow serves)
    written: bool
    slot: int | None  # position among the op's flattened outputs (budgets, spot checks); None for numbers

    @property
    def reference(self) -> Any:
        """What the local error is measured against."""
        return self.local if isinstance(self.local, torch.Tensor) else self.shadow


@dataclasses.dataclass(slots=True)
class Outputs:
    items: list[Output]
    slots: int  # how many output slots the op has (budgets get one entry each, None where absent)
    item: tuple[Any, Any] | None  # an .item()-like (device, shadow) number pair
    dtype: torch.dtype  # the device dtype errors are measured in (a cast is held to its target's rounding)


@dataclasses.dataclass(slots=True)
class Compared:
    """One output's figures, and what the mirror keeps of it."""

    drift: ErrorStats | None = None
    local: ErrorStats | None = None
    flips: int = 0
    local_flips: int = 0
    mismatch: int = 0  # 1: a shape the shadow did not reproduce (the device's value is adopted)
    exact: bool = False  # the shadow equals the device's value: the mirror entry stays exact
    keep: Any = None  # the shadow value to commit (None: nothing to commit)
    nonfinite: bool = False  # the device's value holds a NaN or an infinity
    skipped: int = 0  # elements not compared: the op leaves them undefined


@dataclasses.dataclass(slots=True)
class Verdict:
    """The judged call: merged figures over every output."""

    local: ErrorStats | None
    drift: ErrorStats | None
    flips: int
    local_flips: int
    mismatch: int
    budget: BudgetInfo | None
    spot: SpotStats | None
    compared: list[Compared]
    skipped: int  # elements not compared: the op leaves them undefined


class Engine:
    def __init__(self, options: Options, report: Report, attribution: Attribution):
        self.opt = options
        self.report = report
        self.attr = attribution
        # where shadows live: resolved per device, once (ShadowMode(shadow_device=...); docs/architecture.md)
        self.mirror = Mirror(options.follow == "reference",
                             Placement(options.shadow_device, options.max_shadow_bytes or 0))
        self.spot = SpotPolicy(options.spot_checks)
        self._spotting = self.spot.config.mode != "off"  # whether any call may be spot-checked
        self.scratch = Scratch()  # reused memory for an op call's large temporaries (shadow.scratch)
        # device values read over to where their shadows live, one crossing per storage version (shadow.transfer),
        # kept within 1/32 of the shadows' bytes (at least 8 MiB)
        self.copies = HostCopies(lambda d: self.mirror.place(d), lambda: max(_COPIES_FLOOR, self.mirror.held / 32))
        # id(op) -> (plan, replay chain, direct, fixed budget rule), or None: an id hashes in C where an OpOverload's
        # hash is a Python method; _ops holds every op seen, so that its id stays its own
        self._plans: dict[int, tuple[OpPlan, tuple, bool, InUlps | None] | None] = {}
        self._ops: list = []
        self._index = 0
        # shadow.attribute's hooks (None in a plain ShadowMode): how an ablation world rewrites a call's shadows,
        # given (op, module, phase, call site) (_rewrite_shadow); and a look at each judged call's record and outputs
        self.world: Callable[[str, str, Any, str], str | None] | None = None
        self._observe: Callable[[Record, list[Output], Prepared], None] | None = None
        self.trajectory: Any = None  # shadow.trajectory.Trajectory: the loss and parameters per optimizer step
        self._deferred: list[_Pending] = []  # calls whose device outputs are judged when first touched (Deferred)

    @property
    def observe(self) -> Callable[[Record, list[Output], Prepared], None] | None:
        return self._observe

    @observe.setter
    def observe(self, hook: Callable[[Record, list[Output], Prepared], None] | None) -> None:
        # the observers (shadow.attribute's adjoints, shadow.audit's) compute on the outputs' references with
        # CPU tensors of their own: under shadow_device="auto" their runs keep the shadows on the CPU
        self._observe = hook
        if hook is not None:
            self.mirror.place.on_cpu_unless_chosen()

    # --- entry point, called by the dispatch mode ---
    def dispatch(self, func, args: tuple, kwargs: dict) -> Any:
        entry = self._plans.get(id(func), False)
        if entry is False:
            entry = self._plans[id(func)] = self._plan(func)
            self._ops.append(func)
        if entry is None:  # no tensor in or out (profiler markers...), or a schema shadow cannot read
            self.report.passed_through()
            return func(*args, **kwargs)
        plan, chain, direct, fixed = entry
        if self._deferred:  # an op touching a deferred call's outputs: the user's program waited for them
            completing = self._completing(plan, args)
            self.settle((t for _, t in plan.tensors(args, kwargs)), spare=completing)
            if completing:  # a backend writing a deferred call's result: part of that call, judged with it
                out = func(*args, **kwargs)
                with _no_dispatch():
                    self.mirror.note_write(self._entry(plan, args[0]))  # a write shadow saw (the version moves)
                return out
        if self.opt.scope is not None and not self._in_scope(plan, args, kwargs):
            out = func(*args, **kwargs)
            with _no_dispatch():
                self._outside(plan, args, kwargs)
            return out
        if chain[0] is view_rule:  # aliases and metadata: nothing to compute, nothing to compare
            out = func(*args, **kwargs)
            try:
                with _no_dispatch():
                    self._see(plan, args, kwargs)
            except Exception as exc:
                with _no_dispatch():  # adopting the outputs must not dispatch (and record) ops of its own
                    self._internal_error(plan, args, kwargs, out, exc)
                return out
            self._record(plan, Kind.VIEW, args, kwargs, out)
            return out
        prepared = error = None
        try:
            with _no_dispatch():
                prepared = self._prepare(plan, chain, direct, fixed, args, kwargs)
        except _NoValues:
            out = func(*args, **kwargs)
            self._record(plan, Kind.META, args, kwargs, out)
            return out
        except ShadowMemoryError:  # the user asked for this limit: raised before the device op, nothing half-done
            raise
        except Exception as exc:  # never raise into the user's program
            error = exc
        out = func(*args, **kwargs)  # the op itself: what it raises reaches the user as torch raises it (shadow.cli)
        with _no_dispatch():
            try:
                if error is not None:
                    raise error
                self._finish(prepared, args, kwargs, out)
            except Exception as exc:
                self._internal_error(plan, args, kwargs, out, exc)
        return out

    def graph_call(self, graph: Any, args: tuple) -> Any:
        """A compiled graph's call (``shadow.compiled.Graph``), dispatched as one op whose plan, replay chain and
        budget rule the graph gives (``graph.plan``, ``graph.chain``, ``graph.budget``): the record's op is the
        graph's name, its figures the compiled code's outputs against the float64 replay of its aten graph."""
        if id(graph) not in self._plans:
            self._plans[id(graph)] = (graph.plan, graph.chain, False, graph.budget)
            self._ops.append(graph)
        return self.dispatch(graph, args, {})

    def _plan(self, func) -> tuple[OpPlan, tuple, bool, InUlps | None] | None:
        try:
            plan = plan_of(func)
            if not plan.tensor_args and not any(r.is_tensor for r in plan.returns):
                return None
            chain = REPLAY.chain(func)
            return plan, chain, _direct(plan, chain), fixed_budget(func)
        except Exception as exc:  # never raise into the user's program
            self.report.internal_error(str(func), f"internal error reading the schema: {exc}")
            return None

    # --- scope: ShadowMode(scope=[module, ...]) ---
    def _in_scope(self, plan: OpPlan, args, kwargs) -> bool:
        """A call of a scoped module (its forward or backward), or an optimizer call on one of its parameters."""
        names = self.attr.module_names(self.opt.scope)
        if not names:
            return False
        if self.attr.stepping:
            name = self.attr.parameter_of([t for _, t in plan.tensors(args, kwargs)])
            return any(name == n or name.startswith(n + ".") for n in names)
        parents = self.attr.parents
        return any(n in parents for n in names)

    def _outside(self, plan: OpPlan, args, kwargs) -> None:
        """A call outside the scope ran: no shadow, no record. A storage it wrote that has a shadow (a scoped op
        read it before) takes the device's values again, as a write shadow saw."""
        self.report.out_of_scope()
        m = self.mirror
        if self.copies:  # device values read over before this write are out of date
            self.copies.drop(plan.tensors(args, kwargs, plan.writes))
        for _, t in plan.tensors(args, kwargs, plan.writes):
            if t.layout == torch.strided and not t.is_nested and t.device.type != "meta" \
                    and m.shadow_dtype(t.dtype) is not None and m.known(t) is not None:
                m.resync(t)
                m.note_write(m.entry(t))

    def _memory(self, plan: OpPlan) -> None:
        cap = self.opt.max_shadow_bytes
        if cap is not None and self.mirror.held > cap:
            raise ShadowMemoryError(
                f"shadow holds {self.mirror.held} bytes of float64 shadows at {plan.name} (call {self._index}), "
                f"over max_shadow_bytes={cap}: raise max_shadow_bytes, or shadow part of the model with "
                "ShadowMode(scope=[module, ...]) (those modules' calls, their backward and their parameters' "
                "optimizer calls)")

    def _see(self, plan: OpPlan, args, kwargs) -> None:
        """A view's input storage gets its shadow now (adopted if new, resynced if written behind shadow's
        back), so the view's shadow exists; an in-place view op (``t_``, ``unsqueeze_``) bumps its input's
        version counter, which is noted as a write shadow saw."""
        m = self.mirror
        for spec, t in plan.tensors(args, kwargs):
            if t.device.type != "meta" and m.shadow_dtype(t.dtype) is not None and not t._is_zerotensor() \
                    and t.layout == torch.strided and not t.is_nested:
                e = self._entry(plan, t)
                if spec.index in plan.declared_writes:
                    m.note_write(e)

    def _entry(self, plan: OpPlan, t: torch.Tensor):
        """The mirror entry of a floating input's storage, resynced (and reported) after an unobserved write."""
        m = self.mirror
        e = m.entry(t)
        if m.unobserved_write(t, e):
            m.resync(t)
            if self.copies:
                self.copies.drop([(None, t)])
            e = m.entry(t)
            self.report.unobserved_write(Event(
                self._index, plan.name, "unobserved_write",
                f"{tuple(t.shape)} {t.dtype} on {t.device}: version moved without an op shadow saw; resynced"))
        return e

    def trim_scratch(self) -> None:
        """The pool's idle storages within what ``max_shadow_bytes`` leaves beside the shadows (and its peak)."""
        cap = self.opt.max_shadow_bytes
        if cap is not None:  # without one the limit stays what the pool starts with: none
            self.scratch.set_limit(cap - self.mirror.held)

    # --- before the device op ---
    def _prepare(self, plan: OpPlan, chain: tuple, direct: bool, fixed: InUlps | None, args: tuple, kwargs: dict
                 ) -> Prepared:
        p = Prepared(plan, chain, inputs=[], storages=set(), direct=direct)
        cap = self.opt.max_shadow_bytes
        if cap is not None:
            self.trim_scratch()
        read: dict[int, torch.Tensor] = {}  # a tensor read twice (mha(x, x, x)) has one shadow: kernels test identity

        def shadow(t: torch.Tensor, spec: ArgSpec) -> torch.Tensor:
            if spec.write:
                return self._shadow_arg(p, t, True, spec.index in plan.declared_writes)
            v = read.get(id(t))
            if v is None:
                v = read[id(t)] = self._shadow_arg(p, t, False, False)
            return v

        place = self.mirror.place
        p.shadow = Args(*plan.map_tensors(args, kwargs, shadow))
        if plan.remap_args:
            _remap_args(plan, place, p.shadow)
        if self.opt.local and not p.exact:
            seen: dict[int, torch.Tensor] = {}  # a tensor passed twice (Adam's addcmul_(g, g)) is upcast once

            def up(t: torch.Tensor, _: ArgSpec) -> torch.Tensor:
                c = seen.get(id(t))
                if c is None:
                    d = t.device
                    to = place(d)
                    v = t
                    if to != d:  # read over once per storage version, with the call's other inputs
                        v = self.copies.read(t, p.inputs)
                    c = seen[id(t)] = self.scratch.copy(v, self.mirror.shadow_dtype(t.dtype) or t.dtype, to)
                return c

            p.local = Args(*plan.map_tensors(args, kwargs, up))
            if plan.remap_args:
                _remap_args(plan, place, p.local)
        if plan.writes and self.copies:  # the op writes these: copies read over before it are out of date
            self.copies.drop(plan.tensors(args, kwargs, plan.writes))
        dtype = p.inputs[0].dtype if p.inputs else None
        # float64 devices have no headroom over the float64 reference: nothing to validate
        p.spot = self._spotting and dtype is not None and dtype != torch.float64 and self.spot.wants(plan.name)
        p.budget = self.opt.budgets and self.opt.local and dtype is not None
        if p.budget:
            p.fixed = fixed
        if p.spot or (p.budget and p.fixed is None):
            p.pre = self._pre_inputs(p)
        if cap is not None:
            self._memory(plan)
        if self.opt.compare_cpu and self.opt.local and dtype is not None:
            a, kw = plan.map_tensors(args, kwargs, lambda t, _: t.detach().to("cpu", copy=True))  # the kernel may write
            for spec in plan.remap_args:
                if isinstance(spec.get(a, kw), torch.device):
                    spec.put(a, kw, torch.device("cpu"))
            p.cpu = Args(a, kw)
        return p

    def _pre_inputs(self, p: Prepared) -> Args:
        """The reference's inputs as they are before the op: every input that shares memory with a written
        argument is copied (the replays write them; ``x.add_(x, alpha=2)``, ``add(x, y, out=x)``), except
        out= buffers themselves (nothing reads them) and the op's in-place ``self`` when no spot check is
        planned and the op's budget rules do not read it (``shadow.budgets.reads_overwritten``)."""
        plan, ref = p.plan, p.reference
        written = {t.untyped_storage().data_ptr() for _, t in plan.tensors(ref.args, ref.kwargs, plan.writes)}
        if not written:
            return Args(list(ref.args), dict(ref.kwargs))
        skip = plan.out_args if p.spot or reads_overwritten(plan.func) else plan.write_args

        def snapshot(t: torch.Tensor, _: ArgSpec) -> torch.Tensor:
            if t.untyped_storage().data_ptr() not in written:
                return t
            return self.scratch.copy(t, t.dtype, t.device)

        return Args(*plan.map_tensors(ref.args, ref.kwargs, snapshot, skip))

    def _shadow_arg(self, p: Prepared, t: torch.Tensor, write: bool, declared: bool) -> torch.Tensor:
        if t.is_meta:
            raise _NoValues
        if t.layout != torch.strided:  # sparse (COO, CSR...) and mkldnn tensors have no strided storage to mirror
            raise Unsupported(p.plan.name, f"{t.layout} argument: shadow mirrors strided tensors only")
        if t.is_nested:
            raise Unsupported(p.plan.name, _NESTED.format("argument"))
        m = self.mirror
        sd = m.shadow_dtype(t.dtype)
        if sd is None:  # discrete, following the device: its values, never written back
            d = t.device
            to = m.place(d)
            if to != d:  # read over once per storage version (a copy kept is never handed out to be written)
                return self.copies.read(t, keep=not write)
            return t.clone() if write else t
        if t._is_zerotensor():  # _efficientzerotensor has no memory to read
            return torch.zeros(t.shape, dtype=sd, device=m.place(t.device))
        e = self._entry(p.plan, t)
        p.nonfinite_in = p.nonfinite_in or e.nonfinite
        if e.drift > p.inputs_drift:
            p.inputs_drift = e.drift
        if declared:
            m.note_write(e)
        p.exact = p.exact and e.exact
        p.inputs.append(t)
        p.storages.add(e.sptr)
        return m.view(t, e)

    # --- after the device op ---
    def _finish(self, p: Prepared, args, kwargs, out) -> None:
        plan = p.plan
        try:
            kind, souts = run_chain(p.chain, Replay(plan, p.shadow.args, p.shadow.kwargs, out, p.local, self.scratch))
        except Unsupported as exc:
            self._adopt_all(plan, args, kwargs, out)
            self._record(plan, Kind.UNSUPPORTED, args, kwargs, out, reason=exc.reason, inputs=p.inputs)
            return
        # random or uninitialized: the device's values are adopted (by kind: a replayed in-place op that returns
        # nothing, such as _foreach_add_ or _fused_adam_, also gives None and its shadow writes must be kept).
        # Uninitialized memory (empty) is adopted at its first read, not now: C++ code may fill it without
        # dispatching (at::tensor(list) is empty + std::copy), and its first reader must see what was written.
        if souts is None and kind in (Kind.RANDOM, Kind.ADOPTED):
            if kind is Kind.RANDOM:
                self._adopt_all(plan, args, kwargs, out)
            else:
                for _, t in flat_returns(plan, out):
                    if isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_nested:
                        self.mirror.seen_empty(t)
            self._record(plan, kind, args, kwargs, out, inputs=p.inputs)
            return
        if isinstance(souts, Deferred):  # written asynchronously (collectives): judged once a later op touches them
            p.cpu = None  # the kernel is never run again
            written = [t for _, t in plan.tensors(args, kwargs, plan.writes)] + [t for _, t in flat_returns(plan, out)]
            self._deferred.append(_Pending(p, args, kwargs, out, kind, souts, self.attr.where(
                plan.func, args, kwargs, out, self._index), _storages(written), self.mirror.adopted))
            return
        louts = run_chain(p.chain, Replay(plan, p.local.args, p.local.kwargs, out, scratch=self.scratch))[1] \
            if p.local is not None else None
        if not (p.direct and self._conclude_direct(p, args, kwargs, out, kind, souts, louts)):
            self._conclude(p, args, kwargs, out, kind, souts, louts)

    def _conclude(self, p: Prepared, args, kwargs, out, kind: Kind, souts, louts, at: tuple | None = None) -> None:
        """Judge, commit and record a replayed call on the general path (``at``: where a deferred call was made)."""
        plan = p.plan
        outputs = self._outputs(p, args, kwargs, out, souts, louts)
        regions = defined_regions(plan, args, kwargs, out)
        verdict = self._judge(p, outputs, out, louts if p.local is not None else souts, regions)
        if at is None:
            at = self.attr.where(plan.func, args, kwargs, out, self._index, p.inputs)
        if self.world is not None and kind is not Kind.RANDOM:
            how = self.world(plan.name, *at)
            if how is not None:
                self._rewrite_shadow(how, outputs, verdict.compared)
        for o, c in zip(outputs.items, verdict.compared):
            self._commit(p, o.device, o.written, c)
        cpu = self._cpu_error(p, outputs) if p.cpu is not None and kind is not Kind.RANDOM else None
        result = next((o.device for o in outputs.items if isinstance(o.device, torch.Tensor)), None)
        rec = self._record(plan, kind, args, kwargs, out, verdict=verdict, item=outputs.item, inputs=p.inputs,
                           cpu=cpu, result=result, nonfinite_in=p.nonfinite_in, inputs_drift=p.inputs_drift, at=at)
        if self._observe is not None:
            self._observe(rec, outputs.items, p)

    def _conclude_direct(self, p: Prepared, args, kwargs, out, kind: Kind, souts, louts) -> bool:
        """``_conclude`` for the common case, the direct path: a call of a functional or in-place op (``_direct``)
        whose outputs are all floating strided tensors reproduced in shape by the replay, with no ablation world,
        observer or CPU comparison. The same figures, shadows and record as the general path, without its walk over
        written arguments, numbers and defined regions; False (nothing done) for any other call."""
        if p.cpu is not None or self.world is not None or self._observe is not None:
            return False
        plan = p.plan
        if plan.writes:  # in place on one argument: it is the output
            spec = plan.writes[0]
            devs, shs = (spec.get(args, kwargs),), (p.shadow.get(spec),)
            los = (p.local.get(spec) if p.local is not None else None,)
        elif len(plan.returns) == 1:
            devs, shs, los = (out,), (souts,), (louts,)
        else:
            devs, shs, los = out, souts, louts if louts is not None else (None,) * len(out)
        for d, s in zip(devs, shs):
            if not isinstance(d, torch.Tensor) or not isinstance(s, torch.Tensor) or d.layout != torch.strided \
                    or d.is_nested or s.dtype != SHADOW_DTYPES.get(d.dtype) or s.shape != d.shape or d._is_zerotensor():
                return False
        dtype = devs[0].dtype
        budget = spot = None
        if p.budget:
            budget = self._budget_of(p, los if p.local is not None else shs, dtype)  # the local replay's, if it ran
        if p.spot:
            budget, spot = self._spot_check(p, out, louts if p.local is not None else souts, dtype, budget)
        ulps = None
        if budget is not None:
            budget = self._bounds(p, budget)
            ulps = budget.ulps if budget is not None else None
        home = self.mirror.place.cpu_home  # CPU results beside CPU shadows: nothing to read over (_near)
        compared = []
        for i, (d, s, lo) in enumerate(zip(devs, shs, los)):
            bound = None
            if budget is not None and ulps is None:
                bounds = budget.compared
                bound = bounds[i] if i < len(bounds) else None
            compared.append(self._figures(Compared(keep=s), d if home and d.is_cpu else self._near(d, devs), s, lo,
                                          d.dtype, bound, ulps))
        verdict = self._verdict(p, compared, budget, spot)
        for d, c in zip(devs, compared):
            self._commit(p, d, bool(plan.writes), c)
        self._record(plan, kind, args, kwargs, out, verdict=verdict, inputs=p.inputs, result=devs[0],
                     nonfinite_in=p.nonfinite_in, inputs_drift=p.inputs_drift,
                     at=self.attr.where(plan.func, args, kwargs, out, self._index, p.inputs, _DIRECT_FRAMES))
        return True

    def _rewrite_shadow(self, how: str, outputs: Outputs, compared: list[Compared]) -> None:
        """``shadow.attribute``'s ablation worlds, before the mirror keeps a call's shadows: "device" gives each
        shadow the error the device made on this call (shadow + device - reference: the device's own trajectory
        when the inputs agree), "exact" only the error of rounding the reference to the device dtype (shadow +
        round(reference) - reference: the call made exact, its correctly rounded result where the inputs agree).
        Both errors are the ones measured on the device's inputs, held fixed in the world: a rounding drawn again
        at the world's slightly different values would be noise as large as what is measured. The device's
        tensors are never touched."""
        for o, c in zip(outputs.items, compared):
            d, ref, keep = o.device, o.reference, c.keep
            if not isinstance(d, torch.Tensor) or not isinstance(ref, torch.Tensor) or keep is None or c.mismatch \
                    or not d.is_floating_point() or ref.shape != d.shape or keep.shape != d.shape:
                continue
            # the error first: ref may be keep itself
            y = self.mirror.upcast(d)
            error = y if how == "device" else correctly_rounded(y, ref, d.dtype)
            keep.add_(error.sub_(ref))
            c.exact = False

    def _outputs(self, p: Prepared, args, kwargs, out, souts, louts) -> Outputs:
        """Written arguments (in-place, out=), then fresh returns, then an .item()-like number. Slots follow
        shadow.budgets: the flattened returns (a written argument by the return aliasing it), or the
        written arguments if the op returns nothing."""
        plan = p.plan
        dflat = flat_returns(plan, out)
        has_returns = any(isinstance(t, torch.Tensor) for _, t in dflat)
        # a written argument's slot is the return aliasing it: only ops that write look it up
        ret_slot = {id(t): i for i, (_, t) in enumerate(dflat) if isinstance(t, torch.Tensor)} \
            if plan.writes and has_returns else {}
        items: list[Output] = []
        w = 0
        for spec in plan.writes:
            dev = spec.get(args, kwargs)
            if dev is None:
                continue
            # the local replay ran when local args exist (louts is None too for in-place ops that return nothing)
            sh, lo = p.shadow.get(spec), (p.local.get(spec) if p.local is not None else None)
            if isinstance(dev, torch.Tensor):
                dev, sh, lo = [dev], [sh], [lo]
            elif lo is None:
                lo = [None] * len(dev)
            for d, s, l in zip(dev, sh, lo):
                if isinstance(d, torch.Tensor):
                    items.append(Output(d, s, l, True, ret_slot.get(id(d)) if has_returns else w))
                    w += 1
        item = None
        if plan.fresh_returns:
            sflat = flat_returns(plan, souts)
            lflat = flat_returns(plan, louts) if p.local is not None else [(None, None)] * len(dflat)
            for i, ((spec, d), (_, s), (_, l)) in enumerate(zip(dflat, sflat, lflat)):
                if spec.aliases_write or spec.aliases_read:
                    continue
                if isinstance(d, torch.Tensor):
                    items.append(Output(d, s, l, False, i))
                elif isinstance(d, (int, float, bool)) and isinstance(s, (int, float, bool)):  # .item(), equal
                    item = (d, s)
                    items.append(Output(d, s, l, False, None))
        dtype = None
        for o in items:
            if isinstance(o.device, torch.Tensor) and (o.device.is_floating_point() or o.device.is_complex()):
                dtype = o.device.dtype
                break
        if dtype is None:
            dtype = p.inputs[0].dtype if p.inputs else torch.float64
        return Outputs(items, len(dflat) if has_returns else w, item, dtype)

    # --- judging: the one place that turns outputs into figures ---
    def _judge(self, p: Prepared, outputs: Outputs, out: Any, refs: Any, regions: list | None) -> Verdict:
        """Every output compared with its shadow (drift) and local reference, held to the op's budget
        (``budget_used``: max |error| / bound, or max_ulp / ulps for budgets in ulps), its effective bits, and
        the spot check of the reference, whose untrusted elements are replaced by their exact values first.
        ``regions``: per output slot, the elements the op defines (``shadow.replay.defined``); only those are
        compared."""
        budget = self._budget(p, outputs) if p.budget else None
        spot = None
        if p.spot:
            budget, spot = self._spot_check(p, out, refs, outputs.dtype, budget)
        budget = self._bounds(p, budget)
        compared = []
        for o in outputs.items:
            if isinstance(o.device, torch.Tensor):
                defined = regions[o.slot] if regions is not None and o.slot is not None and o.slot < len(regions) \
                    else None
                compared.append(self._compare(p, o, o.device.dtype, budget, defined, outputs.items))
            else:  # a number (.item(), equal): compared, never kept
                dtype = next((t.dtype for t in p.inputs), torch.float64)
                lo = None if o.local is None else _scalar(o.local, dtype)
                c = self._compare(p, Output(_scalar(o.device, dtype), _scalar(o.shadow, dtype), lo, False, None),
                                  dtype, None)
                c.keep = None
                compared.append(c)
        return self._verdict(p, compared, budget, spot)

    def _verdict(self, p: Prepared, compared: list[Compared], budget: Budget | None, spot: SpotStats | None
                 ) -> Verdict:
        """The call's figures merged over its outputs, its effective bits and its budget's use."""
        if len(compared) == 1:  # most calls: the one output's figures are the call's
            c = compared[0]
            drift, local = c.drift, c.local
            flips, local_flips, mismatch, skipped = c.flips, c.local_flips, c.mismatch, c.skipped
        else:
            drift, local = merged(c.drift for c in compared), merged(c.local for c in compared)
            flips = local_flips = mismatch = skipped = 0
            for c in compared:
                flips, local_flips, mismatch = flips + c.flips, local_flips + c.local_flips, mismatch + c.mismatch
                skipped += c.skipped
        info = None
        if budget is not None and local is not None:
            if local is drift:  # one output's stats serving both figures (merged): only the local error gets bits
                drift = dataclasses.replace(drift)
            if local.norm > 0:
                whole = _whole(compared)
                # a fixed budget's scale is its outputs' (shadow's own code, no rule's: nothing to guard)
                local.effective_bits = budget.bits(local, whole) if p.fixed is not None else \
                    self._guarded(p, None, lambda: budget.bits(local, whole))
            info = BudgetInfo(budget.family, local.budget_used or 0.0, budget.is_default)
        return Verdict(local, drift, flips, local_flips, mismatch, info, spot, compared, skipped)

    def _compare(self, p: Prepared, o: Output, dtype: torch.dtype, budget: Budget | None,
                 defined: torch.Tensor | None = None, others: list[Output] = ()) -> Compared:
        """One output's figures; ``dtype``: the device dtype its error is measured in; ``defined``: the elements
        the op defines (None: all), the only ones compared (the shadow keeps the device's bytes elsewhere);
        ``others``: the call's outputs, read over with this one where their shadows live on another device."""
        dev, sh, lo = o.device, o.shadow, o.local
        sd = self.mirror.shadow_dtype(dev.dtype)
        if not isinstance(sh, torch.Tensor) or dev._is_zerotensor():
            return Compared()
        if dev.layout != torch.strided:  # a sparse result (to_sparse): no strided storage to mirror
            raise Unsupported(p.plan.name, f"{dev.layout} result: shadow mirrors strided tensors only")
        if dev.is_nested:
            raise Unsupported(p.plan.name, _NESTED.format("result"))
        if sh.shape != dev.shape:  # a data-dependent shape the shadow did not reproduce: the device's adopted
            return Compared(mismatch=1, exact=True, keep=self.mirror.upcast(dev) if sd is not None else None)
        if SHADOW_DTYPES.get(dev.dtype) is None:  # discrete result
            flips = count_flips(dev, sh)
            lflips = count_flips(dev, lo) if isinstance(lo, torch.Tensor) and lo.shape == dev.shape else 0
            # follow="reference": the shadow keeps its own discrete result
            return Compared(flips=flips, local_flips=lflips, exact=flips == 0, keep=sh.to(sd) if sd is not None else None)
        if sh.dtype != sd:
            sh = sh.to(sd)
        has_local = isinstance(lo, torch.Tensor)
        bound = None  # budgets in ulps need no tensor: budget_used = max_ulp / ulps
        if budget is not None and o.slot is not None and budget.ulps is None:
            bounds = budget.compared  # tensors, or formulas the comparison forms where it reads the reference
            bound = bounds[o.slot] if o.slot < len(bounds) else None
        dev = self._near(dev, (x.device for x in others))
        keep, skipped = sh, 0
        if defined is not None and defined.shape == dev.shape and not bool(defined.all()):
            defined = defined.to(sh.device)
            keep = torch.where(defined, sh, self.mirror.upcast(dev))
            skipped = int((~defined).sum())
            if bound is not None and not isinstance(bound, torch.Tensor):  # a formula: its tensor, to index
                bound = budget.bound[o.slot]
            dev, sh = dev.detach().to(sh.device)[defined], sh[defined]
            lo = lo[defined] if has_local and lo.shape == defined.shape else lo
            bound = torch.broadcast_to(bound, defined.shape)[defined] if isinstance(bound, torch.Tensor) else bound
        return self._figures(Compared(keep=keep, skipped=skipped), dev, sh, lo, dtype, bound,
                             budget.ulps if budget is not None and o.slot is not None else None)

    def _near(self, d: torch.Tensor, batch: Any) -> torch.Tensor:
        """``d``, or where its shadow lives on another device, its values read over with the call's other outputs in
        ``batch`` (``shadow.transfer``): kept for the next op that reads them, when that op's local replay will."""
        if (d.is_cpu and self.mirror.place.cpu_home) or not self.copies.crosses(d):
            return d
        return self.copies.read(d, batch, keep=self.opt.local)

    def _figures(self, c: Compared, dev: torch.Tensor, sh: torch.Tensor, lo: Any, dtype: torch.dtype, bound: Any,
                 ulps: float | None) -> Compared:
        """``c`` with the figures of a device result against its shadow (drift) and its local reference ``lo``
        (None: the shadow serves), where every element compared is defined; ``bound``: the budget's bound (a
        tensor or formula) or ``ulps``: a budget in ulps."""
        has_local = isinstance(lo, torch.Tensor)
        # with every input exact (no local replay), the shadow comparison is the local error too
        shared = self.opt.local and not has_local
        if has_local and self.opt.drift and lo.shape == dev.shape:  # both figures, from one read where it can
            st, c.local = compare_pair(dev, sh, lo, dtype, bound)
        else:
            st = compare(dev, sh, dtype, bound if shared else None) if self.opt.drift or shared else None
            if self.opt.local:
                c.local = (compare(dev, lo, dtype, bound) if lo.shape == dev.shape else ErrorStats()) if has_local \
                    else st
        c.exact = st is not None and st.exact
        if self.opt.local and ulps is not None:
            c.local.budget_used = c.local.max_ulp / ulps if ulps > 0 else (_INF if c.local.max_abs else 0.0)
        if self.opt.drift:
            c.drift = dataclasses.replace(st, budget_used=None) if shared and st.budget_used is not None else st
        stats = st if st is not None else c.local
        c.nonfinite = stats is not None and stats.device_nonfinite > 0
        return c

    def _budget(self, p: Prepared, outputs: Outputs) -> Budget | None:
        """The op's error budget from its inputs before the op and the float64 results the local error is
        measured against; None (no budget) where there is nothing to bound or no float results."""
        slots: list = [None] * outputs.slots  # None where an output is absent
        found = False
        for o in outputs.items:
            if o.slot is not None and isinstance(o.device, torch.Tensor):
                if o.slot >= len(slots):
                    slots += [None] * (o.slot + 1 - len(slots))
                slots[o.slot] = o.reference
                found = True
        return self._budget_of(p, slots, outputs.dtype) if found else None

    def _budget_of(self, p: Prepared, references: list, dtype: torch.dtype) -> Budget | None:
        """The budget of the references by output slot (None where an output is absent) in the device ``dtype``;
        None when its rule failed."""
        if p.fixed is not None:  # no argument read, no rule's code run: nothing to guard
            return p.fixed.budget(references, dtype)
        return self._guarded(p, None, lambda: budget_for(p.plan.func, p.pre.args, p.pre.kwargs, references, dtype,
                                                         scratch=self.scratch))

    def _bounds(self, p: Prepared, budget: Budget | None) -> Budget | None:
        """``budget`` once the bounds the comparisons read are built (bounds are built lazily: None when the rule
        fails there, which costs the call its budget only); budgets in ulps need no bounds."""
        if budget is not None and budget.ulps is None:
            return self._guarded(p, budget, lambda: budget.compared)
        return budget

    def _guarded(self, p: Prepared, value: Any, build: Callable[[], Any]) -> Any:
        """``value`` once ``build()`` succeeded (``build()``'s result when value is None); None when a budget
        rule failed in it: its bug must not cost the op its error figures (counted, visible in the coverage)."""
        try:
            built = build()
        except Exception as exc:
            self.report.internal_error(f"budget of {p.plan.name}", f"internal error: {type(exc).__name__}: {exc}"[:240])
            return None
        return built if value is None else value

    def _spot_check(self, p: Prepared, out: Any, refs: Any, dtype: torch.dtype, budget: Budget | None
                    ) -> tuple[Budget | None, SpotStats | None]:
        """The call's spot check, before its comparisons: (``budget``, its ``SpotStats``), or (``budget``, None)
        where the check failed (a bug of shadow's costs the op its spot check, not its figures), and None for the
        budget where building the bound of a sum failed."""
        if budget is not None and budget.of_sum:  # its bound ranks the samples: built from the reference as it was
            budget = self._guarded(p, budget, lambda: budget.bound)
        try:
            return budget, self._check(p, out, refs, dtype, budget)
        except Exception as exc:
            self.report.internal_error(f"spot check of {p.plan.name}",
                                       f"internal error: {type(exc).__name__}: {exc}"[:240])
            return budget, None

    def _check(self, p: Prepared, out: Any, refs: Any, dtype: torch.dtype, budget: Budget | None) -> SpotStats:
        """mpmath check of sampled elements of the float64 reference the local error is measured against;
        untrusted elements of that reference are overwritten with their exact values. With the budget of a
        sum (``Budget.of_sum``), bound / |reference| is the condition estimate that picks the first samples
        (where the reference cancels); elementwise ops round once from exact inputs and are sampled at random."""
        plan = p.plan
        dev = [t if isinstance(t, torch.Tensor) else None for _, t in flat_returns(plan, out)]
        ref = [t if isinstance(t, torch.Tensor) else None for _, t in flat_returns(plan, refs)]
        priority = None
        if budget is not None and budget.of_sum:
            priority = [_Condition.of(b, r, self.scratch) for b, r in zip(budget.bound, ref)]
        stats, samples = self.spot.check(plan.func, p.pre.args, p.pre.kwargs, dev, ref, dtype, priority)
        for s in samples:
            if not s.trusted and ref[s.output] is not None:
                ref[s.output][s.index] = s.exact  # the exact value, rounded once to float64
        return stats

    def _cpu_error(self, p: Prepared, outputs: Outputs) -> ErrorStats | None:
        """compare_cpu: the op's CPU kernel in the device dtype, on the device's inputs, against the same
        float64 reference as the local error (the verdict msprobe and dynamo's same(fp64_ref) use).
        Random ops never get here: the CPU kernel would draw from the CPU generator."""
        plan, a = p.plan, p.cpu
        try:
            out = plan.func(*a.args, **a.kwargs)
        except Exception:  # no CPU kernel for this dtype (a device-only kernel): no comparison
            return None
        flat = [t for _, t in flat_returns(plan, out)]
        if not any(isinstance(t, torch.Tensor) for t in flat):  # in-place ops that return nothing
            flat = [t for _, t in plan.tensors(a.args, a.kwargs, plan.writes)]
        stats = []
        for o in outputs.items:
            d = o.device
            if o.slot is None or o.slot >= len(flat) or not isinstance(d, torch.Tensor) \
                    or SHADOW_DTYPES.get(d.dtype) is None:
                continue
            ref, c = o.reference, flat[o.slot]
            if isinstance(c, torch.Tensor) and isinstance(ref, torch.Tensor) and c.shape == ref.shape:
                stats.append(compare(c, ref, d.dtype))
        return merged(stats)

    # --- committing: the shadows the mirror keeps ---
    def _commit(self, p: Prepared, dev: Any, written: bool, c: Compared) -> None:
        """Keep the shadow of one output ``dev``: a ``written`` argument's (in-place, out=) or a fresh return's."""
        if c.keep is None:
            return
        m = self.mirror
        if c.mismatch:  # the device's value, adopted
            m.assign(dev, c.keep, exact=True, fresh=True, nonfinite=any_nonfinite(dev))
            return
        drift = c.drift.rel_norm if c.drift is not None and not c.exact else 0.0
        if written:
            m.commit_write(dev, c.keep, c.exact, c.nonfinite, drift)
        else:
            e = m.assign(dev, c.keep, c.exact, fresh=c.keep.untyped_storage()._cdata not in p.storages,
                         nonfinite=c.nonfinite, drift=drift)
            if SHADOW_DTYPES.get(dev.dtype) is not None:
                m.track(dev, e)

    # --- adoption and recording ---
    def _adopt_all(self, plan: OpPlan, args, kwargs, out) -> None:
        """Make the device's values the shadow of every output and written argument."""
        self._adopt([t for _, t in plan.tensors(args, kwargs, plan.writes)] + [t for _, t in flat_returns(plan, out)])

    def _adopt(self, tensors) -> None:
        m = self.mirror
        for t in tensors:
            if isinstance(t, torch.Tensor) and not t._is_zerotensor() and m.shadow_dtype(t.dtype) is not None \
                    and t.layout == torch.strided and not t.is_nested:  # sparse and nested results: not mirrored
                m.assign(t, m.upcast(t), exact=True, fresh=True, nonfinite=any_nonfinite(t))

    def adopt(self, tensors: list[torch.Tensor]) -> None:
        """Make the device's values the shadow of ``tensors`` (results computed where shadow could not see)."""
        with _no_dispatch():
            if self.copies:  # their values read over before are out of date
                self.copies.drop((None, t) for t in tensors if isinstance(t, torch.Tensor))
            self._adopt(tensors)

    def _internal_error(self, plan: OpPlan, args, kwargs, out, exc: Exception) -> None:
        if isinstance(exc, Unsupported):  # a limit of shadow found while preparing (sparse layouts), not a bug
            self._adopt_all(plan, args, kwargs, out)
            self._record(plan, Kind.UNSUPPORTED, args, kwargs, out, reason=exc.reason)
            return
        reason = f"internal error: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        self.report.internal_error(plan.name, reason)
        try:
            self._adopt_all(plan, args, kwargs, out)
        except Exception:  # adoption failed too: the next read re-adopts from the device
            pass
        self._record(plan, Kind.UNSUPPORTED, args, kwargs, out, reason=reason)

    def _record(self, plan: OpPlan, kind: Kind, args, kwargs, out, *, verdict: Verdict | None = None, item=None,
                reason: str = "", inputs=(), cpu: ErrorStats | None = None, result: Any = False,
                nonfinite_in: bool = False, inputs_drift: float = 0.0, at: tuple | None = None) -> Record:
        """``result``: the call's first tensor result, when the caller knows it (False: look it up); ``at``:
        (module, phase, call site) when the caller asked for them already."""
        module, phase, site = at if at is not None else self.attr.where(plan.func, args, kwargs, out, self._index)
        fallback = bool(inputs) and not inputs[0].is_cpu and inputs[0].device.type == "privateuseone" \
            and cpu_fallback(plan.func, inputs[0].device)
        if result is False:
            result = _first_tensor(plan, args, kwargs, out)
        dtype, shape = ("", ()) if result is None else \
            (_dtype_name(result.dtype), () if result.is_nested else tuple(result.shape))  # nested: no one shape
        if verdict is None:
            rec = Record(self._index, plan.name, module, phase, kind, reason=reason, item=item, cpu_fallback=fallback,
                         cpu=cpu, dtype=dtype, shape=shape, callsite=site)
        else:
            v = verdict
            rec = Record(self._index, plan.name, module, phase, kind, v.local, v.drift, v.flips, v.local_flips,
                         v.mismatch, item, reason, v.spot, v.budget, fallback, cpu, dtype, shape, nonfinite_in,
                         v.skipped, site, inputs_drift)
        self._index += 1
        self.report.add(rec)
        if self.trajectory is not None:
            self.trajectory.seen(rec, result)
        return rec

    def settle(self, tensors=None, spare: tuple = ()) -> None:
        """Judge the deferred calls whose outputs share a storage with ``tensors`` (every one when None), but
        those in ``spare``."""
        with _no_dispatch():
            touched = None if tensors is None else _storages(tensors)
            due = [d for d in self._deferred if (touched is None or not touched.isdisjoint(d.storages))
                   and all(d is not s for s in spare)]
            if not due:
                return
            self._deferred = [d for d in self._deferred if all(d is not x for x in due)]
            for d in due:
                p, r = d.prepared, d.result
                try:
                    self.report.meta.update(r.meta)
                    p.local = Args(*r.local)
                    outs = [t for _, t in p.plan.tensors(d.args, d.kwargs)]
                    outs += [t for _, t in flat_returns(p.plan, d.out)]
                    for t in outs:  # the backend wrote them since the call, outside any op (gloo on torch 2.4)
                        if isinstance(t, torch.Tensor) and t.layout == torch.strided and not t._is_zerotensor():
                            self.mirror.absorb(t)
                    self._conclude(p, d.args, d.kwargs, d.out, d.kind, r.shadow, r.local_out, d.at)
                except Exception as exc:
                    self._internal_error(p.plan, d.args, d.kwargs, d.out, exc)

    def _completing(self, plan: OpPlan, args) -> tuple:
        """The deferred calls this op completes rather than reads: a backend finishing a collective at ``wait()``
        copies its result into the output from a temporary of its own, in the caller's thread (gloo's
        reduce_scatter_tensor: ``aten.copy_`` from a split of a storage first seen after the call). The copy is
        part of those calls: not replayed (their shadows already hold the float64 result), judged with them at
        the next op that touches their outputs."""
        if plan.func is not _COPY:
            return ()
        dst, src = args[0], args[1]
        e = self.mirror.known(src) if isinstance(src, torch.Tensor) and src.layout == torch.strided else None
        if not isinstance(dst, torch.Tensor) or not isinstance(src, torch.Tensor) or (e is not None and not e.adopted):
            return ()
        into = _storages([dst])
        return tuple(d for d in self._deferred if not into.isdisjoint(d.storages)
                     and (e is None or e.adopted > d.adopted))

    # --- queries ---
    def shadow_of(self, t: torch.Tensor) -> torch.Tensor:
        """A CPU copy of t's shadow, wherever the shadows live (shadow_device=)."""
        v = self.shadow_view(t)
        with _no_dispatch():
            return v.to(CPU, copy=True)

    def shadow_view(self, t: torch.Tensor) -> torch.Tensor:
        """t's shadow as the mirror holds it (a view into its storage's shadow, where the shadows live): to read
        only, with dispatch disabled, before the next op."""
        if self._deferred:
            self.settle([t])
        with _no_dispatch():
            if self.mirror.shadow_dtype(t.dtype) is None:
                raise TypeError(f"shadow_of: {t.dtype} tensors are not shadowed (only floating and complex ones "
                                "are; discrete ones too with follow='reference')")
            if t._is_zerotensor():
                return torch.zeros(t.shape, dtype=self.mirror.shadow_dtype(t.dtype))
            v = self.mirror.lookup(t)
            if v is None:
                raise KeyError("shadow_of: this tensor's storage was never seen by this ShadowMode "
                               "(create or use it inside the `with ShadowMode()` block)")
            return v


@dataclasses.dataclass(slots=True)
class _Pending:
    """A call whose replay returned ``Deferred``, waiting for a later op to touch its outputs."""

    prepared: Prepared
    args: Any
    kwargs: dict
    out: Any
    kind: Kind
    result: Deferred
    at: tuple  # (module, phase, call site) where it was called
    storages: set[int]
    adopted: int  # Mirror.adopted at the call: storages adopted later are not the user's (``_completing``)


def _direct(plan: OpPlan, chain: tuple) -> bool:
    """Whether an op's calls may take the direct path (``Engine._conclude_direct``), decided once per overload: it
    reads single tensors (no lists), is replayed rather than viewed, defines every element of its outputs, and
    either writes no argument and returns fresh tensors only (no views, lists or numbers), or writes one argument in
    place, declared (its version moves), and returns it (``mul_``, ``addcdiv_``: not out= ops)."""
    if not plan.returns or chain[0] is view_rule or DEFINED.chain(plan.func) \
            or any(a.type is not ArgType.TENSOR for a in plan.tensor_args) or any(r.tensors for r in plan.returns):
        return False
    if plan.writes:
        return len(plan.writes) == 1 and not plan.out_args and plan.declared_writes == {plan.writes[0].index} \
            and len(plan.returns) == 1 and plan.returns[0].aliases_write
    return all(r.is_tensor and not r.aliases_read and not r.aliases_write for r in plan.returns)


def _storages(tensors) -> set[int]:
    """The data pointers of the strided tensors' storages."""
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor)
            and t.layout == torch.strided and not t.is_nested and t.device.type != "meta" and not t._is_zerotensor()}


def _remap_args(plan: OpPlan, place: Placement, a: Args) -> None:
    """dtype and device arguments rewritten for the float64 replay on the shadow device (in place in these
    copies): a device names where the device op puts its result, so the replay puts the shadow where that
    device's shadows live (``place``)."""
    for spec in plan.remap_args:
        v = spec.get(a.args, a.kwargs)
        new = _remap(plan, spec.name, v, place)
        if new is not v:
            spec.put(a.args, a.kwargs, new)


def _remap(plan: OpPlan, name: str, v: Any, place: Placement) -> Any:
    if isinstance(v, torch.dtype):
        return SHADOW_DTYPES.get(v) or v
    if isinstance(v, torch.device):
        return place(v)
    # a factory op's default device is the CPU: its shadow goes to the device chosen for every shadow
    if v is None and name == "device" and not plan.tensor_args and place.fixed is not None \
            and place.fixed.type != "cpu":
        return place.fixed
    if name in ("pin_memory", "half_to_float") and v:
        return False
    return v


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    """str(dtype) ("torch.bfloat16"), cached: it is asked once per call."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name


def _first_tensor(plan: OpPlan, args, kwargs, out) -> torch.Tensor | None:
    """The call's result: its first returned tensor, else its first written argument (in-place foreach)."""
    for _, t in flat_returns(plan, out):
        if isinstance(t, torch.Tensor):
            return t
    return next((t for _, t in plan.tensors(args, kwargs, plan.writes)), None)


def _whole(compared: list[Compared]) -> bool:
    """Whether a call's local figures are its one output's, over every element, all finite (``Budget.bits``)."""
    if len(compared) != 1:
        return False
    c = compared[0]
    st = c.local
    return st is not None and not c.skipped and not st.nonfinite and not st.nonfinite_agreed and \
        0.0 < st.rel_norm < _INF


class _Condition:
    """bound / |r| elementwise (a budget's error bound relative to the result: large where r cancels), the
    spot checks' priority (``shadow.spot.sampling.Ranked``), computed when asked: its largest element alone
    in one pass where ``shadow._fused.largest_ratio`` reads the tensors."""

    __slots__ = ("bound", "r", "scratch")

    def __init__(self, bound: torch.Tensor, r: torch.Tensor, scratch: Scratch):
        self.bound, self.r, self.scratch = bound, r, scratch

    @staticmethod
    def of(bound: Any, r: Any, scratch: Scratch) -> _Condition | None:
        """The condition estimate of a real floating result and its bound tensor, else None."""
        if not isinstance(bound, torch.Tensor) or not isinstance(r, torch.Tensor) or r.is_complex() \
                or not r.is_floating_point():
            return None
        return _Condition(bound, r, scratch)

    def numel(self) -> int:
        return self.r.numel()

    def top(self, n: int) -> list[int]:
        i = _fused.largest_ratio(self.bound, self.r) if n == 1 and _fused is not None else None
        if i is not None:
            return [] if i < 0 else [i]
        return top_positions(self.tensor(), n)

    def tensor(self) -> torch.Tensor:
        b, r = self.bound, self.r
        a = torch.abs(r, out=self.scratch.empty_like(r, r.dtype))
        return torch.div(b, a, out=a) if b.shape == r.shape else torch.broadcast_to(b, r.shape) / a


def _scalar(v: Any, dtype: torch.dtype) -> torch.Tensor:
    """A Python number returned by an op (.item(), equal) as a 0-d tensor: float64 for floats."""
    if isinstance(v, float) or dtype.is_floating_point and not isinstance(v, bool):
        return torch.tensor(float(v), dtype=torch.float64)
    return torch.tensor(v)
