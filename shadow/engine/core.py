"""The Engine: what one ShadowMode holds across op calls (the mirror, the working memory, the deferred calls, the
hooks), and ``dispatch``, which takes one call through the steps of ``shadow.engine``."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

from ..attribution.tracking import Attribution
from ..budgets import InUlps, builds_early, fixed_budget
from ..compiled.kernels import judge as judge_kernel
from ..errors import ShadowMemoryError
from ..mirror import CPU, Mirror, Placement
from ..options import Options
from ..plan import OpPlan, plan_of
from ..records import KERNELS_KEY, Kind
from ..replay import REPLAY, view_rule
from ..reportdata import ReportData
from ..scratch import Scratch
from ..spot import SpotPolicy
from ..transfer import HostCopies
from .commit import adopt, resync_written
from .conclude import finish, internal_error
from .deferred import Deferrals
from .hooks import EngineHooks
from .keep import keeper_of
from .outputs import takes_direct_path
from .pieces import takes_pieces
from .prepare import NoValues, entry_of, prepare, see
from .record import record
from .values import Prepared

# bytes of device values read over that may be kept however few the shadows' (shadow.transfer)
_COPIES_FLOOR = 8 << 20
# Shadow's own work must reach no dispatch mode (none below sees it, the engine records none of its ops). It
# records no autograd graph either: every tensor it makes is a detached copy (mirror.upcast; copying a lazy
# module's uninitialized parameter with autograd on created its gradient accumulator with the wrong shape).
_no_dispatch = torch._C._DisableTorchDispatch


class Route(NamedTuple):
    """What the engine knows of an op before its first call, read once per overload."""

    plan: OpPlan
    chain: tuple  # the replay rules (``shadow.replay.REPLAY``)
    view: bool  # an alias or a metadata change: nothing to compute, nothing to compare
    direct: bool  # its outputs are read by the direct builder (``shadow.engine.outputs.takes_direct_path``)
    fixed: InUlps | None  # its budget where it reads no argument (``shadow.budgets.fixed_budget``)
    early: bool  # its budget may be built before the replays overwrite its inputs (``shadow.budgets.builds_early``)
    pieces: bool  # its large calls may be judged in pieces (``shadow.engine.pieces.takes_pieces``)


class Skip(enum.Enum):
    """Why a call takes no replay (``Engine.dispatch``)."""

    OUTSIDE = "outside the scope"  # runs untouched; a storage it writes takes the device's values again
    VIEW = "a view"  # its input storages get their shadows
    COMPLETING = "completes a deferred call"  # judged with that call
    META = "on meta tensors"  # recorded, no values


class Engine:
    """The per-op path behind ShadowMode (docs/architecture.md): ``dispatch`` prepares a call, lets the device run
    it, and concludes it (``shadow.engine.conclude``). Its ground rules: the device's computation is never
    changed (shadow only reads device tensors and works on its own copies with Python dispatch disabled, so no mode
    below sees it); no op it cannot replay and no error of its own ever reaches the user's program; every op is seen
    and recorded."""

    def __init__(self, options: Options, report: ReportData, attribution: Attribution,
                 hooks: EngineHooks = EngineHooks()):
        self.options = options
        self.report = report
        self.attribution = attribution
        self.hooks = hooks
        # where shadows live: resolved per device, once (ShadowMode(shadow_device=...); docs/architecture.md)
        self.mirror = Mirror(options.follow == "reference",
                             Placement(options.shadow_device, options.max_shadow_bytes or 0))
        if hooks.observe is not None:  # observers compute on CPU tensors of their own
            self.mirror.place.on_cpu_unless_chosen()
        self.spot = SpotPolicy(options.spot_checks)
        self.spotting = self.spot.config.mode != "off"  # whether any call may be spot-checked
        self.scratch = Scratch()  # reused memory for an op call's large temporaries (shadow.scratch)
        # device values read over to where their shadows live, one crossing per storage version (shadow.transfer),
        # kept within 1/32 of the shadows' bytes (at least 8 MiB)
        self.copies = HostCopies(lambda d: self.mirror.place(d), lambda: max(_COPIES_FLOOR, self.mirror.held / 32))
        self.deferred = Deferrals(self)
        self.keeper = keeper_of(options, report.meta)  # the inputs of the worst calls over budget (shadow repro)
        self.index = 0  # the next record's
        # id(op) -> its Route, or None (passed through): an id hashes in C where an OpOverload's hash is a Python
        # method; _ops holds every op seen, so that its id stays its own
        self._routes: dict[int, Route | None] = {}
        self._ops: list = []

    # --- one op call, from the dispatch mode ---
    def dispatch(self, func, args: tuple, kwargs: dict) -> Any:
        route = self._routes.get(id(func), False)
        if route is False:
            route = self._routes[id(func)] = self._route(func)
            self._ops.append(func)
        if route is None:  # no tensor in or out (profiler markers...), or a schema shadow cannot read
            self.report.passed_through()
            return func(*args, **kwargs)
        before = self._before(route, args, kwargs)
        out = func(*args, **kwargs)  # the op itself: what it raises reaches the user as torch raises it (shadow.cli)
        with _no_dispatch():
            self._after(before, route.plan, args, kwargs, out)
        return out

    def graph_call(self, graph: Any, args: tuple) -> Any:
        """A compiled graph's call (``shadow.compiled.Graph``), dispatched as one op whose plan, replay chain and
        budget rule the graph gives (``graph.plan``, ``graph.chain``, ``graph.budget``): the record's op is the
        graph's name, its figures the compiled code's outputs against the float64 replay of its aten graph."""
        if id(graph) not in self._routes:
            self._routes[id(graph)] = Route(graph.plan, graph.chain, view=False, direct=False, fixed=graph.budget,
                                            early=False, pieces=False)
            self._ops.append(graph)
        n = len(self.report.records)
        out = self.dispatch(graph, args, {})
        if graph.calls:  # its fused kernels, each judged alone where Inductor showed them (shadow.compiled.kernels)
            try:
                record = self.report.records[n] if len(self.report.records) > n else None
                if record is not None and record.op == graph.name:
                    kernels = self.report.meta.setdefault(KERNELS_KEY, [])
                    kernels += [judge_kernel(call, graph.source, record).to_dict() for call in graph.calls]
            except Exception as exc:  # never raise into the user's program
                self.report.internal_error(graph.name, f"internal error judging its kernels: {exc}")
            graph.calls = []
        return out

    def _route(self, func) -> Route | None:
        try:
            plan = plan_of(func)
            if not plan.tensor_args and not any(r.is_tensor for r in plan.returns):
                return None
            chain = REPLAY.chain(func)
            early = not plan.returns and builds_early(func)
            return Route(plan, chain, chain[0] is view_rule, takes_direct_path(plan, chain), fixed_budget(func),
                         early, takes_pieces(plan, early))
        except Exception as exc:  # never raise into the user's program
            self.report.internal_error(str(func), f"internal error reading the schema: {exc}")
            return None

    def _before(self, route: Route, args: tuple, kwargs: dict) -> Prepared | Skip | Exception:
        """What a call needs before the device runs it: its ``Prepared``, or why it takes no replay, or the error
        that cost it its preparation (recorded after the device op; only ``ShadowMemoryError``, the limit the user
        asked for, is raised, before the op runs)."""
        plan = route.plan
        if self.deferred.pending and self.deferred.before(plan, args, kwargs):
            return Skip.COMPLETING
        if self.hooks.shadows is not None and not self.hooks.shadows(plan, args, kwargs):
            return Skip.OUTSIDE
        if route.view:
            return Skip.VIEW
        try:
            with _no_dispatch():
                return prepare(self, route, args, kwargs)
        except NoValues:
            return Skip.META
        except ShadowMemoryError:
            raise
        except Exception as exc:  # never raise into the user's program
            return exc

    def _after(self, before: Prepared | Skip | Exception, plan: OpPlan, args: tuple, kwargs: dict, out: Any) -> None:
        """Everything after the device op (dispatch disabled)."""
        try:
            if type(before) is Prepared:
                finish(self, before, args, kwargs, out)
            elif before is Skip.VIEW:
                see(self, plan, args, kwargs)
                record(self, plan, Kind.VIEW, args, kwargs, out)
            elif before is Skip.OUTSIDE:
                resync_written(self, plan, args, kwargs)
            elif before is Skip.COMPLETING:  # the backend wrote a deferred call's output: a write shadow saw
                self.mirror.note_write(entry_of(self, plan, args[0]))
            elif before is Skip.META:
                record(self, plan, Kind.META, args, kwargs, out)
            else:  # preparing failed
                raise before
        except Exception as exc:  # never raise into the user's program
            internal_error(self, plan, args, kwargs, out, exc)

    # --- between calls ---
    def settle(self) -> None:
        """Judge every deferred call now (the mode exits)."""
        self.deferred.settle()

    def adopt(self, tensors: list[torch.Tensor]) -> None:
        """Make the device's values the shadow of ``tensors`` (results computed where shadow could not see)."""
        with _no_dispatch():
            if self.copies:  # their values read over before are out of date
                self.copies.drop((None, t) for t in tensors if isinstance(t, torch.Tensor))
            adopt(self, tensors)

    def trim_scratch(self) -> None:
        """The pool's idle storages within what ``max_shadow_bytes`` leaves beside the shadows (and its peak)."""
        cap = self.options.max_shadow_bytes
        if cap is not None:  # without one the limit stays what the pool starts with: none
            self.scratch.set_limit(cap - self.mirror.held)

    # --- queries ---
    def near(self, t: torch.Tensor, batch: Iterable[Any] = ()) -> torch.Tensor:
        """t's values where its shadow lives, to read only: t itself, or where its shadow lives on another device,
        its copy read over once per storage version, with the tensors of ``batch`` that have none
        (``shadow.transfer``). Kept for the reads after: the spot check's and the comparisons' of a result, the
        next op's local replay, the trajectory's. A nested tensor is never read over: t itself."""
        if t.is_nested or (t.is_cpu and self.mirror.place.cpu_home) or not self.copies.crosses(t):
            return t
        return self.copies.read(t, batch)

    def shadow_of(self, t: torch.Tensor) -> torch.Tensor:
        """A CPU copy of t's shadow, wherever the shadows live (shadow_device=)."""
        v = self.shadow_view(t)
        with _no_dispatch():
            if v.is_nested and not v.is_contiguous():  # torch copies only contiguous nested tensors
                v = v.contiguous()
            return v.to(CPU, copy=True)

    def shadow_view(self, t: torch.Tensor) -> torch.Tensor:
        """t's shadow as the mirror holds it (a view into its storage's shadow, where the shadows live): to read
        only, with dispatch disabled, before the next op."""
        if self.deferred.pending:
            self.deferred.settle([t])
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
