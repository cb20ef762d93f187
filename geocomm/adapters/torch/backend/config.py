"""The torch.distributed backend's configuration, counters and the keys of its
compressed calls (docs/design.md, "The torch.distributed backend"); nothing here
holds a process group."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

#: the calls that may be compressed (names for :func:`configure`'s ``compress``)
KINDS = ("all_reduce", "reduce_scatter")


FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class BackendConfig:
    """What a geocomm process group compresses, and how.

    ``codec``: codec id, config dict or Codec (a stateless Codec instance is
    shared by the groups made while it is configured; a stateful one, GeoFP8 or
    error feedback, gives its configuration only: each group keeps a state of
    its own, ``backend.state_dict(group)``, and the object's state is neither
    used nor updated); ``min_numel``: smaller tensors
    go exact; ``compress``: which of ``"all_reduce"``, ``"reduce_scatter"``
    are compressed; ``check``: compare every compressed call's metadata across
    ranks first (one small all-gather); ``stage_size``: the pipeline's stage
    size (None: the collectives' default).
    """

    codec: Any = "fp8"
    min_numel: int = 16384
    compress: tuple[str, ...] = KINDS
    check: bool = True
    stage_size: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.min_numel, int) or self.min_numel < 1:
            raise ValueError(f"min_numel must be a positive integer, got {self.min_numel!r}")
        bad = [k for k in self.compress if k not in KINDS]
        if isinstance(self.compress, str) or bad:
            raise ValueError(f"compress takes names from {KINDS}, got {self.compress!r}")


def env_config() -> dict[str, Any]:
    """``GEOCOMM_CODEC`` (an id, or a JSON config) and ``GEOCOMM_MIN_NUMEL``."""
    fields: dict[str, Any] = {}
    codec = os.environ.get("GEOCOMM_CODEC", "").strip()
    if codec.startswith("{"):
        try:
            fields["codec"] = json.loads(codec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"GEOCOMM_CODEC={codec!r} is no JSON config: {exc}") from None
    elif codec:
        fields["codec"] = codec
    numel = os.environ.get("GEOCOMM_MIN_NUMEL", "").strip()
    if numel:
        try:
            fields["min_numel"] = int(numel)
        except ValueError:
            raise ValueError(
                f"GEOCOMM_MIN_NUMEL={numel!r}: expected a whole number of values"
            ) from None
    return fields


#: what :func:`~geocomm.adapters.torch.backend.control.configure` set without a group:
#: the fields of the groups made afterwards
configured: dict[str, Any] = {}


def new_config(configured: dict[str, Any]) -> BackendConfig:
    """A new group's configuration: ``configured`` (what configure() set), over the
    environment's, over the defaults."""
    return BackendConfig(**{**env_config(), **configured})


@dataclass
class BackendStats:
    """What one group did: ``sent`` bytes and ``transfers`` counted at the compressed
    communicator (this rank's own segments, metadata checks included), ``baseline``
    bytes the uncompressed ring would have sent for the same calls, the number of
    ``compressed`` and ``exact`` calls, ``values`` compressed, ``steps`` begun."""

    sent: int = 0
    transfers: int = 0
    baseline: int = 0
    compressed: int = 0
    exact: int = 0
    values: int = 0
    steps: int = 0
    exact_by_call: dict[str, int] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """Baseline bytes over sent bytes (0 before any compressed call)."""
        return self.baseline / self.sent if self.sent else 0.0


class Keys:
    """The keys of one group's compressed calls (see the module docstring): decided from
    the sequence of the calls' (kind, numel, dtype) alone, which every rank shares."""

    def __init__(self) -> None:
        self.counts: dict[tuple, int] = {}
        self.steps = 0
        self.manual = False  # step() was called: steps end there only

    def new_step(self, manual: bool = False) -> None:
        self.counts.clear()
        self.steps += 1
        self.manual = self.manual or manual

    def key(self, signature: tuple) -> tuple:
        if not self.manual and signature in self.counts:  # a repeat: a new step begins
            self.new_step()
        j = self.counts.get(signature, 0)
        self.counts[signature] = j + 1
        return (*signature, j)
