"""Error feedback: what a rank's quantization lost is added to its next call.

``get_codec("fp8", error_feedback=True)`` (any lossy codec, GeoFP8 included)
wraps the codec in :class:`ErrorFeedbackCodec`. Per call signature (the
collective and the keys and shapes of the tensors it moves) it keeps one flat
residual
``r`` on each rank: where the rank quantized another shard's piece, the first
quantization's error; on its own shard, the second quantization's error of
the sum it owns. The next call sends ``x + r`` instead of ``x``, so every
error is sent again until it is gone: the running mean of the results
converges to the exact mean (docs/design.md, "Error feedback").

Residuals differ from rank to rank (each rank's errors are its own), but
they only change what a rank sends, never how the bytes are decoded, so the
results stay bitwise identical on every rank. The state checksum the
collectives compare covers the signatures and call counts, not the
residuals. A signature whose size changes starts from a zero residual.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from geocomm.codecs.base import Codec, StatefulCodec, TransformingCodec, WireOf
from geocomm.codecs.frames import FramedCodec


class ErrorFeedbackCodec(WireOf, FramedCodec, StatefulCodec):
    """``inner`` with error feedback; its wire format and config plus ``error_feedback``."""

    def __init__(self, inner: Codec):
        if inner.lossless or isinstance(inner, ErrorFeedbackCodec):
            raise ValueError(f"error feedback needs a lossy codec, not {inner.get_config()}")
        self.inner = self.wire_codec = inner
        self.codec_id = inner.codec_id  # type: ignore[misc]  # per instance: the inner codec's
        self._residuals: dict[str, Any] = {}
        self._calls: dict[str, int] = {}

    @property
    def mapping_codec(self) -> TransformingCodec | None:
        """The inner codec when it maps tensors (GeoFP8), else None."""
        return self.inner if isinstance(self.inner, TransformingCodec) else None

    def get_config(self) -> dict[str, Any]:
        return {**self.inner.get_config(), "error_feedback": True}

    def frame_body_size(self, shape: tuple[int, ...]) -> int:
        return self.inner.frame_body_size(shape)

    def encode_frame_body(self, x: np.ndarray, body: np.ndarray) -> None:
        self.inner.encode_frame_body(x, body)  # a frame stands alone: no feedback

    def decode_frame_body(self, body: np.ndarray, out: np.ndarray) -> None:
        self.inner.decode_frame_body(body, out)

    # ---- residuals ----------------------------------------------------------------
    @staticmethod
    def residual_name(kind: str, parts: Sequence[Any]) -> str:
        """The signature a call of ``kind`` on ``parts`` (objects with ``key`` and
        ``shape``) keeps its residual under."""
        return json.dumps([kind, [(repr(p.key), p.shape) for p in parts]])

    def calls_of(self, signature: str) -> int:
        """How many calls the residual of ``signature`` has taken (0: none yet)."""
        return self._calls.get(signature, 0)

    def residual(self, signature: str, count: int, xp: Any) -> Any:
        """The residual (flat float32, ``count`` values) of a call signature, counting
        the call; zeros for a new signature or one whose size changed."""
        r = self._residuals.get(signature)
        if r is None or r.shape[0] != count or type(r) is not type(xp.empty(0)):
            r = self._residuals[signature] = xp.zeros(count, dtype=np.float32)
            self._calls[signature] = 0
        self._calls[signature] += 1
        return r

    # ---- state ----------------------------------------------------------------------
    def state_checksum(self, key: Any = None) -> int:
        """CRC32 of the inner codec's state of ``key`` (0 when it keeps none); equal on
        ranks that agree. The residuals are left out, and so are their call counts:
        node-aware calls keep theirs per local index, and a flat call's check compares
        its own residual's count (:func:`geocomm.engine.call.state_checksum`)."""
        if self.mapping_codec is None:
            return 0
        return self.mapping_codec.state_checksum(key)

    def _forget(self) -> None:
        self._residuals.clear()
        self._calls.clear()
        if self.mapping_codec is not None:
            self.mapping_codec.reset_state()

    def state_dict(self) -> dict[str, Any]:
        """This rank's residuals (NumPy) and call counts, and the inner codec's state."""
        return {
            "version": 1,
            "config": self.get_config(),
            "residuals": {k: _to_numpy(v) for k, v in self._residuals.items()},
            "calls": dict(self._calls),
            "inner": None if self.mapping_codec is None else self.mapping_codec.state_dict(),
        }

    def load_state_dict(self, data: dict[str, Any], xp: Any = np) -> None:
        """Restore :meth:`state_dict` output; residuals go to namespace ``xp``. All of it
        is checked before anything changes: a state this codec cannot take raises
        (TypeError for no dict, else ValueError) and leaves the codec as it was."""
        if not isinstance(data, Mapping):
            raise TypeError(f"an error-feedback state is a dict, got {type(data).__name__}")
        if data.get("version") != 1 or data.get("config") != self.get_config():
            raise ValueError(
                f"state was saved by {data.get('config')}, this codec is {self.get_config()}"
            )
        try:
            residuals, calls = dict(data["residuals"]), dict(data["calls"])
            counts = {k: int(v) for k, v in calls.items()}
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"malformed error-feedback state: {error!r}") from None
        if set(residuals) != set(counts):
            raise ValueError("the state's residuals and call counts name other signatures")
        loaded = {}
        for k, v in residuals.items():
            r = np.array(v, np.float32)  # a copy: the calls update residuals in place
            if r.ndim != 1:
                raise ValueError(f"the residual of {k!r} has shape {r.shape}, not (n,)")
            if not np.isfinite(r).all():  # a residual is 0 wherever it would not be finite
                raise ValueError(f"the residual of {k!r} holds non-finite values")
            loaded[k] = r
        inner = data.get("inner")
        if (inner is None) != (self.mapping_codec is None):
            raise ValueError(
                "the state's inner codec state does not fit this codec's "
                f"({'none' if inner is None else 'one'} given)"
            )
        if self.mapping_codec is not None and inner is not None:
            self.mapping_codec.load_state_dict(inner)  # checked whole, like this one
        self._residuals = {k: xp.asarray(r) for k, r in loaded.items()}
        self._calls = counts


def _to_numpy(a: Any) -> np.ndarray:
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.array(a)
