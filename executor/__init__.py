"""stagewise executor: build, run and verify a plan's batched module.

Imports planner, never app.
"""
from executor.build import BatchedModule, build, resolve_device, stack_members  # noqa: F401
from executor.verify import VerifyReport, batched_inputs, loop_outputs, member_inputs, verify  # noqa: F401
