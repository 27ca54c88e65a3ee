"""Workloads of the pressure-eviction check (e2e/gpu/pressure.sh). JSON lines on stdout, each with `t` (time.time()).

neighbour: a pod within its budget that cycles its allocations the way a serving process with a bursty
           batch does: allocate --gib in 512 MiB chunks, hold, free and give it back to the device
           (empty_cache), wait, again. Logs every CUDA out-of-memory it meets (`oom`), and keeps going.
grower:    a pod over its budget that jumps to --jump-gib at once, then climbs by 256 MiB chunks at --rate
           GiB/s until the device is full (it logs its own `oom` and retries). After each chunk it logs the
           device's free memory as CUDA sees it (`torch.cuda.mem_get_info`), so the script can tell when the
           free memory crossed the agent's threshold.
"""

import argparse
import json
import sys
import time

import torch

MIB = 1 << 20
GIB = 1 << 30


def log(event, **fields):
    print(json.dumps({"t": time.time(), "event": event, **fields}), flush=True)


def free_bytes():
    free, total = torch.cuda.mem_get_info()
    return free, total


def neighbour(args):
    torch.zeros(1, device="cuda")
    log("ready")
    chunk = 512 * MIB
    while True:
        held = []
        try:
            for _ in range(int(args.gib * GIB // chunk)):
                held.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
            torch.cuda.synchronize()
            log("holding", bytes=len(held) * chunk)
        except torch.cuda.OutOfMemoryError:
            free, _ = free_bytes()
            log("oom", held=len(held) * chunk, free=free)
        time.sleep(args.hold)
        del held
        torch.cuda.empty_cache()
        time.sleep(args.pause)


def grower(args):
    torch.zeros(1, device="cuda")
    held = []
    chunk = 256 * MIB
    jump = int(args.jump_gib * GIB // chunk)
    for _ in range(jump):
        held.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    free, total = free_bytes()
    log("jumped", bytes=len(held) * chunk, free=free, total=total)
    period = chunk / (args.rate * GIB)
    next_at = time.time()
    while True:
        next_at += period
        try:
            held.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
            torch.cuda.synchronize()
            free, _ = free_bytes()
            log("grew", bytes=len(held) * chunk, free=free)
        except torch.cuda.OutOfMemoryError:
            free, _ = free_bytes()
            log("oom", bytes=len(held) * chunk, free=free)
        delay = next_at - time.time()
        if delay > 0:
            time.sleep(delay)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["neighbour", "grower"])
    p.add_argument("--gib", type=float, default=16)
    p.add_argument("--hold", type=float, default=1.0)
    p.add_argument("--pause", type=float, default=0.5)
    p.add_argument("--jump-gib", type=float, default=40)
    p.add_argument("--rate", type=float, default=1.0, help="GiB/s")
    args = p.parse_args()
    try:
        {"neighbour": neighbour, "grower": grower}[args.mode](args)
    except KeyboardInterrupt:
        pass
    sys.exit(0)


if __name__ == "__main__":
    main()
