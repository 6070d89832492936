"""Emulated devices: dispatch modes that make CPU ops compute with another device's numerics.

Four devices with known numerical behaviour, so that shadow can be tested against defects whose size
is known in advance (and so that a user can ask "what would TF32 do to my model?"):

========================  =========================================================================
``TF32Mode()``            matmul and convolution (mm, addmm, bmm, baddbmm, addbmm, _addmm_activation,
                          convolution and convolution_backward): float32 operands rounded to TF32
                          (10 stored mantissa bits, 8 exponent bits), products accumulated in float32.
``BF16Mode()``            float32 storage, bfloat16 arithmetic: every floating op sees its floating
                          tensor inputs rounded to bfloat16 and its floating outputs rounded to
                          bfloat16 (stored back in the original dtype).
``FP16AccumMode()``       float16 storage with float16 accumulators: sum, mean, cumsum, mm, bmm, addmm,
                          baddbmm, mv, addmv and dot on float16 tensors add their terms into a float16
                          accumulator rounded after every addition (or every ``block`` terms).
``FTZMode()``             flush-to-zero: every floating op sees subnormal inputs as zero and returns
                          subnormal results as zero (the sign is kept: -1e-40 becomes -0.0).
========================  =========================================================================

>>> from shadow.modes.emulate import TF32Mode, emulate
>>> from shadow import ShadowMode
>>> with TF32Mode(), ShadowMode() as sm:       # the emulation OUTSIDE, ShadowMode inside
...     y = a @ b                              # doctest: +SKIP
>>> sm.report.find(op="aten.mm")[0].local      # the TF32 error, seen as the device's  # doctest: +SKIP
>>> with emulate("fp16_accum", block=16):     # the same modes by name
...     s = x.half().sum()                     # doctest: +SKIP

Stacking order. A dispatch mode entered later sits above the ones entered before it and sees each
op first; when it calls the op, the call goes down to the mode below. ShadowMode must see the op
first and let the "device" compute it, so the emulation is entered FIRST (outermost ``with``):
``with TF32Mode(), ShadowMode() as sm:``. ShadowMode replays in float64 with Python dispatch disabled,
so the emulation never touches the shadow. Entering an emulation while a ShadowMode is active is
the wrong order (the emulation would sit on top and ShadowMode would see its internal ops instead of
the user's): it raises ``EmulationOrderError``.

What each emulation claims, and what passes through unchanged:

- Each mode changes only the ops it claims (tables below); every other op, and every op on dtypes a
  mode does not emulate (TF32: float32/complex64 only; fp16 accumulation: float16 only), runs exactly
  as without the mode.
- Pure data movement (copy, cat, index, gather, pad, fill...) is bit-exact on every device and is never
  rounded or flushed (``MOVE_OPS``); neither are views.
- In-place and ``out=`` variants are emulated: the result is written into the destination as the op
  would. Ops that write only part of their destination (``index_add_``, ``scatter_add_``,
  ``index_put_(accumulate=True)``...: ``PARTIAL_WRITE_OPS``) pass through under BF16Mode and FTZMode,
  because rounding the whole destination would change elements the op does not write.
- The modes consume no random numbers (random ops run once, as without the mode, and only their
  inputs and outputs are rounded) and are pure functions of their inputs: the same inputs give the
  same bits.
- Emulations do not compose within one op: an op claimed by an upper emulation is computed by it
  alone (its internal work runs with dispatch disabled); ops it does not claim reach the modes below.

TF32 rounding: which rule real hardware uses
--------------------------------------------
Measured (this module's tests, ``-m cuda``; H100, torch 2.11+cu130, cuBLAS and cuDNN as shipped): an
fp32 matrix times the identity returns its operand rounded to TF32, so the rule can be read off
directly. cuBLAS mm/bmm (sizes 8 to 2048): round to nearest, ties to EVEN, on every element and every
tie tested. cuDNN: 1x1 convolutions (and their grad_input) ties to even too, but a 3x3 convolution
kernel rounds ties AWAY from zero; a 1-channel 1x1 convolution did not use TF32 at all. Ampere GPUs
were not measured.
What public sources say:
- The tensor-core instruction itself (``mma.sync ... .tf32``) reads the upper 19 bits of the float32
  register and ignores the low 13: raw float32 bits fed to it are TRUNCATED (round toward zero)
  (x.momo86.net/article/127; a public attention kernel's comment: "1 + 0.75*2^-10 enters as 1.0").
- PTX ``cvt.rna.tf32.f32`` rounds to nearest with ties AWAY from zero (on Ampere: an integer add of
  0x1000 to the bits and a mask 0xffffe000, x.momo86.net/article/159). CUTLASS's
  ``PreferredRoundingMode<tfloat32_t, float>`` is ``round_half_ulp_truncate``, the same rule
  (include/cutlass/tfloat32.h, gemm/warp/mma_tensor_op.h).
- pytorch/pytorch#49625 (ptrblck, NVIDIA) changed PyTorch's TF32 docs from "truncating" to
  "rounding" for cuBLAS/cuDNN; NVIDIA documents no tie rule for them.
So the default is ``rounding="rne"`` (what cuBLAS did on every matmul measured); ``"rna"`` (CUTLASS,
cvt.rna, the cuDNN 3x3 kernel measured) and ``"rz"`` (raw float32 fed to the instruction) are
selectable. The rules differ only on exact ties (about 1 float32 in 8192), so error statistics agree;
truncation is biased and about 2.5x worse. Products of two TF32 values (11-bit significands) are
exact in float32, and the CPU's float32 matmul accumulates them in float32, as tensor cores do (in
another order: the emulated and real results agree to ~1e-6 of the largest output, measured).

Left out: scaled_dot_product_attention's fused CPU kernel is not TF32-emulated (one fused op here;
on CUDA it depends on the attention backend chosen); mv/addmv/dot are not claimed by TF32Mode
(matrix-vector products, not GEMMs); float16 accumulation does not cover convolution;
convolution_backward.out passes through TF32Mode.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any, Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

aten = torch.ops.aten
_no_dispatch = torch._C._DisableTorchDispatch  # an emulation's own work must reach no mode and no kernel twice

__all__ = [
    "Emulation",
    "TF32Mode",
    "BF16Mode",
    "FP16AccumMode",
    "FTZMode",
    "emulate",
    "EMULATIONS",
    "EmulationOrderError",
    "Format",
    "TF32",
    "BF16",
    "FP16",
    "Rounding",
    "round_to",
    "to_tf32",
    "flush_subnormals",
]


# --- number formats and rounding: pure functions of a tensor ---
@dataclasses.dataclass(frozen=True)
class Format:
    """A binary floating-point format: ``precision`` significand bits (the implicit one included),
    exponents of normal numbers in [emin, emax], gradual underflow below."""

    name: str
    precision: int
    emin: int
    emax: int
    dtype: torch.dtype | None = None  # the torch dtype holding exactly this format, if any

    @property
    def max(self) -> float:
        return (2.0 - 2.0 ** (1 - self.precision)) * 2.0**self.emax


TF32 = Format("tf32", 11, -126, 127)
BF16 = Format("bfloat16", 8, -126, 127, torch.bfloat16)
FP16 = Format("float16", 11, -14, 15, torch.float16)


class Rounding(str, enum.Enum):
    """How a value between two neighbours of the format is rounded."""

    NEAREST_EVEN = "rne"  # IEEE default: nearest, ties to the even significand
    NEAREST_AWAY = "rna"  # nearest, ties away from zero (PTX cvt.rna, CUTLASS round_half_ulp_truncate)
    TOWARD_ZERO = "rz"  # truncation: drop the extra bits

    @classmethod
    def parse(cls, value: str | Rounding) -> Rounding:
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"rounding={value!r}: expected one of {[r.value for r in cls]}") from None


_TORCH_CASTS_EXACTLY = frozenset({torch.float32, torch.float16, torch.bfloat16})


def round_to(x: torch.Tensor, fmt: Format, rounding: str | Rounding = "rne") -> torch.Tensor:
    """``x`` rounded to the values of ``fmt``, returned in ``x``'s dtype (a new tensor).

    Non-finite values are kept; finite values beyond the format's range become +-inf (to nearest) or
    +-max (toward zero); tiny ones round to the format's subnormals. Complex tensors round both parts.

    >>> round_to(torch.tensor([1 + 2**-11], dtype=torch.float32), TF32, "rne")   # a tie: to even
    tensor([1.])
    >>> round_to(torch.tensor([1 + 2**-11], dtype=torch.float32), TF32, "rna")   # a tie: away from 0
    tensor([1.0010])
    """
    rounding = Rounding.parse(rounding)
    if x.is_complex():
        return torch.complex(round_to(x.real, fmt, rounding), round_to(x.imag, fmt, rounding))
    if not x.is_floating_point():
        return x
    if rounding is Rounding.NEAREST_EVEN and fmt.dtype is not None and x.dtype in _TORCH_CASTS_EXACTLY:
        # one correctly rounded cast (float64 sources would go through float32 first: a double rounding)
        return x.to(fmt.dtype).to(x.dtype)
    r = _round_f64(x.to(torch.float64, copy=True), fmt, rounding).to(x.dtype)
    return torch.where(x.abs() < float("inf"), r, x)  # NaN payloads kept bit for bit


_RNE_MAGIC = 1.5 * 2.0**52  # adding it leaves no fraction bits: the sum is rounded to an integer


def _round_f64(s: torch.Tensor, fmt: Format, rounding: Rounding) -> torch.Tensor:
    """Round a float64 tensor to ``fmt`` exactly (every step below is exact in float64)."""
    # the spacing of fmt at s: 2**(e - precision + 1) for |s| in [2**e, 2**(e+1)), and the
    # subnormal spacing below 2**emin; built from exponent bits so that it is an exact power of two
    e = ((s.view(torch.int64) >> 52) & 0x7FF) - 1023
    e = e.clamp_(fmt.emin, 1023 + fmt.precision - 1) - (fmt.precision - 1)
    q = ((e + 1023) << 52).view(torch.float64)
    t = s / q  # an exact scaling: |t| < 2**precision
    if rounding is Rounding.NEAREST_EVEN:
        r = (t + _RNE_MAGIC) - _RNE_MAGIC  # half to even by float64's own rounding (|t| < 2**51); faster than round
        r = torch.copysign(r, t)  # a negative value that rounds to 0 gives +0 above: -0 is the rounded value
    elif rounding is Rounding.NEAREST_AWAY:
        r = torch.copysign(torch.floor(t.abs() + 0.5), t)  # exact: |t| + 0.5 stays below 2**53
    else:
        r = torch.trunc(t)
    r = r * q
    if rounding is Rounding.TOWARD_ZERO:
        r = r.clamp(-fmt.max, fmt.max)
    else:
        r = torch.where(r.abs() > fmt.max, torch.copysign(torch.full_like(r, float("inf")), r), r)
    return torch.where(s.abs() < float("inf"), r, s)  # inf and NaN kept (cheaper than isfinite)


def to_tf32(x: torch.Tensor, rounding: str | Rounding = "rne") -> torch.Tensor:
    """float32 ``x`` rounded to TF32 (10 stored mantissa bits), as tensor cores see it; a new tensor.

    >>> to_tf32(torch.tensor([1.0 + 2**-11, 1.0 + 3 * 2**-12]))   # a tie, to even; above a tie
    tensor([1.0000, 1.0010])
    >>> to_tf32(torch.tensor([1.0 + 2**-11]), "rna")                # the tie away from zero
    tensor([1.0010])
    """
    return round_to(x, TF32, rounding)


def flush_subnormals(x: torch.Tensor) -> torch.Tensor:
    """``x`` with every subnormal (0 < |v| < smallest normal of its dtype) replaced by a zero of
    the same sign; a new tensor. Normal values, zeros, inf and NaN are kept bit for bit.

    >>> flush_subnormals(torch.tensor([1e-40, -1e-40, 1e-30]))
    tensor([0.0000e+00, -0.0000e+00, 1.0000e-30])
    """
    if x.is_complex():
        return torch.complex(flush_subnormals(x.real), flush_subnormals(x.imag))
    if not x.is_floating_point():
        return x
    return torch.where(x.abs() < torch.finfo(x.dtype).tiny, x * 0, x)  # x * 0: a zero with x's sign


# --- reading and rewriting an op's arguments by schema name ---
@functools.lru_cache(maxsize=None)
def _positions(func: torch._ops.OpOverload) -> dict[str, int]:
    return {a.name: i for i, a in enumerate(func._schema.arguments)}


def _get(func, args: tuple, kwargs: dict, name: str) -> Any:
    i = _positions(func)[name]
    a = func._schema.arguments[i]
    if not a.kwarg_only and i < len(args):
        return args[i]
    if name in kwargs:
        return kwargs[name]
    return a.default_value if a.has_default_value() else None


def _with(func, args: tuple, kwargs: dict, **new: Any) -> tuple[list, dict]:
    """Copies of (args, kwargs) with the named arguments replaced."""
    args, kwargs = list(args), dict(kwargs)
    for name, v in new.items():
        i = _positions(func)[name]
        if not func._schema.arguments[i].kwarg_only and i < len(args):
            args[i] = v
        else:
            kwargs[name] = v
    return args, kwargs


def _map(fn: Callable[[torch.Tensor], torch.Tensor], v: Any) -> Any:
    """fn applied to a floating tensor, or to each one of a tensor list; anything else unchanged."""
    if isinstance(v, torch.Tensor):
        return fn(v) if (v.is_floating_point() or v.is_complex()) and not v._is_zerotensor() else v
    if isinstance(v, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in v):
        return type(v)(_map(fn, t) for t in v)
    return v


def _apply_in_place(fn: Callable[[torch.Tensor], torch.Tensor], v: Any) -> None:
    if isinstance(v, torch.Tensor):
        if (v.is_floating_point() or v.is_complex()) and not v._is_zerotensor() and v.numel():
            v.copy_(fn(v))
    elif isinstance(v, (list, tuple)):
        for t in v:
            _apply_in_place(fn, t)


def _op_name(func) -> str:
    """The op's name without namespace and overload: "add_" for aten.add_.Tensor."""
    return func._schema.name.split("::")[-1]


