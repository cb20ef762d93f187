"""The CPU twin of CuPy itself: what it must catch for the GPU tests to have teeth.

Each test states the CUDA/CuPy behaviour the twin models and checks that the
twin both allows the correct program and refuses the broken one.
"""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest
from gpu_helpers import ON_TWIN

pytestmark = pytest.mark.skipif(
    not ON_TWIN,
    reason="checks the twin itself (a real GPU "
    "does not report these errors: that is why the twin exists)",
)


def test_work_runs_in_stream_order_not_at_call_time(cp):
    """Queued work runs later, in order: a host read waits for it (get synchronizes)."""
    x = cp.asarray(np.arange(1000, dtype=np.float32))
    for _ in range(20):
        x += 1
    assert np.array_equal(x.get(), np.arange(1000, dtype=np.float32) + 20)


def test_a_stream_that_makes_no_progress_fails_its_synchronization(cp, monkeypatch):
    """A synchronization on a stream whose head waits for good (a transfer whose peer
    never comes) raises after STUCK_S seconds, naming the stream and what it waits in,
    where CUDA would hang; one that moves again drains as usual."""
    import threading

    from cupy import _device

    monkeypatch.setattr(_device, "STUCK_S", 0.3)
    release = threading.Event()
    stream = cp.cuda.Stream(non_blocking=True)
    stream.enqueue(lambda: release.wait(), "a transfer that waits for its peer")
    with pytest.raises(_device.CUDARuntimeError, match="waits in a transfer that waits"):
        stream.synchronize()
    release.set()
    stream.synchronize()


def test_missing_event_wait_is_reported(cp):
    """Work on stream A reading what stream B wrote needs an event wait (cudaStreamWaitEvent)."""
    x = cp.zeros(64, cp.float32)
    side = cp.cuda.Stream(non_blocking=True)
    side.wait_event(cp.cuda.get_current_stream().record())
    with side:
        x += 1  # written on the side stream
    with pytest.raises(cp.cuda.StreamOrderError, match="no event wait"):
        x * 2  # the current stream reads it without waiting
    cp.cuda.get_current_stream().wait_event(side.record())
    assert float((x * 2)[0]) == 2.0


def test_overwrite_before_a_reader_finished_is_reported(cp):
    """A write on stream A of bytes stream B still reads (write after read) needs a wait too."""
    x = cp.ones(64, cp.float32)
    side = cp.cuda.Stream(non_blocking=True)
    side.wait_event(cp.cuda.get_current_stream().record())
    with side:
        y = x * 3  # the side stream reads x
    with pytest.raises(cp.cuda.StreamOrderError, match="read"):
        x.fill(0)
    cp.cuda.get_current_stream().wait_event(side.record())
    x.fill(0)
    side.synchronize()
    del y


@pytest.mark.parametrize("ordered", [False, True])
def test_a_freed_block_comes_back_on_its_stream_after_what_other_streams_did(cp, ordered):
    """CuPy's pool hands a freed block out again on the stream it was allocated on, at
    once, trusting that stream's order: work another stream queued on the block is
    ordered before the new owner's only if the block's stream waited for it. The twin
    pools alike, and the new owner's first write races the side stream's read unless
    the block's stream waited for the side stream before the block died."""
    x = cp.ones(4096, cp.float32)  # allocated on the current stream
    address = x.data.ptr
    side = cp.cuda.Stream(non_blocking=True)
    side.wait_event(cp.cuda.get_current_stream().record())
    with side:
        y = x * 3  # the side stream reads x
    if ordered:
        cp.cuda.get_current_stream().wait_event(side.record())
    _drained(side)  # ran (the queued work held x), though the host never waited for it
    del x
    z = cp.empty(4096, cp.float32)
    assert z.data.ptr == address  # the block came back
    if ordered:
        z.fill(0)
    else:
        with pytest.raises(cp.cuda.StreamOrderError, match="read"):
            z.fill(0)
    side.synchronize()
    del y


