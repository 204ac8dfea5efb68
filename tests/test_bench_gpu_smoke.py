"""benchmarks/gpu.py runs end to end: `--smoke` on CPU, two workloads (MLP N=100 in float32, the 2-layer encoder in bf16).

The GPU session runs the full benchmark once, with no chance to fix it there; this checks every way, the two timing
tables, the JSON and the target lines exist, with the CUDA-only ways skipped and saying why.
"""
import json

import pytest
import torch

from benchmarks import gpu

BF16_ROW = "nn.TransformerEncoder 2L d256 h8 s128, N=8, b16 [bf16]"


@pytest.mark.slow  # ~25-40 s on a 2-core machine (tracing, autotune, an aot_eager compile per row)
def test_smoke_writes_every_way_and_target(tmp_path):
    rc = gpu.main(["--device", "cpu", "--smoke", "--out", str(tmp_path),
                   "--only", "MLP 64-128-64, N=100, b32, shared", "--only", BF16_ROW])
    assert rc == 0
    md = (tmp_path / "cpu-gpu-smoke-only.md").read_text()
    data = json.loads((tmp_path / "cpu-gpu-smoke-only.json").read_text())

    names = [r["workload"] for r in data["rows"]]
    assert names == ["MLP 64-128-64, N=100, b32, shared x", BF16_ROW]
    for row in data["rows"]:
        assert set(row["ways"]) == set(gpu.WAYS)
        for way, rec in row["ways"].items():
            if way in gpu.CUDA_ONLY:
                assert rec["skipped"] == gpu.CUDA_ONLY[way]
                continue
            assert rec["error"] is None, (row["workload"], way, rec["error"])
            assert rec["throughput_ms"] > 0 and rec["latency_ms"] > 0
            assert way == "floor" or (rec["rel_err"] is not None and not rec["wrong"])
        assert row["flops"] > 0 and row["strategies"]

    for title in ("## Throughput", "## Per-call latency"):
        table = md.split(title, 1)[1].split("###", 1)[0]
        assert all(label in table for label in gpu.WAYS.values())
        assert all(name in table for name in names)
    for mode in ("throughput", "latency"):
        lines = data["targets"][mode]
        assert len(lines) >= 8 and all(t.split(":")[0] in ("MET", "NOT MET", "NOT EVALUATED") for t in lines)
        assert any(t.startswith(("MET:", "NOT MET:")) and "MLP N=100" in t for t in lines)
        assert all(f"- {t}" in md for t in lines)
    assert "skipped on every row" in md and "smoke run" in md

    bf16 = data["rows"][1]
    errs = [r["rel_err"] for r in bf16["ways"].values() if r["rel_err"] is not None]
    assert bf16["dtype"] == "bfloat16" and bf16["tuned_plan"]["dtype"] == "bfloat16"
    assert errs and all(0 < e <= 3e-2 for e in errs)  # bf16 really ran, within executor.verify's DTYPE_RTOL
    assert any("[bf16] >= 3x faster than float32" in t for t in data["targets"]["throughput"])


def test_targets_without_rows_are_not_evaluated():
    lines = gpu.targets([{"workload": "x", "skipped": "skipped: 0 s of the --budget-s left", "large": False, "dtype": "float32"}],
                        "throughput")
    assert [t.split(":")[0] for t in lines].count("NOT EVALUATED") >= 5


def _way(ms=None, **kw):
    rec = {"setup_s": 1.0, "rel_err": 1e-7, "wrong": False, "error": None, "skipped": None, "throughput_ms": ms, "latency_ms": ms}
    return {**rec, **kw}


