"""Stage strategies beyond the spine's vmap and loop, registered in executor.stages.RUNNERS.

- loop: the member loop over per-member bound copies of the stage (no functional_call per call);
- wide: hand-batched kernels: baddbmm Linear (sibling Linears fused), convolutions in one of
  several forms (wide_layers.CONV_FORMS: per-member loop, grouped, grouped channels_last, im2col
  + baddbmm; cuDNN benchmark mode on GPU), fused norms and pools, scaled_dot_product_attention,
  nn.GRU, nn.LSTM, nn.MultiheadAttention, nn.TransformerEncoderLayer / TransformerEncoder;
- compile: torch.compile of the stage's vmapped callable (compile time kept apart);
- cuda_graph: CUDA-graph capture of the stage (GPU only; refused on CPU).
"""
from stagewise.planner.plan import Strategy
from stagewise.executor.stages import RUNNERS
from stagewise.executor.strategies.bound_loop import BoundLoopRunner
from stagewise.executor.strategies.compiled import CompileRunner
from stagewise.executor.strategies.cudagraph import CPU_REFUSAL, CudaGraphRunner
from stagewise.executor.strategies.wide import WideRunner, wide_rule_gaps

RUNNERS[Strategy.LOOP] = BoundLoopRunner  # same results as LoopRunner, without re-parametrising per call
RUNNERS[Strategy.WIDE] = WideRunner
RUNNERS[Strategy.COMPILE] = CompileRunner
RUNNERS[Strategy.CUDA_GRAPH] = CudaGraphRunner

__all__ = ["BoundLoopRunner", "CompileRunner", "CudaGraphRunner", "WideRunner", "CPU_REFUSAL", "wide_rule_gaps"]
