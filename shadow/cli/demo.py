"""``shadow demo``: a small model's training step shadowed, its table, verdict and losses printed."""

from __future__ import annotations

import argparse

import torch

from .. import devices
from ..scratch import copy
from .common import positive_int, summary, unwritable
from .registry import command, fail

DEVICES = ("auto",) + devices.BACKENDS
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="where the model runs (default: auto = the first available of "
                        f"{', '.join(devices.PREFERENCE)}; `shadow doctor` lists them)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="the model's dtype (default: float32)")
    p.add_argument("--steps", type=positive_int, default=2, help="optimizer steps to shadow (default: 2)")
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed for weights and data (default: 0)")
    p.add_argument("--top", type=positive_int, default=None, help="show only the N worst ops in the table")
    p.add_argument("--save", metavar="PATH", default=None, help="also write the report as JSON to PATH")


@command("demo", "shadow a small model's training step (Linear layers, Adam) and print the per-op table and verdict",
         arguments)
def execute(args: argparse.Namespace) -> int:
    from ..modes import ShadowMode

    backends = devices.discover()
    if args.device == "auto":
        backend = devices.choose(backends)
    else:
        backend = next(b for b in backends if b.name == args.device)
        if not backend.available:
            available = ", ".join(b.name for b in backends if b.available)
            return fail(f"demo: --device {args.device} is not available on this machine: {backend.reason}; "
                         f"available: {available} (or --device auto)")
    if args.save and (problem := unwritable(args.save)):
        return fail(f"demo: --save {args.save}: {problem}")
    device = backend.torch_device()
    dtype = DTYPES[args.dtype]
    if dtype == torch.float64 and backend.float64 is False:
        return fail(f"demo: --dtype float64 is not supported on {backend.name} ({backend.device_name or device}); "
                     "use float32, bfloat16 or float16")

    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 10)
    ).to(device=device, dtype=dtype)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(128, 64, device=device, dtype=dtype)
    y = torch.randint(0, 10, (128,), device=device)

    losses = []
    with ShadowMode() as sm:
        for _ in range(args.steps):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss)
    rep = sm.report

    print(f"shadow demo: MLP 64-256-256-10, Adam, {args.steps} step(s) on {device} {args.dtype} "
          f"(torch {torch.__version__}); errors against a float64 replay on the CPU")
    print()
    print(summary(rep, top=args.top))
    print()
    print("coverage:", rep.coverage)
    for i, loss in enumerate(losses):
        dev, ref = loss.item(), sm.shadow_of(loss).item()
        print(f"loss step {i + 1}: device {dev:.9g}  shadow {ref:.17g}  rel diff {abs(dev - ref) / abs(ref):.3g}")
    params = [(p.detach(), sm.shadow_of(p)) for p in model.parameters()]
    bad = sum(int((~torch.isfinite(p)).sum()) for p, _ in params)
    if bad:
        print(f"parameters after the last step: {bad} non-finite elements on the device")
    else:
        print(f"parameters after the last step: max rel_norm(device - shadow) "
              f"{max(_rel_diff(p, s) for p, s in params):.3g}")
    first = rep.first_nonfinite()
    if first is not None:
        print(f"first op call where device and shadow disagree on NaN/Inf: #{first.index} {first.op} "
              f"{first.module or '-'} ({first.phase})")
    if args.save:
        rep.save(args.save)
        print(f"report saved to {args.save}")
    return 0



def _rel_diff(p: torch.Tensor, s: torch.Tensor) -> float:
    d = copy(p, torch.float64, "cpu") - s
    return (torch.linalg.vector_norm(d) / torch.linalg.vector_norm(s).clamp_min(torch.finfo(torch.float64).tiny)).item()

