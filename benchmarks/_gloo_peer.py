"""One rank of a gloo pair: for every line on stdin, one send/recv of SIZE bytes (fresh
receive buffer each time, as a new tensor on the far side would need); the receiver prints
seconds per transfer. MASTER_ADDR (default 127.0.0.1) is rank 0's address: another host's, as
seen from a network namespace."""

import os
import sys
import time

import torch
import torch.distributed as dist

rank, size_bytes, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ["MASTER_PORT"] = port
dist.init_process_group("gloo", rank=rank, world_size=2)
src = torch.randn(size_bytes // 4)
print("ready", flush=True)
for _ in sys.stdin:  # one transfer per line
    dist.barrier()
    if rank == 0:
        dist.send(src, dst=1)
    else:
        start = time.perf_counter()
        dst = torch.empty(size_bytes // 4)
        dist.recv(dst, src=0)
        print(time.perf_counter() - start, flush=True)
dist.destroy_process_group()
