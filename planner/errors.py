"""The one error family of stagewise. Imports nothing of ours.

Every message names the thing that is wrong and says what to do about it,
so a CLI user sees one clear line instead of a traceback.
"""
from __future__ import annotations


class StagewiseError(Exception):
    """Base of every error stagewise raises on purpose (CLI exit code 2)."""


class ModelLoadError(StagewiseError):
    """A model file, export archive or weight file could not be loaded."""


class TraceError(StagewiseError):
    """Neither torch.fx nor torch.export could trace the model."""


class PlanFileError(StagewiseError):
    """A plan file is not JSON, has another schema version, or is malformed."""


class PlanMismatchError(StagewiseError):
    """A plan names nodes or stages that the graph does not have, or is for another model."""


class EditError(StagewiseError):
    """A merge/split/exclude/include was refused; the previous plan is unchanged."""


class MemberError(StagewiseError):
    """Members do not match the architecture or the plan (count, state keys, shapes)."""


class InputError(StagewiseError):
    """Inputs do not match the plan's input modes or the traced shapes."""


class ExecutionError(StagewiseError):
    """A stage failed while running; the message names the stage and its nodes."""


class DeviceError(StagewiseError):
    """A device was requested that this machine does not have."""


class UntrustedArchiveError(ModelLoadError):
    """A `.pt2` archive needs unpickling (which can run code) and the caller did not opt in to trusting it."""


class OutputFileError(StagewiseError):
    """A file stagewise was asked to write (a chrome trace, a report) cannot be written."""


class OptimizerError(StagewiseError):
    """A stacked optimizer, scheduler or clipping call got a bad hyper-parameter or parameter."""


class MemoryBudgetError(StagewiseError):
    """N members would not fit in memory (planner.budget's estimate vs what the device has available)."""


def first_line(e: BaseException) -> str:
    """An exception's message cut to its first non-empty line (its type's name if it has none): errors stay one line."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[0] if lines else type(e).__name__
