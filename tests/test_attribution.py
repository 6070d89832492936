"""Which module and phase each call is charged to (shadow.attribution): backward ops through pass-through modules,
optimizer ops and their temporaries; and FaultMode, which puts an error of known size in chosen ops or modules."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from models import make_optimizer
from shadow import ShadowMode, ShadowOptionError
from shadow.modes import EmulationOrderError, FaultMode

pytestmark = pytest.mark.usefixtures("one_thread")

aten = torch.ops.aten


def _shadowed_step(model: nn.Module, x: torch.Tensor) -> ShadowMode:
    with ShadowMode(spot_checks="off") as sm:
        model(x).sum().backward()
    return sm


def _modules(sm: ShadowMode, op: str, phase: str) -> list[str]:
    return [r.module for r in sm.report.find(op=op, phase=phase)]


# --- backward through pass-through modules ---
class Residual(nn.Module):
    """y = skip(x) + fc(x), the skip an nn.Identity: its output is its input."""

    def __init__(self):
        super().__init__()
        self.skip = nn.Identity()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.skip(x) + self.fc(x)


@pytest.mark.parametrize("middle", [nn.Identity, lambda: nn.Dropout(p=0.0)], ids=["identity", "dropout0"])
def test_backward_ops_are_charged_past_a_pass_through_module(middle):
    """Sequential(Linear, pass-through, Linear): the pass-through returns its input tensor, so it ran no backward;
    each Linear's backward mm and bias sum are charged to that Linear (the pass-through used to take every op
    upstream of it)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), middle(), nn.Linear(3, 2)).train()
    sm = _shadowed_step(model, torch.randn(5, 4))
    # the last Linear: grad of its input, then of its weight; the first: of its weight only (x needs no grad)
    assert _modules(sm, "aten.mm.default", "backward") == ["Sequential.2", "Sequential.2", "Sequential.0"]
    assert _modules(sm, "aten.sum.dim_IntList", "backward") == ["Sequential.2", "Sequential.0"]
    assert "Sequential.1" not in {r.module for r in sm.report.records}


def test_backward_ops_are_charged_past_a_residual_skip():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Residual(), nn.Linear(4, 1))
    sm = _shadowed_step(model, torch.randn(5, 4))
    assert _modules(sm, "aten.mm.default", "backward") == [
        "Sequential.2", "Sequential.2", "Sequential.1.fc", "Sequential.1.fc", "Sequential.0"]
    assert "Sequential.1.skip" not in {r.module for r in sm.report.records}


def test_an_in_place_module_keeps_its_backward():
    """ReLU(inplace=True) returns its input tensor too, but rewritten: its autograd node is new, so it has a
    backward of its own (threshold_backward), charged to it, and the Linear before it keeps its own."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(inplace=True), nn.Linear(3, 2))
    sm = _shadowed_step(model, torch.randn(5, 4))
    assert _modules(sm, "aten.threshold_backward.default", "backward") == ["Sequential.1"]
    assert _modules(sm, "aten.mm.default", "backward") == ["Sequential.2", "Sequential.2", "Sequential.0"]


# --- the tracker's gradient hooks: removed, so that nothing outlives the run ---
def test_a_dropped_shadow_mode_frees_its_shadows():
    """A multi-grad hook left registered on an autograd node holds, through its callback, the tracker, its
    ShadowMode and every shadow: a cycle through C++ no collection frees. The mode used to keep them all."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters())
    sm = ShadowMode(spot_checks="off")
    with sm:
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(5, 4)).square().mean().backward()
            opt.step()
    assert sm.memory()["shadow_bytes"] > 0
    mirror = weakref.ref(sm._engine.mirror)
    del sm
    gc.collect()
    assert mirror() is None


def test_gradient_hooks_do_not_pile_up_over_steps():
    """Fired hooks are removed at the next forward: after any number of steps one step's hooks wait, at most;
    on exit none. Each step's backward is still charged to its modules."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    sm = ShadowMode(spot_checks="off")
    tracker = sm._engine.attribution._tracker
    held = []
    with sm:
        for _ in range(5):
            model(torch.randn(5, 4)).sum().backward()
            held.append(len(tracker._waiting) + len(tracker._fired))
    assert held[0] > 0 and held == [held[0]] * 5
    assert not tracker._waiting and not tracker._fired
    assert _modules(sm, "aten.mm.default", "backward") == ["Sequential.2", "Sequential.2", "Sequential.0"] * 5


# --- the module stack: torch's ModuleTracker's names; leaf inputs; the stack after a backward ---
class _Block(nn.Module):
    def __init__(self, shared: nn.Module):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.shared = shared  # the same module under two parents: named by the last parent that names it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(torch.relu(self.fc(x)))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([_Block(self.proj), _Block(nn.Identity())])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.proj(x)


def _stacks(tracker, run) -> list[tuple[str, frozenset[str]]]:
    """``tracker.parents`` (read through its public surface only) as each module's forward starts and ends."""
    seen = []
    handles = [nn.modules.module.register_module_forward_pre_hook(
                   lambda m, a: seen.append((type(m).__name__, frozenset(tracker.parents)))),
               nn.modules.module.register_module_forward_hook(
                   lambda m, a, o: seen.append((type(m).__name__, frozenset(tracker.parents))))]
    try:
        with tracker:  # entered after the hooks above: its own run first
            run()
    finally:
        for h in handles:
            h.remove()
    return seen


