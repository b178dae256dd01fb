"""A tiny gloo all-reduce run by each rank under `xeontune launch` (tests launch it as a module).

It initialises torch.distributed the way the trainer does (env:// from MASTER_ADDR/PORT and the
PMI rank/size Hydra sets), all-reduces a tensor, and prints one line per rank. ``--sleep S``
keeps the ranks in a loop of all-reduces for S seconds (the kill test).
"""

from __future__ import annotations

import argparse
import datetime
import os
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dist-backend", default="gloo")
    parser.add_argument("--dist-timeout", type=float, default=30)
    parser.add_argument("--numel", type=int, default=768)
    parser.add_argument("--sleep", type=float, default=0)
    parser.add_argument("--pid-dir")
    parser.add_argument("--print-env", action="store_true", help="print the names of the rank's variables")
    parser.add_argument("--show", action="append", default=[], help="print this variable's value (repr), repeatable")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
    if args.pid_dir:
        with open(os.path.join(args.pid_dir, f"rank{rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=args.dist_timeout))
    t = torch.full((args.numel,), float(rank + 1))
    start = time.perf_counter()
    dist.all_reduce(t)
    ms = (time.perf_counter() - start) * 1000
    expected = world * (world + 1) / 2
    ok = bool(torch.all(t == expected))
    addr = os.environ.get("MASTER_ADDR")
    print(f"probe rank={rank} world={world} ok={ok} sum={t[0].item()} ms={ms:.1f} master={addr} "
          f"omp={os.environ.get('OMP_NUM_THREADS')} ifname={os.environ.get('GLOO_SOCKET_IFNAME')} "
          f"netns={os.readlink('/proc/self/ns/net')} pid={os.getpid()}", flush=True)
    for var in args.show:
        print(f"show rank={rank} netns={os.readlink('/proc/self/ns/net')} {var}={os.environ.get(var)!r}", flush=True)
    if args.print_env:
        print(f"env rank={rank} " + " ".join(sorted(os.environ)), flush=True)
    # the same number of all-reduces on every rank (a deadline each, from starts seconds apart on a busy
    # machine, left one rank waiting in an all-reduce the others had ended: "connection closed by peer")
    for _ in range(round(args.sleep / 0.2)):
        dist.all_reduce(t)
        time.sleep(0.2)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
