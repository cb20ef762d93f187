"""Shard layout shared by the collectives and the shard-local geometry maps."""

from __future__ import annotations

import numpy as np


def shard_bounds(count: int, size: int) -> np.ndarray:
    """Offsets of the ``np.array_split(range(count), size)`` shards (size + 1 values)."""
    q, r = divmod(count, size)
    j = np.arange(size + 1, dtype=np.int64)
    return j * q + np.minimum(j, r)
