"""A Linear model's training step, written as usual, shadowed in float64 by wrapping it in ShadowMode.

    python examples/train_step.py

Prints the per-op table (worst budget use first), the five op calls with the largest local error,
the loss as the device computed it beside its float64 shadow, and how far each parameter moved away
from its shadow during the step.
"""

from __future__ import annotations

import torch
from torch import nn

from shadow import ShadowMode


def main() -> int:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 32), torch.randint(0, 4, (64,))

    with ShadowMode() as sm:  # the only line that changes in the user's code
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    rep = sm.report
    print(rep.table())
    print("\nworst op calls (local error: the op's own error, replayed in float64 on its own inputs):")
    computed = [r for r in rep.records if r.local is not None]
    for r in sorted(computed, key=lambda r: r.local.max_ulp, reverse=True)[:5]:
        print(f"  #{r.index:<4} {r.op:<28} {r.module or '-':<22} {r.phase:<9} "
              f"{r.local.max_ulp:10.3g} ulp  {r.local.max_abs:.3g} abs")

    dev, ref = loss.item(), sm.shadow_of(loss).item()
    print(f"\nloss: device {dev:.9g}  shadow {ref:.17g}  rel diff {abs(dev - ref) / abs(ref):.3g}")
    print("parameters after the step, rel_norm(device - shadow):")
    for name, p in model.named_parameters():
        s = sm.shadow_of(p)
        rel = (torch.linalg.vector_norm(p.detach().double() - s) / torch.linalg.vector_norm(s)).item()
        print(f"  {name:<10} {rel:.3g}")
    print(f"\ncoverage: {rep.coverage}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