def _written(func) -> list[torch._C.Argument]:
    return [a for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write]


def _write_back(func, args: tuple, kwargs: dict, result: torch.Tensor) -> torch.Tensor:
    """Return ``result`` as the op would: written into ``out=`` or ``self`` for those variants."""
    writes = _written(func)
    if not writes:
        return result
    dest = _get(func, args, kwargs, writes[0].name)
    if writes[0].is_out and dest.shape != result.shape:
        dest.resize_(result.shape)  # out= semantics: the op resizes its output
    dest.copy_(result)
    return dest


# --- the rule tables ---
@dataclasses.dataclass(frozen=True)
class Call:
    """A rule's input: the op, its arguments as the mode received them, and the mode's options."""

    func: torch._ops.OpOverload
    args: tuple
    kwargs: dict
    options: _Options


@dataclasses.dataclass(frozen=True)
class _Options:
    rounding: Rounding = Rounding.NEAREST_EVEN  # TF32 operand rounding (cuBLAS, measured)
    block: int = 1  # fp16 accumulation: terms summed in float32 before each float16 rounding


Rule = Callable[[Call], Any]  # returns the op's result, or NotImplemented to fall through


class _Table:
    """One emulation's rules: exact op -> predicates (in registration order) -> pass through."""

    def __init__(self, name: str):
        self.name = name
        self.exact: dict[torch._ops.OpOverload, Rule] = {}
        self.predicates: list[tuple[Callable[[torch._ops.OpOverload], bool], Rule]] = []

    def register(self, *ops: torch._ops.OpOverload) -> Callable[[Rule], Rule]:
        """Register a rule for exact overloads; registering one twice is an error."""

        def deco(rule: Rule) -> Rule:
            for op in ops:
                if not isinstance(op, torch._ops.OpOverload):
                    raise TypeError(f"{self.name}: rules are registered for OpOverloads such as aten.mm.default, "
                                    f"got {op!r}")
                if op in self.exact:
                    raise ValueError(f"{self.name}: a rule for {op} is already registered ({self.exact[op]!r})")
                self.exact[op] = rule
            return rule

        return deco

    def predicate(self, pred: Callable[[torch._ops.OpOverload], bool]) -> Callable[[Rule], Rule]:
        def deco(rule: Rule) -> Rule:
            self.predicates.append((pred, rule))
            return rule

        return deco

    def chain(self, func) -> tuple[Rule, ...]:
        if not isinstance(func, torch._ops.OpOverload) or func.namespace != "aten":
            return ()
        rules = [self.exact[func]] if func in self.exact else []
        rules.extend(rule for pred, rule in self.predicates if pred(func))
        return tuple(rules)


