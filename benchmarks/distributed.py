"""Sharded forward on CPU, 1 vs 2 processes: `python -m benchmarks.distributed [--n 64] [--batch 32] [--repeats 50]`.

The MLP sample with N members (per_member inputs [N, B, 64]) runs three ways, one
after the other on this machine, 127.0.0.1 only:

- 1 process, no torch.distributed: executor.build's forward (the reference);
- K processes (gloo), each with `--threads` threads: each rank's forward of its
  N/K members alone ("local"), and forward + all-gather to [N, ...] on every rank
  ("fwd+gather", timed on rank 0 after a barrier each repeat), and forward + the
  ensemble mean (an all-reduce of one member's output size, "fwd+mean"); K = 1 and 2.

Medians of `--repeats` calls after warm-up. On a 2-core machine shared with other
work, 2 processes x 1 thread compete with everything else for both cores: read the
load average printed with the table before trusting a ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MLP = ROOT / "sample_models" / "mlp.py"


def _setup(n: int, batch: int):
    from stagewise import executor
    from stagewise import planner
    import torch

    src = planner.load_model_file(MLP)
    graph = planner.trace(src.model, src.example_inputs)
    plan = planner.propose(graph, n_members=n, input_mode="per_member")
    x = torch.randn(batch, 64, generator=torch.Generator().manual_seed(0))
    return src, plan, executor.batched_inputs(plan, (x,))


def _median_ms(fn, repeats: int, before=None) -> float:
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def rank_main(rank: int, world: int, port: int, n: int, batch: int, repeats: int, threads: int, out: Path) -> None:
    """One rank: time the local forward and forward + all-gather; write rank{r}.json."""
    import torch
    import torch.distributed as dist

    from stagewise.executor.distributed import build_sharded

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    src, plan, inputs = _setup(n, batch)
    sharded = build_sharded(plan, lambda idx: src.members(idx.stop)[idx.start:])
    local = sharded.local_inputs(inputs)
    with torch.no_grad():
        for _ in range(5):  # warm-up: allocator, gloo connections
            sharded.gather(sharded(*inputs))
        local_ms = _median_ms(lambda: sharded.module(*local), repeats)
        end_ms = _median_ms(lambda: sharded.gather(sharded(*inputs)), repeats, before=dist.barrier)
        mean_ms = _median_ms(lambda: sharded.mean(sharded(*inputs)), repeats, before=dist.barrier)
    (out / f"rank{rank}.json").write_text(json.dumps({"members": len(sharded.member_indices), "local_ms": local_ms,
                                                      "end_to_end_ms": end_ms, "mean_ms": mean_ms}))
    dist.barrier()  # leave together: a rank tearing gloo down under a peer's last read can abort it
    dist.destroy_process_group()


def run_ranks(world: int, args, out: Path) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT),
           "CUDA_VISIBLE_DEVICES": ""}
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--world", str(world), "--port", str(port),
                               "--n", str(args.n), "--batch", str(args.batch), "--repeats", str(args.repeats),
                               "--threads", str(args.threads), "--out", str(out)], env=env) for r in range(world)]
    for p in procs:
        p.wait(timeout=600)
    missing = [r for r in range(world) if not (out / f"rank{r}.json").is_file()]
    if missing:
        raise SystemExit(f"rank(s) {missing} of the {world}-process run wrote no result (exit codes {[p.returncode for p in procs]})")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=64, help="members N (default 64)")
    p.add_argument("--batch", type=int, default=32, help="rows per member (default 32)")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank is not None:
        rank_main(args.rank, args.world, args.port, args.n, args.batch, args.repeats, args.threads, Path(args.out))
        return

    import torch

    from stagewise import executor

    torch.set_num_threads(args.threads)
    src, plan, inputs = _setup(args.n, args.batch)
    ens = executor.build(plan, src.members(args.n))
    with torch.no_grad():
        for _ in range(5):
            ens(*inputs)
        plain_ms = _median_ms(lambda: ens(*inputs), args.repeats)
        plain_mean_ms = _median_ms(lambda: ens(*inputs).mean(0), args.repeats)
    rows = [("1 process, executor.build (no torch.distributed)", args.n, plain_ms, plain_ms, plain_mean_ms)]
    for world in (1, 2):
        with tempfile.TemporaryDirectory() as tmp:
            ranks = run_ranks(world, args, Path(tmp))
        slowest = max(r["local_ms"] for r in ranks)
        rows.append((f"{world} process{'es' if world > 1 else ''} (gloo), build_sharded", ranks[0]["members"], slowest,
                     ranks[0]["end_to_end_ms"], ranks[0]["mean_ms"]))
    print(f"MLP sample, N={args.n}, per_member inputs [{args.n}, {args.batch}, 64], {args.threads} thread(s) per process, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}, median of {args.repeats}")
    print(f"{'run':<52} {'members/rank':>12} {'local fwd ms':>13} {'fwd+gather ms':>14} {'fwd+mean ms':>12}")
    for name, k, local_ms, end_ms, mean_ms in rows:
        print(f"{name:<52} {k:>12} {local_ms:>13.3f} {end_ms:>14.3f} {mean_ms:>12.3f}")
    print(f"load average after the run: {os.getloadavg()[0]:.2f} (above ~1.5 on 2 cores: noise)")


if __name__ == "__main__":
    main()
