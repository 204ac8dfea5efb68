"""executor.n_sweep: one plan profiled at several member counts N.

For each N the plan (same stages and strategies, `plan.with_n_members(N)`) is
profiled against the member loop; the report gives per stage the break-even N
(the smallest measured N from which the stage's strategy beats the loop of that
stage at every larger measured N) and the largest N whose peak memory fits a budget.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from stagewise.planner.errors import StagewiseError
from stagewise.planner.plan import Plan, Strategy
from stagewise.executor.profile import Progress, profile
from stagewise.executor.report import SweepPoint, SweepReport
from stagewise.executor.timing import keeps_random_state


@keeps_random_state
def n_sweep(plan: Plan, make_members: Callable[[int], Sequence[nn.Module]], inputs_for_n: Callable[[int], Sequence[Any]],
            ns: Sequence[int], *, device: str | torch.device = "cpu", memory_budget: Optional[int] = None,
            repeats: Optional[int] = None, progress: Progress = None) -> SweepReport:
    """Profile `plan` at each N in `ns`.

    Args:
        make_members: N -> N member modules.
        inputs_for_n: N -> the batched module's inputs for N members (per_member inputs [N, ...]).
        ns: member counts, e.g. [1, 2, 4, 8, 16, 32].
        memory_budget: bytes; report the largest N whose end-to-end peak memory fits.
    Returns:
        SweepReport (to_text / to_json).
    """
    points: list[SweepPoint] = []
    ns = sorted(set(int(n) for n in ns))
    for k, n in enumerate(ns):
        if progress is not None:
            progress(k, len(ns), f"N={n}")
        try:
            report = profile(plan.with_n_members(n), make_members(n), inputs_for_n(n), device=device,
                             repeats=repeats, baselines=True)
        except (StagewiseError, RuntimeError) as e:  # e.g. out of memory while building at this N
            points.append(SweepPoint(n, {}, {}, None, None, None, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"))
            continue
        loop = report.baseline("loop")
        whole = report.end_to_end
        points.append(SweepPoint(
            n=n,
            stage_ms={s.id: s.result.time.median_ms if s.result.ok and s.result.time else None for s in report.stages},
            loop_ms={s.id: s.loop.time.median_ms if s.loop and s.loop.ok and s.loop.time else None for s in report.stages},
            end_to_end_ms=report.end_to_end.time.median_ms if report.end_to_end.ok and report.end_to_end.time else None,
            loop_end_to_end_ms=loop.time.median_ms if loop and loop.ok and loop.time else None,
            peak_mem_bytes=report.end_to_end.peak_mem_bytes,
            # the plan end to end failed or answered otherwise than the loop at this N: said, not a blank time
            error="" if whole.ok else f"end to end: {whole.error or 'did not match the member loop'}",
        ))
    if progress is not None:
        progress(len(ns), len(ns), "done")
    stage_ids = [s.id for s in plan.stages]
    looped = {s.id for s in plan.stages if s.options.strategy is Strategy.LOOP}
    break_even = {sid: (None if sid in looped else _break_even(points, sid)) for sid in stage_ids}
    notes = [f"{sid} runs as a member loop in this plan (no break-even)" for sid in stage_ids if sid in looped]
    fits, estimate = _budget(points, memory_budget)
    return SweepReport(model=plan.model, device=str(device), points=points, break_even=break_even,
                       memory_budget=memory_budget, max_n_in_budget=fits, max_n_estimate=estimate, notes=notes)


def _break_even(points: list[SweepPoint], sid: str) -> Optional[int]:
    wins = [(p.n, p.stage_ms.get(sid) is not None and p.loop_ms.get(sid) is not None and p.stage_ms[sid] < p.loop_ms[sid])
            for p in points if not p.error]
    answer = None
    for n, win in reversed(wins):
        if not win:
            break
        answer = n
    return answer


def _budget(points: list[SweepPoint], budget: Optional[int]) -> tuple[Optional[int], Optional[int]]:
    if budget is None:
        return None, None
    measured = [(p.n, p.peak_mem_bytes) for p in points if p.peak_mem_bytes is not None]
    fits = max((n for n, m in measured if m <= budget), default=None)
    if len(measured) < 2:
        return fits, fits
    xs, ys = [float(n) for n, _ in measured], [float(m) for _, m in measured]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    if slope <= 0:
        return fits, None
    return fits, max(0, int(math.floor((budget - (my - slope * mx)) / slope)))