_TF32 = _Table("tf32")
_BF16 = _Table("bf16")
_FP16_ACCUM = _Table("fp16_accum")
_FTZ = _Table("ftz")


def _overloads(*names: str, skip: Iterable[str] = ("dtype", "dtype_out")) -> list[torch._ops.OpOverload]:
    """Every overload of the named aten ops, except ``skip`` (mm.dtype: a float32 result of float16
    inputs, not an accumulation in the input dtype)."""
    out = []
    for name in names:
        packet = getattr(aten, name)
        out.extend(getattr(packet, ov) for ov in packet.overloads() if ov not in skip)
    return out


# --- TF32: operands of matmul and convolution rounded ---
# op -> the operands tensor cores read in TF32; the accumulator input (addmm's self), bias, alpha and
# beta stay float32, as in cuBLAS/cuDNN epilogues
TF32_OPERANDS: dict[str, tuple[str, ...]] = {
    "mm": ("self", "mat2"),
    "bmm": ("self", "mat2"),
    "addmm": ("mat1", "mat2"),
    "addmm_": ("mat1", "mat2"),
    "_addmm_activation": ("mat1", "mat2"),
    "baddbmm": ("batch1", "batch2"),
    "baddbmm_": ("batch1", "batch2"),
    "addbmm": ("batch1", "batch2"),
    "addbmm_": ("batch1", "batch2"),
    "convolution": ("input", "weight"),
    "_convolution": ("input", "weight"),
    "convolution_overrideable": ("input", "weight"),
}
_TF32_DTYPES = frozenset({torch.float32, torch.complex64})  # TF32 applies to float32 data only


