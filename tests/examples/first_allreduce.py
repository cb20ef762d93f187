# first_allreduce.py: sum a NumPy array over every rank, sent as FP8
import hashlib
import os

import numpy as np

import geocomm

if "RANK" in os.environ:                       # torchrun: ranks from torch.distributed
    import torch.distributed as dist

    from geocomm.comm.torchdist import TorchDistCommunicator

    dist.init_process_group("gloo")
    comm = geocomm.init(TorchDistCommunicator())
else:                                          # mpirun or geocomm.launch: MPI.COMM_WORLD
    comm = geocomm.init()


def gradient(rank):                            # each rank's own values, reproducible anywhere
    return np.random.default_rng(rank).standard_normal(1 << 20, dtype=np.float32)


total = geocomm.allreduce(gradient(comm.rank), codec="fp8")   # 1 byte a value on the wire
exact = sum(gradient(r).astype(np.float64) for r in range(comm.size))
error = np.linalg.norm(total - exact) / np.linalg.norm(exact)
digest = hashlib.sha256(total).hexdigest()[:16]               # the same bits on every rank
print(f"rank {comm.rank} of {comm.size}: relative error {error:.4f}, sum {digest}")