def test_module_names_are_torch_module_trackers():
    """The forward's module stack, name by name, as torch's ModuleTracker keeps it: dotted paths from the outermost
    module that ran; a module not under one that ran by its class name ("Linear"); a block run alone before its
    model keeps the names its own run gave its submodules ("_Block.fc"), a module under two parents one name (the
    last found: "_Net.proj", also while blocks.0 calls it)."""
    from torch.utils.module_tracker import ModuleTracker

    from shadow.attribution.tracking import Tracker

    def run(net, lone):
        x = torch.randn(2, 4)
        lone(x)
        net.blocks[0](x)
        net(x)
        net(x)

    torch.manual_seed(0)
    net, lone = _Net(), nn.Linear(4, 4)
    with torch.no_grad():
        want = _stacks(ModuleTracker(), lambda: run(net, lone))
        got = _stacks(Tracker(), lambda: run(net, lone))
    assert got == want
    names = set().union(*(s for _, s in got))
    assert {"Linear", "_Block.fc", "_Net.blocks.1.fc", "_Net.proj"} <= names
    assert ("Linear", frozenset({"Global", "_Net", "_Net.blocks.0", "_Net.proj"})) in got


def test_innermost_and_parents_follow_forward_and_backward():
    """``innermost`` is the deepest running module at every op (read here in a module's forward and in its
    backward); after a backward, no module is left entered."""
    from shadow.attribution.tracking import Tracker

    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            seen.append(("backward", tracker.innermost, set(tracker.parents)))
            return g

    class Inner(nn.Module):
        def forward(self, x):
            seen.append(("forward", tracker.innermost, set(tracker.parents)))
            return Probe.apply(x)

    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(Inner()), nn.Linear(4, 1))
    with Tracker() as tracker:
        model(torch.randn(2, 4)).sum().backward()
        after = (tracker.innermost, set(tracker.parents), tracker.is_bw)
    inside = {"Global", "Sequential", "Sequential.1", "Sequential.1.0"}
    assert seen == [("forward", "Sequential.1.0", inside), ("backward", "Sequential.1.0", inside)]
    assert after == ("", {"Global"}, False)


def test_autograd_grad_of_a_leaf_input_runs_under_shadow():
    """``torch.autograd.grad(loss, x)`` with x a leaf the model takes: a gradient hook on x would make autograd raise
    ("A leaf node was passed to _will_engine_execute_node", pytorch/pytorch#131753); the gradient is the plain
    run's, bit for bit, and the backward is charged to the model's modules."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
    x = torch.randn(5, 4, requires_grad=True)
    (want,) = torch.autograd.grad(model(x).sum(), x)
    with ShadowMode(spot_checks="off") as sm:
        (got,) = torch.autograd.grad(model(x).sum(), x)
    assert torch.equal(got, want)
    # grad of the last Linear's input, then of the first's (the only gradient asked for: no weight gradients)
    assert _modules(sm, "aten.mm.default", "backward") == ["Sequential.2", "Sequential.0"]


# --- optimizer steps: each op charged to the parameter it updates ---
def _training(opt_name: str, impl: str, groups: bool = False, steps: int = 2) -> tuple[ShadowMode, list[str]]:
    """Two steps of Sequential(Linear, ReLU, Linear); ``groups``: each Linear's parameters in a group of their
    own. Returns the run and the parameters' names."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))
    params = [{"params": model[0].parameters()}, {"params": model[2].parameters()}] if groups else model.parameters()
    opt = make_optimizer(opt_name, params, impl)
    with ShadowMode(spot_checks="off") as sm:
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(5, 4)).sum().backward()
            opt.step()
    return sm, [f"Sequential.{n}" for n, _ in model.named_parameters()]