def _tf32_operand(c: Call, t: Any) -> Any:
    if isinstance(t, torch.Tensor) and t.dtype in _TF32_DTYPES:
        return to_tf32(t, c.options.rounding)
    return t


def _tf32_operands(c: Call, operands: tuple[str, ...]) -> Any:
    """Round the TF32 operands; the op itself then multiplies exactly and accumulates in float32
    (and writes in-place / out= results where it always does)."""
    new = {n: _tf32_operand(c, _get(c.func, c.args, c.kwargs, n)) for n in operands}
    args, kwargs = _with(c.func, c.args, c.kwargs, **new)
    return c.func(*args, **kwargs)


for _name, _operands in TF32_OPERANDS.items():
    for _op in _overloads(_name):
        _TF32.register(_op)(functools.partial(_tf32_operands, operands=_operands))


@_TF32.register(aten.convolution_backward.default)
def _tf32_convolution_backward(c: Call) -> Any:
    """grad_input (grad_output x weight) and grad_weight (input x grad_output) are TF32 convolutions;
    grad_bias is a float32 sum of the unrounded grad_output."""
    get = functools.partial(_get, c.func, c.args, c.kwargs)
    mask = list(get("output_mask"))
    args, kwargs = _with(c.func, c.args, c.kwargs, grad_output=_tf32_operand(c, get("grad_output")),
                         input=_tf32_operand(c, get("input")), weight=_tf32_operand(c, get("weight")),
                         output_mask=[mask[0], mask[1], False])
    gi, gw, _ = c.func(*args, **kwargs)
    gb = None
    if mask[2]:
        args, kwargs = _with(c.func, c.args, c.kwargs, output_mask=[False, False, True])
        gb = c.func(*args, **kwargs)[2]
    return gi, gw, gb


