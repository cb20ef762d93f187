# train_fsdp.py
import hashlib
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import geocomm.adapters.torch as gt

if "RANK" in os.environ:
    dist.init_process_group("gloo")
else:
    gt.init_distributed_from_mpi("gloo")
rank = dist.get_rank()

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(),
                            torch.nn.Linear(1024, 1024), torch.nn.GELU(),
                            torch.nn.Linear(1024, 10))
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer)                    # one reduce-scatter per layer
fully_shard(model)
fsdp = gt.compress_fsdp(model, codec="geofp8")  # after fully_shard, on every rank
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

for step in range(20):
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(100 * step + rank))
    loss = torch.nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long())
    opt.zero_grad()
    loss.backward()                           # compressed reduce-scatter per layer
    opt.step()
    if rank == 0 and step % 5 == 0:
        print(f"loss {loss.item():.4f}; {fsdp.last_step.summary()}")
full = [p.full_tensor().detach().numpy().tobytes() for p in model.parameters()]
print(f"rank {rank}: parameters {hashlib.sha256(b''.join(full)).hexdigest()[:16]}")
dist.destroy_process_group()
