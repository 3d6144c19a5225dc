"""Device time of one ONNX Runtime run, without ORT's per-run host overhead in it.

A host clock around `Run` of a one-region model sits on a floor of ORT's own per-run cost (17-25 us per run
on the H100 machine, 2026-11-24) that is the same for ORT's sub-model and ours, so it compresses every
ratio toward 1. Here the session runs on a stream of ours (the CUDA EP's `user_compute_stream`), and each
timed run is enqueued behind a spin kernel that keeps the stream busy while the host enqueues the run's
kernels; CUDA events recorded just before and after the run then bracket only the GPU's work. Run options
skip ORT's end-of-run stream synchronisation, so the closing event follows the last kernel directly. A run
whose enqueue outlasted the spin is repeated with a longer spin (the bracket would include host time).
Before every run a buffer twice the L2 size is written, so weights are read from DRAM as in a whole-model
run, not from a cache the previous iteration warmed.

The host side is measured too: `enqueue_us` is how long the non-synchronising `Run` call took. A region
costs a pipelined model whichever is longer, its GPU time or the host time to issue it, so the profile
weighs `max(gpu_us, enqueue_us - floor)` where `floor` is the enqueue time of a one-node model (the part
of a `Run` every region pays once, not once per kernel).

Needs CuPy with a CUDA driver (the GPU machine); `available()` says whether it can run here."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

_SPIN = r"""
extern "C" __global__ void ofz_spin(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""
CLOCK = "GPU events: max(device time, enqueue time - per-run floor), L2 flushed"
MIN_SPIN_NS = 50_000
MAX_SPIN_NS = 50_000_000


@dataclass(frozen=True)
class Timing:
    gpu_us: float  # median device time between the events around the run
    enqueue_us: float  # median host time of the non-synchronising Run call
    runs: int
    spin_us: float  # the spin that covered the enqueue (grown until it did)

    def cost_us(self, floor_us: float) -> float:
        """What the region costs a pipelined model: the longer of its GPU time and its issue time past the
        per-run floor."""
        return max(self.gpu_us, self.enqueue_us - floor_us)


def available() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device
        return False


class GpuTimer:
    """One stream, its events, the spin kernel and the L2 flush buffer; `cuda_options()` goes into the CUDA
    EP's provider options of every session timed with it."""

    def __init__(self, flush_l2: bool = True):
        import cupy
        self._cp = cupy
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self._spin = cupy.RawKernel(_SPIN, "ofz_spin")
        l2 = int(cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["l2CacheSize"])
        self._flush = cupy.empty(2 * l2, dtype=cupy.uint8) if flush_l2 and l2 else None
        self._start, self._end = cupy.cuda.Event(), cupy.cuda.Event()
        self._floor_run: Optional[Callable[[], None]] = None

    def cuda_options(self) -> dict[str, str]:
        return {"user_compute_stream": str(self.stream.ptr)}

    @staticmethod
    def run_options() -> Any:
        import onnxruntime as ort
        ro = ort.RunOptions()
        ro.add_run_config_entry("disable_synchronize_execution_providers", "1")
        # the default CUDA-graph annotation, stated: onnxruntime 1.31's Python run_with_iobinding looks this
        # key up on every run, and a RunOptions without it costs a C++ exception turned into a Python one
        # (~35 us of host time per run, which made a one-node run's enqueue read 46-72 us on the H100)
        ro.add_run_config_entry("gpu_graph_id", "0")
        return ro

    def _prepare(self, spin_ns: int) -> None:
        with self.stream:
            if self._flush is not None:
                self._flush.fill(1)
            self._spin((1,), (1,), (np.uint64(spin_ns),), stream=self.stream)

    def time(self, run: Callable[[], None], warmup: int = 10, runs: int = 50) -> Timing:
        """`run` enqueues one inference on `self.stream` and returns without waiting for it."""
        host = []
        for _ in range(max(warmup, 1)):
            t0 = time.perf_counter()
            run()
            host.append(time.perf_counter() - t0)
            self.stream.synchronize()
        spin_ns = int(min(max(MIN_SPIN_NS, 3e9 * statistics.median(host)), MAX_SPIN_NS))
        gpu, enq = [], []
        while len(gpu) < runs:
            self._prepare(spin_ns)
            self._start.record(self.stream)
            t0 = time.perf_counter()
            run()
            took = time.perf_counter() - t0
            self._end.record(self.stream)
            self._end.synchronize()
            if took * 1e9 > 0.8 * spin_ns:  # the spin may have ended before the last kernel was enqueued
                if spin_ns >= MAX_SPIN_NS:
                    raise RuntimeError(f"a run took {took * 1e3:.1f} ms to enqueue: longer than the "
                                       f"{MAX_SPIN_NS / 1e6:.0f} ms spin, so its device time cannot be isolated")
                spin_ns = min(2 * spin_ns, MAX_SPIN_NS)
                continue
            gpu.append(self._cp.cuda.get_elapsed_time(self._start, self._end) * 1e3)
            enq.append(took * 1e6)
        return Timing(statistics.median(gpu), statistics.median(enq), runs, spin_ns / 1e3)

    def session_floor_us(self, make_run: Callable[[], Callable[[], None]], runs: int = 50) -> float:
        """The enqueue time of a one-node model's run: ORT's per-run host cost. Its session is made once; the
        time is taken afresh at each call, next to the run it is subtracted from (H100 2026-11-25: a floor
        cached at 95 us, one-node runs timed later at 46-72 us, docs/gpu/2026-11-25-h100-timer-diag.txt;
        most of that was the RunOptions lookup `run_options` now avoids)."""
        if self._floor_run is None:
            self._floor_run = make_run()
        return self.time(self._floor_run, warmup=5, runs=runs).enqueue_us


_shared: dict[bool, GpuTimer] = {}


def shared(flush_l2: bool = True) -> GpuTimer:
    """The process's timer (one stream and flush buffer for every measurement); `flush_l2=False` gives a
    second one that leaves the L2 as the previous run left it (bench/sweep.py --no-flush)."""
    if flush_l2 not in _shared:
        _shared[flush_l2] = GpuTimer(flush_l2)
    return _shared[flush_l2]
