"""Which op calls get spot-checked, with how many elements, and what that costs: the ``spot_checks=``
option parsed once (``SpotConfig``, frozen) and the per-run state built from it (``SpotPolicy``: call
counts, escalations, the escalation budget)."""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import ShadowOptionError
from ..metrics import precision_bits
from ..references import DEFAULT_BITS, Reference, estimate_cost_us, reference_for
from .sampling import Ranked, next_drawn, sample_indices
from .verdict import Sample, SpotStats, spot_check, summarize

DEFAULT_SAMPLES = 2  # elements per output per op call by default: one by priority (when given), one at random
ESCALATED_SAMPLES = 16  # elements per output of an escalated call
ESCALATE_CALLS = 4  # later calls of an op that stay escalated after a call showed risk
EVERY_CALL_FIRST = 16  # spot_checks="default": each op's first calls all get samples ...
THEN_ONE_IN = 16  # ... then one call in this many, drawn from the seed, the op's name and the call number
ALL_MAX_ELEMENTS = 4096  # spot_checks="all" checks every element of outputs up to this size
ELEMENT_CAP_US = 50_000.0  # an element estimated dearer than this is not checked
CALL_CAP_US = 20_000.0  # a call's default samples stop at this estimated cost
ESCALATED_CALL_CAP_US = 100_000.0  # ... its escalated samples at this one
ESCALATION_REFILL_US = 200.0  # escalation budget earned per op call seen
ESCALATION_BUDGET_US = 200_000.0  # at most this much banked

_MODES = ("off", "default", "all")
_FORMS = (
    "spot_checks= expects 'off', 'default', 'all' (every element of outputs up to "
    f"{ALL_MAX_ELEMENTS} elements), an int >= 0 (elements per output per op call), or a dict "
    "{op ('aten.mm.default') or family ('aten.mm'), or 'default' for the others: int >= 0 or 'all'}"
)


def _priority(priority: Sequence[torch.Tensor | Ranked | None] | None, k: int,
              numel: int) -> torch.Tensor | Ranked | None:
    """Output ``k``'s priorities, when given for every one of its elements."""
    if priority is None or k >= len(priority):
        return None
    p = priority[k]
    return p if p is not None and p.numel() == numel else None


def _family(op_name: str) -> str:
    return op_name.rsplit(".", 1)[0] if op_name.count(".") >= 2 else op_name


@functools.cache
def _resolve(name: str) -> Any:
    """The OpOverload or OpOverloadPacket called ``name`` ("aten.mm.default", "aten.mm"), or None."""
    parts = name.split(".")
    if len(parts) not in (2, 3) or not all(parts):
        return None
    try:
        obj = getattr(getattr(torch.ops, parts[0]), parts[1])
        return getattr(obj, parts[2]) if len(parts) == 3 else obj
    except (AttributeError, RuntimeError):
        return None


def _has_reference(op: Any) -> bool:
    if isinstance(op, torch._ops.OpOverload):
        return reference_for(op) is not None
    if isinstance(op, torch._ops.OpOverloadPacket):
        return any(reference_for(getattr(op, o)) is not None for o in op.overloads())
    return False


