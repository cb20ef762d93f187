"""Per-step telemetry of the DDP hook and the FSDP2 reduce-scatter: bytes, times and a
sampled estimate of the compression error per bucket and per step.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from geocomm.codecs import TransformingCodec
from geocomm.codecs.checks import roundtrip
from geocomm.engine import costs

LOG = logging.getLogger("geocomm.torch")

#: values per sampled run of the error estimate: a multiple of every block length
#: (fp8 128, NVFP4 16), so a run holds whole blocks
SAMPLE_RUN = 256
#: values an estimate samples per bucket of CPU tensors unless told otherwise; none
#: for device tensors, whose sample the host would wait for (:func:`sample_budget`)
DEFAULT_SAMPLE = 4096


def sample_budget(requested: int | None, values: torch.Tensor) -> int:
    """Values the error estimate of a bucket of ``values`` samples: ``requested``, or
    by default :data:`DEFAULT_SAMPLE` on the CPU and none on a device. An estimate reads
    its sample on the host before and after the collective, which on a GPU waits for the
    device twice per bucket: the steady calls that replay as one CUDA graph would wait
    for each other's work."""
    if requested is not None:
        return requested
    return DEFAULT_SAMPLE if values.device.type == "cpu" else 0


@dataclass
class BucketStats:
    """One reduction (a DDP bucket, an FSDP2 module's reduce-scatter or all-reduce).

    ``bytes_sent``: bytes this rank handed to the network (counted at the
    communicator); ``baseline_bytes``: what the uncompressed ring collective in
    the gradient dtype sends; ``rel_error``: estimated ||result - exact|| /
    ||exact|| of the compressed tensors (None: nothing compressed or sampling
    off; see :class:`ErrorSample`); ``calls``: byte-moving calls at the
    communicator; ``collectives``: geocomm collectives run (1 or 2).
    """

    index: int
    kind: str
    numel: int
    compressed_numel: int
    collectives: int
    calls: int
    bytes_sent: int
    baseline_bytes: int
    rel_error: float | None
    seconds: float

    @property
    def ratio(self) -> float:
        """Compression ratio: baseline bytes over bytes sent."""
        return self.baseline_bytes / self.bytes_sent if self.bytes_sent else math.inf

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio}


@dataclass
class StepStats:
    """Every reduction of one training step (one backward)."""

    step: int
    buckets: list[BucketStats] = field(default_factory=list)

    def _total(self, name: str) -> Any:
        return sum(getattr(b, name) for b in self.buckets)

    bytes_sent = property(lambda self: self._total("bytes_sent"))
    baseline_bytes = property(lambda self: self._total("baseline_bytes"))
    collectives = property(lambda self: self._total("collectives"))
    calls = property(lambda self: self._total("calls"))
    seconds = property(lambda self: self._total("seconds"))

    @property
    def ratio(self) -> float:
        return self.baseline_bytes / self.bytes_sent if self.bytes_sent else math.inf

    @property
    def rel_error(self) -> float | None:
        """The largest bucket estimate (None when no bucket has one)."""
        errors = [b.rel_error for b in self.buckets if b.rel_error is not None]
        return max(errors) if errors else None

    #: the totals :meth:`as_dict` reports beside the buckets
    FIELDS = ("step", "bytes_sent", "baseline_bytes", "ratio", "collectives", "calls",
              "rel_error", "seconds")  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        totals = {name: getattr(self, name) for name in self.FIELDS}
        return {**totals, "buckets": [b.as_dict() for b in self.buckets]}

    def summary(self) -> str:
        err = "n/a" if self.rel_error is None else f"{self.rel_error:.2e}"
        return (
            f"step {self.step}: {len(self.buckets)} reductions, {self.collectives} "
            f"collectives, {self.bytes_sent / 1e6:.3f} MB sent, ratio {self.ratio:.2f}x, "
            f"est. rel. error {err}, {self.seconds * 1e3:.1f} ms reducing"
        )


