"""Collectives under ShadowMode: two-rank DDP on the CPU (gloo, 127.0.0.1), started by torch.multiprocessing.

The parameters' shadows after 3 SGD steps must equal a single-process float64 run over the global batch: the
shadow all-reduces run on shadow's own side group, in program order, whatever DDP's asynchronous bucket
all-reduces do on the user's group.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import time

import pytest
import torch

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)

WORLD, STEPS, LR, BATCH = 2, 3, 0.1, 8
JOIN_S = 120  # one run of two ranks, bounded


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g)


def _bf16_hook(process_group, bucket):
    """torch's bf16_compress_hook, which DDP refuses on the CPU since torch 2.5: the bucket cast to bfloat16,
    divided by the world size, all-reduced in bfloat16, copied back."""
    group = process_group if process_group is not None else dist.group.WORLD
    compressed = bucket.buffer().to(torch.bfloat16).div_(group.size())
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut):
        out = bucket.buffer()
        out.copy_(fut.value()[0])
        return out

    return fut.then(decompress)


def _init(rank: int, port: int) -> None:
    """This rank in a gloo group on 127.0.0.1, one thread; its stacks go to stderr on SIGUSR1 (``_launch``
    asks for them before it kills a run that hangs)."""
    from datetime import timedelta

    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    torch.set_num_threads(1)


def _launch(worker, *args, join_s: float = JOIN_S) -> None:
    """``worker(rank, port, *args)`` in WORLD spawned processes, bounded in time: killed past ``join_s``, after
    the ranks still running dumped their stacks to stderr (the test's captured output says where they hung)."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(worker, args=(_free_port(), *args), nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + join_s
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                alive = [rank for rank, p in enumerate(ctx.processes) if p.is_alive()]
                if hasattr(signal, "SIGUSR1"):
                    for rank in alive:
                        os.kill(ctx.processes[rank].pid, signal.SIGUSR1)
                    time.sleep(2)
                pytest.fail(f"two-rank run did not finish in {join_s} s: ranks {alive} still running (their "
                            "stacks: the captured stderr)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


def _worker(rank: int, port: int, hook: str, outdir: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from shadow import ShadowMode

    _init(rank, port)
    try:
        model = _model()
        ddp = DistributedDataParallel(model)
        if hook == "bf16":
            ddp.register_comm_hook(None, _bf16_hook)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        x, y = _batch()
        x, y = x[rank::WORLD], y[rank::WORLD]
        with ShadowMode() as sm:
            for _ in range(STEPS):
                opt.zero_grad()
                torch.nn.functional.mse_loss(ddp(x), y).backward()
                opt.step()
        assert not sm._engine.deferred.pending  # ShadowMode's exit judged the collectives nothing read in the block
        shadows = {n: sm.shadow_of(p) for n, p in model.named_parameters()}
        torch.save(shadows, os.path.join(outdir, f"shadows{rank}.pt"))
        sm.report.save(os.path.join(outdir, f"report{rank}.json"))
    finally:
        dist.destroy_process_group()


def _run(tmp_path, hook: str = "") -> tuple[list[dict], list]:
    from shadow import load_report

    _launch(_worker, hook, str(tmp_path))
    shadows = [torch.load(tmp_path / f"shadows{r}.pt", weights_only=True) for r in range(WORLD)]
    reports = [load_report(tmp_path / f"report{r}.json") for r in range(WORLD)]
    return shadows, reports


def _reference(optimizer=torch.optim.SGD, lr: float = LR) -> dict[str, torch.Tensor]:
    """The same 3 steps in float64 in one process, over the global batch (DDP and FSDP average the ranks'
    gradients of their mean losses over equal halves: the gradient of the global mean)."""
    model = _model().double()
    opt = optimizer(model.parameters(), lr=lr)
    x, y = _batch()
    for _ in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x.double()), y.double()).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _check_ddp(tmp_path) -> list:
    shadows, reports = _run(tmp_path)
    ref = _reference()
    for rank, sh in enumerate(shadows):
        for name, r in ref.items():
            rel = float((sh[name] - r).norm() / r.norm())
            assert rel <= 1e-12, f"rank {rank} {name}: shadow off the float64 run by {rel:.2e} relative"
    return reports


def test_ddp_two_ranks_shadows_equal_float64_run(tmp_path):
    reports = _check_ddp(tmp_path)
    import shadow

    for rank, rep in enumerate(reports):
        assert rep.meta["rank"] == rank and rep.meta["world_size"] == WORLD
        calls = rep.find(op="c10d.allreduce_.default")
        assert len(calls) == STEPS and all(c.kind.value == "replayed" for c in calls)
        # float32 sums of two float32 halves: the collective's own error is at most half an ulp
        assert all(c.local is not None and c.local.max_ulp <= 0.5 for c in calls)
    merged = shadow.merge_reports(reports)
    assert merged.meta["ranks"] == [0, 1]
    assert set(merged.meta["record_ranks"]) == {0, 1}
    assert merged.by_op["c10d.allreduce_.default"].calls == WORLD * STEPS


@pytest.mark.slow
@pytest.mark.parametrize("repeat", range(10))
def test_ddp_two_ranks_repeated(tmp_path, repeat):
    _check_ddp(tmp_path)


def test_bf16_compress_hook_is_the_collectives_local_error(tmp_path):
    _, reports = _run(tmp_path, "bf16")
    for rep in reports:
        calls = rep.find(op="c10d.allreduce_.default")
        assert len(calls) == STEPS
        for c in calls:
            assert c.dtype == "torch.bfloat16"
            # the device's bf16 sums against the exact sums of the bf16 inputs: rounding at 2^-9 relative
            assert 2.0 ** -14 < c.local.rel_norm < 2.0 ** -7, c.local


def test_merge_reports_needs_distinct_ranks():
    import shadow
    from shadow.report import Report

    with pytest.raises(ValueError, match="repeat"):
        shadow.merge_reports([Report(meta={"rank": 0}), Report(meta={"rank": 0})])
    merged = shadow.merge_reports([Report(), Report()])
    assert merged.meta["ranks"] == [0, 1]
