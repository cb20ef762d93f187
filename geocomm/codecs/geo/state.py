"""Per-key GeoFP8 state: the basis a tensor is mapped with, and its checksum.

State changes only from values that are bitwise identical on every rank (the
summed side reductions of a refresh), so ranks that start alike stay alike;
:meth:`KeyState.checksum` lets the collectives prove it before every call.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from array_api_compat import is_cupy_array

from geocomm.codecs.geo.kernels import basis_hash
from geocomm.codecs.geo.policy import MapShape


def _host_array(a: Any) -> np.ndarray:
    """A little-endian float32 NumPy copy of an array of any namespace (CuPy copies)."""
    if hasattr(a, "get") and not isinstance(a, np.ndarray):
        a = a.get()
    host = a if isinstance(a, np.ndarray) else np.from_dlpack(a)
    return np.array(host, "<f4", order="C", copy=True)


def _fingerprint(a: Any, digest: int | None = None) -> int:
    """CRC32 of a basis's :func:`~geocomm.codecs.geo.kernels.basis_hash` (``digest``
    when the caller has it, else hashed from a host copy of ``a``)."""
    if digest is None:
        digest = int(basis_hash(_host_array(a))[0])
    return zlib.crc32(struct.pack("<Q", digest))


@dataclass
class KeyState:
    """What GeoFP8 knows about one tensor.

    ``map_shape``: the key's cap (its k: rows tracked); ``vt``: the (k, d)
    basis, orthonormal rows, best first (None before the first result);
    ``calls``: calls so far; ``refreshed``: the call count at the last basis
    update (a power step, or a measure from the result); ``share``: the
    top-k energy share measured then (None before); ``energies``: the energy
    along each tracked direction then, and ``total`` the whole energy (every
    rank's values after a step, the result after a measure: the spectrum the
    budget reads); ``use``: the rank the budget gave the key at its last call
    (its first ``use`` rows map; 0: plain); ``period``: calls between its
    basis updates now (adapted at each,
    :func:`~geocomm.codecs.geo.policy.next_period`); ``summed``: whether its
    last update summed each rank's part over the ranks (a power step, or a
    measure in a reduce-scatter) rather than every rank measuring from the
    whole result (an all-reduce), i.e. whether it cost side bytes.

    Whitening (``transform="whiten"``): ``wt``, the (rows, d) basis of the
    last result's dominant directions (orthonormal, best first; None before
    one was measured), ``wenergies`` the result's energy along each, and
    ``wbulk`` its mean energy per direction outside them.
    """

    map_shape: MapShape
    vt: Any = None
    calls: int = 0
    refreshed: int = 0
    share: float | None = None
    energies: tuple[float, ...] = ()
    total: float = 0.0
    use: int = 0
    period: int = 1
    summed: bool = False
    wt: Any = None
    wenergies: tuple[float, ...] = ()
    wbulk: float = 0.0
    _basis_crc: int = field(default=0, init=False, repr=False)
    _white_crc: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.vt is not None:
            self._set_basis(self.vt)
        if self.wt is not None:
            self._white_crc = _fingerprint(self.wt)

    @property
    def crc(self) -> int:
        """CRC32 of the whole state (each basis through its
        :func:`~geocomm.codecs.geo.kernels.basis_hash`, taken once, when it changes)."""
        dims = self.map_shape
        head = struct.pack(
            f"<7q??d{len(self.energies) + 1}d",
            dims.m,
            dims.n,
            dims.k,
            self.calls,
            self.refreshed,
            self.use,
            self.period,
            self.share is not None,
            self.summed,
            self.share or 0.0,
            self.total,
            *self.energies,
        )
        crc = zlib.crc32(head, self._basis_crc)
        if self.wt is None:
            return crc
        white = struct.pack(f"<d{len(self.wenergies)}d", self.wbulk, *self.wenergies)
        return zlib.crc32(white, crc ^ self._white_crc)

    def _set_basis(self, vt: Any, digest: int | None = None) -> None:
        """``vt`` becomes the basis; ``digest``: its
        :func:`~geocomm.codecs.geo.kernels.basis_hash`, if the caller has it (else
        hashed from a host copy). A device basis of the same shape is copied into the
        old one's memory (in stream order), so CUDA graphs of mapped calls, which read
        it from there, stay valid; the first basis is kept as given, so later updates
        write into it: a caller hands over memory that nothing else keeps (a view of it
        would change)."""
        old = self.vt
        if is_cupy_array(old) and is_cupy_array(vt) and old.shape == vt.shape and old is not vt:
            old[...] = vt
        else:
            self.vt = vt
        self._basis_crc = _fingerprint(vt, digest)

    def commit(
        self,
        vt: Any,
        energies: tuple[float, ...],
        total: float,
        period: int,
        summed: bool,
        digest: int | None = None,
    ) -> None:
        """A basis update: the new basis (``digest``: its hash, if the caller has it),
        the energies along its directions, the whole energy (the share follows), the
        next period and whether the update summed over ranks."""
        self._set_basis(vt, digest)
        self.refreshed, self.period = self.calls, int(period)
        self.summed = bool(summed)
        self.energies, self.total = tuple(float(e) for e in energies), float(total)
        self.share = min(sum(self.energies) / self.total, 1.0)

    def commit_whitening(
        self, wt: Any, energies: tuple[float, ...], bulk: float, host: np.ndarray | None = None
    ) -> None:
        """A measured whitening basis (``host``: its NumPy copy, if the caller has one),
        the result's energy along each of its rows and the bulk's mean energy per
        direction."""
        self.wt, self.wbulk = wt, float(bulk)
        self.wenergies = tuple(float(e) for e in energies)
        self._white_crc = _fingerprint(wt if host is None else host)

    def to_dict(self) -> dict[str, Any]:
        """A JSON- and NumPy-only snapshot (for checkpoints)."""
        dims = self.map_shape
        return {
            "shape": (dims.m, dims.n),
            "k": dims.k,
            "calls": self.calls,
            "refreshed": self.refreshed,
            "share": self.share,
            "energies": list(self.energies),
            "total": self.total,
            "use": self.use,
            "period": self.period,
            "summed": self.summed,
            "vt": _host_matrix(self.vt, dims.n),
            "wt": _host_matrix(self.wt, dims.n),
            "wenergies": list(self.wenergies),
            "wbulk": self.wbulk,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], xp: Any) -> KeyState:
        """Inverse of :meth:`to_dict`; ``xp`` is the namespace the basis lives in."""
        m, n = (int(v) for v in data["shape"])
        st = cls(MapShape(m, n, int(data["k"])))
        st.calls, st.refreshed = int(data["calls"]), int(data["refreshed"])
        st.share = None if data["share"] is None else float(data["share"])
        st.energies = tuple(float(e) for e in data.get("energies", ()))
        st.total, st.use = float(data.get("total", 0.0)), int(data.get("use", 0))
        st.period = int(data.get("period", 1))
        st.summed = bool(data.get("summed", False))
        if data["vt"] is not None:
            vt = np.array(data["vt"], "<f4", order="C")  # a copy: the caller's stays theirs
            if vt.shape != (st.map_shape.k, st.map_shape.n):
                raise ValueError(f"basis of shape {vt.shape} does not fit {st.map_shape}")
            if not np.isfinite(vt).all():
                raise ValueError("the basis holds non-finite values")
            st._set_basis(xp.asarray(vt), int(basis_hash(vt)[0]))
        if data.get("wt") is not None:
            wt = np.asarray(data["wt"], np.float32)
            if wt.ndim != 2 or wt.shape[1] != st.map_shape.n:
                raise ValueError(f"whitening basis of shape {wt.shape} does not fit {st.map_shape}")
            if not np.isfinite(wt).all():
                raise ValueError("the whitening basis holds non-finite values")
            energies = tuple(float(e) for e in data.get("wenergies", ()))
            st.commit_whitening(xp.asarray(wt), energies, float(data.get("wbulk", 0.0)))
        return st


def _host_matrix(a: Any, n: int) -> np.ndarray | None:
    """A host copy of a (rows, n) basis of any namespace (None stays None)."""
    if a is None:
        return None
    return _host_array(a).reshape(-1, n)
