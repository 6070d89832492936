"""What a report concludes, in lines a user can act on, at the level of the cause: NaN/Inf that reaches the loss, a
gradient or a parameter (the op that made it, and how it got there), the arithmetic the op classes over budget read
like (one line when most read the same format, then the exceptions), float64 references that mpmath found wrong,
what shadow could not check or judge (ops no budget rule knows: their guessed budget is no evidence); or the
all-clear, which counts the calls held to derived budgets only. NaN/Inf that float64 makes too and that reaches none of those (an
attention mask of -inf that softmax absorbs) is information, not a finding (docs/reports.md: The verdict).

A pure function of a report (``conclude``); ``Report.summary``, ``shadow show``, ``shadow run``, the HTML page and
the pytest plugin render it.

>>> v = conclude(sm.report)                                   # doctest: +SKIP
>>> print(v.text)                                             # doctest: +SKIP
verdict: bfloat16-like arithmetic throughout: 23 op classes read ~7 bits, 1.5e+03x to 3.7e+05x their float32 budgets (worst: aten.add at GPT, forward, call #3)
exceptions: 1 op class over budget reads otherwise:
  aten._foreach_add_ 1.4e+04x budget in 2 of 4 calls (reads ~18 bits; worst: GPT, optimizer, call #488)
info: NaN/Inf made in aten.masked_fill at GPT.h.0.attn, GPT.h.1.attn (4 calls; float64 makes it too), absorbed by aten._softmax: it reaches no loss, gradient or parameter, so it is not a finding
>>> v.suspicious, v.arithmetic.like, v.nonfinite               # doctest: +SKIP
(True, 'bfloat16-like', None)
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from .amplification import Amplification, amplification
from .nonfinite import Absorbed, Flow, Reach, flow
from .records import KERNELS_KEY, Aggregate, Record, op_class
from .reportdata import ReportData

if TYPE_CHECKING:
    from .band import Envelope

# mantissa bits each dtype stores (what `effective_bits` reads in), and the narrower arithmetics an error may read
# like: the same 10 bits are TF32 in a matmul or convolution and float16 elsewhere
STORED_BITS = {"torch.float64": 52, "torch.float32": 23, "torch.float16": 10, "torch.bfloat16": 7}
FORMATS = (("bfloat16", 7), ("float16", 10))  # (name, mantissa bits) of the narrower arithmetics an error may read
_MATMUL_LIKE = frozenset({"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.matmul", "aten.linear",
                          "aten.mv", "aten.addmv", "aten.dot", "aten.vdot", "aten.convolution", "aten._convolution",
                          "aten.conv1d", "aten.conv2d", "aten.conv3d", "aten.convolution_backward",
                          "aten.mkldnn_convolution", "aten._scaled_mm"})
ONE_CAUSE = 3  # op classes over budget reading one format: said in one line from this many on
THROUGHOUT = 2 / 3  # ... "throughout" when they are this share of the op classes whose results round
_SHOWN = 3  # unsupported ops, untrusted op classes, modules, absorbers named in a line; the rest counted


def times(x: float) -> str:
    """A budget use as a multiple: 0.31x, 40x, 2.8e+03x."""
    if not math.isfinite(x):
        return f"{x}x"
    return f"{x:.2g}x" if x < 10 or x >= 1e4 else f"{x:.0f}x"


def _names(items: list[str] | tuple[str, ...], shown: int = _SHOWN) -> str:
    """"a, b, c and 4 more"."""
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more


def _plural(n: int, word: str, plural: str = "") -> str:
    return f"{n} {word if n == 1 else plural or word + 's'}"


@dataclasses.dataclass(frozen=True)
class OpClass:
    """The calls of one op class held to an error budget: how much of it the worst call used, and what it reads."""

    op: str  # "aten.mm": every overload
    budgeted_calls: int  # calls held to a rule's budget (not the default guess)
    over_calls: int  # ... over it (Record.over_budget)
    budget_used: float  # the worst call's local error / its budget
    effective_bits: float | None  # the fewest mantissa bits a call's error reads (None: exact or not known)
    dtypes: tuple[str, ...]  # the floating result dtypes ("torch.float32")
    worst: Record | None = dataclasses.field(repr=False)  # the worst kept call (None: not kept: max_records)

    @property
    def format_bits(self) -> int | None:
        """The mantissa bits of the narrower arithmetic the error reads like (``FORMATS``: 7 or 10; None when it is
        the dtype's own or no known format fits): the narrowest known format within 1.5 bits of
        ``effective_bits``, narrower than the dtype by more than 2 bits."""
        bits, stored = self.effective_bits, min((STORED_BITS.get(d, 52) for d in self.dtypes), default=52)
        if bits is None or not math.isfinite(bits) or bits > stored - 2:
            return None
        return next((p for _, p in FORMATS if abs(bits - p) <= 1.5), None)

    @property
    def reads_like(self) -> str:
        """The arithmetic the error reads like: "bfloat16-like", "float16-like", "TF32-like" (10 bits in a matmul or
        convolution); "" when ``format_bits`` is None."""
        return _like(self.format_bits, self.op in _MATMUL_LIKE)

    def __str__(self) -> str:
        return self.describe()

    def describe(self, like: bool = True) -> str:
        """The class in a line; ``like=False`` leaves out what its bits read like (an exception to a shared cause:
        9 bits under bfloat16 arithmetic is luckier rounding, not float16)."""
        detail = []
        if self.effective_bits is not None and math.isfinite(self.effective_bits):
            shown = self.reads_like if like else ""
            detail.append(f"reads ~{self.effective_bits:.0f} bits" + (f": {shown}" if shown else ""))
        if self.worst is not None:
            detail.append(f"worst: {self.worst.module or '(no module)'}, {self.worst.phase}, call #{self.worst.index}")
        calls = f" in {self.over_calls} of {self.budgeted_calls} calls" if self.over_calls else ""
        return f"{self.op} {times(self.budget_used)} budget{calls}" + (f" ({'; '.join(detail)})" if detail else "")


def _like(bits: int | None, matmuls: bool) -> str:
    if bits is None:
        return ""
    name = next(n for n, p in FORMATS if p == bits)
    return f"{'TF32' if matmuls and name == 'float16' else name}-like"


@dataclasses.dataclass(frozen=True)
class Arithmetic:
    """The cause that ``ONE_CAUSE`` or more op classes over budget share: their errors all read one narrower format
    (an emulated or misconfigured device: bfloat16 arithmetic on float32 tensors, TF32 matmuls)."""

    bits: int  # the format's mantissa bits (FORMATS)
    classes: tuple[OpClass, ...]  # worst first
    throughout: bool  # they are at least THROUGHOUT of the op classes whose results round (an error not 0)
    within: tuple[str, ...]  # op classes whose results round within their budgets (said when ``throughout``)

    @property
    def like(self) -> str:
        """"bfloat16-like", "float16-like", "TF32-like" (every class a matmul or convolution)."""
        return _like(self.bits, all(c.op in _MATMUL_LIKE for c in self.classes))

    def line(self, dtypes: str) -> str:
        worst = self.classes[0]
        span = f"{times(min(c.budget_used for c in self.classes))} to {times(worst.budget_used)} their {dtypes} budgets"
        at = "" if worst.worst is None else \
            f" at {worst.worst.module or '(no module)'}, {worst.worst.phase}, call #{worst.worst.index}"
        if self.throughout:
            return (f"{self.like} arithmetic throughout: {len(self.classes)} op classes read ~{self.bits} bits, "
                    f"{span} (worst: {worst.op}{at})")
        return (f"{self.like} arithmetic in {len(self.classes)} op classes (read ~{self.bits} bits, {span}): "
                f"{_names([c.op for c in self.classes], 6)}")


def arithmetic(classes: list[OpClass]) -> Arithmetic | None:
    """The format most op classes over budget read, when ``ONE_CAUSE`` or more read it (None otherwise)."""
    over = [c for c in classes if c.over_calls]
    groups: dict[int, list[OpClass]] = {}
    for c in over:
        if c.format_bits is not None:
            groups.setdefault(c.format_bits, []).append(c)
    if not groups:
        return None
    bits, group = max(groups.items(), key=lambda kv: (len(kv[1]), -kv[0]))
    if len(group) < ONE_CAUSE:
        return None
    rounding = [c for c in classes if c.effective_bits is not None and math.isfinite(c.effective_bits)]
    throughout = len(group) >= THROUGHOUT * len(rounding)
    within = tuple(c.op for c in rounding if not c.over_calls) if throughout else ()
    return Arithmetic(bits, tuple(group), throughout, within)


@dataclasses.dataclass(frozen=True)
class NonfiniteOrigin:
    """A NaN/Inf finding: NaN or Inf that reaches the loss (a run's result), a gradient or a parameter
    (``shadow.nonfinite.flow``), the call that made it from finite inputs, whether float64 makes it there too
    ("math") or not ("precision": the device's dtype overflowed), and how it got there.

    ``op`` is "" when no kept call made it: it came in with the inputs, or was born past the kept records
    (``reaches`` then holds only what the trajectory saw)."""

    op: str
    module: str
    phase: str
    index: int
    cause: str  # "math" | "precision" | "" (no kept call made it)
    reaches: tuple[Reach, ...] = ()
    path: tuple[str, ...] = ()  # modules holding it on the way, origin to the first reach
    callsite: str = ""
    others: int = 0  # other births live at the first reach, which may feed it too
    upstream: bool = False  # "precision" made before this call: float64 on the device's own inputs agrees

    @classmethod
    def of(cls, f: Flow) -> NonfiniteOrigin | None:
        if not f.reaches:
            return None
        o = f.origin
        if o is None:
            return cls("", "", "", -1, "", f.reaches)
        upstream = o.nonfinite_cause == "precision" and o.local is not None and not o.local.nonfinite_device
        return cls(o.op, o.module, str(o.phase), o.index, o.nonfinite_cause, f.reaches, f.path, o.callsite, f.others,
                   upstream)

    @property
    def headline(self) -> str:
        if not self.op:
            seen = [r for r in self.reaches if r.record is not None]
            if seen:
                return (f"NaN/Inf reaches {_reach(seen[0])}, and no kept call made it from finite values: it came in "
                        "with the inputs (the data, or a tensor made before shadow started)")
            return (f"NaN/Inf reaches {_reach(self.reaches[0])}, born past the kept records (raise --max-records / "
                    "max_records to see where)")
        where = f"NaN/Inf born in {op_class(self.op)} at {self.module or '(no module)'} ({self.phase}, call #{self.index})"
        if self.cause == "math":
            return f"{where}: a math problem: float64 gives NaN/Inf there too (fix the math: the inputs reach " \
                   "a pole or leave the domain)"
        if self.upstream:
            return f"{where}: a precision problem: the float64 program is finite there, but float64 on the " \
                   "device's own inputs is not: they lost it before this call (a value rounded to 0 or to inf: " \
                   "see the op classes over budget)"
        return f"{where}: a precision problem: float64 is finite there (the dtype overflowed or lost the " \
               "difference: compute it in a wider dtype or rescale)"

    @property
    def route(self) -> str:
        """How it got there: what it reaches, through which modules, from which line."""
        text = "it reaches " + _and([_reach(r) for r in self.reaches])
        if len(self.path) > 1:
            shown = self.path if len(self.path) <= 4 else (*self.path[:3], f"... {len(self.path) - 4} more ...",
                                                           self.path[-1])
            text += f", through {', '.join(shown)}"
        if self.callsite:
            text += f"; made at {self.callsite}"
        if self.others:
            text += (f"; {_plural(self.others, 'other birth')} of NaN/Inf live there may feed it too "
                     "(shadow.nonfinite)")
        return text

    def __str__(self) -> str:
        return f"{self.headline}; {self.route}" if self.op else self.headline


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _reach(r: Reach) -> str:
    what = {"loss": "the loss", "result": "the result", "gradients": "the gradients", "parameters": "the parameters",
            "state": "the optimizer's state"}[r.what]
    rec = r.record
    if rec is None:
        return f"{what} (after optimizer step {r.step})"
    if r.what in ("loss", "result"):
        return f"{what} ({op_class(rec.op)}, call #{rec.index})"
    return f"{what} (first: {op_class(rec.op)} at {rec.module or '(no module)'}, {rec.phase}, call #{rec.index})"


def _absorbed_line(a: Absorbed, trained: bool) -> str:
    made = f"NaN/Inf made in {a.op} at {_names(list(a.modules))} ({_plural(a.calls, 'call')}; " + (
        "float64 makes it too)" if a.cause == "math" else "the device's rounding: float64 is finite there)")
    fate = f"absorbed by {_names(list(a.absorbers))}" if a.absorbers else "never read by a call shadow compared"
    targets = "no loss, gradient or parameter" if trained else "not the result"
    if a.caught:
        fate = f"caught in the gradients by {_names(list(a.absorbers))} (GradScaler skips those optimizer steps)"
        targets = "no loss or parameter"
    return f"info: {made}, {fate}: it reaches {targets}, so it is not a finding"


@dataclasses.dataclass(frozen=True)
class BandCheck:
    """A run's loss against the envelope of correct implementations (``shadow.envelope``): whether it stays in the
    band, step by step, and the first step where it leaves it."""

    first: int  # the first step compared (the report's first shadowed optimizer step)
    steps: int  # steps compared
    runs: int  # the envelope's runs with random rounding
    device: str  # ... their emulated device
    confidence: float  # the band's
    left: int | None  # the first step whose loss lies outside the band (None: inside at every step compared)
    loss: float = math.nan  # at that step: the run's loss, the band's edges and the float64 loss
    low: float = math.nan
    high: float = math.nan
    float64: float = math.nan

    def __str__(self) -> str:
        band = f"the {self.confidence:.0%} band of correct implementations ({self.runs} {self.device} runs)"
        last = self.first + self.steps - 1
        if self.left is None:
            return f"the loss stays inside {band} at every step compared ({self.first} to {last}): normal rounding"
        side = "above" if self.loss > self.high else "below"
        edge = self.high if self.loss > self.high else self.low
        return (f"the loss leaves {band} at step {self.left}: {self.loss:.9g} lies {abs(self.loss - edge):.2e} "
                f"{side} it ([{self.low - self.float64:+.2e}, {self.high - self.float64:+.2e}] around the float64 "
                f"loss {self.float64:.9g}, {abs(self.loss - self.float64) / (self.high - self.low):.2g} band widths "
                "away): more than correct rounding makes")


def run_losses(report: ReportData, steps: int) -> tuple[int, list[float]]:
    """(the first step, the losses): ``report``'s loss per optimizer step (its trajectory) up to step ``steps``, from
    the step shadowing began (``shadow run --skip-steps``), as far as each step has a loss."""
    first = 1 + int((report.meta.get("run") or {}).get("skip_steps") or 0)
    losses = []
    for s in report.trajectory[:max(0, steps - first + 1)]:
        if s.loss is None:
            break
        losses.append(s.loss)
    return first, losses


def check_band(report: ReportData, envelope: Envelope) -> BandCheck | None:
    """``report``'s losses (``run_losses``) against ``envelope``; None where the report has no loss in a step the
    envelope covers."""
    first, losses = run_losses(report, envelope.steps)
    if not losses:
        return None
    left = envelope.leaves(losses, start=first)
    kept = dict(runs=envelope.runs, device=envelope.device, confidence=envelope.confidence)
    if left is None:
        return BandCheck(first, len(losses), left=None, **kept)
    i = left - 1
    return BandCheck(first, len(losses), left=left, loss=losses[left - first], low=envelope.low[i],
                     high=envelope.high[i], float64=envelope.float64[i], **kept)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What a report concludes. ``lines`` (``text``) render it; the fields hold the same findings as data."""

    calls: int  # aten calls seen
    replayed: int  # ... replayed in float64 (own kernel or decomposition)
    budgeted: int  # ... held to a rule's error budget (a derived one)
    guessed: tuple[tuple[str, int], ...]  # (op class, calls) judged only by the guess for ops no rule knows: not judged
    dtypes: tuple[str, ...]  # floating result dtypes of the budgeted calls
    over_budget: tuple[OpClass, ...]  # op classes with calls over budget, worst first
    arithmetic: Arithmetic | None  # the format most of them read, said once (None: no shared cause)
    nonfinite: NonfiniteOrigin | None  # NaN/Inf that reaches the loss, a gradient or a parameter (None: none does)
    absorbed: tuple[Absorbed, ...]  # NaN/Inf born and absorbed before any of those: information
    trained: bool  # the run has a backward (its targets: losses, gradients, parameters; else its result)
    nonfinite_elements: int  # elements where device and shadow disagree on NaN/Inf (every call)
    first_nonfinite_op: str  # ... the op of the first of them when it is past the kept records ("" otherwise)
    untrusted: tuple[tuple[str, int], ...]  # (op class, calls) whose float64 reference mpmath found wrong
    unsupported: tuple[tuple[str, str], ...]  # (op, first reason) of the ops shadow could not replay
    unsupported_calls: int
    notes: tuple[str, ...]  # what else limits the report: internal errors, unseen writes, capped records...
    kernels: tuple[FusedKernel, ...]  # fused kernels of compiled graphs over budget, judged alone, worst first
    known: tuple[tuple[str, str], ...]  # (op class over budget, the kernel property that explains it: KERNELS)
    amplification: Amplification | None = None  # drift correct rounding grew into (None: over budget, or none)
    band: BandCheck | None = None  # the loss against an envelope of correct implementations (None: none given)

    @property
    def suspicious(self) -> bool:
        """Something a user should look at: an op over budget, NaN/Inf reaching what is trained or disagreed on past
        the kept records, a wrong reference. Calls judged only by a guessed budget are none of these (no
        evidence either way): ``guessed`` lists them, and they are never counted in the all-clear."""
        return bool(self.over_budget or self.nonfinite or self.first_nonfinite_op or self.untrusted
                    or (self.band is not None and self.band.left is not None))

    @property
    def plot(self) -> str:
        """The figure of ``shadow.plots.FIGURES`` that shows the verdict: the bits each op class reads when op
        classes are over budget, else the drift along the op sequence (where a NaN/Inf finding is born is marked
        on it)."""
        return "bits" if self.over_budget and self.nonfinite is None else "drift"

    @property
    def lines(self) -> list[str]:
        dtypes = "/".join(d.replace("torch.", "") for d in self.dtypes) or "float"
        out = []
        if self.nonfinite is not None:
            out.append(self.nonfinite.headline)
            if self.nonfinite.op:
                out.append(f"  {self.nonfinite.route}")
        if self.arithmetic is not None:
            out.append(self.arithmetic.line(dtypes))
            others = [c for c in self.over_budget if c not in self.arithmetic.classes]
            if others:
                out.append(f"exceptions: {_plural(len(others), 'op class', 'op classes')} over budget "
                           f"read{'s' if len(others) == 1 else ''} otherwise:")
                out += [f"  {c.describe(like=False)}" for c in others]
            if self.arithmetic.within:
                out.append(f"exceptions: within their {dtypes} budgets: {_names(list(self.arithmetic.within), 6)}")
        elif self.over_budget:
            n = len(self.over_budget)
            out.append(f"{n} op class{'es' if n > 1 else ''} over budget ({'their' if n > 1 else 'its'} own "
                       f"error beyond what a correct {dtypes} kernel makes):")
            out += [f"  {c}" for c in self.over_budget]
        out += [f"  {k}" for k in self.kernels]
        out += [f"known: {op}: {why}" for op, why in self.known]
        if self.first_nonfinite_op:
            out.append(f"device and shadow disagree on NaN/Inf in {self.nonfinite_elements} elements, first in "
                       f"{op_class(self.first_nonfinite_op)}; where it was born is past the kept records (raise "
                       "--max-records / max_records)")
        if self.amplification is not None:
            out += self.amplification.lines(dtypes)
        if self.band is not None and self.band.left is not None:
            out.append(str(self.band))
        if self.untrusted:
            shown = _names([f"{op} ({_plural(n, 'call')})" for op, n in self.untrusted])
            out.append(f"float64 itself is inaccurate (cancellation) in {shown}: their figures use mpmath's exact "
                       "value where sampled")
        if not out:
            if not self.replayed:
                out.append("no op call was replayed: nothing to judge")
            elif self.budgeted:
                out.append(f"all {self.budgeted} calls held to derived budgets are within their {dtypes} budgets: "
                           "nothing suspicious")
            elif self.guessed:
                out.append(f"{self.replayed} replayed calls, none held to a derived error budget: their local errors "
                           "are not judged")
            else:
                out.append(f"{self.replayed} replayed calls, none held to an error budget (budgets off): "
                           "their local errors are not judged")
        if self.band is not None and self.band.left is None:
            out.append(str(self.band))
        out[0] = "verdict: " + out[0]
        shown_absorbed = self.absorbed[:_SHOWN]
        out += [_absorbed_line(a, self.trained) for a in shown_absorbed]
        if len(self.absorbed) > _SHOWN:
            out.append(f"info: and {len(self.absorbed) - _SHOWN} more op classes made NaN/Inf that was absorbed "
                       "(shadow.nonfinite.flow lists them)")
        if self.guessed:
            calls = sum(n for _, n in self.guessed)
            out.append(f"not judged: {_plural(calls, 'call')} of {_names([op for op, _ in self.guessed])} (no budget "
                       "rule: the few ulps guessed for them are no evidence, so they are neither over nor within)")
        if self.unsupported:
            shown = "; ".join(f"{op} ({why})" for op, why in self.unsupported[:_SHOWN])
            more = f"; and {len(self.unsupported) - _SHOWN} more ops" if len(self.unsupported) > _SHOWN else ""
            out.append(f"not checked: {self.unsupported_calls} calls of {len(self.unsupported)} ops shadow cannot "
                       f"replay (device results adopted, drift restarts there): {shown}{more}")
        out += [f"note: {n}" for n in self.notes]
        return out

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


@dataclasses.dataclass(frozen=True)
class FusedKernel:
    """A fused kernel of a compiled graph over its budget, judged alone against its own nodes' float64 replay
    (``report.meta[KERNELS_KEY]``): the kernel in the graph that errs."""

    op: str  # "inductor.cpp_fused_add_div_exp_0"
    graph: str  # "compiled.graph0"
    calls: int  # calls judged
    over_calls: int  # ... over budget
    budget_used: float  # the worst call's
    effective_bits: float | None

    def __str__(self) -> str:
        bits = "" if self.effective_bits is None else f" (reads ~{self.effective_bits:.0f} bits)"
        return (f"fused kernel {self.op} of {self.graph}: {times(self.budget_used)} budget in {self.over_calls} of "
                f"{self.calls} calls{bits}")


def fused_kernels(report: ReportData) -> tuple[FusedKernel, ...]:
    """The compiled graphs' fused kernels with calls over budget, the worst first."""
    calls: dict[tuple[str, str], list[Record]] = {}
    for d in report.meta.get(KERNELS_KEY) or ():
        r = Record.from_dict(d)
        calls.setdefault((r.op, r.module), []).append(r)
    found = []
    for (op, graph), rs in calls.items():
        over = [r for r in rs if r.over_budget]
        if over:
            worst = max(over, key=lambda r: r.budget.used)
            bits = worst.local.effective_bits if worst.local is not None else None
            found.append(FusedKernel(op, graph, len(rs), len(over), worst.budget.used,
                                     bits if bits is not None and math.isfinite(bits) else None))
    return tuple(sorted(found, key=lambda k: (-k.budget_used, k.op)))


def _thnn_bf16_convolutions(numerics: dict) -> bool:
    """Whether a CPU bfloat16 convolution ran PyTorch's own kernels: oneDNN has none below AVX-512 or is disabled."""
    return False in (numerics.get("torch.backends.mkldnn.enabled"),
                     numerics.get("torch.ops.mkldnn._is_mkldnn_bf16_supported()"))


# (op classes, dtype, when (on the report's meta["numerics"]), why): kernel properties measured and reproduced bit for
# bit (docs/budgets.md: Kernel findings) that put a correct kernel's calls over the budget of one rounding
KERNELS = (
    (("aten.convolution", "aten.convolution_backward"), "torch.bfloat16", _thnn_bf16_convolutions,
     "if it ran on the CPU: this CPU has no oneDNN bfloat16 convolution (below AVX-512, or oneDNN disabled: "
     "meta numerics), so PyTorch's own kernels ran, which round partial sums to bfloat16 (col2im adds the "
     "overlapping columns in bfloat16: up to one rounding per kernel offset, 9 for 3x3, where a correct kernel "
     "rounds once); a property of those kernels, reproduced bit for bit (docs/budgets.md: Kernel findings)"),
)


def known_kernels(classes: tuple[OpClass, ...], numerics: dict) -> tuple[tuple[str, str], ...]:
    """The op classes over budget that a kernel property in ``KERNELS`` explains, with what it is."""
    return tuple((c.op, why) for c in classes for ops, dtype, when, why in KERNELS
                 if c.op in ops and dtype in c.dtypes and when(numerics))


def op_classes(report: ReportData) -> list[OpClass]:
    """Every op class with calls held to a rule's budget, the worst budget use first."""
    merged: dict[str, Aggregate] = {}
    for op, agg in report.by_op.items():
        if agg.budgeted_calls:
            key = op_class(op)
            if key not in merged:
                merged[key] = Aggregate()
            merged[key].merge(agg)
    worst: dict[str, Record] = {}
    for r in report.records:
        if r.budget is not None and not r.budget.is_default:
            key = op_class(r.op)
            w = worst.get(key)
            if w is None or r.budget.used > w.budget.used:
                worst[key] = r
    found = [OpClass(op=key, budgeted_calls=a.budgeted_calls, over_calls=a.over_budget_calls,
                     budget_used=a.max_budget_used,
                     effective_bits=a.min_effective_bits if math.isfinite(a.min_effective_bits) else None,
                     dtypes=tuple(sorted(d for d in a.dtypes if "float" in d)), worst=worst.get(key))
             for key, a in merged.items()]
    return sorted(found, key=lambda c: (-c.budget_used, c.op))


def _per_class(by_op: dict[str, Aggregate], count: str) -> tuple[tuple[str, int], ...]:
    """(op class, calls) of the op classes with calls ``count`` counts (an ``Aggregate`` field), most first."""
    found: dict[str, int] = {}
    for op, a in by_op.items():
        n = getattr(a, count)
        if n:
            found[op_class(op)] = found.get(op_class(op), 0) + n
    return tuple(sorted(found.items(), key=lambda kv: (-kv[1], kv[0])))


def conclude(report: ReportData, envelope: Envelope | None = None) -> Verdict:
    """The verdict on ``report``: findings as data, and their lines; with ``envelope`` (``shadow.envelope``), whether
    the run's loss stays in the band of correct implementations, and from which step it leaves it."""
    by_op = report.by_op
    classes = op_classes(report)
    nonfinite = flow(report)
    first = min(((a.first_nonfinite, op) for op, a in by_op.items() if a.first_nonfinite is not None), default=None)
    kept = {r.index for r in report.records}
    untrusted, guessed = _per_class(by_op, "spot_untrusted"), _per_class(by_op, "guessed_calls")
    cov = report.coverage
    notes = []
    if cov.internal_errors:
        notes.append(f"{cov.internal_errors} internal errors of shadow (their ops adopted from the device, listed in "
                     "the coverage): a bug in shadow, please report it")
    if cov.unobserved_writes:
        notes.append(f"{cov.unobserved_writes} writes shadow did not see (ops run outside the ShadowMode block, with "
                     "torch dispatch disabled, or on another thread): resynced from the device, so drift restarts "
                     "there")
    if report.dropped_records:
        notes.append(f"per-call records capped at {report.max_records}: the {report.dropped_records} later calls are "
                     "in the tables, not in the records")
    for name, n in sorted(cov.compiled.items()):
        how = "ran eagerly: its figures are the eager kernels'" if cov.compiled_eagerly else \
            "ran as compiled code: its fused kernels unseen, its outputs adopted"
        notes.append(f"compiled module {name} ({n} calls) {how}")
    unsupported = tuple(sorted((op, why) for op, why in cov.unsupported.items() if by_op.get(op) is not None
                               and by_op[op].kinds.get("unsupported")))
    over_budget = tuple(c for c in classes if c.over_calls)
    return Verdict(
        calls=cov.calls, replayed=cov.replayed, budgeted=sum(c.budgeted_calls for c in classes), guessed=guessed,
        dtypes=tuple(sorted({d for c in classes for d in c.dtypes})),
        over_budget=over_budget, arithmetic=arithmetic(classes),
        nonfinite=NonfiniteOrigin.of(nonfinite), absorbed=nonfinite.absorbed, trained=nonfinite.trained,
        nonfinite_elements=sum(a.nonfinite for a in by_op.values()),
        first_nonfinite_op=first[1] if first is not None and first[0] not in kept else "",
        untrusted=untrusted,
        unsupported=unsupported, unsupported_calls=cov.unsupported_calls, notes=tuple(notes),
        kernels=fused_kernels(report), known=known_kernels(over_budget, report.meta.get("numerics") or {}),
        amplification=None if nonfinite.reaches else amplification(report),
        band=None if envelope is None else check_band(report, envelope))
