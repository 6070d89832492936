"""The cost of shadow.audit and shadow.attribute against one default shadowed step, as ratios in one run.

    python benchmarks/audit.py

A small transformer block (an encoder layer of width 64, 4 heads, feed-forward 256, batch 8 x 32 tokens, and a
classifier head) and an AdamW training step. For each measurement the model and optimizer start from the same
state. Reported: one default ShadowMode step (seconds), then the audit (by module, bf16/fp16/tf32, verify=5) and
attribute (linear, ablation by module) as multiples of it.
"""

from __future__ import annotations

import copy
import platform
import time

import torch
import torch.nn.functional as F
from torch import nn

import shadow


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x).mean(1))


def main() -> None:
    torch.manual_seed(0)
    model = Block()
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    x, y = torch.randn(8, 32, 64), torch.randint(0, 10, (8,))
    start = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())

    def step():
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    def timed(fn) -> float:
        model.load_state_dict(start[0])
        opt.load_state_dict(copy.deepcopy(start[1]))
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    def shadowed():
        with shadow.ShadowMode():
            step()

    timed(shadowed)  # warm-up: first-call costs (compilation, caches) apart
    base = min(timed(shadowed) for _ in range(3))
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"one default shadowed step: {base:.3f} s")
    audit = timed(lambda: shadow.audit(step, precisions=("bf16", "fp16", "tf32"), verify=5))
    print(f"audit (module, bf16/fp16/tf32, verify=5): {audit:.2f} s = {audit / base:.1f}x")
    linear = timed(lambda: shadow.attribute(step, by="op", method="linear"))
    print(f"attribute linear (op): {linear:.2f} s = {linear / base:.1f}x")
    ablation = timed(lambda: shadow.attribute(step, by="module", method="ablation"))
    print(f"attribute ablation (module): {ablation:.2f} s = {ablation / base:.1f}x")


if __name__ == "__main__":
    main()
