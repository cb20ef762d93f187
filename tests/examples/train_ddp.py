# train_ddp.py
import hashlib
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import geocomm.adapters.torch as gt

if "RANK" in os.environ:                      # torchrun set RANK, WORLD_SIZE, MASTER_ADDR/PORT
    dist.init_process_group("gloo")           # "nccl" with CUDA tensors
else:                                         # mpirun: rank, size and address from MPI
    gt.init_distributed_from_mpi("gloo")
rank = dist.get_rank()

torch.manual_seed(0)                          # the same initial weights on every rank
net = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(),
                          torch.nn.LayerNorm(1024), torch.nn.Linear(1024, 10))
model = DDP(net, bucket_cap_mb=4)
state = gt.GeocommHookState(net, codec="fp8",            # or "geofp8", "nvfp4", a config
                            exclude=("*norm*", "*.bias"),  # these travel exact ...
                            min_numel=4096)                # ... and so do small tensors
model.register_comm_hook(state, gt.geocomm_hook)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

for step in range(20):
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(100 * step + rank))
    loss = torch.nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long())
    opt.zero_grad()
    loss.backward()                           # buckets are reduced while backward runs
    opt.step()
    if rank == 0 and step % 5 == 0:
        print(f"loss {loss.item():.4f}; {state.last_step.summary()}")
state.close()
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in net.parameters()))
print(f"rank {rank}: parameters {digest.hexdigest()[:16]}")  # the same on every rank
dist.destroy_process_group()
