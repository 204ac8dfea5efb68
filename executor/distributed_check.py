"""executor.distributed_check: a sharded plan checked and timed rank by rank (`stagewise run|profile --distributed`).

Each rank verifies (or profiles) its slice of the members against the loop over
those members, the all-gather of the outputs is timed, and every rank ends with
every rank's row, so rank 0 can print one table. Collective: every rank calls it.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from stagewise.planner.plan import Plan
from stagewise.executor.distributed import MemberFactory, ShardedModule, collective_guard, local_members, resolve_groups, agreed, build_sharded, member_slice


@dataclass
class RankVerdict:
    """One rank's check of its slice against the loop over its members."""

    rank: int
    start: int
    stop: int
    ok: bool
    max_rel: float
    verify_s: float  # executor.verify on the slice (build, both runs, compare)
    forward_ms: float  # median of the slice's forward alone (no collectives)
    device: str


@dataclass
class ShardedVerifyReport:
    """Every rank's verdict, and what gathering the outputs cost; the same on every rank."""

    n_members: int
    backend: str
    rtol: float
    ranks: list[RankVerdict] = field(default_factory=list)
    gather_ms: float = 0.0  # median all-gather of one forward's outputs along the member axis (failure check included)
    gather_bytes: int = 0  # bytes of the gathered outputs

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.ranks)

    def to_text(self) -> str:
        lines = [f"{'rank':>4}  {'members':<14} {'device':<8} {'verdict':<9} {'max rel':>9} {'verify s':>9} {'forward ms':>11}"]
        for r in self.ranks:
            span = f"{r.start}-{r.stop - 1} ({r.stop - r.start})"
            lines.append(f"{r.rank:>4}  {span:<14} {r.device:<8} {'MATCH' if r.ok else 'MISMATCH':<9} {r.max_rel:>9.2e} "
                         f"{r.verify_s:>9.2f} {r.forward_ms:>11.3f}")
        lines.append(f"all-gather of the outputs along the member axis: {self.gather_ms:.3f} ms "
                     f"({self.gather_bytes / 1024:.1f} KiB, {self.backend})")
        verdict = "MATCH" if self.ok else "MISMATCH"
        lines.append(f"{verdict}: {self.n_members} members over {len(self.ranks)} ranks, each slice against the loop over "
                     f"its members, rtol {self.rtol:g}")
        return "\n".join(lines)


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _this_ranks_slice(plan: Plan, members, inputs: Sequence[Any], member_group, group, device):
    """(member indices, members, ShardedModule, inputs) of this rank's slice; building agreed across ranks."""
    indices = member_slice(plan.n_members, dist.get_rank(member_group), dist.get_world_size(member_group))
    with agreed("building each rank's members", group):
        local = local_members(members, indices, plan.n_members)
    sharded = build_sharded(plan, lambda _: local, group, device)
    return indices, local, sharded, sharded.local_inputs(inputs)


def verify_sharded(plan: Plan, members: Union[Sequence[nn.Module], MemberFactory], inputs: Sequence[Any], *,
                   rtol: float | None, group=None, device: str | torch.device | None = None, repeats: int = 5) -> ShardedVerifyReport:
    """Each rank verifies its slice (executor.verify against the loop over its members, at a second batch
    size where the plan allows), times its forward and the all-gather; returns every rank's verdict on every rank.
    Collective over a ProcessGroup (None: the world)."""
    from stagewise.executor.verify import resized_inputs, verify

    member_group, _ = resolve_groups(group)
    indices, local, sharded, local_inputs = _this_ranks_slice(plan, members, inputs, member_group, group, device)
    with agreed("verifying each rank's members against their loop", group):
        t0 = time.perf_counter()
        sliced = plan.with_n_members(len(indices))
        other = resized_inputs(sliced, local_inputs)
        report = verify(sliced, local, local_inputs, rtol=rtol, device=sharded.device, more_inputs=[other] if other else ())
        rtol = report.rtol  # None above: the plan dtype's tolerance, as verify chose it
        verify_s = time.perf_counter() - t0
        with torch.no_grad():
            sharded.module(*local_inputs)  # warm-up
            forward_ms = _median_ms(lambda: sharded.module(*local_inputs), repeats)
            out = sharded.module(*local_inputs)
    gather_ms, size = _gather_cost(sharded, out, repeats)
    mine = RankVerdict(dist.get_rank(member_group), indices.start, indices.stop, report.ok, report.max_rel,
                       verify_s, forward_ms, str(sharded.device))
    return ShardedVerifyReport(plan.n_members, dist.get_backend(member_group), rtol, _every_rank(mine, member_group),
                               gather_ms, size)


