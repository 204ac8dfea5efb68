"""Careful timers, peak-memory probes and the fault-injection hook used by profile/autotune.

CPU: `time.perf_counter` around each call (calls under ~0.2 ms are repeated
inside one sample so the timer's own cost stays small). CUDA: throughput, the
way inference and training loops run: one sample is CUDA events around K calls
back to back (K >= CUDA_MIN_INNER, enough for ~CUDA_BLOCK_S), one synchronize per
sample, so a call's host work overlaps the previous call's kernels as it does in
a loop. A synchronize after every call (per-call latency) ranked plans differently
on an H100 (2026-11-23: a conv stage as one CUDA graph 0.45 ms vs torch.compile
reduce-overhead 0.50 ms per synchronised call, 0.41 vs 0.32 ms back to back).
Several callables can be timed round-robin (`interleaved`) so that load from
other processes hits them alike. A `Prepared` callable has a preparation run
before each call outside what is measured (fresh values for inputs a forward()
writes in place): its calls are timed one by one (CUDA: events around each call).

Peak memory: CUDA allocator peak above the allocation before the call; on CPU
the allocator's peak live bytes from torch.profiler's allocation events (malloc
caching would hide a growth of the resident set), falling back to the growth
of the process's peak RSS (VmHWM, reset through /proc/self/clear_refs).
"""
from __future__ import annotations

import contextlib
import functools
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

TINY_CALL_S = 2e-4  # CPU: calls faster than this are repeated within one sample
CUDA_BLOCK_S = 1e-3  # CUDA: a sample runs calls back to back for about this long (see the module docstring)
CUDA_MIN_INNER, CUDA_MAX_INNER = 3, 100  # calls per CUDA sample
SAMPLE_BUDGET_S = 0.25  # default time spent timing one callable (repeats derived from it)
MIN_REPEATS, MAX_REPEATS = 10, 40
MIN_DEADLINE_ROUNDS = 3  # a deadline never cuts a round-robin shorter than this


@dataclass
class Timing:
    """Per-call wall time over `repeats` samples (milliseconds)."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    min_ms: float
    repeats: int

    @staticmethod
    def of(samples_s: list[float]) -> "Timing":
        ms = sorted(s * 1e3 for s in samples_s)
        q = lambda f: ms[min(len(ms) - 1, int(round(f * (len(ms) - 1))))]  # noqa: E731
        return Timing(statistics.median(ms), q(0.1), q(0.9), ms[0], len(ms))

    @staticmethod
    def from_json(d: dict | None) -> Optional["Timing"]:
        return Timing(**d) if d else None


@contextlib.contextmanager
def native_stderr_silenced():
    """Silence file descriptor 2 (Kineto prints start/stop lines from C++ on every profiler run)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class Prepared:
    """A call timed apart from an untimed preparation run before each call (`prepare()`, e.g. putting fresh values
    into inputs that forward() writes in place, so that every call sees the caller's values, not the previous call's
    writes): the samplers, one_call_seconds and peak_memory_bytes run `prepare()` outside what they measure, so the
    time and memory are the call's alone. Calling it runs both (checks, warm-ups, traces)."""

    def __init__(self, prepare: Callable[[], object], call: Callable[[], object]):
        self.prepare, self.call = prepare, call

    def __call__(self) -> object:
        self.prepare()
        return self.call()


def _parts(fn: Callable[[], object]) -> tuple[Optional[Callable[[], object]], Callable[[], object]]:
    """(the untimed preparation or None, the call to measure)."""
    return (fn.prepare, fn.call) if isinstance(fn, Prepared) else (None, fn)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_call_seconds(fn: Callable[[], object], device: torch.device) -> float:
    prepare, fn = _parts(fn)
    if prepare is not None:
        prepare()
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def default_repeats(call_s: float, budget_s: float = SAMPLE_BUDGET_S) -> int:
    """Enough samples to fill `budget_s`, clamped to [MIN_REPEATS, MAX_REPEATS]."""
    return int(min(MAX_REPEATS, max(MIN_REPEATS, budget_s / max(call_s, 1e-6))))


def calls_per_sample(first_call_s: float, device: torch.device) -> int:
    """How many calls one sample runs back to back: CUDA throughput blocks, CPU repeats of tiny calls."""
    if device.type == "cuda":
        return min(CUDA_MAX_INNER, max(CUDA_MIN_INNER, int(CUDA_BLOCK_S / max(first_call_s, 1e-7))))
    return max(1, int(TINY_CALL_S / max(first_call_s, 1e-7)))


def _sampler(fn: Callable[[], object], device: torch.device, inner: int) -> Callable[[], float]:
    prepare, fn = _parts(fn)
    if prepare is not None:
        return _prepared_sampler(prepare, fn, device, inner)
    if device.type == "cuda":
        def sample() -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / inner
    else:
        def sample() -> float:
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            return (time.perf_counter() - start) / inner
    return sample


def _prepared_sampler(prepare: Callable[[], object], fn: Callable[[], object], device: torch.device,
                      inner: int) -> Callable[[], float]:
    """As _sampler, each call's `prepare()` outside the timed spans: CUDA events around each call (the preparation's
    kernels run between one call's end event and the next one's start), still one synchronize per sample; CPU
    perf_counter around each call."""
    if device.type == "cuda":
        def sample() -> float:
            spans = []
            for _ in range(inner):
                prepare()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                spans.append((start, end))
            spans[-1][1].synchronize()
            return sum(a.elapsed_time(b) for a, b in spans) / 1e3 / inner
    else:
        def sample() -> float:
            total = 0.0
            for _ in range(inner):
                prepare()
                start = time.perf_counter()
                fn()
                total += time.perf_counter() - start
            return total / inner
    return sample


