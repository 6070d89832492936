"""Page faults, time and peak memory of one shadowed training step, in a process of its own (CPU, Linux).

    python benchmarks/page_faults.py                          # the LM-shaped model, default ShadowMode()
    python benchmarks/page_faults.py --model "mlp 4x1024 b256" --steps 5

Fresh CPU tensors above glibc's mmap threshold (32 MB at most) are new pages, which fault in at their first
write: what ``shadow.scratch`` pools. Two untimed steps, then ``--steps`` timed ones: each step's time, the
minor page faults per step (in MB of 4 KB pages), the pool's idle bytes after the last step beside the shadows
and the device bytes, and the process's peak resident memory. To compare two commits, run it in a git worktree
of each (the figures of one process, never mixed with another's).
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from overhead import MODELS, _step_fn
from shadow import ShadowMode


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="lm gpt2 4x768 v50k b1 s128", choices=list(MODELS))
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    torch.manual_seed(0)
    model, x = MODELS[args.model]()
    step = _step_fn(model, x)
    step()
    with ShadowMode() as mode:
        for _ in range(2):
            step()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        memory = mode.memory()
    mb = 1 << 20
    print(f"{args.model}: steps {', '.join(f'{t:.2f}' for t in times)} s; page faults {faults * 4096 / args.steps / mb:.0f} MB "
          f"per step; after the last step: shadows {memory['shadow_bytes'] / mb:.0f} MB, device {memory['device_bytes'] / mb:.0f} MB, "
          f"idle in the pool {memory['scratch_bytes'] / mb:.0f} MB; peak resident "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()
