"""The codec contract. It imports nothing of geocomm.

A :class:`Codec` turns float arrays into bytes and back. It has two faces:

* the standalone API, ``encode(x) -> frame`` / ``decode(frame, out=None)``,
  where a frame carries magic, version, codec config, dtype, shape, the wire
  body and a CRC32, and ``decode`` rejects anything malformed with
  ``ValueError``;
* the wire API used inside collectives, where no header travels and every
  rank derives the layout from the element count: ``wire_size(n)``,
  ``encode_wire(x, wire, rounding_stream=0, offset=0)``, ``decode_wire(wire,
  out, accumulate)`` and ``decode_wire_onto(wire, base, out)`` on flat float32
  arrays.

``get_config()`` is JSON-able and defines equality:
``get_codec(c.get_config()) == c``. A codec's configuration is fixed once it is
made: its public attributes cannot be set again (its hash is its config's, and the
collectives keep what they derived from a codec instance, plans and graphs, for its
later calls). Private attributes (``_name``) are the codec's own working state.
:class:`geocomm.codecs.frames.FramedCodec` implements the standalone API over the
frame format; every built-in codec derives from it.
"""

from __future__ import annotations

import json
import math
import threading
import weakref
from abc import ABCMeta, abstractmethod
from collections.abc import Generator, Sequence
from typing import Any, ClassVar

import numpy as np