def _gather_cost(sharded: ShardedModule, out: Any, repeats: int) -> tuple[float, int]:
    """(median ms, bytes) of all-gathering `out` along the member axis. Collective."""
    with torch.no_grad():
        sharded.gather(out)  # warm-up
        gather_ms = _median_ms(lambda: sharded.gather(out), repeats)
        gathered = sharded.gather(out)
    return gather_ms, sum(x.numel() * x.element_size() for x in tree_flatten(gathered)[0] if isinstance(x, torch.Tensor))


def _every_rank(mine: Any, member_group) -> list[Any]:
    """Every member rank's `mine`, in rank order, on every rank. Collective."""
    got: list[Any] = [None] * dist.get_world_size(member_group)
    with collective_guard("collecting every rank's results"):
        dist.all_gather_object(got, mine, group=member_group)
    return got


@dataclass
class RankProfile:
    """One rank's profile of its slice (executor.profile: the plan and the loop over its members)."""

    rank: int
    start: int
    stop: int
    device: str
    plan_ms: float | None  # median end to end of the slice's plan (forward, or training step with train)
    loop_ms: float | None  # the same for the loop over the slice's members
    profile_s: float  # the whole executor.profile call


@dataclass
class ShardedProfileReport:
    """Every rank's times and the all-gather cost; the same on every rank."""

    n_members: int
    backend: str
    train: bool
    ranks: list[RankProfile] = field(default_factory=list)
    gather_ms: float = 0.0  # median all-gather of one forward's outputs (failure check included)
    gather_bytes: int = 0

    def to_text(self) -> str:
        what = "training step" if self.train else "forward"
        lines = [f"{'rank':>4}  {'members':<14} {'device':<8} {'plan ms':>9} {'loop ms':>9} {'loop/plan':>9} {'profile s':>9}"]
        fmt = lambda v: f"{v:>9.3f}" if v is not None else f"{'-':>9}"  # noqa: E731
        for r in self.ranks:
            span = f"{r.start}-{r.stop - 1} ({r.stop - r.start})"
            ratio = f"{r.loop_ms / r.plan_ms:>8.2f}x" if r.plan_ms and r.loop_ms else f"{'-':>9}"
            lines.append(f"{r.rank:>4}  {span:<14} {r.device:<8} {fmt(r.plan_ms)} {fmt(r.loop_ms)} {ratio} {r.profile_s:>9.1f}")
        lines.append(f"all-gather of the outputs along the member axis: {self.gather_ms:.3f} ms "
                     f"({self.gather_bytes / 1024:.1f} KiB, {self.backend})")
        slowest = max((r.plan_ms for r in self.ranks if r.plan_ms is not None), default=None)
        if slowest is not None:
            total = slowest if self.train else slowest + self.gather_ms
            extra = "; member shards exchange no gradients" if self.train else " + the all-gather"
            lines.append(f"one {what} of all {self.n_members} members over {len(self.ranks)} ranks: {total:.3f} ms "
                         f"(the slowest rank{extra})")
        return "\n".join(lines)


def profile_sharded(plan: Plan, members: Union[Sequence[nn.Module], MemberFactory], inputs: Sequence[Any], *,
                    group=None, device: str | torch.device | None = None, repeats: int | None = None,
                    train: bool = False, autotune: bool = False) -> ShardedProfileReport:
    """Each rank profiles its slice (executor.profile against the loop over its members; `train`: a training
    step), then the all-gather of a forward's outputs is timed; returns every rank's times on every rank.
    Collective over a ProcessGroup (None: the world)."""
    from stagewise.executor.profile import profile

    member_group, _ = resolve_groups(group)
    indices, local, sharded, local_inputs = _this_ranks_slice(plan, members, inputs, member_group, group, device)
    with agreed("profiling each rank's members", group):
        t0 = time.perf_counter()
        report = profile(plan.with_n_members(len(indices)), local, local_inputs, device=sharded.device, repeats=repeats,
                         train=train, autotune=autotune)
        profile_s = time.perf_counter() - t0
        loop = report.baseline("loop")
        plan_ms = report.end_to_end.time.median_ms if report.end_to_end.ok and report.end_to_end.time else None
        loop_ms = loop.time.median_ms if loop and loop.ok and loop.time else None
        with torch.no_grad():
            out = sharded.module(*local_inputs)
    gather_ms, size = _gather_cost(sharded, out, repeats or 10)
    mine = RankProfile(dist.get_rank(member_group), indices.start, indices.stop, str(sharded.device), plan_ms, loop_ms, profile_s)
    return ShardedProfileReport(plan.n_members, dist.get_backend(member_group), train, _every_rank(mine, member_group),
                                gather_ms, size)