@pytest.mark.parametrize("impl", ["forloop", "foreach"])
@pytest.mark.parametrize("opt_name", ["sgd", "adam", "adamw"])
def test_optimizer_ops_and_their_temporaries_are_charged_to_the_parameter(opt_name, impl):
    """Every op of the step is charged to the parameter it updates, the ones on temporaries too (Adam's
    ``denom = (exp_avg_sq.sqrt() / c).add_(eps)``, the foreach kernels' intermediate lists) and the first step's
    reads of the state it creates; a foreach kernel over every parameter to their common prefix, the model. Only
    the new step counters (``torch.tensor(0.0)``: no parameter among their arguments) go to the model too."""
    steps = 2
    sm, names = _training(opt_name, impl, steps=steps)
    recs = sm.report.find(phase="optimizer")
    assert recs and "" not in {r.module for r in recs}
    others = {r.op for r in recs if r.module not in names}
    assert {r.module for r in recs if r.module not in names} <= {"Sequential"}
    assert all(op == "aten.lift_fresh.default" or op.startswith("aten._foreach_") for op in others), others
    if opt_name != "sgd" and impl == "forloop":  # the temporaries: exp_avg_sq.sqrt(), then / c and .add_(eps)
        for op in ("aten.sqrt.default", "aten.div.Tensor"):
            assert _modules(sm, op, "optimizer") == names * steps, op
    if opt_name != "sgd" and impl == "foreach":  # on the list of square roots
        for op in ("aten._foreach_div_.ScalarList", "aten._foreach_add_.Scalar"):
            assert _modules(sm, op, "optimizer") == ["Sequential"] * steps, op


def test_foreach_temporaries_keep_their_group_name():
    """Two parameter groups: each foreach kernel runs over one group's lists and is charged to its prefix, the
    kernels over the intermediate lists too (their elements were named one by one)."""
    sm, _ = _training("adam", "foreach", groups=True)
    for op in ("aten._foreach_sqrt.default", "aten._foreach_div_.ScalarList", "aten._foreach_add_.Scalar",
               "aten._foreach_addcdiv_.ScalarList"):
        assert _modules(sm, op, "optimizer") == ["Sequential.0", "Sequential.2"] * 2, op


# --- FaultMode: a known error, injected on the device side ---
REL = {torch.float64: 1e-9, torch.float32: 1e-3, torch.bfloat16: 0.1}  # well above each dtype's rounding


def _faulty(h: torch.Tensor, rel: float) -> torch.Tensor:
    """gelu(h) times (1 + rel), rounded once: what the fault makes of a clean gelu."""
    return (F.gelu(h).double() * (1 + rel)).to(h.dtype)


def _tol(dtype: torch.dtype, rel: float) -> float:
    """How far the relative error may sit from rel: gelu's own rounding and the fault's, one eps at most."""
    return 2 * torch.finfo(dtype).eps * (1 + rel)


@pytest.mark.parametrize("random_sign", [False, True], ids=["plus", "random_sign"])
@pytest.mark.parametrize("dtype", list(REL), ids=str)
def test_a_fault_in_gelu_is_that_ops_local_error(dtype, random_sign):
    """x @ w1 -> gelu -> @ w2 with a fault in gelu: gelu's local error is the injected rel (within the dtype's
    rounding), the matmuls are bit-identical to plain ones on the same inputs, no random number is drawn from
    torch's generators, and the fault is the same at every run."""
    rel = REL[dtype]
    g = torch.Generator().manual_seed(0)
    x, w1, w2 = (torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
                 for shape in [(16, 8), (8, 32), (32, 4)])
    rng = torch.get_rng_state()
    with FaultMode(rel=rel, op="gelu", random_sign=random_sign) as fault, ShadowMode(spot_checks="off") as sm:
        h = x @ w1
        y = F.gelu(h)
        z = y @ w2
    assert torch.equal(torch.get_rng_state(), rng)
    assert fault.injected == {"aten.gelu.default": 1}
    (rec,) = sm.report.find(op="aten.gelu.default")
    assert abs(rec.local.rel_norm - rel) <= _tol(dtype, rel)
    assert torch.equal(h, x @ w1) and torch.equal(z, y @ w2)
    up, down = _faulty(h, rel), _faulty(h, -rel)  # each element: one or the other
    assert ((y == up) | (y == down)).all()
    assert ((y != up).any() and (y != down).any()) if random_sign else torch.equal(y, up)
    with FaultMode(rel=rel, op="gelu", random_sign=random_sign):
        assert torch.equal(F.gelu(h), y)  # a pure function of the call's inputs
    assert {r.op for r in sm.report.records if r.local is not None and r.local.rel_norm > _tol(dtype, 0)} == \
        {"aten.gelu.default"}


