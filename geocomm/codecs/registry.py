"""Codec registry: ``get_codec(id_or_config, **params)``.

Built-in codecs register at import; third-party packages add theirs through
the ``geocomm.codecs`` entry-point group (``name = "module:CodecClass"``),
loaded the first time an unknown id is asked for.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

from geocomm.codecs.base import Codec

ENTRY_POINT_GROUP = "geocomm.codecs"
_registry: dict[str, type[Codec]] = {}
_entry_points_loaded = False


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Register a codec class under its ``codec_id``, so :func:`get_codec` finds it.

    Usable as a class decorator. A class registered under an id already taken
    replaces the earlier one.

    Args:
        cls: a subclass of :class:`~geocomm.codecs.base.Codec` with a ``codec_id``.

    Returns:
        ``cls`` itself.

    Raises:
        TypeError: ``cls`` is not a Codec subclass.

    Example::

        @geocomm.register_codec
        class MyCodec(FramedCodec):
            codec_id = "mine"
            ...
    """
    if not (isinstance(cls, type) and issubclass(cls, Codec)):
        raise TypeError(f"{cls!r} is not a Codec subclass")
    _registry[cls.codec_id] = cls
    return cls


def _load_entry_points() -> None:
    global _entry_points_loaded
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in _registry:
            register_codec(ep.load())


def registered_ids() -> list[str]:
    """Ids of every known codec, entry points included."""
    if not _entry_points_loaded:
        _load_entry_points()
    return sorted(_registry)


def get_codec(codec: str | dict[str, Any] | Codec | None, /, **params: Any) -> Codec:
    """A codec by id or config.

    Args:
        codec: a registered id ("fp8", "nvfp4", "geofp8", ...), a config dict with an
            ``"id"`` (what :meth:`Codec.get_config` returns), a Codec (returned as it
            is), or None for "none".
        **params: the codec's parameters, over those of a config dict
            (``fmt="e5m2"``, ``block=0``, ``rounding="stochastic"``, ...);
            ``error_feedback=True`` wraps a lossy codec in
            :class:`~geocomm.codecs.feedback.ErrorFeedbackCodec`.

    Returns:
        A new codec instance; ``get_codec(c.get_config()) == c`` for every codec ``c``.

    Raises:
        KeyError: an unknown id (the message lists the known ones).
        TypeError: ``codec`` of another type, parameters given with a Codec, or a
            parameter the codec does not take.
        ValueError: a parameter value the codec refuses.

    Example::

        codec = geocomm.get_codec("fp8", fmt="e4m3", block=128)
    """
    if isinstance(codec, Codec):
        if params:
            raise TypeError("parameters cannot be combined with a Codec instance")
        return codec
    if codec is None:
        codec = "none"
    if isinstance(codec, dict):
        config = {**codec, **params}
        codec_id = config.get("id")
        if not isinstance(codec_id, str):
            raise TypeError(f"a codec config's 'id' is a codec id string, got {codec_id!r}")
    elif isinstance(codec, str):
        config = {"id": codec, **params}
        codec_id = codec
    else:
        raise TypeError(
            f"codec must be an id, a config dict or a Codec, not {type(codec).__name__}"
        )
    if codec_id not in _registry and not _entry_points_loaded:
        _load_entry_points()
    if codec_id not in _registry:
        raise KeyError(f"unknown codec {codec_id!r}; known: {', '.join(registered_ids())}")
    feedback = config.pop("error_feedback", False)
    if not isinstance(feedback, bool):
        raise ValueError(f"error_feedback must be True or False, got {feedback!r}")
    if feedback and codec_id == "auto":
        raise ValueError("error feedback wraps the codec auto switches to, not auto itself")
    codec = _registry[codec_id].from_config(config)
    if feedback:
        from geocomm.codecs.feedback import ErrorFeedbackCodec

        return ErrorFeedbackCodec(codec)
    return codec


def frame_body_size(config: dict[str, Any], shape: tuple[int, ...]) -> int:
    """The body length of a frame of the registered codec ``config`` names, for
    :func:`geocomm.codecs.frames.parse_frame`; ValueError when no codec takes it."""
    try:
        codec = get_codec(config)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"frame names an unusable codec {config}: {exc}") from None
    return codec.frame_body_size(shape)
