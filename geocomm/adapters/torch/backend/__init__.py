"""The compressed torch.distributed backend "geocomm":
``dist.init_process_group("geocomm")`` (docs/design.md, "The torch.distributed backend").

* :mod:`~geocomm.adapters.torch.backend.group`: the process group and its compressed
  calls;
* :mod:`~geocomm.adapters.torch.backend.control`: what users call on its groups:
  ``configure``, ``stats``, ``step``, ``state_dict``, ``load_state_dict``;
* :mod:`~geocomm.adapters.torch.backend.exact`: the calls it passes on exact;
* :mod:`~geocomm.adapters.torch.backend.checks`: its early cross-rank checks;
* :mod:`~geocomm.adapters.torch.backend.config`: configuration, counters, keys;
* :mod:`~geocomm.adapters.torch.backend.work`: the ``Work`` objects it returns.
"""

from geocomm.adapters.torch.backend.config import BackendConfig, BackendStats
from geocomm.adapters.torch.backend.control import (
    configure,
    load_state_dict,
    reset_configuration,
    state_dict,
    stats,
    step,
)
from geocomm.adapters.torch.backend.group import NAME, GeocommProcessGroup

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
