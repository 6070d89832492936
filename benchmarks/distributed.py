"""DDP on two ranks (CPU, gloo, 127.0.0.1): one shadowed SGD step against one native step.

    python benchmarks/distributed.py [--width 256] [--steps 5]

Each rank runs one thread; the figure is rank 0's median step time over ``--steps`` steps after one warm-up.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _step(ddp, opt, x, y) -> None:
    opt.zero_grad()
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()


def _timed(n: int, fn) -> float:
    fn()  # warm-up
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _worker(rank: int, port: int, width: int, steps: int) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    from torch.nn.parallel import DistributedDataParallel

    from shadow import ShadowMode

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, width),
                                torch.nn.GELU(), torch.nn.Linear(width, 10))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, width), torch.randn(32, 10)
    native = _timed(steps, lambda: _step(ddp, opt, x, y))
    with ShadowMode() as sm:
        shadowed = _timed(steps, lambda: _step(ddp, opt, x, y))
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"DDP 2 ranks, MLP width {width} ({params} parameters), batch 32 per rank, SGD: native step "
              f"{native * 1e3:.1f} ms, shadowed {shadowed * 1e3:.1f} ms, ratio {shadowed / native:.1f}x; "
              f"{len(sm.report.find(op='c10d.allreduce_.default'))} all-reduces recorded")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, a.width, a.steps), nprocs=2)


if __name__ == "__main__":
    main()