class _Sealing(ABCMeta):
    """Seals every codec once its ``__init__`` returned (:meth:`Codec.__setattr__`)."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        codec = super().__call__(*args, **kwargs)
        codec.__dict__["_sealed"] = True
        return codec


class Codec(metaclass=_Sealing):
    """Base class of every geocomm codec (see the module docstring)."""

    _sealed = False

    def __setattr__(self, name: str, value: Any) -> None:
        if name[:1] != "_" and self._sealed:  # private names first: a call's own state
            raise AttributeError(
                f"{type(self).__name__}.{name} cannot change: a codec's configuration is "
                f"fixed once made; make a new codec, such as "
                f"geocomm.get_codec({{**codec.get_config(), {name!r}: ...}})"
            )
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if name[:1] != "_" and self._sealed:
            raise AttributeError(f"{type(self).__name__}.{name} cannot be deleted")
        super().__delattr__(name)

    codec_id: ClassVar[str]
    #: True when decode(encode(x)) == x exactly (then collectives may sum natively)
    lossless: ClassVar[bool] = False

    # ---- configuration ----------------------------------------------------
    @abstractmethod
    def get_config(self) -> dict[str, Any]:
        """The codec's parameters.

        Returns:
            A JSON-able dict with the codec's ``"id"`` and every parameter;
            :meth:`from_config` (and :func:`geocomm.get_codec`) make an equal codec
            from it, and two codecs are equal when their configs are.
        """

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Codec:
        params = dict(config)
        codec_id = params.pop("id", cls.codec_id)
        if codec_id != cls.codec_id:
            raise ValueError(f"config id {codec_id!r} does not match codec {cls.codec_id!r}")
        return cls(**params)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and self.get_config() == other.get_config()

    def __hash__(self) -> int:
        return hash(json.dumps(self.get_config(), sort_keys=True))

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items() if k != "id")
        return f"{type(self).__name__}({params})"

    # ---- wire API (headerless, flat float32) -------------------------------
    def scale_span(self) -> int:
        """Values whose codes depend on one another, counted from the start of a wire
        body: one scale's block (FP8's ``block``, MX's 32, NVFP4's superblock of 4096),
        1 for codecs that encode each value on its own, 0 for one scale over a whole
        body. The collectives cut their pieces at multiples of it, so no result
        depends on the stage size."""
        return 1

    @abstractmethod
    def wire_size(self, n: int) -> int:
        """Bytes of the wire body of ``n`` values."""

    @abstractmethod
    def encode_wire(
        self, x: np.ndarray, wire: np.ndarray, *, rounding_stream: int = 0, offset: int = 0
    ) -> None:
        """Encode values into a headerless wire body (the collectives' API).

        Args:
            x: flat, contiguous float32 values.
            wire: uint8 array of at least ``wire_size(x.size)`` bytes; the first
                ``wire_size(x.size)`` are written.
            rounding_stream: stochastic rounding's stream, an integer in [0, 2^64).
            offset: the global index of ``x[0]`` in [0, 2^64): the random bits of
                ``x[i]`` are drawn from (the codec's seed, ``rounding_stream``,
                ``offset + i``), so encoding pieces with their offsets gives every
                element the bits of one whole call. Codecs that round to nearest
                ignore both.
        """

    @abstractmethod
    def decode_wire(self, wire: np.ndarray, out: np.ndarray, accumulate: bool = False) -> None:
        """Decode a wire body written by :meth:`encode_wire`.

        Args:
            wire: uint8 array holding at least ``wire_size(out.size)`` bytes.
            out: flat, contiguous float32 array: ``out.size`` values are decoded.
            accumulate: add the decoded values to ``out`` (``+=``) instead of
                overwriting it.
        """

    def decode_wire_onto(self, wire: Any, base: Any, out: Any) -> None:
        """out = base + the values :meth:`decode_wire` decodes, added one by one in
        float32: the bits of copying ``base`` into ``out`` and decoding with
        ``accumulate``, which is what this does. ``base`` is ``out`` or shares no
        memory with it. Codecs with a loop that reads ``base`` as it decodes
        (one pass over memory) override it."""
        if base is not out:
            out[...] = base
        self.decode_wire(wire, out, accumulate=True)

    # ---- frame bodies (override when the body depends on more than the count) --
    def frame_body_size(self, shape: tuple[int, ...]) -> int:
        """Bytes of the frame body for an array of ``shape``."""
        return self.wire_size(math.prod(shape))

    def encode_frame_body(self, x: np.ndarray, body: np.ndarray) -> None:
        """Encode float32 ``x`` (its own shape) into ``body``."""
        self.encode_wire(x.reshape(-1), body)

    def decode_frame_body(self, body: np.ndarray, out: np.ndarray) -> None:
        """Decode ``body`` into float32 ``out`` (the frame's shape)."""
        self.decode_wire(body, out.reshape(-1))

    # ---- standalone API (FramedCodec in geocomm.codecs.frames implements it) --
    @abstractmethod
    def encode(self, x: np.ndarray) -> np.ndarray:
        """Encode an array as a self-describing frame.

        Args:
            x: NumPy array of any shape, float32, float16, bfloat16 or float64.

        Returns:
            A uint8 array: magic, version, dtype, shape, this codec's config, the
            body and a CRC32 (:func:`geocomm.decode` reads it without the codec).

        Raises:
            TypeError: ``x`` is not a NumPy array of a supported float dtype.
        """

    @abstractmethod
    def decode(self, buf: Any, out: np.ndarray | None = None) -> np.ndarray:
        """Decode a frame written by this codec's :meth:`encode`.

        Args:
            buf: the frame (uint8 array or any bytes-like object).
            out: an array of the frame's shape and any supported float dtype to fill,
                or None.

        Returns:
            ``out``, or a new array of the frame's shape and dtype.

        Raises:
            ValueError: a malformed or corrupted frame, one of another codec or
                config, or an ``out`` of another shape or read-only.
        """


class WireOf:
    """Mixin: the wire API of another codec, ``self.wire_codec`` (a codec that wraps
    one and sends its bytes: GeoFP8 its quantizer, error feedback its inner codec)."""

    wire_codec: Codec

    def scale_span(self) -> int:
        return self.wire_codec.scale_span()

    def wire_size(self, n: int) -> int:
        return self.wire_codec.wire_size(n)

    def encode_wire(self, x: Any, wire: Any, *, rounding_stream: int = 0, offset: int = 0) -> None:
        self.wire_codec.encode_wire(x, wire, rounding_stream=rounding_stream, offset=offset)

    def decode_wire(self, wire: Any, out: Any, accumulate: bool = False) -> None:
        self.wire_codec.decode_wire(wire, out, accumulate)

    def decode_wire_onto(self, wire: Any, base: Any, out: Any) -> None:
        self.wire_codec.decode_wire_onto(wire, base, out)


class StatefulCodec(Codec):
    """A codec with state that lives across calls (GeoFP8's bases, error feedback's
    residuals). The collectives compare ``state_checksum`` across ranks before
    every call; checkpoints carry ``state_dict``.

    The state is the state of one group of ranks: GeoFP8 spreads its side budget
    over every key it holds, and error feedback's call counts are compared across
    ranks, so ranks whose instances also served calls of another group would send
    different bytes. The collectives name the group (:meth:`hold_for`) before a
    call uses the state; :meth:`reset_state` frees the codec for another."""

    #: the group of ranks whose calls this state serves (None: none yet)
    _group: Any = None

    def hold_for(self, group: Any) -> None:
        """Let the state serve the calls of ``group``: a hashable name of a group of
        ranks, equal for equal groups (a tuple of their ranks in the job, or a weak
        reference to a communicator that cannot name them: free again once that one
        is gone, its state kept for the next, which the collectives' state check
        then compares across its ranks). Raises ValueError when it serves another
        group."""
        if group is self._group:  # every call after the first: the same name
            return
        with _HOLDING:
            held = self._group
            if held is None or held == group or _gone(held):
                self._group = group
                return
        raise ValueError(
            f"this {type(self).__name__} object holds the state of the calls of "
            f"{_describe_group(held)}; a call of {_describe_group(group)} would mix theirs "
            "into it, and the ranks would then send different bytes. Give each "
            "communicator (process group) its own instance: pass the codec's id or "
            "config (get_config()), which keeps one per communicator, or "
            "get_codec(codec.get_config()) per communicator; or reset_state() first"
        )

    def reset_state(self) -> None:
        """Forget every key's state; the codec may then serve another group of ranks."""
        self._group = None
        self._forget()

    @abstractmethod
    def state_checksum(self, key: Any = None) -> int:
        """CRC32 of one key's state (or of all, key None); equal on ranks that agree."""

    @abstractmethod
    def _forget(self) -> None:
        """Forget every key's state (:meth:`reset_state`)."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The state as plain values and NumPy arrays (for checkpoints)."""

    @abstractmethod
    def load_state_dict(self, data: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""


#: makes a codec's first group one, whichever threads call first
_HOLDING = threading.Lock()


def _gone(group: Any) -> bool:
    """Whether ``group`` names a communicator that no longer exists."""
    return isinstance(group, weakref.ref) and group() is None


def _describe_group(group: Any) -> str:
    if isinstance(group, tuple):
        return f"ranks {list(group)}"
    return "a communicator that does not name its ranks (no world_ranks())"


class TransformingCodec(StatefulCodec):
    """A codec that maps each tensor before quantizing and keeps per-key state (GeoFP8).

    Its protocol with the collectives (docs/design.md, "Transforming codecs"):

    * ``plan = codec.plan(x, shape, key, bounds)``: local, decided from shape,
      config and the key's state only; None means plain quantization;
    * ``plan.forward(x, out)`` writes the mapped values and sets ``plan.side``,
      this rank's contribution to an exact side sum (or None); a plan with
      ``ranged`` true also offers ``plan.begin(x, side, scratch)`` (sets ``side``:
      written into ``side``, an array of ``plan.side_shape``, where the plan names
      one and the caller gives it; ``scratch``, None or float32 of at least
      ``plan.scratch_size`` values, is the caller's to lend for the call; a plan
      that names ``inputs``, the arrays its map and its step read, may be
      replayed from a CUDA graph, its step too, and then takes what the
      captured step left, ``pending``, through ``plan.resume(pending)``) and then
      ``plan.forward_range(values, lo, out)`` for any flat range, and
      ``plan.encode_range(values, lo, codec, wire, rounding_stream, offset)``,
      which encodes a range's mapped values with ``codec`` without storing them
      (True) or leaves that to the caller (False);
    * after the quantized sum, ``plan.inverse(values, lo, side_sum)`` maps a
      flat range of the result back in place (any range for a ranged plan,
      whole rows otherwise); ranged plans also offer
      ``plan.decode_range(wire, codec, out, lo, side_sum)``: decode and
      inverse in one pass (True), or nothing (False);
    * before any of that, if ``plan.steps``, the collective drives the
      generator ``codec.step(plan, x)`` (the plan's basis turns towards this
      call's values): every array it yields is summed exactly over the ranks
      and sent back into it, all tensors' arrays of a round in one sum;
    * if ``plan.refreshes``, the collective drives the generator
      ``codec.refresh(plan, shard, lo, side_sum, alone)``: every array it
      yields is summed exactly over the ranks and sent back into it; with
      ``alone`` (an all-reduce, where every rank holds the whole result)
      ``shard`` is the whole result and every yield is sent back as it is;
    * after a call's refresh rounds, the collective calls ``codec.flush()``: the
      codec may then queue what it copies to the host for the rounds' outcomes
      (behind the call on the current stream; nothing waits for the device);
    * ``side_format`` ("fp32" or "bf16") is what those exact sums carry: every
      side and every yielded array holds values of that format (float32
      arrays), so the wire keeps them exactly at 4 or 2 bytes a value.

    The codec never talks to a communicator, and its state changes only from
    summed values, so every rank stays alike; ``state_checksum`` proves it.
    """

    #: the codec that quantizes the mapped values (whose bytes go on the wire)
    quantizer: Codec
    #: the format of the sides and refresh sums on the wire (see above)
    side_format: ClassVar[str] = "fp32"

    @abstractmethod
    def plan(self, x: Any, shape: Sequence[int], key: Any, bounds: Sequence[int]) -> Any:
        """This call's plan for flat float32 ``x`` of a tensor of ``shape``, or None."""

    def step(self, plan: Any, x: Any) -> Generator[Any, Any, None]:
        """Rounds that update the plan's basis from this rank's values ``x`` before the
        map (only plans with ``steps``; a codec whose plans never step need not
        offer it)."""
        raise NotImplementedError(f"{type(self).__name__} plans do not step")

    @abstractmethod
    def refresh(
        self, plan: Any, shard: Any, lo: int, side_sum: Any, alone: bool = False
    ) -> Generator[Any, Any, None]:
        """Rounds that update the plan's key from this rank's shard of the result."""

    def flush(self) -> None:
        """Queue what the call's refresh rounds copy to the host (nothing here)."""
