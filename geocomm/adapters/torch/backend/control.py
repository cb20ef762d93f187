"""What users call on the torch.distributed backend's groups: :func:`configure`,
:func:`stats`, :func:`step`, :func:`state_dict` and :func:`load_state_dict`
(docs/design.md, "The torch.distributed backend"); the groups themselves are in
:mod:`geocomm.adapters.torch.backend.group`."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from geocomm.adapters.torch.backend.config import (
    BackendConfig,
    BackendStats,
    configured,
    env_config,
)
from geocomm.adapters.torch.backend.group import NAME, GeocommProcessGroup
from geocomm.codecs import get_codec

__all__ = ["configure", "load_state_dict", "reset_configuration", "state_dict", "stats", "step"]


def _group(group: Any = None) -> GeocommProcessGroup:
    if group is None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised")
        group = dist.distributed_c10d._get_default_group()
    if not isinstance(group, GeocommProcessGroup):
        raise TypeError(
            f"not a geocomm process group: {type(group).__name__} (make it with "
            f'init_process_group("{NAME}") or new_group(backend="{NAME}"))'
        )
    return group


def configure(group: Any = None, **fields: Any) -> BackendConfig:
    """Choose what geocomm process groups compress, and how.

    Args:
        group: a geocomm process group, configured now (every rank must call this
            at the same point); None: the groups made afterwards, over
            ``GEOCOMM_CODEC`` and ``GEOCOMM_MIN_NUMEL``.
        **fields: :class:`BackendConfig` fields: ``codec`` (id, config or Codec),
            ``min_numel`` (smaller tensors go exact), ``compress`` (which of
            "all_reduce", "reduce_scatter"), ``check`` (compare each compressed
            call across ranks first), ``stage_size``.

    Returns:
        The group's configuration, or (without ``group``) the one a new group gets.

    Raises:
        ValueError: a field value the configuration refuses (an unknown codec:
            KeyError).
        TypeError: ``group`` is not a geocomm process group.

    Example::

        backend.configure(dist.group.WORLD, codec="nvfp4", min_numel=65536)
    """
    if group is not None:
        return _group(group).configure(**fields)
    trial = BackendConfig(**{**env_config(), **configured, **fields})
    get_codec(trial.codec)  # a bad codec fails here
    configured.update(fields)
    return trial


def reset_configuration() -> None:
    """Forget what :func:`configure` set for new groups (the environment and defaults again)."""
    configured.clear()


def stats(group: Any = None) -> BackendStats:
    """What a geocomm process group did on this rank.

    Args:
        group: a geocomm process group (default: the default group).

    Returns:
        Its :class:`BackendStats`: bytes sent and what the uncompressed ring would
        have sent (``ratio``), compressed and exact calls, values, steps.

    Raises:
        RuntimeError: no group given and torch.distributed is not initialized.
        TypeError: ``group`` is not a geocomm process group.
    """
    return _group(group).stats()


def step(group: Any = None) -> None:
    """Begin a new step of ``group``'s keys now.

    After a first call, steps end only here, and each compressed call of a step
    gets a key of its own: GeoFP8's state per call site (docs/design.md,
    "The torch.distributed backend"). Every rank must call it at the same point.

    Args:
        group: a geocomm process group (default: the default group).

    Raises:
        RuntimeError: no group given and torch.distributed is not initialized.
        TypeError: ``group`` is not a geocomm process group.
    """
    _group(group).new_step()


def state_dict(group: Any = None) -> dict[str, Any]:
    """The codec state of ``group`` on this rank, for a checkpoint.

    Queued compressed calls finish first. Each rank saves its own.

    Args:
        group: a geocomm process group (default: the default group).

    Returns:
        GeoFP8's bases and call counts, error feedback's residuals and stochastic
        rounding's call counts, as torch tensors and plain values (``torch.load``
        with ``weights_only=True`` reads it), with the group's size, rank and steps.

    Raises:
        RuntimeError: no group given and torch.distributed is not initialized.
        TypeError: ``group`` is not a geocomm process group.
    """
    return _group(group).state_dict()


def load_state_dict(state: dict[str, Any], group: Any = None) -> None:
    """Restore a checkpoint's codec state into ``group``, before the resumed job's
    first compressed call (save and load between steps).

    Args:
        state: what :func:`state_dict` returned on this rank.
        group: a geocomm process group (default: the default group).

    Raises:
        ValueError: the state is of another world size, rank or codec, or not the
            backend's.
        TypeError: ``group`` is not a geocomm process group.
    """
    _group(group).load_state_dict(state)