class Telemetry:
    """Per-step statistics: reductions are recorded as they finish; :meth:`end_step`
    closes the step. Keeps the last ``history`` steps and logs a summary every
    ``log_every`` steps (logger ``geocomm.torch``, level INFO). Thread-safe:
    the DDP hook records from its worker thread."""

    def __init__(self, history: int = 100, log_every: int = 0):
        self._lock = threading.Lock()
        self._current: list[BucketStats] = []
        self._history: deque[StepStats] = deque(maxlen=max(history, 1))
        self.steps = 0
        self.log_every = log_every

    def record(self, stats: BucketStats) -> None:
        with self._lock:
            self._current.append(stats)

    def end_step(self) -> StepStats:
        with self._lock:
            step = StepStats(self.steps, self._current)
            self._current = []
            self._history.append(step)
            self.steps += 1
        if self.log_every and step.step % self.log_every == 0:
            LOG.info("geocomm %s", step.summary())
        return step

    @property
    def last_step(self) -> StepStats | None:
        """The most recent complete step (None before the first)."""
        with self._lock:
            return self._history[-1] if self._history else None

    @property
    def history(self) -> list[StepStats]:
        with self._lock:
            return list(self._history)


class ErrorSample:
    """A cheap estimate of a compressed collective's relative error.

    Before the collective, ``budget`` values of this rank's input (runs of
    :data:`SAMPLE_RUN` at evenly spaced aligned offsets within [lo, hi)) go
    through the codec's quantizer: eps^2 = ||Q(x) - x||^2 / ||x||^2 is the
    relative error of one quantization. In the collective, each shard's sum
    receives the N - 1 other ranks' quantized pieces (error^2 about eps^2 (N -
    1) ||g||^2, taking this rank's ||g|| for every rank's) and, for an
    all-reduce, the quantized sum (eps^2 ||S||^2), so with S the summed result
    at the same positions::

        rel_error^2 = eps^2 ((N - 1) ||g||^2 / ||S||^2 + [all-reduce])

    It assumes the quantization errors are uncorrelated with each other and
    with the data, and sees the quantizer alone: a transforming codec's map
    (GeoFP8) lowers the real error below it.
    """

    def __init__(self, codec: Any, values: torch.Tensor, lo: int, hi: int, budget: int):
        self.eps2 = self.g2 = 0.0
        self.index = None
        if codec.lossless or budget <= 0 or hi <= lo:
            return
        count = hi - lo
        runs = max(1, min(budget // SAMPLE_RUN, count // SAMPLE_RUN))
        if count <= SAMPLE_RUN:
            index = np.arange(lo, hi)
        else:
            starts = (
                lo
                + (np.linspace(0, count - SAMPLE_RUN, runs) // SAMPLE_RUN).astype(np.int64)
                * SAMPLE_RUN
            )
            index = (starts[:, None] + np.arange(SAMPLE_RUN)).reshape(-1)
        self.index = torch.from_numpy(index).to(values.device)
        local = values[self.index].float().cpu().numpy()
        quantizer = costs.codec_for(codec, values.numel())  # what the collective chooses
        if isinstance(quantizer, TransformingCodec):
            quantizer = quantizer.quantizer
        err = roundtrip(quantizer, local).astype(np.float64) - local
        self.g2 = float(np.dot(local.astype(np.float64), local))
        self.eps2 = float(np.dot(err, err)) / self.g2 if self.g2 else 0.0

    def estimate(
        self, result: torch.Tensor, offset: int, size: int, avg: bool, gather: bool
    ) -> float | None:
        """The estimate from ``result`` (absolute index i lies at result[i - offset])."""
        if self.index is None:
            return None
        if self.eps2 == 0.0:
            return 0.0
        total = result[self.index - offset].float().cpu().numpy().astype(np.float64)
        if avg:
            total *= size
        s2 = float(np.dot(total, total))
        if s2 == 0.0:
            return math.nan
        return math.sqrt(self.eps2 * ((size - 1) * self.g2 / s2 + (1.0 if gather else 0.0)))