def test_report_marks_wrong_failed_and_skipped_ways():
    """The GPU run's states that a CPU smoke run never reaches: a wrong way, a failed one, a refused capture, a skipped
    and a failed row, capture faster than auto; the report shows each and keeps them out of the ratios."""
    ways = {w: _way(10.0) for w in gpu.WAYS}
    ways["vmap"] = _way(1.0, wrong=True, rel_err=0.5)  # fastest but wrong: not the best peer
    ways["compile"] = _way(error="OutOfMemoryError: CUDA out of memory")
    ways["compile_ro"] = _way(4.0)
    ways["auto"], ways["capture"] = _way(2.0), _way(1.0)
    row = {"workload": "MLP 64-128-64, N=100, b32, shared x", "n": 100, "dtype": "float32", "large": False, "flops": 4e9,
           "strategies": "s0:vmap", "ways": ways, "error": None}
    refused = dict(row, workload="conv resblock 64ch 16x16, N=20, b8",
                   ways={**ways, "capture": _way(skipped="capture refused: ExecutionError: a host sync")})
    rows = [row, refused, {"workload": "GRU h64 32 steps, N=16, b8", "dtype": "float32", "large": False, "skipped": "skipped: 3 s left"},
            {"workload": "nn.TransformerEncoderLayer d64", "dtype": "float32", "large": False, "error": "ValueError: boom"}]
    x = gpu.ratios(row, "throughput")
    assert (x["best_peer"], x["stagewise"], x["vs_best_peer"], x["vs_loop"]) == ("compile_ro", "capture", 4.0, 10.0)
    assert x["auto_tflops"] == pytest.approx(4e9 / 2e-3 / 1e12)
    meta = {"device_name": "H100", "device": "cuda:0", "date": "d", "torch": "2.11", "cuda": "12.8", "cudnn": 9, "python": "3.12",
            "platform": "linux", "smoke": False, "peak_tflops": {"float32": 50.0, "bfloat16": 700.0}, "peak_size": 8192,
            "wall_s": 1.0, "budget_s": 480.0}
    md = gpu.markdown(rows, meta)
    assert "WRONG (5e-01) 1" in md and "| fail |" in md and "4.00x c (compile reduce-overhead)" in md
    assert "capture refused: ExecutionError: a host sync" in md and "OutOfMemoryError" in md
    assert "GRU h64 32 steps, N=16, b8: skipped: 3 s left" in md and "ValueError: boom" in md
    assert "- MET: MLP N=100" not in md  # 10x
    assert "NOT MET: MLP N=100 (shared x) >= 250x the eager loop: 10.00x" in md
    assert "NOT MET: conv resblock >= 12x the eager loop: 5.00x" in md  # capture refused: stagewise = auto
    assert "NOT EVALUATED: GRU >= 5x the eager loop" in md


def _precision() -> tuple:
    return (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision())


def test_main_puts_the_precision_flags_back(tmp_path, capsys):
    """main() turns TF32 off for its run; the flags are process-wide, so they must be as before afterwards (a pytest
    session on a GPU runs the smoke test in-process, and every later test would otherwise see cuDNN's TF32 off).
    An --only that matches nothing is an error naming the workloads (it used to end in an UnboundLocalError)."""
    before = _precision()
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("high")
        assert gpu.main(["--device", "cpu", "--smoke", "--out", str(tmp_path), "--only", "no such workload"]) == 2
        assert _precision() == (True, True, "high")
        assert "no workload matches --only ['no such workload']" in capsys.readouterr().err
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, precision = before
        torch.set_float32_matmul_precision(precision)


def test_compile_diagnostics_report_each_compile_stage_and_its_fallbacks(monkeypatch):
    """The row's diagnostics name each compile stage of the auto module with its signatures and the calls that ran as
    plain vmap instead (past MAX_SIGNATURES here)."""
    from torch import nn

    from stagewise import executor, planner
    from stagewise.executor.strategies import compiled

    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")  # the plumbing, not inductor's kernels
    monkeypatch.setattr(compiled, "MAX_SIGNATURES", 1)
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval() for _ in range(3)]
    graph = planner.trace(members[0], (torch.randn(5, 4),))
    plan = planner.set_options(planner.propose(graph, n_members=3), graph, "s0", strategy="compile")
    ens = executor.build(plan, members)
    with torch.no_grad():
        for batch in (5, 5, 7, 7):  # the second shape is past the one signature allowed: plain vmap, twice
            x = torch.randn(batch, 4)
            torch.testing.assert_close(ens(x), torch.stack([m(x) for m in members]))
    d = gpu.compile_diagnostics(ens, torch.device("cpu"))
    assert d["compile_stages"] == [{"stage": "s0", "mode": "default", "signatures": 1, "compile_s": d["compile_stages"][0]["compile_s"],
                                    "eager_calls": 2}]
