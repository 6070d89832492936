"""``shadow.envelope``: how far apart correct implementations of a training loop land, step by step.

A step runs N times from the same start: once under ShadowMode, whose float64 shadow of the loss is the float64 run,
then ``runs`` times under a correct implementation with random rounding (``shadow.modes.emulate.stochastic``), each
with its own seed. Between runs, and at the end, the step's modules, optimizers and torch's generators are put back
as the first run found them (``StepState``), so that every run starts alike and the program's own randomness is the
same in each. Cost: about ``runs`` emulated runs (each op computed twice, once in float64) plus one shadowed run.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._python_dispatch import TorchDispatchMode

from ..band import CONFIDENCE, Envelope
from ..errors import ShadowOptionError
from ..modes.emulate import emulate
from ..records import Phase, loss_candidate
from .state import StepState

RANDOM_DEVICES = ("stochastic_budget", "stochastic")  # the emulated devices an envelope's runs may use, default first
_no_dispatch = torch._C._DisableTorchDispatch


def check_options(runs: Any, steps: Any, device: Any, confidence: Any) -> None:
    """Refuse options an envelope cannot be built with, naming the valid ones."""
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 2:
        raise ShadowOptionError(f"runs={runs!r}: expected an int >= 2 (runs with random rounding; 8 is a good start)")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ShadowOptionError(f"steps={steps!r}: expected an int >= 1 (training steps per run)")
    if device not in RANDOM_DEVICES:
        raise ShadowOptionError(f"device={device!r}: expected one of {list(RANDOM_DEVICES)}")
    if isinstance(confidence, bool) or not isinstance(confidence, float) or not 0.0 < confidence < 1.0:
        raise ShadowOptionError(f"confidence={confidence!r}: expected a float in (0, 1), e.g. 0.99")


def _float64_mode() -> Any:
    from ..modes import ShadowMode

    # the cheapest ShadowMode that carries float64 shadows through the whole run: no local replays, no budgets
    return ShadowMode(local=False, budgets=False, spot_checks="off", follow="reference", max_records=0)


def _loss(value: Any) -> torch.Tensor:
    if not (isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point()):
        got = f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}" if isinstance(value, torch.Tensor) \
            else type(value).__name__
        raise TypeError(f"envelope: step() must return the step's loss, a one-element floating tensor; got {got}")
    return value


def envelope(step: Callable[[], Any], runs: int = 8, steps: int = 10, *, device: str = "stochastic_budget",
             confidence: float = CONFIDENCE, seed: int = 0) -> Envelope:
    """The band correct implementations of ``steps`` training steps span: ``step`` is a zero-argument callable that
    runs one step and returns its loss; it runs ``steps`` times under ShadowMode (the float64 losses), then ``runs``
    times ``steps`` times under ``device`` (seeds ``seed``, ``seed + 1``...), from the same start each time. The
    model, optimizer and torch's generators end as they were found.

    >>> def step():
    ...     opt.zero_grad(); loss = F.mse_loss(model(x), y); loss.backward(); opt.step()
    ...     return loss
    >>> env = shadow.envelope(step, runs=8, steps=20)           # doctest: +SKIP
    >>> print(env.table(my_device_losses))                      # doctest: +SKIP
    """
    if not callable(step):
        raise TypeError(f"envelope: step must be a zero-argument callable running one training step, got "
                        f"{type(step).__name__}")
    check_options(runs, steps, device, confidence)
    state = StepState()
    float64: list[float] = []
    values: list[tuple[float, ...]] = []
    dtype = "torch.float32"
    with state.as_found():
        with state.learning(), _float64_mode() as sm:
            for _ in range(steps):
                loss = _loss(step())
                dtype = str(loss.dtype)
                float64.append(float(sm.shadow_of(loss).reshape(-1)[0]))
        for i in range(runs):
            state.restore(state.start)
            with emulate(device, seed=seed + i):
                values.append(tuple(float(_loss(step()).detach()) for _ in range(steps)))
    return Envelope(float64=tuple(float64), values=tuple(values), device=device, dtype=dtype, confidence=confidence,
                    meta={"seed": seed})


class Enough(BaseException):  # noqa: N818 - not an error: the run has made the steps asked for
    """Raised from the optimizer step hook once a program has made the steps asked for: it ends the program's run
    (a BaseException, so that the program's own ``except Exception`` lets it through)."""


class StepLosses(TorchDispatchMode):
    """The loss of each optimizer step of an unmodified program, read as ``shadow.trajectory`` reads it: the last
    one-element floating result computed outside the backward before the backward began. ``value`` turns that
    tensor into the figure kept (its own value, or its float64 shadow); after ``steps`` optimizer steps the
    program is stopped (``Enough``). Enter it inside ShadowMode or an emulation (the innermost ``with``): it sees
    each op first and passes it on unchanged."""

    def __init__(self, steps: int, value: Callable[[torch.Tensor], float]):
        super().__init__()
        self.steps, self.value = steps, value
        self.losses: list[float] = []
        self.missing: int | None = None  # the first step without a loss to read (the program is stopped there)
        self.dtype = "torch.float32"
        self._last: weakref.ref | None = None
        self._loss: torch.Tensor | None = None  # frozen when the step's backward began
        self._handle: Any = None

    def __enter__(self) -> StepLosses:
        self._handle = register_optimizer_step_post_hook(self._stepped)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._handle.remove()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch._C._current_autograd_node() is not None:
            if self._loss is None and self._last is not None:
                self._loss = self._last()
        elif isinstance(first := _first_tensor(out), torch.Tensor) and \
                loss_candidate(str(func), Phase.OTHER, first.numel(), first.is_floating_point()):
            self._last = weakref.ref(first)  # the first result, as the trajectory reads it (nll_loss: its loss)
        return out

    def _stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        with _no_dispatch():
            loss = self._loss
            if loss is None:  # no one-element floating result before the backward: nothing to read as the loss
                self.missing = len(self.losses) + 1
                raise Enough
            self.losses.append(self.value(loss))
            self.dtype = str(loss.dtype)
        self._last = self._loss = None
        if len(self.losses) >= self.steps:
            raise Enough


def _first_tensor(out: Any) -> Any:
    """An op's first result (nll_loss_forward returns the loss and the total weight): no tree walk, every op of the
    run passes here."""
    return out[0] if type(out) in (tuple, list) and out else out


def program_envelope(run: Callable[[], int], restore: Callable[[], None], runs: int = 8, steps: int = 10, *,
                     device: str = "stochastic_budget", confidence: float = CONFIDENCE, seed: int = 0,
                     meta: dict | None = None) -> Envelope:
    """The envelope of an unmodified program: ``run`` executes it from its start (stopped by ``Enough`` after
    ``steps`` optimizer steps; it returns the program's exit status), ``restore`` puts the process state it starts
    from back (its generators) before each run. Raises RuntimeError when a run ends before ``steps`` steps or a step
    has no loss to read."""
    check_options(runs, steps, device, confidence)

    def losses(value: Callable[[torch.Tensor], float], mode: Any) -> tuple[list[float], str]:
        restore()
        reader = StepLosses(steps, value)
        with mode, reader:
            status = run()
        if reader.missing is not None:
            raise RuntimeError(f"optimizer step {reader.missing} had no loss to read (a one-element floating result "
                               "computed before its backward began): an envelope needs a loss per step; from Python, "
                               "give shadow.envelope a step() that returns it")
        if len(reader.losses) < steps:
            raise RuntimeError(f"the program made {len(reader.losses)} optimizer steps (exit status {status}), not "
                               f"the {steps} asked for: give fewer --steps")
        return reader.losses, reader.dtype

    sm = _float64_mode()
    float64, dtype = losses(lambda t: float(sm.shadow_of(t).reshape(-1)[0]), sm)
    values = [tuple(losses(lambda t: float(t.reshape(-1)[0]), emulate(device, seed=seed + i))[0])
              for i in range(runs)]
    restore()
    return Envelope(float64=tuple(float64), values=tuple(values), device=device, dtype=dtype, confidence=confidence,
                    meta={"seed": seed, **(meta or {})})
