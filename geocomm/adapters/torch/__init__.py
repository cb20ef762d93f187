"""PyTorch integration (docs/design.md, "Training integration").

    import geocomm.adapters.torch as gt
    gt.init_distributed_from_mpi()              # under mpirun (torchrun sets the env itself)
    model = DDP(net)
    state = gt.GeocommHookState(net, codec="geofp8")
    model.register_comm_hook(state, gt.geocomm_hook)

* :mod:`~geocomm.adapters.torch.ddp`: the DDP communication hook and its state;
* :mod:`~geocomm.adapters.torch.fsdp`: FSDP2's compressed reduce-scatter
  (:func:`compress_fsdp`);
* :mod:`~geocomm.adapters.torch.backend`: the torch.distributed backend "geocomm",
  registered when this package is imported;
* :mod:`~geocomm.adapters.torch.support`: the torch releases supported (2.9 to 2.15)
  and what each can do;
* :mod:`~geocomm.adapters.torch.grads`: what the hook and FSDP2 share (bucket layouts,
  the reducer); :mod:`~geocomm.adapters.torch.telemetry`: bytes, times and error
  estimates per step; :mod:`~geocomm.adapters.torch.checkpoints`: codec state in
  checkpoints; :mod:`~geocomm.adapters.torch.distributed`: process groups;
  :mod:`~geocomm.adapters.torch.worker`: the thread the hook and the backend run on.
"""

from geocomm.adapters.torch import support

support.check_torch()  # before anything reaches for an API the window's oldest torch has

from geocomm.adapters.torch import backend  # noqa: E402  (registers the backend "geocomm")
from geocomm.adapters.torch.ddp import GeocommHookState, geocomm_hook  # noqa: E402
from geocomm.adapters.torch.distributed import (  # noqa: E402
    dedicated_comm,
    init_distributed_from_mpi,
)
from geocomm.adapters.torch.fsdp import (  # noqa: E402
    FSDPCompression,
    GeocommAllReduceHook,
    GeocommReduceScatter,
    compress_fsdp,
)
from geocomm.adapters.torch.grads import Selection  # noqa: E402
from geocomm.adapters.torch.telemetry import BucketStats, StepStats, Telemetry  # noqa: E402

__all__ = [
    "BucketStats",
    "FSDPCompression",
    "GeocommAllReduceHook",
    "GeocommHookState",
    "GeocommReduceScatter",
    "Selection",
    "StepStats",
    "Telemetry",
    "backend",
    "compress_fsdp",
    "dedicated_comm",
    "geocomm_hook",
    "init_distributed_from_mpi",
]
