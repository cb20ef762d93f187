"""Framework adapters: any array kind in and out; PyTorch DDP and FSDP2 in ``.torch``."""

from geocomm.adapters.arrays import allgather, allreduce, as_array, reduce_scatter

__all__ = ["allgather", "allreduce", "as_array", "reduce_scatter"]