def interleaved(fns: dict[str, Callable[[], object]], device: torch.device, repeats: Optional[int] = None,
                warmup: int = 2, deadline_s: Optional[float] = None) -> dict[str, Timing]:
    """Time several callables round-robin; each is warmed up `warmup` times first.

    `deadline_s`: stop sampling once the round-robin has run this long (wall time), after at
    least MIN_DEADLINE_ROUNDS rounds; on a loaded machine the planned repeats can take many
    times their budget, and autotune's minimum needs few samples."""
    if not fns:
        return {}
    first = {}
    for name, fn in fns.items():
        for _ in range(max(0, warmup - 1)):
            fn()
        first[name] = one_call_seconds(fn, device)
    if repeats is None:
        repeats = default_repeats(sum(first.values()), SAMPLE_BUDGET_S * len(fns))
    samplers = {name: _sampler(fn, device, calls_per_sample(first[name], device)) for name, fn in fns.items()}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    start = time.perf_counter()
    for k in range(repeats):
        for name, sample in samplers.items():
            samples[name].append(sample())
        if deadline_s is not None and k + 1 >= MIN_DEADLINE_ROUNDS and time.perf_counter() - start > deadline_s:
            break
    return {name: Timing.of(s) for name, s in samples.items()}


def measure(fn: Callable[[], object], device: torch.device, repeats: Optional[int] = None, warmup: int = 2) -> Timing:
    """Median and spread of one callable's per-call time, after `warmup` calls."""
    return interleaved({"fn": fn}, device, repeats, warmup)["fn"]


# --- memory -------------------------------------------------------------------------

def _status_kb(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def allocator_peak_bytes(fn: Callable[[], object]) -> Optional[int]:
    """Peak of the CPU allocator's live bytes during one call, above the level before it.

    Read from torch.profiler's allocation events (their running `total_allocated`),
    so memory that malloc keeps cached between calls does not hide the peak.
    None when this torch's profiler does not expose those events.
    """
    try:
        from torch._C._profiler import _EventType

        with native_stderr_silenced(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        events = []
        stack = list(prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            e = stack.pop()
            if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
                events.append((e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.total_allocated))
            stack.extend(e.children)
    except (ImportError, AttributeError, RuntimeError):
        return None
    if not events:
        return 0
    events.sort()
    base = events[0][2] - events[0][1]
    return max(0, max(total for _, _, total in events) - base)


def peak_memory_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Memory one call needs above what was in use before it.

    CUDA: the caching allocator's peak. CPU: the allocator peak from the profiler's
    allocation events, or else the growth of the process's peak RSS (VmHWM after
    a reset through /proc/self/clear_refs; ru_maxrss as a last resort). A Prepared call's preparation runs before,
    unmeasured.
    """
    prepare, fn = _parts(fn)
    if prepare is not None:
        prepare()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - before)
    peak = allocator_peak_bytes(fn)
    if peak is not None:
        return peak
    if _reset_hwm():
        before = _status_kb("VmRSS") or 0
        fn()
        return max(0, ((_status_kb("VmHWM") or 0) - before) * 1024)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fn()
    return max(0, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)


# --- faults -------------------------------------------------------------------------

FaultHook = Callable[[str, str], None]  # (stage id or "whole", strategy name) -> may raise
_FAULT_HOOKS: list[FaultHook] = []


def inject_faults(stage: str, strategy: str) -> None:
    """Called by profile/autotune right before running `strategy` of `stage`."""
    for hook in list(_FAULT_HOOKS):
        hook(stage, strategy)


@contextlib.contextmanager
def fault_hook(hook: FaultHook) -> Iterator[None]:
    """Install a fault-injection hook for the duration of the block (tests)."""
    _FAULT_HOOKS.append(hook)
    try:
        yield
    finally:
        _FAULT_HOOKS.remove(hook)


@contextlib.contextmanager
def simulate_oom(stage: Optional[str] = None, strategy: Optional[str] = None) -> Iterator[None]:
    """Raise torch.OutOfMemoryError whenever `strategy` of `stage` runs (None matches any).

    Strategy names are labels: "vmap", "wide", "loop", "compile", "cuda_graph",
    "vmap/chunk=4" for a chunked vmap; the whole-model baselines use stage
    "whole" and "loop", "vmap", "vmap+compile". Example:
    `with simulate_oom(stage="s0", strategy="vmap"): profile(...)`.
    """
    def hook(s: str, strat: str) -> None:
        if (stage is None or s == stage) and (strategy is None or strat == strategy):
            raise torch.OutOfMemoryError(f"simulated out of memory in {strat} of {s} (fault injection)")

    with fault_hook(hook):
        yield


def is_oom(e: BaseException) -> bool:
    """True for CUDA/CPU out-of-memory errors, also when wrapped (ExecutionError from a runner)."""
    while e is not None:
        if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
            return True
        text = str(e).lower()
        if "out of memory" in text or "can't allocate memory" in text:
            return True
        e = e.__cause__
    return False


def describe_error(e: BaseException) -> str:
    """'out of memory: ...' or 'TypeName: first line' for a report."""
    root = e
    while root.__cause__ is not None:
        root = root.__cause__
    text = str(root).strip().splitlines()
    first = text[0] if text else ""
    prefix = "out of memory: " if is_oom(e) else ""
    return f"{prefix}{type(root).__name__}: {first[:300]}"


def keeps_random_state(fn: Callable) -> Callable:
    """`fn` run with torch's random state forked: the caller's draws after it are the ones it would have made without
    it (a profile or autotune draws dropout masks a number of times that depends on the timings)."""
    @functools.wraps(fn)
    def kept(*args, **kwargs):
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=devices):
            return fn(*args, **kwargs)
    return kept