def _count_value(where: str, v: Any) -> int | str:
    if v == "all" or (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
        return v
    raise ShadowOptionError(f"spot_checks: {where}: {v!r} is not a count. {_FORMS}")


class _OpState:
    __slots__ = ("calls", "escalate_left", "later", "next", "planned")

    def __init__(self, sampled: bool, later: bool) -> None:
        # the next call number that gets samples unescalated; 0 (never) unless the op has a reference rule and a
        # count above 0. Known ahead: wants() compares, and draws once per call drawn, not once per call
        self.next = 1 if sampled else 0
        # spot_checks="default" draws calls past the first EVERY_CALL_FIRST: not for an op whose float64 kernel
        # rounds once (Reference.rounds_once), whose reference those calls cannot find untrusted
        self.later = later
        self.calls = 0  # wants() calls: the call number that seeds the samples
        self.planned: int | None = None  # the call number wants() said yes to, until check() uses it
        self.escalate_left = 0  # next calls that get escalated samples


@dataclasses.dataclass(frozen=True)
class SpotConfig:
    """The ``spot_checks=`` option, parsed and validated once (``SpotConfig.parse``).

    >>> SpotConfig.parse({"aten.mm": 8, "default": 1}).per_op
    mappingproxy({'aten.mm': 8, 'default': 1})
    """

    mode: str = "default"  # "off" | "default" | "count" | "all" | "per_op"
    count: int = DEFAULT_SAMPLES  # elements per output per call (mode default/count)
    # op or family name -> count or "all"; "default" -> the others
    per_op: Mapping[str, int | str] = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))
    seed: int = 0  # with the op name, call number and output, it picks the random samples
    bits: int = DEFAULT_BITS  # precision of the references
    escalation_budget_us: float = ESCALATION_BUDGET_US  # most estimated cost banked for escalated samples
    escalation_refill_us: float = ESCALATION_REFILL_US  # ... earned per op call seen

    @classmethod
    def parse(cls, value: Any) -> SpotConfig:
        """Validate ``spot_checks=``: "off", "default", "all", an int >= 0 (elements per output per call,
        0 = off), or a dict {op or family name (or its OpOverload): count or "all"}, where the key
        "default" sets the count of unlisted ops (0 otherwise). A SpotConfig passes through; a SpotPolicy
        gives its config."""
        if isinstance(value, SpotConfig):
            return value
        if isinstance(value, SpotPolicy):
            return value.config
        if isinstance(value, str):
            if value not in _MODES:
                raise ShadowOptionError(f"spot_checks={value!r}: unknown mode. {_FORMS}")
            return cls(mode=value)
        if isinstance(value, int) and not isinstance(value, bool):
            if value < 0:
                raise ShadowOptionError(f"spot_checks={value}: a count must be >= 0. {_FORMS}")
            return cls(mode="count", count=value) if value else cls(mode="off")
        if isinstance(value, Mapping):
            per_op: dict[str, int | str] = {}
            for key, v in value.items():
                name = str(key) if isinstance(key, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) else key
                if not isinstance(name, str):
                    raise ShadowOptionError(f"spot_checks: key {key!r} is not an op name. {_FORMS}")
                per_op[name] = _count_value(f"{name!r}", v)
                if name == "default":
                    continue
                op = _resolve(name)
                if op is None:
                    raise ShadowOptionError(
                        f"spot_checks: {name!r} names no op (expected 'namespace.op' or 'namespace.op.overload', "
                        f"such as 'aten.mm' or 'aten.mm.default'). {_FORMS}")
                if not _has_reference(op):
                    raise ShadowOptionError(
                        f"spot_checks: {name!r} has no mpmath reference rule, so it cannot be spot-checked "
                        "(shadow.references lists the covered ops)")
            return cls(mode="per_op", per_op=types.MappingProxyType(per_op))
        raise ShadowOptionError(f"spot_checks={value!r} ({type(value).__name__}). {_FORMS}")

    @property
    def option(self) -> str | int | dict:
        """The ``spot_checks=`` value that parses to this config, as a report's meta keeps it ("default", "all",
        "off", a count, {op: count}), with the fields that option cannot set beside it where they are not their
        defaults: {"spot_checks": "default", "seed": 3}."""
        value = self.count if self.mode == "count" else dict(self.per_op) if self.mode == "per_op" else self.mode
        rest = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("mode", "count", "per_op") and getattr(self, f.name) != f.default}
        return {"spot_checks": value, **rest} if rest else value

    def count_for(self, op_name: str) -> int | str:
        """Elements per output per call for ``op_name`` (0: none; "all": every element)."""
        if self.mode == "off":
            return 0
        if self.mode == "all":
            return "all"
        if self.mode == "per_op":
            p = self.per_op
            return p.get(op_name, p.get(_family(op_name), p.get("default", 0)))
        return self.count


