"""Comparing the gathered fingerprint rows of a call (geocomm.engine.call.raise_on_mismatch).

The steady state (equal rows) is one comparison of bytes; every other case must
still name what differs, on every rank alike: a difference in any column of any
rank's row, in any byte of a value, and a rank that refused the call.
"""

from __future__ import annotations

import numpy as np
import pytest

from geocomm.engine.call import (
    FIELDS,
    REFUSED,
    CollectiveMismatchError,
    raise_on_mismatch,
    refused_row,
)


def rows_of(ranks: int) -> np.ndarray:
    row = np.arange(1, len(FIELDS) + 1, dtype=np.int64) * 1_000_003
    return np.tile(row, (ranks, 1))


@pytest.mark.parametrize("ranks", [1, 2, 3, 8])
def test_equal_rows_pass(ranks):
    raise_on_mismatch("allreduce", rows_of(ranks))


@pytest.mark.parametrize("ranks", [2, 3, 8])
def test_any_column_of_any_rank_differing_raises_naming_it(ranks):
    for rank in range(ranks):
        for column, field in enumerate(FIELDS):
            for delta in (1, 1 << 40, -(1 << 62)):  # the low, a middle and the top byte
                rows = rows_of(ranks)
                rows[rank, column] += delta
                with pytest.raises(CollectiveMismatchError, match=field) as caught:
                    raise_on_mismatch("allreduce", rows)
                bad = [rank] if rank else list(range(1, ranks))  # rows differ from rank 0's
                assert f"ranks {bad}" in str(caught.value)


def test_a_refused_row_raises_naming_the_rank():
    rows = rows_of(3)
    rows[2] = refused_row()
    with pytest.raises(CollectiveMismatchError, match=r"ranks \[2\] refused"):
        raise_on_mismatch("reduce_scatter", rows)


def test_rows_every_rank_refused_are_not_a_pass():
    """Equal rows are a pass only when they are not refusals (refuse() reads such rows
    itself; a check that got them must not return as if the call were made)."""
    rows = np.full((2, len(FIELDS)), REFUSED, dtype=np.int64)
    with pytest.raises(CollectiveMismatchError, match="refused"):
        raise_on_mismatch("allreduce", rows)
