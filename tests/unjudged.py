"""An op no budget rule knows, for the tests of what shadow does with one (the default guess, flagged): the aten ops
programs and PyTorch's suites run have rules (tests/test_budget_coverage.py), so it is a custom op of the tests' own,
replayed in float64 through its CPU kernel as any custom op is."""

import torch


@torch.library.custom_op("shadow_tests::unjudged", mutates_args=())
def unjudged(x: torch.Tensor) -> torch.Tensor:
    """x * 1.5 + 0.25, rounded once per operation."""
    return x * 1.5 + 0.25


@unjudged.register_fake
def _(x):
    return torch.empty_like(x)


OP = torch.ops.shadow_tests.unjudged.default
NAME = "shadow_tests.unjudged.default"
