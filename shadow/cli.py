"""The ``shadow`` command line: ``python -m shadow demo``, ``python -m shadow doctor``.

The CLI is the one place that prints; library code returns objects and leaves rendering to its caller.
Each subcommand is a function registered with ``@command``; ``main`` builds the parser from that table.

>>> main(["demo", "--steps", "1"])   # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import os
import dataclasses
import sys
from typing import Callable, Sequence

import torch

from . import devices as _devices

DEVICES = ("auto",) + _devices.BACKENDS
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclasses.dataclass(frozen=True)
class _Command:
    name: str
    help: str
    run: Callable[[argparse.Namespace], int]  # returns the exit status
    arguments: Callable[[argparse.ArgumentParser], None]  # adds the subcommand's own arguments


_COMMANDS: dict[str, _Command] = {}


def command(name: str, help: str, arguments: Callable[[argparse.ArgumentParser], None] | None = None):
    """Register ``run(args) -> int`` as the subcommand ``name``; ``arguments(parser)`` adds its options.

    >>> @command("hello", "say hello")
    ... def _hello(args): print("hello"); return 0      # doctest: +SKIP
    """

    def register(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        if name in _COMMANDS:
            raise ValueError(f"shadow command {name!r} is already registered (by {_COMMANDS[name].run.__qualname__})")
        _COMMANDS[name] = _Command(name, help, run, arguments or (lambda parser: None))
        return run

    return register


# --- argument types: errors name what was expected and what came ---
def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {n}")
    return n


# --- demo ---
def _demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="where the model runs (default: auto = the first available of "
                        f"{', '.join(_devices.PREFERENCE)}; `shadow doctor` lists them)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="the model's dtype (default: float32)")
    p.add_argument("--steps", type=_positive_int, default=2, help="optimizer steps to shadow (default: 2)")
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed for weights and data (default: 0)")
    p.add_argument("--top", type=_positive_int, default=None, help="show only the N worst ops in the table")
    p.add_argument("--save", metavar="PATH", default=None, help="also write the report as JSON to PATH")


@command("demo", "shadow a small model's training step (Linear layers, Adam) and print the per-op table",
         _demo_arguments)
def _demo(args: argparse.Namespace) -> int:
    from .modes import ShadowMode

    backends = _devices.discover()
    if args.device == "auto":
        backend = _devices.choose(backends)
    else:
        backend = next(b for b in backends if b.name == args.device)
        if not backend.available:
            available = ", ".join(b.name for b in backends if b.available)
            return _fail(f"demo: --device {args.device} is not available on this machine: {backend.reason}; "
                         f"available: {available} (or --device auto)")
    if args.save and (problem := _unwritable(args.save)):
        return _fail(f"demo: --save {args.save}: {problem}")
    device = backend.torch_device()
    dtype = DTYPES[args.dtype]
    if dtype == torch.float64 and backend.float64 is False:
        return _fail(f"demo: --dtype float64 is not supported on {backend.name} ({backend.device_name or device}); "
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
    print(rep.table(top=args.top))
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


# --- doctor ---
def _doctor_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the findings as JSON instead of text")


@command("doctor", "list each device backend (cpu, cuda, mps, xpu, directml): available or why not, its name, "
         "float64 support, and which one demo uses", _doctor_arguments)
def _doctor(args: argparse.Namespace) -> int:
    import json
    import platform

    backends = _devices.discover()
    chosen = _devices.choose(backends)
    numerics = _devices.numerics_settings()
    if args.json:
        print(json.dumps({"torch": torch.__version__, "python": platform.python_version(),
                          "backends": [dataclasses.asdict(b) for b in backends], "uses": chosen.name,
                          "numerics": numerics}, indent=2))
        return 0
    print(f"shadow doctor: torch {torch.__version__}, Python {platform.python_version()}, "
          f"{platform.system()} {platform.machine()}")
    print()
    print(_doctor_table(backends))
    print()
    where = chosen.name if chosen.device == chosen.name else f"{chosen.name}, {chosen.device}"
    print(f"demo will use: {where}" + (f" ({chosen.device_name})" if chosen.device_name else ""))
    print()
    print("numerics settings (recorded with each report):")
    width = max(map(len, numerics), default=0)
    for name, value in numerics.items():
        print(f"  {name:<{width}}  {value}")
    return 0


def _doctor_table(backends: list) -> str:
    """One line per backend, its reason wrapped and indented below it."""
    import textwrap

    rows = [("backend", "available", "device", "float64", "name")]
    for b in backends:
        f64 = "-" if b.float64 is None else ("yes" if b.float64 else "no")
        rows.append((b.name, "yes" if b.available else "no", b.device or "-", f64, b.device_name or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = []
    for i, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[4])
        if i:
            lines.extend(textwrap.wrap(backends[i - 1].reason, width=100, initial_indent="    ",
                                       subsequent_indent="    ", break_long_words=False, break_on_hyphens=False))
    return "\n".join(lines)


def _rel_diff(p: torch.Tensor, s: torch.Tensor) -> float:
    d = p.to("cpu", torch.float64) - s
    return (torch.linalg.vector_norm(d) / torch.linalg.vector_norm(s).clamp_min(torch.finfo(torch.float64).tiny)).item()


def _unwritable(path: str) -> str:
    """Why a report cannot be written to ``path`` ("" if it can): checked before a long run, not after it."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return "is a directory"
    if not os.path.isdir(folder):
        return f"the folder {folder} does not exist"
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return "not writable"
    return ""


def _fail(message: str) -> int:
    print(f"shadow: error: {message}", file=sys.stderr)
    return 2


# --- entry point ---
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shadow",
        description="Replay a PyTorch program op by op in float64 and report each op's error.",
        epilog="run 'shadow COMMAND --help' for a command's options",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for cmd in _COMMANDS.values():
        cmd.arguments(sub.add_parser(cmd.name, help=cmd.help, description=cmd.help))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for a usage error, as argparse does)."""
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 with a message on bad arguments
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return _COMMANDS[args.command].run(args)
    except BrokenPipeError:  # output piped into `head`: stop quietly, as other command-line tools do
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit-time flush cannot fail
        return 1