def _drained(stream) -> None:
    """Wait until the twin's worker ran everything queued on ``stream``, without the
    host synchronizing with it (which would order everything after it)."""
    deadline = time.monotonic() + 60
    while stream._queue and time.monotonic() < deadline:
        time.sleep(0.001)
    gc.collect()  # and what the work held is gone


def test_host_read_of_unordered_memory_raises(cp):
    """get() is a copy on the current stream: memory another stream wrote must be waited for."""
    x = cp.zeros(16, cp.float32)
    side = cp.cuda.Stream(non_blocking=True)
    side.wait_event(cp.cuda.get_current_stream().record())
    with side:
        x += 5
    with pytest.raises(cp.cuda.StreamOrderError):
        x.get()
    side.synchronize()  # the host waited: now any stream may read it
    assert x.get()[0] == 5


def test_implicit_host_conversion_and_numpy_functions_refuse(cp):
    x = cp.ones(4, cp.float32)
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.asarray(x)
    with pytest.raises(TypeError):
        np.add(np.ones(4, np.float32), x)
    with pytest.raises(NotImplementedError, match="twin"):
        cp.fft.fft(x)
    with pytest.raises(NotImplementedError, match="twin"):
        cp.sort(x)
    with pytest.raises(NotImplementedError, match="basic indexing"):
        x[cp.asarray(np.array([0, 1]))]


def test_float32_arithmetic_flushes_subnormals_like_cupy_kernels(cp):
    """CuPy's elementwise kernels run with -ftz=true: subnormal inputs and results are 0."""
    tiny = np.float32(3e-39)
    x = cp.asarray(np.array([tiny, 1.0, -tiny], np.float32))
    assert np.array_equal((x * 1).get(), np.array([0.0, 1.0, -0.0], np.float32))
    assert np.signbit((x * 1).get()[2])  # flushed to a signed zero
    y = cp.asarray(np.array([np.float32(2.0**-125)], np.float32))
    assert (y / 4).get()[0] == 0.0  # 2^-127 is subnormal: flushed
    assert x.copy().get()[0] == tiny  # a copy keeps bits


def test_out_of_bounds_copy_is_refused(cp):
    a = cp.zeros(8, cp.uint8)
    b = cp.zeros(8, cp.uint8)
    runtime = cp.cuda.runtime
    with pytest.raises(RuntimeError, match="no live device allocation"):
        runtime.memcpyAsync(
            a.data.ptr + 4,
            b.data.ptr,
            8,
            runtime.memcpyDeviceToDevice,
            cp.cuda.get_current_stream().ptr,
        )


def test_red_zones_catch_a_write_past_the_end(cp):
    """A kernel writing one element past its array corrupts a red zone: a sticky error."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import cupy, numpy as np
        src = r'''
        extern "C" __global__ void past_end(float *out, unsigned long long n)
        {
            unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
            if (i <= n) out[i] = 1.0f;   /* <= : one past the end */
        }
        '''
        f = cupy.RawModule(code=src, options=("-std=c++17",)).get_function("past_end")
        out = cupy.zeros(100, cupy.float32)
        f((1,), (128,), (out, np.uint64(100)))
        try:
            out.get()
        except RuntimeError as exc:
            print("ERROR:", exc)
    """)
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240
    )
    assert "ERROR:" in run.stdout and "past its end" in run.stdout, run.stdout + run.stderr


