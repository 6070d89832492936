"""Emulated devices (shadow/modes/emulate/): rounding helpers, each mode's numerics, and stacking
under ShadowMode."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from shadow import ShadowMode
from shadow.modes import emulate as E
from shadow.rules import RuleTable
from shadow.modes.emulate import (
    BF16,
    FP16,
    TF32,
    BF16Mode,
    EmulationOrderError,
    FP16AccumMode,
    FTZMode,
    TF32Mode,
    emulate,
    flush_subnormals,
    round_to,
    to_tf32,
)

aten = torch.ops.aten


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.float16: torch.int16, torch.float64: torch.int64}[t.dtype])


# --- rounding helpers ---
# TF32 keeps the top 19 bits of a float32 (sign, 8 exponent bits, 10 mantissa bits): the 13 low bits go.
# rna = CUTLASS round_half_ulp_truncate: add 0x1000 (half a TF32 ulp) to the bits, then clear the low 13;
# rne adds 0xfff plus the lowest kept bit; rz just clears them.
TF32_BIT_FORMULAS = {
    "rna": lambda b: (b + 0x1000) & -8192,  # -8192 == 0xffffe000 as int32
    "rne": lambda b: (b + 0xFFF + ((b >> 13) & 1)) & -8192,
    "rz": lambda b: b & -8192,
}


@pytest.mark.parametrize("rounding", sorted(TF32_BIT_FORMULAS))
def test_tf32_rounding_matches_the_bit_formulas(rounding):
    b = torch.randint(-(2**31), 2**31 - 1, (200_000,), generator=gen(1), dtype=torch.int64).to(torch.int32)
    b[:4] = torch.tensor([0x7F7FFFFF, -0x00800001, 0x00000001, 0x007FF000], dtype=torch.int64).to(torch.int32)
    x = b.view(torch.float32)  # every bit pattern: normals, subnormals, inf and NaN with payloads
    got = to_tf32(x, rounding)
    finite = torch.isfinite(x)
    want = TF32_BIT_FORMULAS[rounding](b)
    assert torch.equal(bits(got)[finite], want[finite])
    assert torch.equal(bits(got)[~finite], b[~finite])  # non-finite kept bit for bit


def test_tf32_rounding_golden_values():
    u = 2.0**-10  # TF32 ulp at 1
    x = torch.tensor([1 + u / 2, 1 + 0.75 * u, -(1 + u / 2), 1 + 1.5 * u, torch.finfo(torch.float32).max])
    # 1 + u/2 is a tie: away from zero -> 1 + u; to even -> 1 (1 has an even significand); truncated -> 1.
    # 1 + 1.5u is a tie between 1 + u (odd) and 1 + 2u (even): rna and rne both go up to 1 + 2u.
    # float32 max = (2 - 2^-23) 2^127 is above TF32 max + half an ulp = (2 - 2^-11) 2^127: inf when
    # rounding to nearest, TF32 max (2 - 2^-10) 2^127 when truncating.
    tmax = (2 - 2.0**-10) * 2.0**127
    inf = float("inf")
    assert to_tf32(x, "rna").tolist() == [1 + u, 1 + u, -(1 + u), 1 + 2 * u, inf]
    assert to_tf32(x, "rne").tolist() == [1.0, 1 + u, -1.0, 1 + 2 * u, inf]
    assert to_tf32(x, "rz").tolist() == [1.0, 1.0, -1.0, 1 + u, tmax]


def test_round_to_float64_sources_is_correctly_rounded():
    # values with > 24 significant bits, where a float64 -> float32 -> float16 cast rounds twice:
    # 2049 + 2^-23 is just above the float16 tie 2049 (spacing 2 in [2048, 4096)): correct is 2050,
    # but float32 rounds it to 2049 first, and the tie then goes to the even 2048.
    x = torch.tensor([2049 + 2.0**-23, 2049 - 2.0**-23, 2.0**-25 * 3], dtype=torch.float64)
    assert round_to(x, FP16).tolist() == [2050.0, 2048.0, 2.0**-23]  # 3 * 2^-25 = 0.75 subnormal ulp -> 1 ulp
    assert x.to(torch.float16)[0].item() == 2048.0  # torch's cast: the double rounding avoided above
    # on float32-representable values the float64 path agrees with torch's correctly rounded casts
    y = (torch.randn(100_000, generator=gen(2), dtype=torch.float64)
         * torch.exp2(torch.randint(-30, 20, (100_000,), generator=gen(3)).double())).float().double()
    assert torch.equal(round_to(y, FP16).float(), y.float().half().float())
    assert torch.equal(round_to(y, BF16).float(), y.float().bfloat16().float())


def test_round_to_rejects_unknown_rounding():
    with pytest.raises(ValueError, match=r"rounding='nearest'.*'rne', 'rna', 'rz'"):
        round_to(torch.ones(2), TF32, "nearest")


def test_flush_subnormals_golden():
    tiny32 = torch.finfo(torch.float32).tiny  # 2^-126, the smallest normal float32
    x = torch.tensor([1e-40, -1e-40, tiny32, -tiny32, 0.0, 1.0, float("nan"), float("-inf")])
    y = flush_subnormals(x)
    assert y[:2].tolist() == [0.0, 0.0] and y[:2].signbit().tolist() == [False, True]  # -1e-40 -> -0.0
    assert torch.equal(bits(y[2:6]), bits(x[2:6])) and y[6].isnan() and y[7] == float("-inf")
    h = torch.tensor([1e-5, 6.2e-5], dtype=torch.float16)  # float16 smallest normal: 2^-14 = 6.1035e-5
    assert flush_subnormals(h).tolist() == [0.0, h[1].item()]


# --- TF32 ---
def rel_norm(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


def test_tf32_mm_error_is_that_of_10_bit_inputs():
    g = gen(4)
    a, b = torch.randn(64, 1024, generator=g), torch.randn(1024, 64, generator=g)
    ref = a.double() @ b.double()
    with TF32Mode():
        y = a @ b
        y2 = a @ b
    assert torch.equal(y, y2)  # deterministic
    assert torch.equal(y, to_tf32(a) @ to_tf32(b))  # = the inputs rounded by hand, multiplied in fp32
    # each operand carries a relative rounding error of at most 2^-11 (half an 11-bit-significand ulp),
    # rms about 2^-11 * 0.4; a product carries two, ~independent across the K terms, so the normwise
    # relative error is ~ 2^-11 * 0.6 ~ 3e-4 whatever K (measured 2.9e-4); float32's own is ~1e-7.
    tf32, fp32 = rel_norm(y, ref), rel_norm(a @ b, ref)
    assert 2.0**-13 < tf32 < 2.0**-10
    assert fp32 < 2.0**-20 and tf32 > 500 * fp32
    # truncation is biased (every operand shrinks by ~half an ulp): about twice the error
    with TF32Mode(rounding="rz"):
        yz = a @ b
    assert 1.8 < rel_norm(yz, ref) / tf32 < 3.5


def test_tf32_error_grows_like_sqrt_k():
    # independent rounding errors of the K products add up like a random walk: the absolute error of
    # a dot product of unit normals grows like sqrt(K); divided by sqrt(K) it stays put from 64 to 4096
    per_sqrt_k = []
    for k in (64, 4096):
        g = gen(k)
        a, b = torch.randn(32, k, generator=g), torch.randn(k, 32, generator=g)
        with TF32Mode():
            y = a @ b
        err = (y.double() - a.double() @ b.double()).pow(2).mean().sqrt().item()
        per_sqrt_k.append(err / k**0.5)
    assert 0.7 < per_sqrt_k[1] / per_sqrt_k[0] < 1.4
    assert 2.0**-13 < per_sqrt_k[0] < 2.0**-10


def test_tf32_matmul_family_rounds_operands_not_accumulator():
    g = gen(5)
    c, a, b = torch.randn(8, 16, generator=g), torch.randn(8, 32, generator=g), torch.randn(32, 16, generator=g)
    ba, bb = torch.randn(3, 8, 32, generator=g), torch.randn(3, 32, 16, generator=g)
    bc = torch.randn(3, 8, 16, generator=g)
    ra, rb, rba, rbb = to_tf32(a), to_tf32(b), to_tf32(ba), to_tf32(bb)
    out = torch.empty(8, 16)
    c2 = c.clone()
    with TF32Mode():
        got = {
            "addmm": torch.addmm(c, a, b, beta=0.5, alpha=2.0),
            "bmm": torch.bmm(ba, bb),
            "baddbmm": torch.baddbmm(bc, ba, bb),
            "linear": F.linear(a, b.T, c[0]),
            "matmul3d": ba @ b,
            "out=": torch.mm(a, b, out=out),
            "addmm_": c2.addmm_(a, b),
        }
    want = {
        "addmm": torch.addmm(c, ra, rb, beta=0.5, alpha=2.0),
        "bmm": torch.bmm(rba, rbb),
        "baddbmm": torch.baddbmm(bc, rba, rbb),
        "linear": F.linear(ra, rb.T, c[0]),
        "matmul3d": rba @ rb,
        "out=": ra @ rb,
        "addmm_": torch.addmm(c, ra, rb),
    }
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert got["out="] is out and torch.equal(out, want["out="]) and torch.equal(c2, want["addmm_"])
    assert not torch.equal(want["bmm"], torch.bmm(ba, bb))  # the rounding did change something


def test_tf32_convolution_and_backward():
    g = gen(6)
    x = torch.randn(2, 3, 9, 9, generator=g, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, generator=g, requires_grad=True)
    bias = torch.randn(4, generator=g, requires_grad=True)
    go = torch.randn(2, 4, 7, 7, generator=g)
    with TF32Mode():
        y = F.conv2d(x, w, bias)
        y.backward(go)
    assert torch.equal(y, F.conv2d(to_tf32(x.detach()), to_tf32(w.detach()), bias.detach()))
    conv_args = ([4], [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    gi, gw, _ = aten.convolution_backward(to_tf32(go), to_tf32(x.detach()), to_tf32(w.detach()), *conv_args,
                                          [True, True, False])
    _, _, gb = aten.convolution_backward(go, x.detach(), w.detach(), *conv_args, [False, False, True])
    assert torch.equal(x.grad, gi) and torch.equal(w.grad, gw)
    assert torch.equal(bias.grad, gb)  # the bias gradient is a float32 sum of the unrounded grad_output


def test_tf32_leaves_other_ops_and_dtypes_alone():
    g = gen(7)
    a, b = torch.randn(16, 64, generator=g), torch.randn(64, 16, generator=g)
    ad, bd = a.double(), b.double()
    with TF32Mode():
        got = [a * b.T, torch.exp(a), a.sum(0), ad @ bd, torch.mv(a, b[:, 0])]
    want = [a * b.T, torch.exp(a), a.sum(0), ad @ bd, torch.mv(a, b[:, 0])]
    for x, y in zip(got, want):
        assert torch.equal(x, y)


# --- bf16 compute ---
UNARY = {
    "exp": torch.exp, "sin": torch.sin, "cos": torch.cos, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
    "sqrt": lambda t: torch.sqrt(t.abs()), "log": lambda t: torch.log(t.abs()), "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu, "relu": torch.relu,
    "reciprocal": torch.reciprocal, "rsqrt": lambda t: torch.rsqrt(t.abs()), "softplus": F.softplus,
    "expm1": torch.expm1, "atan": torch.atan, "square": torch.square,
    # left out: erf (torch's bfloat16 erf kernel differs from float32 erf rounded, in 1 of 4096 samples)
}
BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "maximum": torch.maximum,
    "atan2": torch.atan2, "hypot": torch.hypot, "pow": lambda a, b: torch.pow(a.abs(), b / 3),
}


@pytest.mark.parametrize("name", sorted(UNARY))
def test_bf16_unary_equals_torch_bfloat16(name):
    x = torch.randn(4096, generator=gen(8)) * 3
    with BF16Mode():
        y = UNARY[name](x)
    assert y.dtype is torch.float32
    assert torch.equal(y, UNARY[name](x.bfloat16()).float())


@pytest.mark.parametrize("name", sorted(BINARY))
def test_bf16_binary_equals_torch_bfloat16(name):
    g = gen(9)
    x, y = torch.randn(4096, generator=g) * 3, torch.randn(4096, generator=g) * 3
    with BF16Mode():
        z = BINARY[name](x, y)
    assert torch.equal(z, BINARY[name](x.bfloat16(), y.bfloat16()).float())


def test_bf16_in_place_out_and_moves():
    g = gen(10)
    x, y = torch.randn(256, generator=g), torch.randn(256, generator=g)
    want = (x.bfloat16() * y.bfloat16()).float()
    x1, out = x.clone(), torch.empty(256)
    with BF16Mode():
        x1.mul_(y)
        torch.mul(x, y, out=out)
        moved = [x.clone(), torch.cat([x, y]), x[torch.tensor([3, 1])], F.pad(x, (1, 1))]
        z = torch.zeros(256)
        z.index_add_(0, torch.tensor([0]), y[:1])  # a partial write: passes through
    assert torch.equal(x1, want) and torch.equal(out, want)
    # data movement is bit-exact on every device: float32 values that bfloat16 cannot hold survive
    assert not torch.equal(x, x.bfloat16().float())
    for m, w in zip(moved, [x, torch.cat([x, y]), x[torch.tensor([3, 1])], F.pad(x, (1, 1))]):
        assert torch.equal(m, w)
    assert z[0] == y[0] and torch.equal(z[1:], torch.zeros(255))


def test_bf16_rounds_what_a_kernel_writes_without_declaring_it():
    # native_batch_norm updates its running statistics in place, which its schema does not declare: they
    # are rounded like its other outputs, not lost. running_mean = 0.9 * 0 + 0.1 * mean(x).
    x = torch.randn(16, 3, generator=gen(20)) * 3
    bn, bn16 = torch.nn.BatchNorm1d(3), torch.nn.BatchNorm1d(3)
    bn(x)
    with BF16Mode():
        bn16(x)
    for name in ("running_mean", "running_var"):
        got, want = getattr(bn16, name), getattr(bn, name)
        assert torch.equal(got, got.bfloat16().float())  # bfloat16 values
        assert torch.allclose(got, want, rtol=2**-6, atol=0) and not torch.equal(got, want), name


# --- float16 accumulation ---
def test_fp16_accumulation_of_ones_stagnates_at_2048():
    ones = torch.ones(4096, dtype=torch.float16)
    with FP16AccumMode():
        s = ones.sum()
        d = ones @ ones
        m = torch.mm(ones[None], ones[:, None])
        mean = ones.mean()
        c = ones.cumsum(0)
    # integers up to 2048 = 2^11 are exact in float16 (11 significant bits); in [2048, 4096) the spacing
    # is 2, so 2048 + 1 = 2049 is a tie between 2048 (even significand) and 2050: it rounds to 2048,
    # and every later + 1 does the same. The mean: 2048 / 4096 = 0.5.
    assert s.item() == 2048 and d.item() == 2048 and m.item() == 2048 and mean.item() == 0.5
    assert s.dtype is torch.float16
    assert c[:2048].tolist() == list(range(1, 2049)) and (c[2048:] == 2048).all()
    assert ones.sum().item() == 4096  # torch's CPU kernel accumulates in float32


def test_fp16_small_terms_vanish_after_a_large_partial_sum():
    x = torch.cat([torch.ones(1024), torch.full((1000,), 0.25)]).half()
    with FP16AccumMode():
        s = x.sum()
    # after 1024 ones the spacing is 1 (float16 at 1024 = 2^10); 1024 + 0.25 is below the half-way
    # point 1024.5, so it rounds back to 1024 a thousand times. The true sum is 1024 + 250 = 1274.
    assert s.item() == 1024 and x.sum().item() == 1274


def test_fp16_blocks_sum_in_float32_between_roundings():
    ones = torch.ones(4096, dtype=torch.float16)
    with FP16AccumMode(block=16):
        s = ones.sum()
        m = torch.mm(ones[None], ones[:, None])
    # blocks of 16 ones sum to 16 exactly; multiples of 16 up to 4096 are float16 values (spacing <= 2)
    assert s.item() == 4096 and m.item() == 4096


def fp16_sequential(terms: np.ndarray) -> float:
    """The reference: a Python loop, rounding to float16 after every addition (numpy rounds a
    float64 to float16 correctly, in one step)."""
    acc = np.float16(terms[0])
    for t in terms[1:]:
        acc = np.float16(float(acc) + float(t))
    return float(acc)


def test_fp16_accumulation_matches_a_sequential_reference():
    g = gen(11)
    x = (torch.randn(300, generator=g) * 10).half()
    a, b = (torch.randn(3, 200, generator=g) * 4).half(), (torch.randn(200, 2, generator=g) * 4).half()
    bias = torch.randn(3, 2, generator=g).half()
    with FP16AccumMode():
        s, mm, am = x.sum(), a @ b, torch.addmm(bias, a, b)
    assert s.item() == fp16_sequential(x.double().numpy())
    for i in range(3):
        for j in range(2):
            # products of two float16 values are exact in float64 (22 significant bits)
            acc = fp16_sequential((a[i].double() * b[:, j].double()).numpy())
            assert mm[i, j].item() == acc
            assert am[i, j].item() == float(np.float16(bias[i, j].item() + acc))  # epilogue: one rounding


def test_fp16_out_and_in_place_variants():
    g = gen(12)
    x = torch.ones(8, 600, dtype=torch.float16)
    a, b = torch.randn(4, 600, generator=g).half(), torch.randn(600, 5, generator=g).half()
    c = torch.zeros(4, 5, dtype=torch.float16)
    out = torch.empty(0, dtype=torch.float16)
    c2 = c.clone()
    y = x.clone()
    with FP16AccumMode(block=4):
        torch.sum(x, dim=1, out=out)
        want = x.sum(1)
        c2.addmm_(a, b)
        mm = torch.addmm(c, a, b)
        y.cumsum_(1)
    assert out.shape == (8,) and torch.equal(out, want) and (want == 600).all()
    assert torch.equal(c2, mm)
    assert y[0, -1].item() == 600  # 600 ones: no stagnation below 2048


def test_fp16_accumulation_leaves_float32_and_dim_sums_consistent():
    g = gen(13)
    x = torch.randn(6, 5, 7, generator=g)
    with FP16AccumMode():
        s32 = x.sum((0, 2))
        keep = x.half().sum((0, 2), keepdim=True)
        perm = x.half().permute(1, 0, 2).reshape(5, -1).sum(1)
    assert torch.equal(s32, x.sum((0, 2)))  # float32 data: not this device's arithmetic
    # reduced dims are accumulated in row-major order, whatever the layout
    assert keep.shape == (1, 5, 1) and torch.equal(keep.flatten(), perm)


# --- flush to zero ---
def test_ftz_flushes_subnormal_inputs_and_outputs_only():
    g = gen(14)
    normal = torch.randn(1000, generator=g)
    x = torch.cat([normal, torch.tensor([1e-40, -1e-40])])
    with FTZMode():
        y = x * 1.0
        e = torch.exp(normal)
        tiny = torch.tensor([1e-30]) * torch.tensor([-1e-10])  # -1e-40: a subnormal result
        h = torch.tensor([1e-5, 1.0], dtype=torch.float16) + 0  # float16: 1e-5 < 2^-14 is subnormal
        kept = x.clone()  # a copy is not arithmetic
        in_place = x.clone().mul_(1.0)
    assert torch.equal(bits(y[:1000]), bits(normal)) and torch.equal(bits(e), bits(torch.exp(normal)))
    assert y[1000:].tolist() == [0.0, 0.0] and y[1000:].signbit().tolist() == [False, True]
    assert tiny.item() == 0.0 and tiny.signbit().item()
    assert h.tolist() == [0.0, 1.0]
    assert torch.equal(bits(kept), bits(x))
    assert torch.equal(bits(in_place), bits(y))


# --- modes in general ---
@pytest.mark.parametrize("name", ["bf16", "ftz"])
def test_modes_consume_no_random_numbers(name):
    def run():
        torch.manual_seed(0)
        x = torch.randn(1000)
        y = F.dropout(x, 0.5, training=True)
        return y, torch.get_rng_state()

    y0, after0 = run()
    with emulate(name):
        y1, after1 = run()
    assert torch.equal(after0, after1)  # the generator is where it would be
    assert torch.equal(y0 == 0, y1 == 0)  # the same dropout mask


def test_emulate_names_and_options_are_validated():
    assert isinstance(emulate("tf32", rounding="rne"), TF32Mode)
    assert emulate("fp16_accum", block=8).options.block == 8
    names = r"\['bf16', 'fp16', 'fp16_accum', 'fp8', 'ftz', 'stochastic', 'stochastic_budget', 'tf32'\]"
    with pytest.raises(ValueError, match=r"emulate\('tf16'\): expected one of " + names):
        emulate("tf16")
    with pytest.raises(TypeError, match="unexpected keyword argument 'rounding'"):
        emulate("bf16", rounding="rne")
    with pytest.raises(TypeError, match=r"emulation 'bf16' takes options none, got \['rounding'\]"):
        E.Emulation("bf16", rounding="rne")
    with pytest.raises(ValueError, match="block=0"):
        FP16AccumMode(block=0)
    with pytest.raises(ValueError, match="rounding='up'"):
        TF32Mode(rounding="up")


def test_registering_a_rule_twice_is_an_error():
    table = RuleTable("test")  # as each device's table: no default, no families
    table.register(aten.mm.default)(lambda *a: None)
    with pytest.raises(ValueError, match="aten.mm.default is already registered"):
        table.register(aten.mm.default)(lambda *a: None)
    with pytest.raises(TypeError, match="OpOverloads"):
        table.register(aten.mm)(lambda *a: None)


# --- under ShadowMode ---
def test_entering_an_emulation_inside_shadow_mode_is_refused():
    with ShadowMode():
        with pytest.raises(EmulationOrderError, match=r"with TF32Mode\(\), ShadowMode\(\) as sm:"):
            with TF32Mode():
                pass


def test_shadow_sees_tf32_matmul_error_and_clean_elementwise_ops():
    g = gen(15)
    a, b = torch.randn(32, 512, generator=g), torch.randn(512, 32, generator=g)

    def step():
        return (a @ b) * 2.0 + 1.0

    with ShadowMode() as plain:
        y0 = step()
    with TF32Mode(), ShadowMode() as sm:
        y1 = step()
    assert not torch.equal(y0, y1)
    mm0, mm1 = plain.report.find(op="aten.mm")[0], sm.report.find(op="aten.mm")[0]
    # the local error is the device's mm against float64 on the same float32 inputs: ~3e-4 under TF32
    # (10-bit operands), ~1e-7 for a float32 matmul
    assert mm0.local.rel_norm < 1e-6 and 1e-4 < mm1.local.rel_norm < 1e-3
    assert mm1.local.rel_norm > 500 * mm0.local.rel_norm
    for rep in (plain.report, sm.report):
        for op in ("aten.mul", "aten.add"):
            (r,) = rep.find(op=op)
            assert r.local.max_ulp <= 0.5  # correctly rounded float32, emulation or not
    # the TF32 error flows downstream as drift
    assert sm.report.find(op="aten.add")[0].drift.rel_norm > 1e-4


def test_shadow_with_in_place_emulated_ops_sees_no_unobserved_writes():
    g = gen(16)
    x, y = torch.randn(64, generator=g), torch.randn(64, generator=g)
    with BF16Mode(), ShadowMode() as sm:
        x.mul_(y)
        z = x.exp()
    assert not [e for e in sm.report.events if e.kind == "unobserved_write"]
    (mul,) = sm.report.find(op="aten.mul_")
    # bf16 arithmetic: up to half a bf16 ulp = 2^-9 relative, i.e. 2^15 float32 ulps
    assert mul.local.max_ulp > 2**10
    assert not torch.equal(sm.shadow_of(z).float(), z)  # the shadow kept its own float64 values


def test_shadow_sees_fp16_accumulation_in_sums():
    x = torch.ones(2, 4096, dtype=torch.float16)
    with FP16AccumMode(), ShadowMode() as sm:
        s = x.sum(1)
    (rec,) = sm.report.find(op="aten.sum")
    assert s.tolist() == [2048, 2048] and rec.local.max_abs == 2048  # the float64 replay of the same inputs: 4096


# --- against a real GPU (skipped without one) ---
@pytest.fixture
def cuda_tf32():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("TF32 needs compute capability 8.0 (Ampere) or newer")
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.mark.cuda
def test_cuda_tf32_matmul_rounds_like_the_default_emulation(cuda_tf32):
    # x @ I returns x's TF32 operand exactly (one product with 1.0, the rest with 0.0), so the rounding
    # rule can be read off; the first row holds ties (1 + u/2 -> 1 under rne, 1 + u under rna)
    u = 2.0**-10
    x = torch.randn(256, 256, generator=gen(17))
    x[0, :4] = torch.tensor([1 + u / 2, 1 + 1.5 * u, -(1 + u / 2), 1 + 0.75 * u])
    eye = torch.eye(256, device="cuda")
    assert torch.equal((x.cuda() @ eye).cpu(), to_tf32(x))
    assert torch.equal(torch.bmm(x[None].cuda(), eye[None]).cpu()[0], to_tf32(x))
    a, b = torch.randn(512, 1024, generator=gen(18)), torch.randn(1024, 512, generator=gen(19))
    with TF32Mode():
        emulated = a @ b
    real = (a.cuda() @ b.cuda()).cpu()
    # the same operands, products exact, float32 sums in another order: ~1e-6 of the largest output
    assert (real - emulated).abs().max() <= 1e-5 * real.abs().max()


# --- float16 arithmetic, FP8 matmuls, one module only ---
def test_fp16_mode_is_float16_arithmetic_with_its_range():
    from shadow.modes import FP16Mode

    x = torch.tensor([1.0, 1e-3, 10.0, 12.0])
    with FP16Mode():
        y = torch.exp(x)
    assert torch.equal(y, torch.exp(x.half()).float())
    assert torch.isinf(y[3]) and float(y[2]) == float(torch.tensor(22026.465, dtype=torch.float16))  # e^12 > 65504


def test_fp8_mode_quantizes_matmul_operands_per_tensor_and_gradients_in_e5m2():
    from shadow.modes import FP8Mode
    from shadow.modes.emulate.formats import E4M3, E5M2, round_to
    from shadow.modes.emulate.fp8 import quantize

    torch.manual_seed(0)
    a, b = torch.randn(16, 32), torch.randn(32, 8)
    with FP8Mode():
        y = a @ b
    assert torch.equal(y, quantize(a, E4M3) @ quantize(b, E4M3))
    q = quantize(a, E4M3)  # amax maps to 448: relative error at most half of 2**-3
    assert float(((q - a).abs() / a.abs()).max()) <= 2**-4 + 1e-6 and float(q.abs().max()) == float(a.abs().max())
    assert torch.equal(round_to(torch.tensor([57344.0, 61440.0]), E5M2), torch.tensor([57344.0, float("inf")]))
    # backward: the gradient reaching the first layer is made during backward (E5M2), the activation is not (E4M3)
    w1, w2 = torch.randn(8, 32, requires_grad=True), torch.randn(1, 8, requires_grad=True)
    grads = []
    with FP8Mode():
        h = a @ w1.t()
        h.register_hook(grads.append)
        (h.relu() @ w2.t()).sum().backward()
    gh = grads[0]
    assert torch.equal(w1.grad, quantize(gh.t(), E5M2) @ quantize(a, E4M3))
    assert not torch.equal(w1.grad, quantize(gh.t(), E4M3) @ quantize(a, E4M3))


def test_scoped_emulation_touches_one_module_only():
    from shadow.modes import BF16Mode, Scoped

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    x = torch.randn(4, 8)
    with Scoped(BF16Mode(), module="Sequential.1"), ShadowMode(spot_checks="off") as sm:
        net(x)
    first, second = (sm.report.find(op="addmm", module=f"Sequential.{i}")[0] for i in (0, 1))
    assert first.local.rel_norm < 1e-6 < 1e-4 < second.local.rel_norm
    with pytest.raises(EmulationOrderError):
        with ShadowMode(), Scoped(BF16Mode(), module="Sequential.1"):
            pass
