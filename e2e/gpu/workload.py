#!/usr/bin/env python3
"""GPU memory workloads for e2e/gpu/run.sh. Every line printed is one JSON object with a wall-clock `t`.

Modes:
  hold     --gib G                 hold a G GiB tensor
  freed    --gib G                 allocate G GiB, free it (the caching allocator keeps it reserved), hold
  stepper  --step-mib S --to-gib T --period P --hold H
                                   after the go file appears, grow by S MiB every P s up to T GiB, hold H s
  crosser  --base-gib B --jump-gib J --cycles N --hold H
                                   hold B GiB; after the go file appears, N times: allocate J GiB (crossing
                                   the budget), synchronize, log "up" with the time; hold H s; free it and
                                   empty the cache, synchronize, log "down"; hold H s
The process waits for --go FILE (if given) before the timed part, and exits after --linger seconds at the end
(or when killed).
"""
import argparse
import json
import os
import sys
import time

import torch

GIB = 1 << 30
MIB = 1 << 20


def log(event, **fields):
    fields.update(event=event, t=time.time(), pid=os.getpid(),
                  allocated=torch.cuda.memory_allocated(), reserved=torch.cuda.memory_reserved())
    print(json.dumps(fields), flush=True)


def alloc(nbytes):
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    x.fill_(1)
    return x


def wait_go(path):
    if not path:
        return
    while not os.path.exists(path):
        time.sleep(0.005)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["hold", "freed", "stepper", "crosser"])
    p.add_argument("--gib", type=float, default=2)
    p.add_argument("--step-mib", type=int, default=512)
    p.add_argument("--to-gib", type=float, default=4)
    p.add_argument("--period", type=float, default=0.5)
    p.add_argument("--base-gib", type=float, default=1)
    p.add_argument("--jump-gib", type=float, default=2)
    p.add_argument("--cycles", type=int, default=25)
    p.add_argument("--hold", type=float, default=1.0)
    p.add_argument("--go", default="")
    p.add_argument("--linger", type=float, default=3600)
    a = p.parse_args()

    torch.cuda.init()
    keep = []
    if a.mode == "hold":
        keep.append(alloc(int(a.gib * GIB)))
        torch.cuda.synchronize()
        log("ready")
    elif a.mode == "freed":
        x = alloc(int(a.gib * GIB))
        torch.cuda.synchronize()
        del x
        torch.cuda.synchronize()
        log("ready")
    elif a.mode == "stepper":
        keep.append(alloc(MIB))  # a context and a first block, so the process shows in NVML
        torch.cuda.synchronize()
        log("ready")
        wait_go(a.go)
        while torch.cuda.memory_reserved() + a.step_mib * MIB <= a.to_gib * GIB:
            keep.append(alloc(a.step_mib * MIB))
            torch.cuda.synchronize()
            log("step")
            time.sleep(a.period)
        log("top")
        time.sleep(a.hold)
        log("done")
    elif a.mode == "crosser":
        keep.append(alloc(int(a.base_gib * GIB)))
        torch.cuda.synchronize()
        log("ready")
        wait_go(a.go)
        for i in range(a.cycles):
            x = alloc(int(a.jump_gib * GIB))
            torch.cuda.synchronize()
            log("up", i=i)
            time.sleep(a.hold)
            del x
            torch.cuda.empty_cache()
            torch.cuda.synchronize()
            log("down", i=i)
            time.sleep(a.hold)
        log("done")
    sys.stdout.flush()
    time.sleep(a.linger)


if __name__ == "__main__":
    main()
