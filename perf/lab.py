"""Perf helpers shared by ``perf/`` and ``perf/studies/``.

:func:`parse_size`, :func:`timed` and :func:`slowest` (the slowest rank's
time, nccl-tests style), :func:`ring_bytes`, :func:`breakdown` (encode,
communication and decode timed apart against the pipelined call),
:func:`emulated_link` and :func:`launch_command` (how the job was started),
:func:`busy_loops` (a slower machine), :func:`write_results` (a result as
JSON, markdown and a plot beside them), and :func:`yardstick`: two speeds of
this machine measured in the run, printed next to every performance table so
readers can scale.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from geocomm.codecs import Codec, get_codec
from geocomm.engine.host import Pipeline
from geocomm.engine.layout import DEFAULT_STAGE_SIZE, Pieces

__all__ = [
    "Yardstick",
    "breakdown",
    "busy_loops",
    "emulated_link",
    "launch_command",
    "parse_size",
    "ring_bytes",
    "slowest",
    "timed",
    "write_results",
    "yardstick",
    "yardstick_line",
]


def parse_size(text: str) -> int:
    """'8', '1K', '128M', '1G' -> bytes (binary multiples, like nccl-tests)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def ring_bytes(nbytes: int, size: int) -> int:
    """Bytes a rank sends in a ring all-reduce of ``nbytes``: 2(N-1)/N of them."""
    return 2 * (size - 1) * nbytes // size


def slowest(comm: Any, value: float) -> float:
    """The largest of every rank's ``value`` (a collective: every rank calls it)."""
    mine, worst = np.array([value], np.float64), np.empty(1)
    comm.allreduce(mine, worst, "max")
    return float(worst[0])


def timed(comm: Any, fn: Callable[[], Any], iters: int) -> float:
    """Mean seconds per call of ``fn`` over ``iters`` calls after a barrier, the
    slowest rank's (as nccl-tests reports); ``iters`` >= 1."""
    if iters < 1:
        raise ValueError(f"timed needs at least one call, got iters={iters}")
    comm.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return slowest(comm, (time.perf_counter() - start) / iters)


def breakdown(
    comm: Any, codec: Codec, x: np.ndarray, stage_size: int | None, gather: bool, repeats: int = 3
) -> dict[str, float]:
    """Seconds of one compressed all-reduce (``gather=False``: reduce-scatter) of ``x``
    taken apart: ``encode``, ``comm`` and ``decode`` run one after the other
    (no overlap), and ``pipelined``, the same call with its stages overlapped.
    Each is the best of ``repeats`` runs, the slowest rank's; a plain codec only
    (no geometry map). Every run writes one result array, whose pages are touched
    first: a fresh array's first writes fault its pages in, which the decode
    would be timed with (about 20 ms of a 64 MiB result here)."""
    source = np.ascontiguousarray(x, np.float32).reshape(-1)
    pieces = Pieces.cut(
        source.size, comm.size, stage_size or DEFAULT_STAGE_SIZE, codec.scale_span()
    )
    bounds = pieces.bounds
    length = source.size if gather else int(bounds[comm.rank + 1] - bounds[comm.rank])
    result = np.ones(length, np.float32)  # written, so its pages are in before any timing
    runs = [_breakdown_once(comm, codec, source, pieces, result, gather) for _ in range(repeats)]
    return {part: min(run[part] for run in runs) for part in runs[0]}


def _start_and_wait(start: Callable[[int], None], requests: dict[int, Any], s: int) -> None:
    """Start stage ``s``'s transfer and wait for it (what the breakdown times as comm)."""
    start(s)
    requests[s].wait()


def _breakdown_once(
    comm: Any, codec: Codec, source: np.ndarray, pieces: Pieces, result: np.ndarray, gather: bool
) -> dict[str, float]:
    offset = 0 if gather else int(pieces.bounds[comm.rank])
    parts = dict.fromkeys(("encode", "comm", "decode", "pipelined"), 0.0)

    def clock(part: str, fn: Callable[..., Any], *args: Any) -> None:
        start = time.perf_counter()
        fn(*args)
        parts[part] += time.perf_counter() - start

    pipe = Pipeline(comm, codec, pieces, source, result, offset, gather)
    comm.barrier()
    for s in range(pieces.stages):
        clock("encode", pipe.encode_stage, s)
        clock("comm", lambda s=s: _start_and_wait(pipe.start_alltoall, pipe.a2a_req, s))
        clock("decode", pipe.reduce_stage, s)
        if gather:
            clock("encode", pipe.reencode_stage, s)
            clock("comm", lambda s=s: _start_and_wait(pipe.start_allgather, pipe.ag_req, s))
            clock("decode", pipe.decode_stage, s)
    pipelined = Pipeline(comm, codec, pieces, source, result, offset, gather)
    comm.barrier()
    clock("pipelined", pipelined.run)
    mine, worst = np.array(list(parts.values())), np.empty(len(parts))
    comm.allreduce(mine, worst, "max")
    return dict(zip(parts, worst.tolist(), strict=True))


