"""Framework adapters: PyTorch's DDP comm hook, FSDP2's reduce-scatter and a
torch.distributed backend (:mod:`geocomm.adapters.torch`). Array kinds of every
framework go in and out of the collectives in :mod:`geocomm.api.arrays`."""
