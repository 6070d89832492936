"""The per-op engine behind ShadowMode: prepare shadow arguments, let the device run, replay, compare.

Ground rules (README): the device's computation is never changed (shadow only reads device tensors and
works on its own copies with Python dispatch disabled, so no mode below sees it); no op it cannot replay
and no error of its own ever reaches the user's program; every op is seen and recorded.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from .attribution import Attribution
from .budgets import Budget, budget_for, reads_overwritten
from .devices import cpu_fallback
from .metrics import ErrorStats, compare, count_flips
from .mirror import Mirror, shadow_dtype_of
from .options import Options
from .replay import Kind, Replay, Unsupported, rule_chain, run_chain, view_rule
from .report import BudgetInfo, Event, Record, Report, merged
from .plan import ArgKind, OpPlan, flat_returns, plan_of
from .spot import SpotPolicy

_INF = math.inf
_no_dispatch = torch._C._DisableTorchDispatch  # shadow's own work must not reach any dispatch mode


class _NoValues(Exception):
    """The call runs on meta tensors: shapes only, no values to shadow."""


class _Call:
    """What ``prepare`` built before the device op ran."""

    __slots__ = ("plan", "chain", "sargs", "skw", "largs", "lkw", "exact", "inputs", "storages", "pre", "spot",
                 "cpu")

    def __init__(self, plan: OpPlan, chain: tuple):
        self.plan = plan
        self.chain = chain
        self.sargs: list = []
        self.skw: dict = {}
        self.largs: list | None = None  # the device's own inputs, upcast (None: not needed)
        self.lkw: dict | None = None
        self.exact = True  # every shadow input equals the device's: local error = drift
        self.inputs: list[torch.Tensor] = []  # device tensors read (for optimizer naming)
        self.storages: set[int] = set()  # shadow storages of the inputs (an output aliasing one is copied)
        self.pre: tuple[list, dict] | None = None  # the reference's inputs before the op (budgets, spot checks)
        self.spot = False  # this call is spot-checked
        self.cpu: tuple[list, dict] | None = None  # compare_cpu: the device's inputs on the CPU, own dtypes


class Engine:
    def __init__(self, options: Options, report: Report, attribution: Attribution):
        self.opt = options
        self.report = report
        self.attr = attribution
        self.mirror = Mirror(follow_reference=options.follow == "reference")
        self.spot = SpotPolicy.from_option(options.spot_checks)
        self._plans: dict[Any, tuple[OpPlan, tuple]] = {}
        self._index = 0

    # --- entry point, called by the dispatch mode ---
    def dispatch(self, func, args: tuple, kwargs: dict) -> Any:
        entry = self._plans.get(func)
        if entry is None:
            entry = self._plans[func] = self._plan(func)
        if entry is None:  # no tensor in or out (profiler markers...), or a schema shadow cannot read
            self.report.coverage.passthrough += 1
            return func(*args, **kwargs)
        plan, chain = entry
        if chain[0] is view_rule:  # aliases and metadata: nothing to compute, nothing to compare
            out = func(*args, **kwargs)
            try:
                with _no_dispatch():
                    self._see(plan, args, kwargs)
            except Exception as exc:
                with _no_dispatch():  # adopting the outputs must not dispatch (and record) ops of its own
                    self._internal_error(plan, args, kwargs, out, exc)
                return out
            self._record(plan, Kind.VIEW, args, kwargs)
            return out
        call = error = None
        try:
            with _no_dispatch():
                call = self._prepare(plan, chain, args, kwargs)
        except _NoValues:
            out = func(*args, **kwargs)
            self._record(plan, Kind.META, args, kwargs)
            return out
        except Exception as exc:  # never raise into the user's program
            error = exc
        out = func(*args, **kwargs)
        with _no_dispatch():
            try:
                if error is not None:
                    raise error
                self._finish(call, args, kwargs, out)
            except Exception as exc:
                self._internal_error(plan, args, kwargs, out, exc)
        return out

    def _plan(self, func) -> tuple[OpPlan, tuple] | None:
        try:
            plan = plan_of(func)
            if not plan.tensor_args and not any(r.is_tensor for r in plan.returns):
                return None
            return plan, rule_chain(plan)
        except Exception as exc:  # never raise into the user's program
            self.report.coverage.internal_errors += 1
            self.report.coverage.unsupported.setdefault(str(func), f"internal error reading the schema: {exc}")
            return None

    def _see(self, plan: OpPlan, args, kwargs) -> None:
        """A view's input storage gets its shadow now (adopted if new), so the view's shadow exists."""
        m = self.mirror
        for spec in plan.tensor_args:
            t = spec.get(args, kwargs)
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and m.shadow_dtype(t.dtype) is not None \
                    and not t._is_zerotensor() and t.layout == torch.strided:
                m.entry(t)

    # --- before the device op ---
    def _prepare(self, plan: OpPlan, chain: tuple, args: tuple, kwargs: dict) -> _Call:
        call = _Call(plan, chain)
        sargs, skw = list(args), dict(kwargs)
        for spec in plan.tensor_args:
            v = spec.get(args, kwargs)
            if v is None:
                continue
            if spec.kind is ArgKind.TENSOR:
                spec.put(sargs, skw, self._shadow_arg(call, v, spec.write, spec.index in plan.declared_writes))
            else:
                spec.put(
                    sargs,
                    skw,
                    [None if t is None else self._shadow_arg(call, t, spec.write, spec.index in plan.declared_writes)
                     for t in v],
                )
        for spec in plan.remap_args:
            v = spec.get(args, kwargs)
            new = _remap(spec.name, v)
            if new is not v:
                spec.put(sargs, skw, new)
        call.sargs, call.skw = sargs, skw
        if self.opt.local and not call.exact:
            call.largs, call.lkw = self._local_args(plan, args, kwargs, sargs, skw)
        dtype = call.inputs[0].dtype if call.inputs else None
        # float64 devices have no headroom over the float64 reference: nothing to validate
        spot = dtype is not None and dtype != torch.float64 and self.spot.wants(plan.name)
        if spot or (self.opt.budgets and self.opt.local and dtype is not None):
            call.pre = self._pre_inputs(plan, call, spot)
            call.spot = spot
        if self.opt.compare_cpu and self.opt.local and dtype is not None:
            call.cpu = self._cpu_inputs(plan, args, kwargs)
        return call

    def _cpu_inputs(self, plan: OpPlan, args, kwargs) -> tuple[list, dict]:
        """The device's inputs on the CPU in their own dtypes (copies: the CPU kernel may write them)."""
        a, kw = list(args), dict(kwargs)
        for spec in plan.tensor_args:
            v = spec.get(args, kwargs)
            if isinstance(v, torch.Tensor):
                spec.put(a, kw, v.detach().to("cpu", copy=True))
            elif isinstance(v, list):
                spec.put(a, kw, [t.detach().to("cpu", copy=True) if isinstance(t, torch.Tensor) else t for t in v])
        for spec in plan.remap_args:
            if isinstance(spec.get(args, kwargs), torch.device):
                spec.put(a, kw, torch.device("cpu"))
        return a, kw

    def _pre_inputs(self, plan: OpPlan, call: _Call, spot: bool) -> tuple[list, dict]:
        """The reference's inputs as they are before the op: every input that shares memory with a written
        argument is copied (the replays write them; ``x.add_(x, alpha=2)``, ``add(x, y, out=x)``), except
        out= buffers themselves (nothing reads them) and the op's in-place ``self`` when no spot check is
        planned and the op's budget rules do not read it (elementwise ulps rules, the optimizer's
        add/addcmul/addcdiv: ``shadow.budgets.reads_overwritten``)."""
        a, kw = (call.largs, call.lkw) if call.largs is not None else (call.sargs, call.skw)
        a, kw = list(a), dict(kw)
        written: set[int] = set()
        for spec in plan.writes:
            v = spec.get(a, kw)
            for t in (v if isinstance(v, list) else [v]):
                if isinstance(t, torch.Tensor):
                    written.add(t.untyped_storage().data_ptr())
        if not written:
            return a, kw
        skip = plan.out_args if spot or reads_overwritten(plan.func) else plan.write_args

        def copy(t: Any) -> Any:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in written:
                return t.clone()
            return t

        for spec in plan.tensor_args:
            if spec.index in skip:
                continue
            v = spec.get(a, kw)
            if isinstance(v, torch.Tensor):
                spec.put(a, kw, copy(v))
            elif isinstance(v, list):
                spec.put(a, kw, [copy(t) for t in v])
        return a, kw

    def _shadow_arg(self, call: _Call, t: Any, write: bool, declared: bool) -> Any:
        if not isinstance(t, torch.Tensor):  # a Python scalar in a Tensor slot
            return t
        if t.device.type == "meta":
            raise _NoValues
        if t.layout != torch.strided:  # sparse (COO, CSR...) and mkldnn tensors have no strided storage to mirror
            raise Unsupported(call.plan.name, f"{t.layout} argument: shadow mirrors strided tensors only")
        sd = self.mirror.shadow_dtype(t.dtype)
        if sd is None:  # discrete, following the device: its values, never written back
            c = t.to("cpu")
            return c.clone() if write and c is t else c
        if t._is_zerotensor():  # _efficientzerotensor has no memory to read
            return torch.zeros(t.shape, dtype=sd)
        m = self.mirror
        e = m.entry(t)
        if m.unobserved_write(t, e):
            m.resync(t)
            e = m.entry(t)
            self.report.coverage.unobserved_writes += 1
            self.report.events.append(
                Event(self._index, call.plan.name, "unobserved_write",
                      f"{tuple(t.shape)} {t.dtype} on {t.device}: version moved without an op shadow saw; resynced")
            )
        if declared:
            m.note_write(e)
        call.exact = call.exact and e.exact
        call.inputs.append(t)
        call.storages.add(e.sptr)
        return m.view(t, e)

    def _local_args(self, plan: OpPlan, args, kwargs, sargs, skw) -> tuple[list, dict]:
        """The device's own inputs, upcast exactly (copies: the replay may write them)."""
        largs, lkw = list(sargs), dict(skw)
        seen: dict[int, torch.Tensor] = {}  # a tensor passed twice (Adam's addcmul_(g, g)) is upcast once

        def up(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            c = seen.get(id(t))
            if c is None:
                c = seen[id(t)] = self.mirror.upcast(t)
            return c

        for spec in plan.tensor_args:
            v = spec.get(args, kwargs)
            if v is None:
                continue
            if spec.kind is ArgKind.TENSOR:
                spec.put(largs, lkw, up(v))
            else:
                spec.put(largs, lkw, [up(t) for t in v])
        return largs, lkw

    # --- after the device op ---
    def _finish(self, call: _Call, args, kwargs, out) -> None:
        plan = call.plan
        try:
            kind, souts = run_chain(call.chain, Replay(plan, call.sargs, call.skw, out))
        except Unsupported as exc:
            self._adopt_all(plan, args, kwargs, out)
            self._record(plan, Kind.UNSUPPORTED, args, kwargs, reason=exc.reason, inputs=call.inputs)
            return
        # random or uninitialized: the device's values are adopted (by kind: a replayed in-place op that returns
        # nothing, such as _foreach_add_ or _fused_adam_, also gives None and its shadow writes must be kept)
        if souts is None and kind in (Kind.RANDOM, Kind.ADOPTED):
            self._adopt_all(plan, args, kwargs, out)
            self._record(plan, kind, args, kwargs, inputs=call.inputs)
            return
        louts = None
        if call.largs is not None:
            _, louts = run_chain(call.chain, Replay(plan, call.largs, call.lkw, out))
        results, item, n_out = self._results(call, args, kwargs, out, souts, louts)
        budget = self._budget(call, results, n_out) if call.pre is not None and self.opt.budgets else None
        # spot-check the reference the local error is measured against, before any comparison: where it
        # is untrusted, the exact value replaces it (and the shadow, when it is that reference)
        spot = self._spot_check(call, out, louts if call.largs is not None else souts, budget) if call.spot else None
        drifts, locals_, flips, lflips, mismatch = [], [], 0, 0, 0
        for d, sh, lo, written, bidx in results:
            if isinstance(d, torch.Tensor):
                f = self._output(call, d, sh, lo, written, drifts, locals_, budget=budget, bidx=bidx)
            else:  # a number (.item(), equal): compared, never kept
                dtype = next((t.dtype for t in call.inputs), torch.float64)
                f = self._output(call, _scalar(d, dtype), _scalar(sh, dtype), None if lo is None else _scalar(lo, dtype),
                                 False, drifts, locals_, keep=False, dtype=dtype)
            flips += f[0]; lflips += f[1]; mismatch += f[2]  # noqa: E702
        drift = merged(drifts) if self.opt.drift else None
        local = merged(locals_) if self.opt.local else None
        binfo = None
        if budget is not None and local is not None:
            if local.norm > 0:
                local.effective_bits = budget.bits(local.norm ** 2)
            binfo = BudgetInfo(budget.kind, local.budget_used or 0.0, budget.is_default)
        cpu = self._cpu_error(call, results) if call.cpu is not None and kind is not Kind.RANDOM else None
        self._record(plan, kind, args, kwargs, local=local, drift=drift, flips=flips, local_flips=lflips,
                     mismatch=mismatch, item=item, inputs=call.inputs, spot=spot, budget=binfo, cpu=cpu)

    def _cpu_error(self, call: _Call, results: list) -> ErrorStats | None:
        """compare_cpu: the op's CPU kernel in the device dtype, on the device's inputs, against the same
        float64 reference as the local error (the verdict msprobe and dynamo's same(fp64_ref) use).
        Random ops never get here: the CPU kernel would draw from the CPU generator."""
        plan, (a, kw) = call.plan, call.cpu
        try:
            out = plan.func(*a, **kw)
        except Exception:  # no CPU kernel for this dtype (a device-only kernel): no comparison
            return None
        flat = [t for _, t in flat_returns(plan, out)]
        if not any(isinstance(t, torch.Tensor) for t in flat):  # in-place ops that return nothing
            flat = []
            for spec in plan.writes:
                v = spec.get(a, kw)
                flat.extend([v] if spec.kind is ArgKind.TENSOR else (v or []))
        stats = []
        for d, sh, lo, _, bidx in results:
            if bidx is None or bidx >= len(flat) or not isinstance(d, torch.Tensor) or shadow_dtype_of(d.dtype) is None:
                continue
            ref, c = lo if isinstance(lo, torch.Tensor) else sh, flat[bidx]
            if isinstance(c, torch.Tensor) and isinstance(ref, torch.Tensor) and c.shape == ref.shape:
                stats.append(compare(c, ref, d.dtype))
        return merged(stats)

    def _results(self, call: _Call, args, kwargs, out, souts, louts) -> tuple[list, Any, int]:
        """(device, shadow, local, written, budget index) per result: written arguments (in-place, out=),
        then fresh returns; and an .item()-like number pair. The budget index follows shadow.budgets: the
        flattened returns (a written argument by the return aliasing it), or the written ones if none."""
        plan = call.plan
        dflat = flat_returns(plan, out)
        has_returns = any(isinstance(t, torch.Tensor) for _, t in dflat)
        ret_idx = {id(t): i for i, (_, t) in enumerate(dflat) if isinstance(t, torch.Tensor)}
        results, w = [], 0
        for spec in plan.writes:
            dev = spec.get(args, kwargs)
            if dev is None:
                continue
            # the local replay ran when largs exist (louts is None too for in-place ops that return nothing)
            sh, lo = spec.get(call.sargs, call.skw), (spec.get(call.largs, call.lkw) if call.largs is not None else None)
            if spec.kind is ArgKind.TENSOR:
                dev, sh, lo = [dev], [sh], [lo]
            elif lo is None:
                lo = [None] * len(dev)
            for d, s, l in zip(dev, sh, lo):
                if isinstance(d, torch.Tensor):
                    results.append((d, s, l, True, ret_idx.get(id(d)) if has_returns else w))
                    w += 1
        item = None
        if plan.returns and not all(r.aliases_write or r.aliases_read for r in plan.returns):
            sflat = flat_returns(plan, souts)
            lflat = flat_returns(plan, louts) if call.largs is not None else [(None, None)] * len(dflat)
            for i, ((spec, d), (_, s), (_, l)) in enumerate(zip(dflat, sflat, lflat)):
                if spec.aliases_write or spec.aliases_read:
                    continue
                if isinstance(d, torch.Tensor):
                    results.append((d, s, l, False, i))
                elif isinstance(d, (int, float, bool)) and isinstance(s, (int, float, bool)):  # .item(), equal
                    item = (d, s)
                    results.append((d, s, l, False, None))
        return results, item, (len(dflat) if has_returns else w)

    def _budget(self, call: _Call, results: list, n_out: int) -> Budget | None:
        """The op's error budget from its inputs before the op and the float64 results the local error is
        measured against; None (no budget) where there is nothing to bound or no float results."""
        refs: dict[int, Any] = {}
        for d, sh, lo, _, bidx in results:
            if bidx is not None and isinstance(d, torch.Tensor):
                refs[bidx] = lo if isinstance(lo, torch.Tensor) else sh
        if not refs:
            return None
        outs = [refs.get(i) for i in range(max(n_out, max(refs) + 1))]  # None where an output is absent

        # the error is measured in the result's dtype (a cast to bfloat16 is held to bfloat16's rounding)
        dtype = next((d.dtype for d, *_ in results if isinstance(d, torch.Tensor) and shadow_dtype_of(d.dtype)),
                     call.inputs[0].dtype)
        try:
            return budget_for(call.plan.func, call.pre[0], call.pre[1], outs, dtype)
        except Exception as exc:  # a budget rule's bug must not cost the op its error figures: counted, visible
            self.report.coverage.internal_errors += 1
            self.report.coverage.unsupported.setdefault(
                f"budget of {call.plan.name}", f"internal error: {type(exc).__name__}: {exc}"[:240])
            return None

    def _spot_check(self, call: _Call, out: Any, refs: Any, budget: Budget | None):
        """mpmath check of sampled elements of the float64 reference the local error is measured against;
        untrusted elements of that reference are overwritten with their exact values. With the budget of a
        sum (``Budget.of_sum``: reductions, matmul, convolution, norms, losses...), bound / |reference| is the
        condition estimate that picks the first samples (sum|x| / |sum x| for sums, ||a_i|| ||b_j|| / |c_ij|
        for matmuls: where the reference cancels). Elementwise ops are one float64 rounding of exact inputs:
        their reference cannot cancel below float64's own rounding, and their samples stay random."""
        plan = call.plan
        dev = [t if isinstance(t, torch.Tensor) else None for _, t in flat_returns(plan, out)]
        ref = [t if isinstance(t, torch.Tensor) else None for _, t in flat_returns(plan, refs)]
        dtype = next((t.dtype for t in dev if t is not None and shadow_dtype_of(t.dtype)), call.inputs[0].dtype)
        priority = None
        if budget is not None and budget.of_sum:
            priority = [_condition(b, r) for b, r in zip(budget.bound, ref)]
        stats = self.spot.check(plan.func, call.pre[0], call.pre[1], dev, ref, dtype, priority)
        if stats is not None and not stats.trusted:
            for s in self.spot.last:
                if not s.trusted and ref[s.output] is not None:
                    ref[s.output][s.index] = s.exact  # the exact value, rounded once to float64
        return stats

    def _output(self, call: _Call, dev: torch.Tensor, sh: Any, lo: Any, written: bool, drifts: list, locals_: list,
                keep: bool = True, dtype: torch.dtype | None = None, budget: Budget | None = None,
                bidx: int | None = None) -> tuple[int, int, int]:
        """Compare one device output with its shadow (and local) value and keep the shadow (``keep``).
        ``dtype``: the device dtype the error is measured in (default: dev's own)."""
        dtype = dtype or dev.dtype
        m = self.mirror
        sd = m.shadow_dtype(dev.dtype)
        if not isinstance(sh, torch.Tensor) or dev._is_zerotensor():
            return 0, 0, 0
        if dev.layout != torch.strided:  # a sparse result (to_sparse): no strided storage to mirror
            raise Unsupported(call.plan.name, f"{dev.layout} result: shadow mirrors strided tensors only")
        if sh.shape != dev.shape:  # a data-dependent shape the shadow did not reproduce
            if sd is not None:
                m.assign(dev, m.upcast(dev), exact=True, fresh=True)
            return 0, 0, 1
        if shadow_dtype_of(dev.dtype) is None:  # discrete result
            flips = count_flips(dev, sh)
            lflips = count_flips(dev, lo) if isinstance(lo, torch.Tensor) and lo.shape == dev.shape else 0
            if sd is not None and keep:  # follow="reference": the shadow keeps its own discrete result
                sh = sh.to(sd)
                if written:
                    m.commit_write(dev, sh, exact=flips == 0)
                else:
                    m.assign(dev, sh, exact=flips == 0, fresh=sh.untyped_storage()._cdata not in call.storages)
            return flips, lflips, 0
        if sh.dtype != sd:
            sh = sh.to(sd)
        has_local = isinstance(lo, torch.Tensor)
        # the bound of this result: none for ulps budgets (budget_used = max_ulp / ulps, no tensor needed)
        bound = None
        if budget is not None and bidx is not None and budget.ulps is None and self.opt.local:
            bounds = budget.bound
            bound = bounds[bidx] if bidx < len(bounds) else None
        # with every input exact (no local replay), the shadow comparison is the local error too
        shared = self.opt.local and not has_local
        st = compare(dev, sh, dtype, bound if shared else None) if self.opt.drift or shared else None
        if self.opt.local:
            loc = (compare(dev, lo, dtype, bound) if lo.shape == dev.shape else ErrorStats()) if has_local else st
            if budget is not None and bidx is not None and budget.ulps is not None:
                loc.budget_used = loc.max_ulp / budget.ulps if budget.ulps > 0 else (_INF if loc.max_abs else 0.0)
            locals_.append(loc)
        if self.opt.drift:
            drifts.append(dataclasses.replace(st, budget_used=None) if shared and st.budget_used is not None else st)
        exact = st is not None and st.exact
        if not keep:
            return 0, 0, 0
        if written:
            m.commit_write(dev, sh, exact)
        else:
            e = m.assign(dev, sh, exact, fresh=sh.untyped_storage()._cdata not in call.storages)
            m.unobserved_write(dev, e)  # start tracking the new output's version counter
        return 0, 0, 0

    # --- adoption and recording ---
    def _adopt_all(self, plan: OpPlan, args, kwargs, out) -> None:
        """Make the device's values the shadow of every output and written argument."""
        m = self.mirror
        targets: list = []
        for spec in plan.writes:
            v = spec.get(args, kwargs)
            if v is not None:
                targets.extend([v] if spec.kind is ArgKind.TENSOR else v)
        targets.extend(t for _, t in flat_returns(plan, out))
        for t in targets:
            if isinstance(t, torch.Tensor) and not t._is_zerotensor() and m.shadow_dtype(t.dtype) is not None \
                    and t.layout == torch.strided:  # sparse results have no storage to mirror
                m.assign(t, m.upcast(t), exact=True, fresh=True)

    def _internal_error(self, plan: OpPlan, args, kwargs, out, exc: Exception) -> None:
        if isinstance(exc, Unsupported):  # a limit of shadow found while preparing (sparse layouts), not a bug
            self._adopt_all(plan, args, kwargs, out)
            self._record(plan, Kind.UNSUPPORTED, args, kwargs, reason=exc.reason)
            return
        self.report.coverage.internal_errors += 1
        try:
            self._adopt_all(plan, args, kwargs, out)
        except Exception:  # adoption failed too: the next read re-adopts from the device
            pass
        reason = f"internal error: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        self._record(plan, Kind.UNSUPPORTED, args, kwargs, reason=reason)

    def _record(self, plan: OpPlan, kind: Kind, args, kwargs, *, local=None, drift=None, flips=0, local_flips=0,
                mismatch=0, item=None, reason="", inputs=(), spot=None, budget=None, cpu=None) -> None:
        module, phase = self.attr.where(inputs)
        fallback = bool(inputs) and inputs[0].device.type == "privateuseone" and cpu_fallback(plan.func, inputs[0].device)
        rec = Record(self._index, plan.name, module, phase, kind.value, local, drift, flips, local_flips, mismatch,
                     item, reason, spot, budget, fallback, cpu)
        self._index += 1
        self.report.add(rec)

    # --- queries ---
    def shadow_of(self, t: torch.Tensor) -> torch.Tensor:
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
            return v.clone()


def _condition(bound: Any, r: Any) -> torch.Tensor | None:
    """bound / |r| elementwise (a budget's error bound relative to the result: large where r cancels)."""
    if not isinstance(bound, torch.Tensor) or not isinstance(r, torch.Tensor) or r.is_complex() \
            or not r.is_floating_point():
        return None
    a = r.abs()
    return torch.div(bound, a, out=a) if bound.shape == r.shape else torch.broadcast_to(bound, r.shape) / a


def _scalar(v: Any, dtype: torch.dtype) -> torch.Tensor:
    """A Python number returned by an op (.item(), equal) as a 0-d tensor: float64 for floats."""
    if isinstance(v, float) or dtype.is_floating_point and not isinstance(v, bool):
        return torch.tensor(float(v), dtype=torch.float64)
    return torch.tensor(v)


def _remap(name: str, v: Any) -> Any:
    """dtype and device arguments for the float64 CPU replay."""
    if isinstance(v, torch.dtype):
        return shadow_dtype_of(v) or v
    if isinstance(v, torch.device):
        return torch.device("cpu")
    if name in ("pin_memory", "half_to_float") and v:
        return False
    return v

