"""A small training loop as usually written. It knows nothing of shadow: run it under shadow unchanged.

    python examples/train.py --steps 3                  # as is
    shadow run examples/train.py --steps 3              # every op of every step replayed in float64
    shadow run --skip-steps 2 --steps 1 examples/train.py --steps 3    # only the third step
    shadow show shadow-report.json                      # the tables and the verdict

A two-layer MLP on a fixed random batch, AdamW; prints the loss of each step.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn


def main(argv: list[str] | None = None) -> list[float]:
    """Train for ``--steps`` steps; returns the losses."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps (default: 2)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 32), torch.randint(0, 4, (64,))

    losses = []
    for step in range(args.steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        print(f"step {step + 1}: loss {losses[-1]:.6f}")
    return losses


if __name__ == "__main__":
    main()