# --- BF16 compute and flush-to-zero: every floating op's inputs and outputs transformed ---
# ops that only copy, select or place values: bit-exact on every device, never rounded
MOVE_OPS = frozenset({
    "copy", "copy_", "_copy_from", "_copy_from_and_resize", "_to_copy", "clone", "lift_fresh", "lift_fresh_copy",
    "detach", "detach_", "cat", "stack", "index", "index_select", "gather", "take", "masked_select", "nonzero",
    "index_put", "index_put_", "index_copy", "index_copy_", "index_fill", "index_fill_", "masked_fill",
    "masked_fill_", "masked_scatter", "masked_scatter_", "scatter", "scatter_", "slice_scatter",
    "select_scatter", "diagonal_scatter", "as_strided_scatter", "where", "fill", "fill_", "zero_", "zeros",
    "zeros_like", "ones", "ones_like", "full", "full_like", "new_zeros", "new_ones", "new_full", "empty",
    "empty_like", "empty_strided", "new_empty", "new_empty_strided", "scalar_tensor", "flip", "roll", "repeat",
    "constant_pad_nd", "reflection_pad1d", "reflection_pad2d", "reflection_pad3d", "replication_pad1d",
    "replication_pad2d", "replication_pad3d", "tril", "triu", "tril_", "triu_", "_local_scalar_dense",
    "resize_", "resize_as_", "set_", "_foreach_copy_", "split_with_sizes_copy", "unbind_copy",
    "narrow_copy", "_unsafe_index", "_unsafe_index_put", "embedding",
})
# ops writing only part of their destination: a whole-tensor round trip would change the rest
PARTIAL_WRITE_OPS = frozenset({
    "index_add", "index_add_", "index_reduce", "index_reduce_", "scatter_add", "scatter_add_",
    "scatter_reduce", "scatter_reduce_", "_index_put_impl_", "put", "put_", "fill_diagonal_",
})
PASS_THROUGH_OPS = MOVE_OPS | PARTIAL_WRITE_OPS


def _computes(func: torch._ops.OpOverload) -> bool:
    """An op that computes floating values: not a view or alias, not data movement, not a partial write."""
    s = func._schema
    if _op_name(func) in PASS_THROUGH_OPS or torch.Tag.inplace_view in func.tags:
        return False
    if torch.Tag.view_copy in func.tags:  # *_copy twins of views: data movement
        return False
    return not any(r.alias_info is not None and not r.alias_info.is_write for r in s.returns)


