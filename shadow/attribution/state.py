"""What a training step changes, saved so that the step can run again from the same start.

``shadow.attribute`` and ``shadow.audit`` run a user's step once or several times; each run must start where the
first did, and the user's objects must end as they were found (``as_found``): they measure a step, they do not
take one. A step is a plain callable, so what it changes is learnt while it first runs: every module it calls
(saved at its first forward, with its submodules: parameters, buffers, gradients) and every optimizer it steps
(its ``state_dict`` before the step), plus torch's CPU and CUDA generators (before the step). Not covered, and
documented as such: tensors the step writes outside modules and optimizers, learning-rate schedulers, Python's
and numpy's generators; gradients are put back as the module's first forward found them (after a ``zero_grad``
the step makes before it).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Iterator

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .tracking import compiling

_no_dispatch = torch._C._DisableTorchDispatch  # saving and restoring are shadow's own work: no mode sees them


@dataclasses.dataclass
class Saved:
    """One moment of a step's state."""

    tensors: list[tuple[torch.Tensor, torch.Tensor]]  # (a parameter or buffer, its values then)
    grads: list[tuple[torch.Tensor, torch.Tensor | None]]  # (a parameter, its gradient then)
    optimizers: list[tuple[torch.optim.Optimizer, dict]]  # (an optimizer, its state_dict then)
    rng: tuple[torch.Tensor, list[torch.Tensor] | None]  # the CPU generator's state, the CUDA ones'


class StepState:
    """The modules and optimizers a step uses, learnt during its first run (``learning``), and their state.

    >>> state = StepState()
    >>> with state.as_found():             # the block's end puts the start back, however it ends
    ...     with state.learning():
    ...         step()                     # doctest: +SKIP
    ...     state.restore(state.start)     # back to the start: run it again  # doctest: +SKIP
    ...     step()                         # doctest: +SKIP
    """

    def __init__(self) -> None:
        self.modules: list[torch.nn.Module] = []  # the outermost modules the step called, in order
        self.optimizers: list[torch.optim.Optimizer] = []
        self.start: Saved | None = None

    @contextlib.contextmanager
    def learning(self) -> Iterator[StepState]:
        """Run the step's first run inside this: each module is saved before its first forward, each optimizer
        before its first step; ``start`` holds the whole state as it was when the step began."""
        rng = _rng()
        tensors: list = []
        grads: list = []
        optimizers: list = []
        seen: set[int] = set()

        def module_pre(mod: torch.nn.Module, args) -> None:
            if id(mod) in seen or compiling():  # torch.compile tracing the modules (fake tensors): not the step's
                return
            seen.update(id(m) for m in mod.modules())
            self.modules.append(mod)
            with _no_dispatch(), torch.no_grad():
                tensors.extend((t, t.detach().clone()) for t in _tensors(mod))
                grads.extend((p, _clone(p.grad)) for p in mod.parameters())

        def optimizer_pre(opt: torch.optim.Optimizer, args, kwargs) -> None:
            if any(opt is o for o in self.optimizers):
                return
            self.optimizers.append(opt)
            with _no_dispatch(), torch.no_grad():
                optimizers.append((opt, copy.deepcopy(opt.state_dict())))
                # parameters no module owns: unchanged until this step (their gradients are this step's)
                owned = {id(t) for t, _ in tensors}
                tensors.extend((p, p.detach().clone()) for g in opt.param_groups for p in g["params"]
                               if id(p) not in owned)

        handles = [register_module_forward_pre_hook(module_pre), register_optimizer_step_pre_hook(optimizer_pre)]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
            self.start = Saved(tensors, grads, optimizers, rng)

    @contextlib.contextmanager
    def as_found(self) -> Iterator[StepState]:
        """Every run of the step inside leaves the user's objects as the first found them: ``start`` is restored
        when the block ends, however it ends (a step that raised included)."""
        try:
            yield self
        finally:
            if self.start is not None:
                self.restore(self.start)

    def restore(self, saved: Saved) -> None:
        """Put every saved tensor, gradient, optimizer state and generator back (in place: the user's parameters
        stay the same objects; optimizer state tensors are new ones, as after ``load_state_dict``)."""
        with _no_dispatch(), torch.no_grad():
            for t, v in saved.tensors:
                t.copy_(v)
            for p, g in saved.grads:
                p.grad = _clone(g)
            for opt, sd in saved.optimizers:
                opt.load_state_dict(copy.deepcopy(sd))  # a copy: the optimizer adopts the tensors it is given
        cpu, cuda = saved.rng
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _tensors(mod: torch.nn.Module) -> list[torch.Tensor]:
    found: dict[int, torch.Tensor] = {}
    for t in (*mod.parameters(), *mod.buffers()):
        found.setdefault(id(t), t)
    return list(found.values())


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().clone()


def _rng() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda
