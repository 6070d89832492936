"""Where a model held in a narrow format computes in float32 on purpose, as a float32 run shows it.

Models cast to bfloat16 upcast explicitly: Llama's and T5's RMS norms compute their statistics on
``h.to(torch.float32)``, Hugging Face's losses on ``logits.float()``, attention asks softmax for
``dtype=torch.float32``. On a float32 device these casts do nothing, and a part emulated op by op in bfloat16 rounds
what the narrow model keeps in float32: a norm's per-row statistics rounded scale every element of the row alike
(measured: 152 of 512 elements of a Llama RMSNorm's output differed from the module cast to bfloat16, none with
the upcasts seen; Llama's whole-model estimate, its loss computed in bfloat16, was 79x its direct run).

``Upcasts`` (entered outside ShadowMode, around the audit's runs and the plan's) watches the torch functions that
name float32: a cast to float32 (``.float()``, ``.to(torch.float32)``, ``.type(torch.float32)``) of a tensor that
is not *wide* gives a wide one; ``.to`` or ``.type`` of a wide tensor, one that is not: the cast back
(``.to(input_dtype)`` names float32 in a float32 run; ``.float()`` never casts back). ``type_as(other)`` and
``.to(other)`` take ``other``'s width; a ``dtype=torch.float32`` result computed from a floating tensor (softmax,
sum) is wide, a factory's is not (its ``dtype=`` is most often the model's own: ``zeros(..., dtype=x.dtype)``).
Every op whose floating inputs are all wide has wide results (its dispatch mode sees every op, the internal views
of composite ops included; the held rules mark what they run on wide inputs). Where a cast does nothing, it
returns an alias view of the tensor instead of the tensor itself: the same storage and values, so nothing the
program computes changes (only ``y is x`` does).

Some kernels compute narrow inputs in float32 inside, where no cast shows (``WIDE_INSIDE``: attention by the math
backend, which PyTorch picks where a mask needs a gradient): their narrow arguments are taken as upcast, their
results as cast back.

A cast back that a float32 run skips is not seen: ``T5LayerNorm`` casts back only where its weight is bfloat16 or
float16. The held rules (``shadow.precision.held``) therefore round the results of an op that mixes wide and narrow
inputs (in the narrow model, float32 by promotion, then cast back), and leave those of ops on wide inputs alone.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakIdKeyDictionary

from ..modes.emulate import computes, require_outside_shadow
from ..plan import flat_returns, plan_of

_CASTS = {torch.Tensor.float, torch.Tensor.to, torch.Tensor.type, torch.Tensor.type_as}


def _sdpa_upcasts(args: tuple, kwargs: dict) -> bool:
    """Attention by the math backend (chosen where no fused kernel takes the call: a mask that needs a gradient)
    computes bfloat16 and float16 inputs in float32 unless that reduction is allowed (torch >= 2.5; before,
    in the inputs' dtype)."""
    allowed = getattr(torch.backends.cuda, "fp16_bf16_reduction_math_sdp_allowed", None)
    if allowed is None or allowed():
        return False
    try:
        return torch._fused_sdp_choice(*args, **kwargs) == 0
    except Exception:  # arguments the call itself will refuse: it says why, not this question
        return False


# functions whose kernels compute narrow inputs in float32 inside (no cast a float32 run could see): on the call's
# arguments, whether this call does
WIDE_INSIDE = {torch.nn.functional.scaled_dot_product_attention: _sdpa_upcasts}


class Upcasts:
    """The wide tensors of one run: ``with upcasts:`` watches the casts (enter it outside ShadowMode);
    ``wide(t)`` asks. A narrow model holds a wide tensor in float32; one that holds *narrow values* (an upcast of
    a narrow tensor, its views and copies) has the narrow tensor's values, already rounded to the format there."""

    def __init__(self) -> None:
        self._wide: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> it holds narrow values
        self._modes = (_Casts(self), Watch(after=self.spread))

    def wide(self, t: torch.Tensor) -> bool:
        return t in self._wide

    def narrow_values(self, t: torch.Tensor) -> bool:
        return self._wide.get(t, False)

    def __len__(self) -> int:
        return len(self._wide)

    def spread(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """An op whose floating inputs are all wide has wide results, holding narrow values where it moves them
        (views, copies) from inputs that all do."""
        if not len(self._wide):
            return
        plan = plan_of(func)
        floats = [t for _, t in plan.tensors(args, kwargs) if t.is_floating_point()]
        if floats and all(self.wide(t) for t in floats):
            moved = not computes(plan) and all(self.narrow_values(t) for t in floats)
            for _, t in flat_returns(plan, out):
                self.mark(t, narrow_values=moved)

    def mark(self, t: Any, wide: bool = True, narrow_values: bool = False) -> None:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            return
        if wide:
            self._wide[t] = narrow_values
        else:
            self._wide.pop(t, None)

    def __enter__(self) -> Upcasts:
        require_outside_shadow("Upcasts()")
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


def _target(func: Any, args: tuple, kwargs: dict) -> Any:
    """What a cast names: a dtype, a tensor whose dtype and width it takes, or None (not a cast)."""
    if func is torch.Tensor.float:
        return torch.float32
    if func is torch.Tensor.type_as:
        return args[1] if len(args) > 1 else kwargs.get("other")
    target = kwargs.get("dtype")
    for a in args[1:]:  # .to(dtype), .to(device, dtype), .to(other), .type(dtype)
        if isinstance(a, (torch.dtype, torch.Tensor)):
            target = a
    return target


class _Casts(TorchFunctionMode):
    def __init__(self, upcasts: Upcasts):
        super().__init__()
        self.upcasts = upcasts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inside = WIDE_INSIDE.get(func)
        if inside is not None and inside(args, kwargs):
            return self._wide_inside(func, args, kwargs)
        out = func(*args, **kwargs)
        if func in _CASTS and args and isinstance(args[0], torch.Tensor):
            target = _target(func, args, kwargs)
            dtype = target.dtype if isinstance(target, torch.Tensor) else target
            if dtype is not torch.float32 or not isinstance(out, torch.Tensor):
                return out
            source = args[0]
            if out is source and source.layout == torch.strided and not source.is_nested:
                out = source.view_as(source)  # an alias, as .to returns: a tensor of its own to mark
            up = self.upcasts
            if isinstance(target, torch.Tensor):
                wide = up.wide(target)
            elif func is torch.Tensor.float:  # asks for float32: never the way back
                wide = True
            elif source.dtype == torch.float32:  # no cast in a float32 run: widening a narrow one, or the way back
                wide = not up.wide(source)
            else:  # from float64 it narrows; from a narrower float or an integer it widens
                wide = source.dtype.itemsize < 8 or not source.is_floating_point()
            # an upcast of a narrow floating tensor holds its (narrow) values; of an integer one, exact float32
            narrow = up.narrow_values(source) if up.wide(source) else source.is_floating_point()
            up.mark(out, wide, narrow)
        elif kwargs.get("dtype") is torch.float32 and any(isinstance(a, torch.Tensor) and a.is_floating_point()
                                                          for a in args):
            # softmax(x, dim, dtype=torch.float32), sum(x, dtype=...); not a factory, whose dtype= is the model's
            # own more often than not (nn.LSTM's initial state: zeros(..., dtype=input.dtype))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                self.upcasts.mark(t)
        return out


    def _wide_inside(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A ``WIDE_INSIDE`` call: its narrow floating arguments upcast (alias views holding narrow values), its
        results cast back."""
        up = self.upcasts

        def upcast(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or up.wide(t) or t.layout != torch.strided:
                return t
            alias = t.view_as(t)
            up.mark(alias, narrow_values=True)
            return alias

        out = func(*tree_map(upcast, args), **tree_map(upcast, kwargs))
        tree_map(lambda t: up.mark(t, wide=False), out)
        return out


class Watch(TorchDispatchMode):
    """Every call the device runs: ``before(func, args, kwargs)`` ahead of it, ``after(func, args, kwargs, out)``
    once it returned. Entered outside ShadowMode, it sees the calls as the device does, after shadow prepared them
    and before it replays them."""

    def __init__(self, before: Any = None, after: Any = None):
        super().__init__()
        self.before, self.after = before, after

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.before is not None:
            self.before(func, args, kwargs)
        out = func(*args, **kwargs)
        if self.after is not None:
            self.after(func, args, kwargs, out)
        return out
