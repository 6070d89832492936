"""The cost of a shadowed compiled training step, as a ratio measured in one run (never a timed test).

    python benchmarks/compiled.py                      # the corpus' Block and GPT, Inductor, AdamW
    python benchmarks/compiled.py --models block --steps 8

For each model: the native compiled step (``torch.compile``, Inductor), the eager step in float64 (what the
shadow replays, model and data converted), and the compiled step under ``ShadowMode()`` (every graph judged:
its aten graph replayed in float64 twice, on the shadows and on the device's inputs, and its budget composed).
The figure is ``shadowed / (native compiled + float64 eager)``, beside the eager ``ShadowMode()`` step of the same
model for comparison. Compilation is excluded: every configuration runs its warm-up steps first (the shadowed
one compiles again inside its block, so its graphs are shown to it), then ``--steps`` timed steps, their median
taken; the unshadowed configurations take turns, before and after the shadowed block. Dropout is off (p = 0).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from corpus import build  # noqa: E402

from shadow import ShadowMode  # noqa: E402


def _step(program, module) -> None:
    opt = program.optimizer
    opt.zero_grad(set_to_none=True)
    loss = program.forward(module, program.batches[0])
    loss.backward()
    opt.step()


def _no_dropout(program):
    for m in program.model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return program


def _rounds(configs: dict, warmup: int, steps: int) -> dict[str, float]:
    """Each configuration's step timed in turn, ``steps`` rounds after ``warmup`` (a loaded machine slows them
    alike); the median of each."""
    times: dict[str, list[float]] = {k: [] for k in configs}
    for r in range(warmup + steps):
        for k, step in configs.items():
            t = time.perf_counter()
            step()
            if r >= warmup:
                times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def measure(name: str, steps: int, warmup: int) -> dict:
    """The native compiled, float64 eager and shadowed eager steps in turn; then the shadowed compiled steps in one
    block (a block's first call compiles the model again, and the first call after it too: code compiled in a
    block is guarded on ShadowMode's module hooks); then the three others again, around it."""
    compiled = _no_dropout(build(name, habit="compile_inductor", steps=1))
    f64 = _no_dropout(build(name, habit="train", dtype=torch.float64, steps=1))
    eager = _no_dropout(build(name, habit="train", steps=1))
    sm_eager = ShadowMode()

    def shadowed_eager() -> None:
        with sm_eager:
            _step(eager, eager.model)

    others = {"native": lambda: _step(compiled, compiled.module), "float64": lambda: _step(f64, f64.model),
              "shadowed_eager": shadowed_eager}
    before = _rounds(others, warmup, steps)
    with ShadowMode() as sm:
        shadowed = _rounds({"shadowed": lambda: _step(compiled, compiled.module)}, warmup, steps)["shadowed"]
    after = _rounds(others, warmup, steps)
    med = {k: (before[k] + after[k]) / 2 for k in others}
    base = med["native"] + med["float64"]
    return {"model": name, **{f"{k}_ms": v * 1e3 for k, v in med.items()}, "shadowed_ms": shadowed * 1e3,
            "ratio": shadowed / base, "eager_ratio": med["shadowed_eager"] / base,
            "graph_calls": sum(r.op.startswith("compiled.graph") for r in sm.report.records)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["block", "gpt_masked_fill"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    for name in args.models:
        r = measure(name, args.steps, args.warmup)
        print(f"{r['model']}: native compiled {r['native_ms']:.1f} ms, float64 eager {r['float64_ms']:.1f} ms, "
              f"shadowed compiled {r['shadowed_ms']:.1f} ms ({r['graph_calls']} graph calls): {r['ratio']:.1f}x "
              f"(native compiled + float64 eager); shadowed eager {r['shadowed_eager_ms']:.1f} ms: "
              f"{r['eager_ratio']:.1f}x")


if __name__ == "__main__":
    main()
