"""The benchmark workloads: sample models at the sizes the issue names.

Each workload is one model file, a member count N and an input mode. The
sample files already have the benchmark shapes (batch, width, sequence); models that
are benchmarks only (not samples every test runs) live in benchmarks/models/.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Workload:
    name: str  # row label
    model: str  # model file, relative to the repository root
    n: int  # members
    input_mode: str  # "shared" or "per_member"
    linear_heavy: bool = False  # the "within 1.5x of the floor" target applies

    @property
    def path(self) -> Path:
        return ROOT / self.model


WORKLOADS = [
    Workload("MLP 64-128-64, N=100, b32, shared x", "sample_models/mlp.py", 100, "shared", linear_heavy=True),
    Workload("MLP 64-128-64, N=100, b32, per-member x", "sample_models/mlp.py", 100, "per_member", linear_heavy=True),
    Workload("deep MLP 8x(64 Linear+GELU), N=20, b32", "sample_models/deep_mlp.py", 20, "shared", linear_heavy=True),
    Workload("conv resblock 64ch 16x16, N=20, b8", "sample_models/resblock.py", 20, "shared"),
    Workload("transformer block d64 h4 s16, N=16, b8", "sample_models/transformer_block.py", 16, "shared"),
    Workload("GRU h64 32 steps, N=16, b8", "sample_models/gru.py", 16, "shared"),
    Workload("LSTM h64 32 steps, N=16, b8", "benchmarks/models/lstm.py", 16, "shared"),
    Workload("nn.TransformerEncoderLayer d64 h4 s16, N=16, b8", "benchmarks/models/transformer_encoder.py", 16, "shared"),
]