class SpotPolicy:
    """The per-run state of the spot checks of one ``SpotConfig``, and the check itself.

    ``wants(op_name)`` (cheap, before the op runs) says whether this call gets samples, then
    ``check(...)`` (after the op) returns its ``SpotStats`` and samples. A new run starts from a new policy.

    >>> policy = SpotPolicy.from_option(3)               # three elements per output per call
    >>> policy.wants("aten.exp.default"), policy.wants("aten.index_add.default")
    (True, False)

    Which calls: every call of an op, except under ``spot_checks="default"``, which samples each op's first
    ``EVERY_CALL_FIRST`` calls, then one later call in ``THEN_ONE_IN`` (drawn from the seed, the op's name
    and the call number, so the same calls in every run; none for an op whose float64 kernel rounds once,
    ``Reference.rounds_once``) and every escalated call. The report counts the
    calls checked (``shadow.report.Aggregate.spot_checked``).

    Escalation: an element is *risky* when it is untrusted, or when float64's typical error on it
    (2**-53 times the magnitude of the terms it is formed from, i.e. cancellation times its value)
    times ``RISK_FACTOR`` exceeds the trust tolerance. A risky sample makes the rest of the call and
    the op's next ``ESCALATE_CALLS`` calls use ``max(ESCALATED_SAMPLES, 8 * count)`` elements per
    output, paid from the escalation budget (see ``shadow.spot``).
    """

    def __init__(self, config: SpotConfig = SpotConfig()):
        self.config = config
        self._ops: dict[str, _OpState] = {}
        self._budget = config.escalation_budget_us
        self._seen = 0  # the op calls seen when the escalation budget was last refilled

    @classmethod
    def from_option(cls, value: Any) -> SpotPolicy:
        """A policy for a ``spot_checks=`` value (see ``SpotConfig.parse``); a SpotPolicy passes through."""
        return value if isinstance(value, SpotPolicy) else cls(SpotConfig.parse(value))

    def __repr__(self) -> str:
        c = self.config
        what = {"count": c.count, "per_op": dict(c.per_op)}.get(c.mode, "")
        return f"SpotPolicy({c.mode}{' ' + repr(what) if what != '' else ''}, seed={c.seed})"

    # --- decisions ---
    def _state(self, op_name: str) -> _OpState:
        state = self._ops.get(op_name)
        if state is None:  # the op's first call: whether it may be sampled, asked once
            op = _resolve(op_name)
            ref = reference_for(op) if isinstance(op, torch._ops.OpOverload) else None
            state = self._ops[op_name] = _OpState(self.config.count_for(op_name) != 0 and ref is not None,
                                               ref is not None and not ref.rounds_once)
        return state

    def wants(self, op_name: str) -> bool:
        """Whether this call of ``op_name`` gets samples (then snapshot the inputs an in-place op
        overwrites, and call ``check``). Deterministic: the op's call count decides, never a clock.
        Ops without a reference rule are never wanted (``check`` still explains them)."""
        state = self._ops.get(op_name)
        if state is None:
            if self.config.mode == "off":  # no call is ever checked: nothing to count
                return False
            state = self._state(op_name)
        state.calls = n = state.calls + 1
        if n == state.next:
            state.next = self._after(state, op_name, n)
        elif not state.escalate_left:
            state.planned = None
            return False
        state.planned = n
        return True

    def _after(self, state: _OpState, op_name: str, n: int) -> int:
        """The call of a sampled op after call ``n`` that gets samples unescalated: every call, except under
        ``spot_checks="default"`` past its first ``EVERY_CALL_FIRST``, the next one drawn (none, 0, for an op
        whose float64 kernel rounds once)."""
        config = self.config
        if config.mode != "default" or n < EVERY_CALL_FIRST:
            return n + 1
        return next_drawn(config.seed, op_name, n, THEN_ONE_IN) if state.later else 0

    def _escalation_budget(self) -> float:
        """The escalation budget: ``escalation_refill_us`` earned per op call seen since it was last read (the
        ops' call counts: nothing is paid per call), at most ``escalation_budget_us`` banked."""
        config = self.config
        seen = sum(state.calls for state in self._ops.values())
        self._budget = min(config.escalation_budget_us,
                           self._budget + config.escalation_refill_us * (seen - self._seen))
        self._seen = seen
        return self._budget

    # --- the check ---
    def check(
        self,
        func: torch._ops.OpOverload,
        args: Sequence,
        kwargs: Mapping[str, Any] | None,
        device_outputs: Sequence[torch.Tensor | None],
        reference_outputs: Sequence[torch.Tensor | None],
        dtype: torch.dtype,
        priority: Sequence[torch.Tensor | Ranked | None] | None = None,
    ) -> tuple[SpotStats | None, list[Sample]]:
        """Spot-check one call: ``args``/``kwargs`` as the float64 reference read them (for in-place and
        ``out=`` ops, as they were before the call); ``device_outputs`` and ``reference_outputs`` aligned
        with the op's tensor outputs (None where absent); ``dtype`` the device dtype; ``priority``
        optional per-element condition estimates (same shapes; larger = checked first).

        Returns ``(stats, samples)``: ``(None, [])`` when the policy does not sample this op (off, or a
        count of 0 for it); otherwise ``SpotStats`` (``samples == 0`` with a reason when nothing could be
        checked) and the checked elements.
        """
        name = str(func)
        state = self._state(name)
        call_no = state.planned if state.planned is not None else state.calls
        state.planned = None
        n = self.config.count_for(name)
        if n == 0:
            return None, []
        ref = reference_for(func)
        if ref is None:
            return SpotStats(reason=f"no mpmath reference for {name}"), []
        if not (dtype.is_floating_point or dtype.is_complex):
            return SpotStats(reason=f"{dtype} result: discrete results are compared exactly, not spot-checked"), []
        outs, why = self._eligible(ref, device_outputs, reference_outputs)
        if not outs:
            return SpotStats(reason=why), []
        cost, terms = estimate_cost_us(func, args, kwargs, max(reference_outputs[k].numel() for k in outs))
        if cost > ELEMENT_CAP_US:
            return SpotStats(reason=f"one element of {name} reduces {terms} terms (~{cost / 1e3:.0f} ms estimated "
                                    f"at high precision): above the {ELEMENT_CAP_US / 1e3:.0f} ms per-element cap"), []
        check = functools.partial(spot_check, func, args, kwargs, device_outputs, reference_outputs, dtype,
                                  bits=self.config.bits)
        if n == "all":
            total = sum(reference_outputs[k].numel() for k in outs)
            if total > ALL_MAX_ELEMENTS:
                return SpotStats(reason=f"spot_checks='all' checks outputs of at most {ALL_MAX_ELEMENTS} elements; "
                                        f"this call's have {total}: give {name} a count instead"), []
            samples, why2 = check([(k, i) for k in outs for i in range(reference_outputs[k].numel())])
            return summarize(samples, why2 or why), samples
        escalated = state.escalate_left > 0 and precision_bits(dtype) < 52
        if escalated:
            state.escalate_left -= 1
        # default samples, within the per-call cap
        per_out = max(1, min(n, int(CALL_CAP_US // (cost * len(outs)))))
        chosen: dict[int, list[int]] = {}
        for k in outs:
            numel = reference_outputs[k].numel()
            chosen[k] = sample_indices(self.config.seed, name, call_no, k, numel, per_out, _priority(priority, k, numel))
        elements = [(k, i) for k in outs for i in chosen[k]]
        samples, why2 = check(elements)
        why = why2 or why
        if any(s.risky for s in samples):
            state.escalate_left = ESCALATE_CALLS
            escalated = precision_bits(dtype) < 52
        if escalated:  # more elements of this call, paid from the escalation budget
            want = max(ESCALATED_SAMPLES, 8 * n) - per_out
            afford = int(min(self._escalation_budget(), ESCALATED_CALL_CAP_US) // (cost * len(outs)))
            extra_n = max(0, min(want, afford))
            if extra_n:
                extra = []
                for k in outs:
                    numel = reference_outputs[k].numel()
                    more = sample_indices(self.config.seed, name, call_no, k, numel, extra_n, _priority(priority, k, numel),
                                          exclude=chosen[k])
                    extra += [(k, i) for i in more]
                self._budget -= cost * len(extra)
                s2, why3 = check(extra)
                samples += s2
                why = why3 or why
        return summarize(samples, why), samples

    def _eligible(self, ref: Reference, device_outputs, reference_outputs) -> tuple[list[int], str]:
        """Outputs the rule computes that both sides have, as floating tensors of one shape."""
        outs, why = [], ""
        for k in range(min(ref.outputs, len(device_outputs), len(reference_outputs))):
            d, r = device_outputs[k], reference_outputs[k]
            if not isinstance(d, torch.Tensor) or not isinstance(r, torch.Tensor):
                continue
            if not (d.is_floating_point() and r.is_floating_point()):
                why = why or f"output {k} is {d.dtype}: not a real floating result"
                continue
            if d.shape != r.shape:
                why = why or f"output {k}: device shape {tuple(d.shape)} != reference shape {tuple(r.shape)}"
                continue
            if r.numel():
                outs.append(k)
        if not outs and not why:
            why = f"no output of {ref.func} the reference rule computes (it covers outputs 0..{ref.outputs - 1})"
        return outs, why