def test_a_capture_replays_in_order_and_refuses_an_allocation(cp):
    """A captured stream's work runs at each launch of its graph, not at capture time,
    in capture order. An allocation under capture is refused: CuPy's pool would hand the
    block to someone else once its array dies, while every replay still writes it (a
    graph's buffers are made before the capture)."""
    from cupy import _device

    x = cp.zeros(64, cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    stream.wait_event(cp.cuda.get_current_stream().record())
    stream.begin_capture()
    with stream:
        x += 1
        x *= 3
        with pytest.raises(_device.CUDARuntimeError, match="an allocation under capture"):
            cp.empty(8, cp.float32)
    graph = stream.end_capture()
    assert float(x.get()[0]) == 0.0, "captured work does not run at capture time"
    for _ in range(2):
        graph.launch(stream=cp.cuda.get_current_stream())
    assert float(x.get()[0]) == 12.0  # ((0 + 1) * 3 + 1) * 3


def test_an_allocator_of_memory_made_before_serves_a_capture(cp):
    """``cupy.cuda.using_allocator`` makes this thread's arrays from what the allocator
    returns (a pointer into memory made before), under capture too; outside it the
    twin's own allocator makes them again."""
    block = cp.cuda.alloc(1024)
    handed = []

    def allocate(nbytes):
        handed.append(nbytes)
        return block + 256 * (len(handed) - 1)

    stream = cp.cuda.Stream(non_blocking=True)
    stream.begin_capture()
    with stream, cp.cuda.using_allocator(allocate):
        y = cp.empty(8, cp.float32)
        y.fill(2)
        z = cp.empty(8, cp.float32)
    graph = stream.end_capture()
    assert handed == [32, 32] and cp.cuda.get_allocator() is not allocate
    assert y.data.ptr == block.ptr and z.data.ptr == block.ptr + 256
    graph.launch(stream=cp.cuda.get_current_stream())
    assert np.array_equal(y.get(), np.full(8, 2, np.float32))
    assert cp.empty(8, cp.float32).data.mem is not block.mem


def test_a_held_device_runs_nothing_and_refuses_host_waits(cp):
    """Inside ``cupy._device.hold()`` the streams queue work but run none of it, as a
    GPU busy with earlier work; a host synchronization that would wait for the held
    work raises DeviceHeld (one with nothing to wait for does not), and the queue runs
    on leaving."""
    from cupy import _device

    x = cp.zeros(8, cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    stream.wait_event(cp.cuda.get_current_stream().record())  # x is made
    stream.synchronize()
    with stream:
        with _device.hold():
            stream.synchronize()  # nothing queued: nothing to wait for
            x += 1
            done = stream.record()
            assert not done.done
            for wait in (stream.synchronize, done.synchronize, cp.cuda.Device().synchronize):
                with pytest.raises(_device.DeviceHeld, match="holds the device"):
                    wait()
            with pytest.raises(_device.DeviceHeld):
                x.get()
        done.synchronize()
        assert np.array_equal(x.get(), np.ones(8, np.float32))


def test_an_asynchronous_copy_to_the_host_lands_in_pinned_memory_in_stream_order(cp):
    """``get(out=..., blocking=False)`` only queues the copy: ``out`` must be pinned
    memory (a copy to pageable memory does not overlap the host on a GPU), reads as
    poison until the stream reaches the copy, and holds the values once an event
    recorded after it has passed."""
    from cupy import _memory

    x = cp.asarray(np.arange(8, dtype=np.float32))
    with pytest.raises(ValueError, match="pinned memory"):
        x.get(out=np.empty(8, np.float32), blocking=False)
    out = np.frombuffer(cp.cuda.alloc_pinned_memory(x.nbytes), np.float32, 8)
    stream = cp.cuda.Stream(non_blocking=True)
    stream.wait_event(cp.cuda.get_current_stream().record())  # x is made
    with stream:
        gate_open = threading.Event()
        # a held kernel: the stream cannot reach the copy until the gate opens
        stream.enqueue(lambda: gate_open.wait(), "a held kernel")
        before = _memory.counters["syncs"]
        x.get(out=out, blocking=False)
        landed = cp.cuda.Event()
        landed.record()
        assert _memory.counters["syncs"] == before, "queuing the copy does not wait"
        assert not landed.done
        assert np.all(out.view(np.uint8) == _memory.POISON), "a read before it lands"
        gate_open.set()
        landed.synchronize()
    assert np.array_equal(out, np.arange(8, dtype=np.float32))
