"""geocomm's environment variables, read one way everywhere: the on/off ones
(``GEOCOMM_CHECK``, ``GEOCOMM_GRAPHS``, ``GEOCOMM_ABORT_ON_ERROR``) and the
positive numbers (``GEOCOMM_INTRA_GBPS``, ``GEOCOMM_INTER_GBPS``)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")


def switch(name: str) -> bool | None:
    """The on/off variable ``name``: True for 1, true, yes or on, False for 0, false, no
    or off (any case, spaces around ignored), None when unset or empty; anything else
    raises :class:`ValueError` naming it."""
    text = os.environ.get(name, "").strip().lower()
    if not text:
        return None
    if text in ON:
        return True
    if text in OFF:
        return False
    raise ValueError(
        f"{name}={os.environ[name]!r}: expected one of {', '.join(ON)} (on) "
        f"or {', '.join(OFF)} (off)"
    )


def positive_number(name: str, env: Mapping[str, str] | None = None) -> float | None:
    """The variable ``name`` of ``env`` (default: the process's environment) as a
    finite number greater than 0; None when unset or empty; anything else raises
    :class:`ValueError` naming it."""
    source = os.environ if env is None else env
    text = source.get(name, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={source[name]!r}: expected a number greater than 0")
    return value
