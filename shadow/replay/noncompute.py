"""Replay rules for ops with nothing to recompute in float64: views and metadata, uninitialized memory (the
device's bytes are the value) and randomness (never replayed: it would consume the device's generator)."""

from __future__ import annotations

from typing import Any

import torch

from ..opsets import Family
from ..plan import OpPlan
from ..records import Kind
from .table import Replay, register_predicate, register_rule

aten = torch.ops.aten


# --- views and metadata-only ops: nothing to recompute ---
def views_and_metadata(plan: OpPlan) -> bool:
    return plan.is_view or torch.Tag.inplace_view in plan.tags


@register_predicate(views_and_metadata, family=Family.VIEW)
def view_rule(r: Replay) -> tuple[Kind, Any]:
    return Kind.VIEW, None


# --- uninitialized memory: the device's bytes are the value ---
EMPTY_OPS = frozenset(
    op
    for op in (
        aten.empty.memory_format,
        aten.empty_strided.default,
        aten.new_empty.default,
        aten.new_empty_strided.default,
        aten.empty_like.default,
        aten.empty_permuted.default if hasattr(aten, "empty_permuted") else None,
    )
    if op is not None
)


@register_rule(*EMPTY_OPS, family=Family.UNINITIALIZED)
def uninitialized_rule(r: Replay) -> tuple[Kind, Any]:
    """Adopted at the first read of the device's bytes."""
    return Kind.ADOPTED, None


# --- randomness: never replayed (it would consume the device's generator) ---
# Ops tagged nondeterministic_seeded that draw no random numbers when their dropout probability is 0.
_DROPOUT_ARGS = ("dropout_p", "dropout")


def _draws_random(r: Replay) -> bool:
    dropout_args = [n for n in _DROPOUT_ARGS if r.plan.has(n)]
    if not dropout_args:
        return True
    if r.plan.has("train") and r.arg("train") is False:
        return False
    return any(r.arg(n, 0.0) not in (0, 0.0, None) for n in dropout_args)


def seeded(plan: OpPlan) -> bool:
    """Tagged ``torch.Tag.nondeterministic_seeded`` (SDPA and RNNs too: random only with a dropout > 0)."""
    return torch.Tag.nondeterministic_seeded in plan.tags


@register_predicate(seeded, family=Family.RANDOM)
def random_rule(r: Replay) -> Any:
    """Adopt the device's random outputs; SDPA and RNNs with dropout 0 fall through to a replay."""
    return (Kind.RANDOM, None) if _draws_random(r) else NotImplemented


@register_rule(aten.native_dropout.default, family=Family.RANDOM)
def native_dropout_rule(r: Replay) -> tuple[Kind, Any]:
    """Adopt the device's mask; the kept values come from the shadow input, so drift survives."""
    x, p, train = r.args[0], r.args[1], r.arg("train")
    mask = r.device_out[1].to(x.device)  # where x's shadow lives
    if train is False:
        return Kind.REPLAYED, (x.clone(), mask)
    scale = 0.0 if p >= 1 else 1.0 / (1.0 - p)
    return Kind.RANDOM, (x * mask * scale, mask)
