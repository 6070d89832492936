"""How other parts of shadow take part in each op call: one ``EngineHooks``, given to the engine when it is made."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

    from ..plan import OpPlan
    from ..records import Phase, Record
    from .values import Output, Prepared


@dataclasses.dataclass(frozen=True, slots=True)
class EngineHooks:
    """What the per-op path asks or tells outside itself; a hook left None is never called.

    ShadowMode gives its scope (``shadows``) and its trajectory (``recorded``); ``shadow.attribute`` and
    ``shadow.audit`` give theirs through ``ShadowMode(hooks=EngineHooks(world=..., observe=...))``.

    >>> seen = []
    >>> hooks = EngineHooks(recorded=lambda rec, result: seen.append(rec.op))
    """

    # whether a call is shadowed (ShadowMode(scope=...)): one that is not runs untouched and is not recorded,
    # and a storage it writes takes the device's values again
    shadows: Callable[[OpPlan, tuple, dict], bool] | None = None
    # an ablation world: given a replayed call's (op, module, phase, call site), "device" (its shadows keep the error
    # the device made on it), "exact" (only the error of rounding to the device dtype) or None (as replayed)
    world: Callable[[str, str, Phase, str], str | None] | None = None
    # every judged call: its record, its outputs and what preparation built. Observers compute with CPU tensors of
    # their own: under shadow_device="auto" the shadows then stay on the CPU
    observe: Callable[[Record, tuple[Output, ...], Prepared], None] | None = None
    # every record, with the call's first tensor result (None: it has none)
    recorded: Callable[[Record, torch.Tensor | None], Any] | None = None

    def merged(self, other: EngineHooks) -> EngineHooks:
        """These hooks and ``other``'s together; a hook both give is an error."""
        both = [f.name for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None and getattr(other, f.name) is not None]
        if both:
            raise ValueError(f"EngineHooks: {', '.join(both)} given twice; each hook has one owner")
        return EngineHooks(**{f.name: getattr(self, f.name) if getattr(self, f.name) is not None
                              else getattr(other, f.name) for f in dataclasses.fields(self)})
