"""``shadow doctor``: each device backend, available or why not, and the numerics settings a report records."""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import textwrap

import torch

from .. import devices
from .registry import command


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the findings as JSON instead of text")


@command("doctor", "list each device backend (cpu, cuda, mps, xpu, directml): available or why not, its name, "
         "float64 support, and which one demo uses", arguments)
def execute(args: argparse.Namespace) -> int:
    backends = devices.discover()
    chosen = devices.choose(backends)
    numerics = devices.numerics_settings()
    if args.json:
        print(json.dumps({"torch": torch.__version__, "python": platform.python_version(),
                          "backends": [dataclasses.asdict(b) for b in backends], "uses": chosen.name,
                          "numerics": numerics}, indent=2))
        return 0
    print(f"shadow doctor: torch {torch.__version__}, Python {platform.python_version()}, "
          f"{platform.system()} {platform.machine()}")
    print()
    print(_table(backends))
    print()
    where = chosen.name if chosen.device == chosen.name else f"{chosen.name}, {chosen.device}"
    print(f"demo will use: {where}" + (f" ({chosen.device_name})" if chosen.device_name else ""))
    print()
    print("numerics settings (recorded with each report):")
    width = max(map(len, numerics), default=0)
    for name, value in numerics.items():
        print(f"  {name:<{width}}  {value}")
    return 0


def _table(backends: list) -> str:
    """One line per backend, its reason wrapped and indented below it."""
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