def _transform_io(c: Call, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Run the op on fn(inputs) and return fn(outputs); written arguments are transformed in place.

    An in-place op's ``self`` is transformed in place before the op (it is read, then overwritten in
    full: ops that write part of their destination are in PARTIAL_WRITE_OPS and pass through)."""
    func = c.func
    args, kwargs = list(c.args), dict(c.kwargs)
    written = []
    for i, a in enumerate(func._schema.arguments):
        positional = not a.kwarg_only and i < len(args)
        if not positional and a.name not in kwargs:
            continue
        v = args[i] if positional else kwargs[a.name]
        if a.alias_info is not None and a.alias_info.is_write:
            written.append(v)
            if not a.is_out:
                _apply_in_place(fn, v)
            continue
        nv = _map(fn, v)
        if nv is not v:
            if positional:
                args[i] = nv
            else:
                kwargs[a.name] = nv
    out = func(*args, **kwargs)
    for v in written:
        _apply_in_place(fn, v)
    returns = func._schema.returns
    flat = [out] if len(returns) == 1 else list(out) if isinstance(out, (tuple, list)) else []
    for spec, v in zip(returns, flat):
        if spec.alias_info is None:  # a fresh result: this rule owns it
            _apply_in_place(fn, v)
    return out


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype is torch.bfloat16 else round_to(t, BF16)


_BF16.predicate(_computes)(functools.partial(_transform_io, fn=_bf16))
_FTZ.predicate(_computes)(functools.partial(_transform_io, fn=flush_subnormals))


# --- float16 accumulation: sums and dot products through a float16 accumulator ---
def _round16(s: torch.Tensor) -> torch.Tensor:
    return _round_f64(s, FP16, Rounding.NEAREST_EVEN)


def _accumulate(term: Callable[[int, int], torch.Tensor], n: int, block: int) -> torch.Tensor:
    """fp16(...fp16(fp16(t_0) + t_1)... + t_last) over the blocks [j, j + block) of n terms.

    ``term`` returns a block's terms summed in float32, or a float16 tensor when the block is one
    float16 value. float16 + float16 is one torch op (computed in float32, then rounded: correctly
    rounded, as double rounding is innocuous for a sum when 24 >= 2 * 11 + 1). Other terms go
    through float64, where an accumulator plus a float32 term is exact, so each step rounds once
    (a float32 -> float16 cast would round twice). Returns float64 holding float16 values."""
    acc = None
    for j in range(0, n, block):
        t = term(j, min(j + block, n))
        if t.dtype is torch.float16:
            acc = t.clone() if acc is None else acc + t
        else:
            t = t.to(torch.float64)
            acc = _round16(t if acc is None else acc + t)
    return acc.to(torch.float64)


def _fp16_only(c: Call, *tensors: Any) -> bool:
    """Emulated only for float16 data with a float16 result (a dtype= argument other than float16, or
    a float32 input, is another device's arithmetic)."""
    dtype = _get(c.func, c.args, c.kwargs, "dtype") if "dtype" in _positions(c.func) else None
    return all(isinstance(t, torch.Tensor) and t.dtype is torch.float16 for t in tensors if t is not None) and (
        dtype in (None, torch.float16))


def _matmul16(a: torch.Tensor, b: torch.Tensor, block: int) -> torch.Tensor:
    """a @ b (mm, bmm, mv, dot shapes) with a float16 accumulator along the contraction."""
    a32, b32 = a.float(), b.float()  # exact: float16 -> float32
    k = a.shape[-1]
    if k == 0:
        return torch.matmul(a32, b32).double()
    if b.dim() == 1:
        return _accumulate(lambda j, e: torch.matmul(a32[..., j:e], b32[j:e]), k, block)
    return _accumulate(lambda j, e: torch.matmul(a32[..., j:e], b32[..., j:e, :]), k, block)


def _reduce_last(x: torch.Tensor, dims: Any) -> tuple[torch.Tensor, list[int], int]:
    """x with the reduced dims moved last and flattened: (x2, kept sizes, n reduced)."""
    nd = x.dim()
    red = sorted({d % nd for d in dims}) if dims else list(range(nd))
    keep = [d for d in range(nd) if d not in red]
    n = 1
    for d in red:
        n *= x.shape[d]
    return x.permute(keep + red).reshape([x.shape[d] for d in keep] + [n]), red, n


def _sum16(c: Call, x: torch.Tensor, mean: bool) -> torch.Tensor:
    get = functools.partial(_get, c.func, c.args, c.kwargs)
    dims = get("dim") if "dim" in _positions(c.func) else None
    keepdim = bool(get("keepdim")) if "keepdim" in _positions(c.func) else False
    if isinstance(dims, int):
        dims = [dims]
    x2, red, n = _reduce_last(x, dims)
    b = c.options.block
    if n == 0:
        r = torch.zeros(x2.shape[:-1], dtype=torch.float64)
    elif b == 1:
        r = _accumulate(lambda j, e: x2[..., j], n, 1)
    else:
        x32 = x2.float()
        r = _accumulate(lambda j, e: x32[..., j:e].sum(-1), n, b)
    if mean:
        r = _round16(r / n)  # one rounding of the float16 quotient (0/0 -> nan, as torch's mean)
    if keepdim:
        for d in red:
            r = r.unsqueeze(d)
    return r.to(torch.float16)


def _fp16_rule(compute: Callable[[Call], torch.Tensor | None]) -> Rule:
    """Wrap a float16-accumulation computation: it returns the functional result (or None: pass
    through); in-place and out= variants get it written into their destination."""

    @functools.wraps(compute)
    def rule(c: Call) -> Any:
        r = compute(c)
        if r is None:
            return NotImplemented
        return _write_back(c.func, c.args, c.kwargs, r)

    return rule


@_FP16_ACCUM.register(*_overloads("sum", skip=("int", "float", "complex", "bool")), *_overloads("mean"))
@_fp16_rule
def _fp16_sum(c: Call) -> torch.Tensor | None:
    x = _get(c.func, c.args, c.kwargs, "self")
    if not _fp16_only(c, x):
        return None
    return _sum16(c, x, mean=_op_name(c.func) == "mean")


@_FP16_ACCUM.register(*_overloads("cumsum", "cumsum_"))
@_fp16_rule
def _fp16_cumsum(c: Call) -> torch.Tensor | None:
    """Each partial sum is a stored float16 output: sequential, rounded at every step (no blocks)."""
    x, dim = _get(c.func, c.args, c.kwargs, "self"), _get(c.func, c.args, c.kwargs, "dim")
    if not _fp16_only(c, x):
        return None
    if x.dim() == 0 or x.numel() == 0:
        return x.clone()
    xt = x.movedim(dim, -1)
    acc, outs = None, []
    for j in range(xt.shape[-1]):  # float16 + float16 is correctly rounded (see _accumulate)
        acc = xt[..., j].clone() if acc is None else acc + xt[..., j]
        outs.append(acc)
    return torch.stack(outs, -1).movedim(-1, dim)


# op -> (the two factors, the accumulator input or None): out = beta * input + alpha * (a @ b)
FP16_MATMULS: dict[str, tuple[str, str, str | None]] = {
    "mm": ("self", "mat2", None),
    "bmm": ("self", "mat2", None),
    "mv": ("self", "vec", None),
    "dot": ("self", "tensor", None),
    "addmm": ("mat1", "mat2", "self"),
    "addmm_": ("mat1", "mat2", "self"),
    "baddbmm": ("batch1", "batch2", "self"),
    "baddbmm_": ("batch1", "batch2", "self"),
    "addmv": ("mat", "vec", "self"),
    "addmv_": ("mat", "vec", "self"),
}


def _fp16_matmul(c: Call, a_name: str, b_name: str, c_name: str | None) -> torch.Tensor | None:
    get = functools.partial(_get, c.func, c.args, c.kwargs)
    a, b = get(a_name), get(b_name)
    bias = get(c_name) if c_name else None
    if not _fp16_only(c, a, b, bias):
        return None
    r = _matmul16(a, b, c.options.block)
    if bias is not None:
        # the epilogue: beta * C + alpha * acc, computed wide and rounded once to float16
        beta, alpha = get("beta"), get("alpha")
        r = alpha * r + (beta * bias.double() if beta != 0 else 0)
        r = _round16(r)
    return r.to(torch.float16)


for _name, _roles in FP16_MATMULS.items():
    _FP16_ACCUM.register(*_overloads(_name))(_fp16_rule(functools.partial(_fp16_matmul, a_name=_roles[0],
                                                                         b_name=_roles[1], c_name=_roles[2])))


# --- the modes ---
class EmulationOrderError(RuntimeError):
    """An emulation entered while a ShadowMode is active: it must be entered first (outside)."""

    def __init__(self, emulation: str):
        self.emulation = emulation  # how the emulation is built, e.g. "TF32Mode()"
        super().__init__(
            f"{emulation} entered inside an active ShadowMode: the emulation would sit above ShadowMode and "
            f"ShadowMode would see its internal ops. Enter the emulation first: "
            f"`with {emulation}, ShadowMode() as sm:`"
        )


class Emulation(TorchDispatchMode):
    """A dispatch mode that computes the ops its table claims with an emulated device's numerics and
    passes every other op through. Enter it OUTSIDE ShadowMode (see the module docstring).

    >>> with Emulation("tf32", rounding="rz"), ShadowMode() as sm:   # doctest: +SKIP
    ...     y = a @ b
    """

    def __init__(self, kind: str, **options: Any):
        super().__init__()
        if kind not in _TABLES:
            raise ValueError(f"Emulation({kind!r}): expected one of {sorted(_TABLES)}")
        self.kind = kind
        self._table = _TABLES[kind]
        self.options = _validated(kind, options)
        self._chains: dict[Any, tuple[Rule, ...]] = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.kind!r}, {self.options})"

    def __enter__(self):
        from .shadow import _ShadowDispatch

        if any(isinstance(m, _ShadowDispatch) for m in _get_current_dispatch_mode_stack()):
            built = f"emulate({self.kind!r})" if type(self) is Emulation else f"{type(self).__name__}()"
            raise EmulationOrderError(built)
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        chain = self._chains.get(func)
        if chain is None:
            chain = self._chains[func] = self._table.chain(func)
        if chain:
            call = Call(func, args, kwargs, self.options)
            with _no_dispatch():
                for rule in chain:
                    out = rule(call)
                    if out is not NotImplemented:
                        return out
        return func(*args, **kwargs)


