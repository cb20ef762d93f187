"""geocomm's on/off environment variables, read one way everywhere
(``GEOCOMM_CHECK``, ``GEOCOMM_GRAPHS``, ``GEOCOMM_ABORT_ON_ERROR``)."""

from __future__ import annotations

import os

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
