""""Which layers can I move to bf16?" — shadow.audit on one training step, and a plan that is checked.

    python examples/which_layers_bf16.py

For every module of a small transformer classifier (its submodules included: the encoder layer's row covers its
attention and feed-forward) and each candidate precision (bfloat16, float16, TF32), the audit estimates how much
the loss would move if that module alone ran in that precision, everything else in float64 (one shadowed run:
each op recomputed on its float64 inputs held in the format, by the device's own bfloat16 or float16 kernels, TF32
emulated; weighted by the float64 derivative of the loss), then measures the most sensitive modules directly (in
brackets). It flags
modules whose values would overflow float16 (O) or fall below its smallest normal (U). The plan moves the least
sensitive modules to the cheapest precision within a tolerance; plan.check runs the step with the plan on this
device (bfloat16 and float16 by casting, TF32 emulated on a CPU) and measures the loss against float64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import shadow


class Classifier(nn.Module):
    def __init__(self, width: int = 32, classes: int = 5):
        super().__init__()
        self.embed = nn.Linear(16, width)
        self.encoder = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)).mean(1))


def main() -> int:
    torch.manual_seed(0)
    model = Classifier()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 12, 16), torch.randint(0, 5, (16,))

    def step() -> torch.Tensor:  # the user's training step, unchanged: it returns the loss
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    audit = shadow.audit(step, precisions=("bf16", "fp16", "tf32"), verify=3)
    print(audit.table())
    tolerance = 1e-3
    plan = audit.plan(tolerance=tolerance)
    print()
    print(plan)
    plan.apply(model)
    measured = plan.check(step)
    verdict = "within" if measured <= tolerance else "BEYOND"
    print(f"\nchecked: the loss moved {measured:.2e} (relative) with the plan, {verdict} the tolerance {tolerance:g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