def _validated(kind: str, options: dict) -> _Options:
    allowed = {"tf32": {"rounding"}, "fp16_accum": {"block"}}.get(kind, set())
    unknown = set(options) - allowed
    if unknown:
        raise TypeError(f"emulation {kind!r} takes options {sorted(allowed) or 'none'}, got {sorted(unknown)}")
    kw = {}
    if "rounding" in options:
        kw["rounding"] = Rounding.parse(options["rounding"])
    if "block" in options:
        block = options["block"]
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"block={block!r}: expected an int >= 1 (terms summed in float32 per float16 rounding)")
        kw["block"] = block
    return _Options(**kw)


class TF32Mode(Emulation):
    """float32 matmul and convolution with TF32 operands (10 mantissa bits), float32 accumulation.

    >>> with TF32Mode(), ShadowMode() as sm:      # the emulation outside   # doctest: +SKIP
    ...     y = a @ b
    """

    def __init__(self, *, rounding: str = "rne"):  # "rne" (cuBLAS), "rna" (CUTLASS, cvt.rna), "rz" (raw mma)
        super().__init__("tf32", rounding=rounding)


class BF16Mode(Emulation):
    """float32 storage, bfloat16 arithmetic: floating inputs and outputs of every op rounded to bfloat16.

    >>> with BF16Mode():
    ...     y = torch.exp(x)       # == torch.exp(x.bfloat16()).float()   # doctest: +SKIP
    """

    def __init__(self):
        super().__init__("bf16")


