"""A GPT-2-medium-sized model (355M parameters, a random config: nothing downloaded) shadowed for one AdamW step
within the machine's memory, with ShadowMode(scope=...) where the whole model does not fit twice.

    python benchmarks/scale.py [--blocks N]     # shadow the first N of the 24 blocks (default: 12)

Prints the native step time, the shadowed step time and their ratio, and the peak resident memory of each
(measured in separate processes, so that each peak is its own).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def run(blocks: int, shadowed: bool) -> dict:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import shadow

    torch.manual_seed(0)
    config = GPT2Config(n_embd=1024, n_layer=24, n_head=16, vocab_size=50257, n_positions=1024)
    model = GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (1, 128))

    def step():
        opt.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        return loss

    scope = [model.transformer.h[i] for i in range(blocks)] if blocks < 24 else None
    t = time.perf_counter()
    if shadowed:
        with shadow.ShadowMode(scope=scope, max_records=1000, spot_checks="off") as sm:
            step()
        calls, outside = sm.report.coverage.calls, sm.report.coverage.out_of_scope
    else:
        step()
        calls = outside = 0
    seconds = time.perf_counter() - t
    params = sum(p.numel() for p in model.parameters())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": seconds, "peak_bytes": peak, "params": params, "calls": calls, "out_of_scope": outside}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--child", choices=("native", "shadowed"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run(args.blocks, args.child == "shadowed")))
        return
    out = {}
    for kind in ("native", "shadowed"):
        proc = subprocess.run([sys.executable, __file__, "--blocks", str(args.blocks), "--child", kind],
                              capture_output=True, text=True, check=True)
        out[kind] = json.loads(proc.stdout.strip().splitlines()[-1])
    n, s = out["native"], out["shadowed"]
    print(f"GPT-2-medium-sized ({n['params'] / 1e6:.0f}M parameters), AdamW, batch 1 x 128, scope: first "
          f"{args.blocks} of 24 blocks")
    print(f"native: {n['seconds']:.1f} s, peak {n['peak_bytes'] / 2**30:.1f} GiB")
    print(f"shadowed: {s['seconds']:.1f} s ({s['seconds'] / n['seconds']:.1f}x), peak {s['peak_bytes'] / 2**30:.1f} "
          f"GiB; {s['calls']} calls shadowed, {s['out_of_scope']} outside the scope")


if __name__ == "__main__":
    main()
