"""stagewise executor: build, run and verify a plan's batched module; profile, autotune and N-sweep it.

Imports planner, never app.
"""
from stagewise.executor.build import BatchedModule, build, resolve_device, save_member_weights, stack_member_state  # noqa: F401
from stagewise.executor.verify import VerifyReport, batched_inputs, loop_outputs, member_inputs, resized_inputs, verify  # noqa: F401
import stagewise.executor.strategies  # noqa: F401,E402  (registers the wide, compile and cuda_graph runners)
from stagewise.executor.report import ProfileReport, StageProfile, StrategyResult, SweepReport  # noqa: F401,E402
from stagewise.executor.timing import Timing, simulate_oom  # noqa: F401,E402
from stagewise.executor.profile import profile  # noqa: F401,E402
from stagewise.executor.autotune import autotune  # noqa: F401,E402
from stagewise.executor.sweep import n_sweep  # noqa: F401,E402
from stagewise.executor.optim import MemberLeftOutWarning, StackedAdam, StackedAdamW, StackedCosineLR, StackedReduceLROnPlateau, StackedSGD, StackedStepLR, clip_grad_norm_per_member_  # noqa: F401,E402
from stagewise.executor.distributed import ShardedModule, build_sharded, member_slice  # noqa: F401,E402
from stagewise.executor.capture import CapturedPlan, ReplayBackend, capture  # noqa: F401,E402
from stagewise.executor.habits import JointNormWarning, update_bn  # noqa: F401,E402
from stagewise.executor import habits as _habits  # noqa: E402

_habits.install()  # torch's update_bn reaches batched modules however it is imported after this
