"""Which torch releases geocomm's torch integrations support, and what each can do.

The window is torch 2.9 (the first with FSDP2's public custom reduce-scatter,
``FSDPModule.set_custom_reduce_scatter``) through 2.15, the newest release tested; CI
runs the torch suites on both ends. Features are detected, never assumed from the
version: where a torch release lacks what a call needs, the call raises an error
that names the release that has it.
"""

from __future__ import annotations

import re
from typing import Any

import torch

#: The oldest and the newest torch release of the support window.
OLDEST, NEWEST = (2, 9), (2, 15)


def torch_version() -> tuple[int, int]:
    """(major, minor) of the torch that is imported."""
    match = re.match(r"(\d+)\.(\d+)", torch.__version__)
    if match is None:
        raise ImportError(f"cannot read torch's version {torch.__version__!r}")
    return int(match.group(1)), int(match.group(2))


def check_torch() -> None:
    """ImportError unless the imported torch is in the window's oldest release or newer."""
    if torch_version() < OLDEST:
        raise ImportError(
            f"geocomm.adapters.torch needs torch >= {OLDEST[0]}.{OLDEST[1]} (FSDP2's "
            f"custom reduce-scatter); this is torch {torch.__version__}"
        )


def require(obj: Any, method: str, release: str, what: str) -> Any:
    """``obj.method``, or RuntimeError naming the torch ``release`` that has it."""
    found = getattr(obj, method, None)
    if found is None:
        raise RuntimeError(
            f"{what} needs {type(obj).__name__}.{method}, which torch {release} added; "
            f"this is torch {torch.__version__}"
        )
    return found