def emulated_link() -> str | None:
    """The rate (and delay) of ``perf/emulated_link.py``'s link; None when unshaped."""
    return os.environ.get("GEOCOMM_LINK")


@contextlib.contextmanager
def busy_loops(count: int) -> Iterator[list[subprocess.Popen]]:
    """``count`` CPU-spinning processes during the block: an emulated slower machine."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def launch_command(nranks: int) -> str:
    """The command line that reproduces this run of ``nranks`` ranks, launcher included."""
    link = emulated_link()
    plain = " --plain" if link and link.endswith(" plain") else ""
    launcher = (
        f"python perf/emulated_link.py --rate {link.split()[0]}{plain} -n {nranks}"
        if link
        else f"python -m geocomm.launch -n {nranks}"
    )
    return " ".join([launcher, "--", "python", shlex.join(sys.argv)])


@dataclass(frozen=True)
class Yardstick:
    """Two speeds of the machine a run measured, so readers can scale its numbers
    to theirs: ``copy_GBps``, ``np.copyto`` of ``mib`` MiB of float32 into a
    preallocated array (memory bandwidth), and ``fp8_encode_GBps``, geocomm's
    E4M3 block-128 encode of the same values (codec speed); both in GB/s of
    float32 input (1 GB = 1e9 bytes), one thread, median of the timed calls.
    """

    copy_GBps: float
    fp8_encode_GBps: float
    mib: int = 64

    def __str__(self) -> str:
        return (
            f"np.copyto {self.copy_GBps:.2f} GB/s, fp8 E4M3 block-128 encode "
            f"{self.fp8_encode_GBps:.2f} GB/s ({self.mib} MiB of fp32, one thread)"
        )


def write_results(
    stem: str | Path,
    result: dict[str, Any],
    markdown: str | Callable[[dict[str, Any]], str] | None = None,
    plot: Callable[[dict[str, Any], Path], None] | None = None,
) -> Path:
    """Write ``result`` to ``stem.json`` (the record: indented, one trailing newline),
    then ``markdown`` (a text, or a function of the result, called only once the
    record is on disk, so a failing table loses nothing) to ``stem.md`` and, with
    ``plot``, ``plot(result, stem.png)``; make the folder first. The suffixes are
    appended (``compare_2.5gbit`` keeps its name); a trailing ``.json`` on ``stem``
    is dropped first. Returns the JSON path."""
    text = str(stem)
    base = text[: -len(".json")] if text.endswith(".json") else text
    path = Path(f"{base}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    if markdown is not None:
        Path(f"{base}.md").write_text(markdown if isinstance(markdown, str) else markdown(result))
    if plot is not None:
        plot(result, Path(f"{base}.png"))
    return path


def yardstick(comm: Any = None, mib: int = 64, repeats: int = 5) -> Yardstick | None:
    """Measure :class:`Yardstick` here and now (about half a second at 64 MiB).

    Call it in the run whose numbers it accompanies and store it with them.
    With ``comm`` (a collective: every rank calls it), rank 0 measures while
    the others wait in a barrier, so that no rank competes with it for the
    memory bus; rank 0 gets the result, the others None.
    """
    if comm is not None:
        ruler = yardstick(None, mib, repeats) if comm.rank == 0 else None
        comm.barrier()
        return ruler
    x = np.random.default_rng(0).standard_normal((mib << 20) // 4, dtype=np.float32)
    copy = np.empty_like(x)
    codec = get_codec("fp8", fmt="e4m3", block=128)
    wire = np.empty(codec.wire_size(x.size), np.uint8)

    def gbps(fn: Callable[[], Any]) -> float:
        fn()  # warm-up: page faults, lazy initialisation
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return x.nbytes / float(np.median(times)) / 1e9

    return Yardstick(
        gbps(lambda: np.copyto(copy, x)), gbps(lambda: codec.encode_wire(x, wire)), mib
    )


def yardstick_line(record: dict[str, Any] | None) -> str:
    """A markdown sentence for a stored yardstick (``dataclasses.asdict`` of a
    :class:`Yardstick`; None for a result recorded before yardsticks existed)."""
    if not record:
        return "Machine yardstick: not measured in this run."
    return f"Machine yardstick, measured in this run: {Yardstick(**record)}."
