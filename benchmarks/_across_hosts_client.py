"""The client's side of `across_hosts`, run in the client's network namespace: a session on the
backend discovery chooses, then one round of transfers for each line on stdin, its seconds
printed as one JSON line (the caller interleaves these rounds with gloo's)."""

import json
import sys
import time

import torch

import genie_core

DEV = "remote_accelerator:0"
address, token, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
state = genie_core.init_sync(address, token=token, timeout=30)
client = state.client
report = state.backend_report.to_dict()
x = torch.randn(nbytes // 4)
x.to(DEV).cpu()  # warm: the session's worker up, torch imported there, the first of a size made
client.push({"x": x})
client.pull(["x"])
said = {key: report[key] for key in ("chosen", "reason", "candidates", "elapsed_s")}
print(json.dumps(said))
sys.stdout.flush()
for _ in sys.stdin:
    took = {}
    start = time.perf_counter()
    y = x.to(DEV)
    torch.remote_accelerator.synchronize()
    took["to_remote"] = time.perf_counter() - start
    start = time.perf_counter()
    back = y.cpu()
    took["cpu"] = time.perf_counter() - start
    assert back.shape == x.shape
    del y, back
    start = time.perf_counter()
    client.push({"x": x})
    took["push"] = time.perf_counter() - start
    start = time.perf_counter()
    pulled = client.pull(["x"])
    took["pull"] = time.perf_counter() - start
    del pulled
    print(json.dumps(took), flush=True)
genie_core.shutdown_sync()
