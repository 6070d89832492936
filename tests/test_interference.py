"""Zero interference: a program computes bit for bit the same with and without ShadowMode.

Each case runs the same training program twice from the same initialization and the same RNG seed, once
plain and once under ShadowMode, and compares with ``torch.equal`` (bitwise; NaN-free here): parameters,
buffers, gradients, optimizer state, losses, and the global RNG state afterwards (shadow never draws a
random number: it adopts the device's). Warnings are recorded in both runs and must be the same (shadow
adds none), and shadow's own report must show no internal error and no unsupported op for these models.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from shadow import ShadowMode

from models import IMPLS, MODELS, OPTIMIZERS, build, dtype_unsupported, loss_fn, make_batches, \
    make_optimizer, train_steps
from skips import skip_unsupported

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 3


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor a training program leaves behind, by name."""
    out = {f"param {n}": p.detach() for n, p in model.named_parameters()}
    out |= {f"grad {n}": p.grad for n, p in model.named_parameters() if p.grad is not None}
    out |= {f"buffer {n}": b for n, b in model.named_buffers()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        out |= {f"opt {names[id(p)]}.{k}": v for k, v in st.items() if isinstance(v, torch.Tensor)}
    return out


def _run(model_name: str, opt_name: str, impl: str, shadow: ShadowMode | None, *, accumulate: int = 1,
         clip: float | None = None, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    model = build(model_name, seed=seed, dtype=dtype)
    opt = make_optimizer(opt_name, model.parameters(), impl)
    batches = make_batches(model_name, STEPS * accumulate, seed=seed + 1, dtype=dtype)
    torch.manual_seed(seed + 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if shadow is None:
            losses = train_steps(model, opt, batches, loss_fn(model_name), accumulate=accumulate, clip=clip)
        else:
            with shadow:
                losses = train_steps(model, opt, batches, loss_fn(model_name), accumulate=accumulate, clip=clip)
    return dict(state=_state(model, opt), losses=losses, rng=torch.get_rng_state(),
                warnings=[(w.category.__name__, str(w.message)) for w in caught])


def assert_identical(plain: dict, shadowed: dict) -> None:
    assert plain["state"].keys() == shadowed["state"].keys()
    differ = [k for k, v in plain["state"].items() if not torch.equal(v, shadowed["state"][k])]
    assert not differ, f"changed by ShadowMode: {differ}"
    assert len(plain["losses"]) == len(shadowed["losses"])
    assert all(torch.equal(a, b) for a, b in zip(plain["losses"], shadowed["losses"])), \
        (plain["losses"], shadowed["losses"])
    assert torch.equal(plain["rng"], shadowed["rng"]), "ShadowMode moved the global RNG"
    assert shadowed["warnings"] == plain["warnings"], f"warnings added by ShadowMode: {shadowed['warnings']}"


def assert_clean_report(sm: ShadowMode) -> None:
    cov = sm.report.coverage
    assert cov.internal_errors == 0, str(cov)
    assert not cov.unsupported and cov.unsupported_calls == 0, str(cov)
    assert cov.replayed > 0 and cov.calls == sum(cov.kinds.values())



@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("opt_name", OPTIMIZERS)
@pytest.mark.parametrize("model_name", MODELS)
def test_bit_identical_with_and_without_shadow(model_name, opt_name, impl):
    skip_unsupported(opt_name, impl)
    plain = _run(model_name, opt_name, impl, None)
    sm = ShadowMode()
    shadowed = _run(model_name, opt_name, impl, sm)
    assert_identical(plain, shadowed)
    assert_clean_report(sm)
    if model_name != "mlp":  # dropout drew random numbers: the RNG did move, the same way in both runs
        torch.manual_seed(2)
        assert not torch.equal(torch.get_rng_state(), plain["rng"])


@pytest.mark.parametrize("model_name", MODELS)
def test_bit_identical_with_accumulation_and_clipping(model_name):
    plain = _run(model_name, "adamw", "foreach", None, accumulate=2, clip=0.2)
    sm = ShadowMode()
    shadowed = _run(model_name, "adamw", "foreach", sm, accumulate=2, clip=0.2)
    assert_identical(plain, shadowed)
    assert_clean_report(sm)


@pytest.mark.parametrize("options", [
    dict(local=False),
    dict(drift=False),
    dict(local=False, drift=False),
    dict(follow="reference"),  # the shadow keeps its own max-pool indices and masks: the device must not care
    dict(max_records=10),
])
@pytest.mark.parametrize("model_name", ["cnn", "transformer"])
def test_options_do_not_interfere(model_name, options):
    plain = _run(model_name, "adam", "forloop", None)
    sm = ShadowMode(**options)
    shadowed = _run(model_name, "adam", "forloop", sm)
    assert_identical(plain, shadowed)
    assert_clean_report(sm)
    if "max_records" in options:
        assert len(sm.report.records) == 10 and sm.report.dropped_records == sm.report.coverage.calls - 10


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("model_name", MODELS)
def test_bit_identical_in_other_dtypes(model_name, dtype):
    """SGD (Adam's eps=1e-8 is 0 in float16, so a zero gradient gives 0/0: a true float16 NaN, not shadow's)."""
    reason = dtype_unsupported(model_name, dtype)
    if reason:
        pytest.skip(reason)
    plain = _run(model_name, "sgd", "foreach", None, dtype=dtype)
    sm = ShadowMode()
    shadowed = _run(model_name, "sgd", "foreach", sm, dtype=dtype)
    assert_identical(plain, shadowed)
    assert_clean_report(sm)


def test_no_mode_hook_or_global_setting_left_behind():
    """After its block ShadowMode leaves the dispatch mode stack, optimizer hooks, grad mode and default dtype
    as it found them."""
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    def snapshot():
        return (list(_get_current_dispatch_mode_stack()), len(_global_optimizer_pre_hooks),
                len(_global_optimizer_post_hooks), torch.is_grad_enabled(), torch.get_default_dtype())

    before = snapshot()
    model = build("mlp")
    with ShadowMode():
        train_steps(model, make_optimizer("adam", model.parameters(), "forloop"), make_batches("mlp", 1),
                    loss_fn("mlp"))
    assert snapshot() == before


def test_infinities_in_the_program_add_no_warning():
    """A causal attention mask holds -inf on the device and in the shadow alike: comparing them (inf - inf)
    must not print a numpy warning into the user's program, nor count as an internal error."""

    def masked():
        torch.manual_seed(0)
        x = torch.randn(2, 4, 16)
        mask = torch.nn.Transformer.generate_square_subsequent_mask(4)
        return build("transformer").enc(x, src_mask=mask, is_causal=True).sum()

    with warnings.catch_warnings(record=True) as ref_caught:
        warnings.simplefilter("always")
        ref = masked()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ShadowMode() as sm:
            out = masked()
    assert torch.equal(out, ref)
    assert [str(w.message) for w in caught] == [str(w.message) for w in ref_caught]
    assert sm.report.coverage.internal_errors == 0, str(sm.report.coverage)
    assert any(r.drift is not None and r.drift.n for r in sm.report.find(op="aten.add.Tensor"))


def test_the_programs_storages_stay_resizable():
    """Reading a tensor must leave it as it was: numpy views made with Tensor.numpy() mark a storage
    non-resizable, after which the program's own resize_ would fail. Spot checks of every element read the
    operands of exact sums and dot products; the program then resizes each of its tensors."""
    torch.manual_seed(0)
    x, w = torch.randn(3, 5), torch.randn(5, 4, requires_grad=True)
    with ShadowMode(spot_checks="all") as sm:
        y = x @ w
        s = y.sum()
        s.backward()
        m = x.mean(dim=1)
    assert sm.report.find(op="aten.mm.default")[0].spot.checked
    for name, t in {"x": x, "w": w.detach(), "w.grad": w.grad, "y": y.detach(), "s": s.detach(), "m": m}.items():
        t.resize_(64)  # raises "Trying to resize storage that is not resizable" if shadow pinned it
        assert t.numel() == 64, name