@pytest.mark.parametrize("op", ["gelu", "aten.gelu", aten.gelu], ids=["name", "qualified", "packet"])
def test_in_place_and_out_variants_are_perturbed_as_written(op):
    """A name or a packet takes gelu.default, gelu.out and the in-place gelu_: each writes its result times
    (1 + rel) where the op writes it, and each is that call's local error."""
    rel = 1e-3
    x = torch.randn(64, generator=torch.Generator().manual_seed(1))
    a, out = x.clone(), torch.empty_like(x)
    with FaultMode(rel=rel, op=op) as fault, ShadowMode(spot_checks="off") as sm:
        y = F.gelu(x)
        aten.gelu_(a)
        returned = aten.gelu.out(x, out=out)
    assert fault.injected == {"aten.gelu.default": 1, "aten.gelu_.default": 1, "aten.gelu.out": 1}
    assert returned is out
    for t in (y, a, out):
        assert torch.equal(t, _faulty(x, rel))
    for name in fault.injected:
        (rec,) = sm.report.find(op=name)
        assert abs(rec.local.rel_norm - rel) <= _tol(torch.float32, rel)


def test_one_overload_claims_only_itself():
    x = torch.randn(64, generator=torch.Generator().manual_seed(2))
    a, out = x.clone(), torch.empty_like(x)
    with FaultMode(rel=1e-3, op=aten.gelu.out) as fault:
        y = F.gelu(x)
        aten.gelu_(a)
        aten.gelu.out(x, out=out)
    assert fault.injected == {"aten.gelu.out": 1}
    assert torch.equal(y, F.gelu(x)) and torch.equal(a, F.gelu(x)) and torch.equal(out, _faulty(x, 1e-3))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


@pytest.mark.parametrize("target", ["path", "object"])
def test_a_fault_in_a_module_shows_in_that_module_only(target):
    """A fault in Net.fc2 (by its dotted path or the module itself) perturbs the ops that compute inside it,
    forward and backward: each of them, and only them, has the injected local error."""
    rel = 1e-3
    torch.manual_seed(0)
    net, x = Net(), torch.randn(32, 8)
    with FaultMode(rel=rel, module="Net.fc2" if target == "path" else net.fc2) as fault, \
            ShadowMode(spot_checks="off") as sm:
        net(x).square().mean().backward()
    assert fault.injected == {"aten.addmm.default": 1, "aten.mm.default": 2, "aten.sum.dim_IntList": 1}
    measured = [r for r in sm.report.records if r.local is not None]
    faulty = [r for r in measured if r.module == "Net.fc2"]
    assert [(r.op, r.phase) for r in faulty] == [("aten.addmm.default", "forward"), ("aten.mm.default", "backward"),
                                                 ("aten.mm.default", "backward"), ("aten.sum.dim_IntList", "backward")]
    assert all(abs(r.local.rel_norm - rel) <= 1e-6 for r in faulty)
    assert all(r.local.rel_norm < 1e-6 for r in measured if r.module != "Net.fc2")


def test_an_op_inside_a_module():
    torch.manual_seed(0)
    net, x = Net(), torch.randn(32, 8)
    with FaultMode(rel=1e-3, op="mm", module="Net.fc2") as fault:
        net(x).square().mean().backward()
    assert fault.injected == {"aten.mm.default": 2}


@pytest.mark.parametrize("kwargs, message", [
    ({"rel": 1e-3}, r"choose what to perturb: op= \(an OpOverload .*\) and/or module= \(a dotted module path"),
    ({"rel": "big", "op": "gelu"}, "rel='big'.*expected a finite real number"),
    ({"rel": float("nan"), "op": "gelu"}, "expected a finite real number"),
    ({"rel": True, "op": "gelu"}, "expected a finite real number"),
    ({"rel": 1e-3, "op": "no_such_op"}, "no aten op 'no_such_op'; expected an OpOverload"),
    ({"rel": 1e-3, "op": "aten.gelu.fast"}, "aten.gelu has no overload 'fast'; its overloads: default, out"),
    ({"rel": 1e-3, "op": "aten.mm.default.x"}, "no aten op"),
    ({"rel": 1e-3, "op": 3}, "op=3.*expected an OpOverload"),
    ({"rel": 1e-3, "op": "view"}, "computes no values.*choose an op that computes"),
    ({"rel": 1e-3, "op": aten.t.default}, "computes no values"),
    ({"rel": 1e-3, "module": 3}, "module=3.*expected a dotted module path as shadow's records name it"),
    ({"rel": 1e-3, "module": ""}, "expected a dotted module path"),
    ({"rel": 1e-3, "op": "gelu", "random_sign": "yes"}, "random_sign='yes'.*expected True or False"),
    ({"rel": 1e-3, "op": "gelu", "seed": 1.5}, "seed=1.5.*expected an int"),
])
def test_bad_arguments_are_refused_naming_the_valid_forms(kwargs, message):
    with pytest.raises(ShadowOptionError, match=message):
        FaultMode(**kwargs)


def test_a_fault_entered_inside_shadow_mode_is_refused():
    with ShadowMode():
        with pytest.raises(EmulationOrderError, match=r"with FaultMode\(rel=0.001, op='gelu'\), ShadowMode\(\) as sm:"):
            with FaultMode(rel=1e-3, op="gelu"):
                pass
