"""Memory budget: refuse N members that cannot fit before building or stacking any of them.

Building N members takes N x (one member's parameters and buffers) of CPU memory;
stacking them (executor.build) takes N x that again on the target device. Both
are compared with what the device has available now (CPU: MemAvailable of
/proc/meminfo, else os.sysconf; CUDA: torch.cuda.mem_get_info), and a
MemoryBudgetError says the estimate, what is available and the fix, instead of
running out of memory after minutes and blaming the model file.

Activations are not estimated (they depend on the inputs); the message points
at `chunk_size` for them. Override: `check_memory=False` on ModelSource.members
/ executor.build, or the environment variable STAGEWISE_SKIP_MEMORY_CHECK=1
(for the CLI and the app). Imports nothing of ours but planner.errors.
"""
from __future__ import annotations

import os
from typing import Callable

import torch
from torch import nn

from stagewise.planner.errors import MemoryBudgetError

SKIP_ENV = "STAGEWISE_SKIP_MEMORY_CHECK"  # "1": skip every check (users who know their memory better)
USABLE_FRACTION = 0.9  # of the available memory; the rest is left for activations, allocator slack and the OS


def state_bytes(module: nn.Module) -> int:
    """Bytes of one member's parameters and buffers, each tensor counted once (tied weights are one tensor)."""
    seen: dict[int, int] = {}
    for t in list(module.parameters()) + list(module.buffers()):
        seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def _cpu_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file says kB and means KiB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def available_bytes(device: torch.device | str) -> int | None:
    """Memory free for new tensors on `device` now, or None where it cannot be known (then nothing is checked)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return _cpu_available()
    if dev.type == "cuda" and torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free)
    return None


# tests replace this to pretend a smaller machine
AVAILABLE: Callable[[torch.device | str], int | None] = available_bytes


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def skipped(check_memory: bool = True) -> bool:
    """Whether the caller or the environment turned the check off."""
    return not check_memory or os.environ.get(SKIP_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def check_fits(n: int, one_member: int, device: torch.device | str, what: str, fixes: str,
               check_memory: bool = True, copies: int = 1) -> None:
    """Raise MemoryBudgetError when `copies` x `n` x `one_member` bytes exceed the usable memory of `device`.

    Args:
        n: number of members.
        one_member: bytes per member (state_bytes).
        device: where the bytes go.
        what: what needs them, e.g. "building 100000 members of mlp".
        fixes: the fixes beyond fewer members, e.g. "or run on another device".
        check_memory: False skips the check (as does STAGEWISE_SKIP_MEMORY_CHECK=1).
        copies: how many copies of every member's state `what` holds at once on `device`.
    """
    if skipped(check_memory) or n <= 0 or one_member <= 0:
        return
    free = AVAILABLE(device)
    if free is None:
        return
    per_member = copies * one_member
    need = n * per_member
    usable = int(free * USABLE_FRACTION)
    if need <= usable:
        return
    fit = usable // per_member
    fewer = f"use at most {fit} members" if fit >= 1 else "not even one member fits: free memory first"
    times = f"{copies} x " if copies > 1 else ""
    raise MemoryBudgetError(
        f"{what} needs about {format_bytes(need)} on {torch.device(device)} ({times}{n} x {format_bytes(one_member)} of "
        f"parameters and buffers) but {format_bytes(free)} is available; {fewer}, {fixes} "
        f"(set {SKIP_ENV}=1 to skip this check)"
    )


def check_run(n: int, one_member: int, device: torch.device | str | None, name: str, check_memory: bool = True) -> None:
    """Before building anything: N members on the CPU, then their state stacked on `device`.

    On the CPU both are held at once (2 x N x state); on another device N x state
    each side. Raises MemoryBudgetError naming the larger need that does not fit.
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    fixes = "set chunk_size on large stages for their activations, or use another device"
    if dev.type == "cpu":
        check_fits(n, one_member, dev, f"building {n} members of {name} and stacking their state", fixes, check_memory, copies=2)
        return
    check_fits(n, one_member, "cpu", f"building {n} members of {name}", "or run the members in smaller groups (plan.with_n_members)",
               check_memory)
    check_fits(n, one_member, dev, f"stacking the state of {n} members of {name}", fixes, check_memory)


def ranks_for(n: int, per_member: int, device_bytes: int, *, fixed: int = 0) -> int:
    """How many ranks (devices) N members need when each device has `device_bytes`: the fewest W whose
    largest slice (ceil(N / W) members, as executor.distributed.member_slice deals them) fits.

    Args:
        n: members N.
        per_member: bytes one member takes on its device: its state (state_bytes) times the copies held,
            or an N sweep's measured peak-memory slope.
        device_bytes: memory of one device (the usable fraction, USABLE_FRACTION, is applied here).
        fixed: bytes per device that do not grow with N (an N sweep's intercept: activations, workspace).
    Raises:
        MemoryBudgetError when not even one member fits on a device.
    """
    if n < 1 or per_member < 0 or device_bytes <= 0:
        raise ValueError(f"ranks_for needs n >= 1, per_member >= 0, device_bytes > 0; got {n}, {per_member}, {device_bytes}")
    usable = int(device_bytes * USABLE_FRACTION) - fixed
    if per_member == 0:
        return 1
    most = usable // per_member  # members per device
    if most < 1:
        raise MemoryBudgetError(
            f"one member needs about {format_bytes(per_member + fixed)} but a device has {format_bytes(device_bytes)} "
            f"({USABLE_FRACTION:.0%} usable); use devices with more memory or set chunk_size on large stages"
        )
    return -(-n // most)  # ceil: the first ranks take one more member when N does not divide evenly