class FP16AccumMode(Emulation):
    """float16 sums, means, cumsums and matmuls accumulated in float16.

    >>> with FP16AccumMode():
    ...     torch.ones(4096, dtype=torch.float16).sum()   # 2048: 2048 + 1 rounds back to 2048  # doctest: +SKIP
    """

    def __init__(self, *, block: int = 1):  # terms summed in float32 before each float16 rounding
        super().__init__("fp16_accum", block=block)


class FTZMode(Emulation):
    """Flush-to-zero: subnormal inputs and outputs of every floating op become signed zeros.

    >>> with FTZMode():
    ...     torch.tensor([1e-40]) * 1.0     # tensor([0.])   # doctest: +SKIP
    """

    def __init__(self):
        super().__init__("ftz")


_TABLES: dict[str, _Table] = {"tf32": _TF32, "bf16": _BF16, "fp16_accum": _FP16_ACCUM, "ftz": _FTZ}
EMULATIONS: dict[str, type[Emulation]] = {"tf32": TF32Mode, "bf16": BF16Mode, "fp16_accum": FP16AccumMode,
                                          "ftz": FTZMode}


def emulate(name: str, **options: Any) -> Emulation:
    """The emulation mode called ``name`` ("tf32", "bf16", "fp16_accum", "ftz"), with its options.

    >>> with emulate("tf32", rounding="rne"), ShadowMode() as sm:   # doctest: +SKIP
    ...     y = a @ b
    """
    if name not in EMULATIONS:
        raise ValueError(f"emulate({name!r}): expected one of {sorted(EMULATIONS)}")
    return EMULATIONS[name](**options)
