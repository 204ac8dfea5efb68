"""stagewise planner: load a model, trace it, propose and edit vmap stages.

Imports nothing above it (executor, app); see shared/DESIGN.md for the vocabulary.
"""
from stagewise.planner.errors import (  # noqa: F401
    DeviceError, EditError, ExecutionError, InputError, MemberError, MemoryBudgetError, ModelLoadError,
    OptimizerError, OutputFileError, PlanFileError, PlanMismatchError, StagewiseError, TraceError, UntrustedArchiveError,
)
from stagewise.planner.plan import InputMode, InputSpec, Plan, Stage, StageMode, StageOptions, Strategy, SCHEMA_VERSION, DTYPES  # noqa: F401
from stagewise.planner.source import ModelSource, load_export, load_model_file, load_source, natural_key, read_state_dict  # noqa: F401
from stagewise.planner.graph import ModelGraph, NodeInfo, trace, retrace, fingerprint  # noqa: F401
from stagewise.planner.capability import annotate_capability, chain, unbatchable  # noqa: F401
from stagewise.planner.propose import propose  # noqa: F401
from stagewise.planner.edits import exclude, include, merge, set_capture, set_dtype, set_options, split  # noqa: F401
from stagewise.planner.validate import validate, stage_graph, convexity_violation  # noqa: F401
from stagewise.planner.table import format_stage_table, stage_rows  # noqa: F401
from stagewise.planner.diff import ChangeKind, PlanDiff, diff_plans, format_diff  # noqa: F401
