""""My training drifts from the CPU: which op is to blame?" — shadow.attribute on one training step.

    python examples/which_op_drifts.py

The "device" here is the CPU with one bad kernel: FaultMode gives every GELU a relative error of 1e-3, as an
approximate GELU on some backend would (on a real device, leave FaultMode out). shadow.attribute runs the step,
measures the drift of the loss against its float64 shadow, and says which share of it each op class, then each
module, causes: by the linear method (one run: each op's own error weighted by the float64 derivative of the
loss), then by ablation (one run per suspect: the drift left when it is made exact; it covers the backward and
the optimizer too). Each key's row also gives the share of its results' correct rounding (stored in float32, which
no kernel avoids: on a correct device, the answer to "whose rounding drives my drift?"); the rounding left to no
key and the residual close the sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import shadow
from shadow.modes import FaultMode


class FeedForward(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


class Block(nn.Module):
    def __init__(self, width: int = 32, classes: int = 5):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, 4, batch_first=True)
        self.ff = FeedForward(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        h = x + self.attn(h, h, h, need_weights=False)[0]
        h = h + self.ff(h)
        return self.head(h.mean(1))


def main() -> int:
    torch.manual_seed(0)
    model = Block()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 10, 32), torch.randint(0, 5, (16,))

    def step() -> torch.Tensor:  # the user's training step, unchanged: it returns the loss
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    with FaultMode(rel=1e-3, op="gelu"):  # the "device" with a bad GELU kernel
        by_op = shadow.attribute(step, by="op", method="linear")
        by_module = shadow.attribute(step, by="module", method="ablation")

    print("share of the loss's drift by op class (linear, one run):")
    print(by_op.table(top=6))
    print("\nshare of the loss's drift by module (ablation, one run per suspect):")
    print(by_module.table(top=6))
    top, where = by_op.rows[0], by_module.rows[0]
    print(f"\nto blame: {top.key} ({100 * top.share:.0f}% of the loss's drift; its own relative error "
          f"{top.introduced:.2g}), in {where.key} ({100 * where.share:.0f}%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
