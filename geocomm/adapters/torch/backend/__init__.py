"""The compressed torch.distributed backend "geocomm":
``dist.init_process_group("geocomm")`` (docs/design.md, "The torch.distributed backend").

* :mod:`~geocomm.adapters.torch.backend.group`: the process group, its compressed
  calls, and the module-level ``configure``, ``stats``, ``step``, ``state_dict``;
* :mod:`~geocomm.adapters.torch.backend.exact`: the calls it passes on exact;
* :mod:`~geocomm.adapters.torch.backend.checks`: its early cross-rank checks;
* :mod:`~geocomm.adapters.torch.backend.config`: configuration, counters, keys;
* :mod:`~geocomm.adapters.torch.backend.work`: the ``Work`` objects it returns.
"""

from geocomm.adapters.torch.backend.config import BackendConfig, BackendStats
from geocomm.adapters.torch.backend.group import (
    NAME,
    GeocommProcessGroup,
    configure,
    load_state_dict,
    reset_configuration,
    state_dict,
    stats,
    step,
)

__all__ = [
    "NAME",
    "BackendConfig",
    "BackendStats",
    "GeocommProcessGroup",
    "configure",
    "load_state_dict",
    "reset_configuration",
    "state_dict",
    "stats",
    "step",
]
