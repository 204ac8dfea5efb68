"""Plan precision (plan.dtype): the batched module at bfloat16/float16 against the float32 member loop,
within the documented tolerance (executor.verify.DTYPE_RTOL, README "Precision"); the plan field's JSON."""
from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from torch import nn

from stagewise import executor, planner
from stagewise.executor.verify import DEFAULT_RTOL, DTYPE_RTOL, resized_inputs
from stagewise.planner import EditError, Plan, PlanFileError
from conftest import SAMPLE_NAMES

N = 3


def _verify(sample, name, dtype, mode="shared", device=None):
    src, graph = sample(name)
    plan = planner.set_dtype(planner.propose(graph, n_members=N, input_mode=mode), dtype)
    inputs = executor.batched_inputs(plan, src.example_inputs)
    other = resized_inputs(plan, inputs)
    return executor.verify(plan, src.members(N), inputs, device=device, more_inputs=[other] if other else ())


@pytest.mark.parametrize("mode", ["shared", "per_member"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_low_precision_matches_float32_loop(sample, name, dtype, mode):
    report = _verify(sample, name, dtype, mode)
    assert report.rtol == DTYPE_RTOL[dtype]  # picked from the plan's dtype when rtol is not given
    assert report.ok, report.to_text()
    # the error is the precision's, not zero: the module really ran at the lower precision
    assert report.max_rel > DEFAULT_RTOL, report.to_text()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_weights_cast_once_outputs_back_in_callers_dtype(sample, dtype):
    src, graph = sample("mlp")
    plan = planner.set_dtype(planner.propose(graph, n_members=N), dtype)
    module = executor.build(plan, src.members(N))
    assert {t.dtype for t in module.stacked_state.values() if t.is_floating_point()} == {getattr(torch, dtype)}
    out = module(*src.example_inputs)
    assert out.dtype == torch.float32 and out.shape[0] == N


def test_tf32_on_cpu_is_float32(sample):
    report = _verify(sample, "mlp", "tf32")
    assert report.rtol == DTYPE_RTOL["tf32"] and report.ok and report.max_rel <= DEFAULT_RTOL, report.to_text()


def test_float16_without_a_kernel_names_the_op_and_suggests_bfloat16(sample, monkeypatch):
    src, graph = sample("mlp")
    plan = planner.set_dtype(planner.propose(graph, n_members=N), "float16")
    module = executor.build(plan, src.members(N))
    real = torch.nn.functional.linear

    def no_half(x, w, b=None):
        if x.dtype == torch.float16:
            raise RuntimeError('"addmm_impl_cpu_" not implemented for \'Half\'')
        return real(x, w, b)

    monkeypatch.setattr(torch.nn.functional, "linear", no_half)
    monkeypatch.setattr(torch._C._nn, "linear", no_half)
    with pytest.raises(planner.ExecutionError, match=r"(?s)addmm_impl_cpu_.*bfloat16"):
        module(*src.example_inputs)


# --- the plan field ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", planner.DTYPES)
def test_plan_json_round_trip(sample, dtype):
    _, graph = sample("mlp")
    plan = planner.set_dtype(planner.propose(graph, n_members=N), dtype)
    back = Plan.loads(plan.dumps())
    assert back == plan and back.dtype == dtype
    assert ("dtype" in json.loads(plan.dumps())) == (dtype != "float32")  # float32 files read as before


def test_old_plan_files_load_as_float32(sample):
    _, graph = sample("mlp")
    d = planner.propose(graph, n_members=N).to_json()
    d.pop("dtype", None)
    assert Plan.from_json(d).dtype == "float32"


def test_edits_keep_the_dtype(sample):
    _, graph = sample("mlp")
    plan = planner.set_dtype(planner.propose(graph, n_members=N), "bfloat16")
    assert plan.with_n_members(5).dtype == "bfloat16"
    assert planner.set_options(plan, graph, plan.stages[0].id, chunk_size=2).dtype == "bfloat16"


@pytest.mark.parametrize("bad", ["fp16", "half", 16, None, "Float32"])
def test_invalid_dtype_in_a_file_names_value_and_choices(sample, bad):
    _, graph = sample("mlp")
    d = planner.propose(graph, n_members=N).to_json()
    d["dtype"] = bad
    with pytest.raises(PlanFileError, match=r"(?s)unknown dtype .*float32, tf32, bfloat16, float16"):
        Plan.loads(json.dumps(d), source="p.json")


def test_set_dtype_refuses_unknown_values(sample):
    _, graph = sample("mlp")
    plan = planner.propose(graph, n_members=N)
    with pytest.raises(EditError, match=r"'fp8'.*bfloat16"):
        planner.set_dtype(plan, "fp8")


def test_stage_table_shows_the_dtype(sample):
    _, graph = sample("mlp")
    plan = planner.set_dtype(planner.propose(graph, n_members=N), "bfloat16")
    assert "dtype=bfloat16" in planner.format_stage_table(plan, graph).splitlines()[0]


# --- CUDA -----------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["tf32", "bfloat16"])
@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer_block"])
def test_cuda_precision_matches_float32_loop(sample, name, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    before = (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())
    report = _verify(sample, name, dtype, device="cuda")
    assert report.ok, report.to_text()
    assert (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()) == before  # tf32 only inside calls


# --- CLI ------------------------------------------------------------------------

def test_cli_plan_dtype_and_run_uses_its_tolerance(tmp_path, capsys):
    from stagewise.app import cli
    from conftest import SAMPLES_DIR

    out = tmp_path / "p.json"
    assert cli.main(["plan", str(SAMPLES_DIR / "mlp.py"), "-n", "3", "--dtype", "bfloat16", "-o", str(out)]) == 0
    assert "dtype=bfloat16" in capsys.readouterr().out
    assert Plan.load(out).dtype == "bfloat16"
    assert cli.main(["run", str(out), str(SAMPLES_DIR / "mlp.py")]) == 0
    text = capsys.readouterr().out
    assert "MATCH" in text and f"rtol {DTYPE_RTOL['bfloat16']:g}" in text


def test_profile_and_autotune_check_a_low_precision_plan_at_its_tolerance():
    """Stages at bfloat16 differ from the float32 loop by ~5e-3: profile and autotune must judge them at the
    plan dtype's tolerance (and the float32 baselines at float32's), not refuse every candidate."""
    from stagewise import executor, planner

    src = planner.load_model_file("sample_models/mlp.py")
    graph = planner.trace(src.model, src.example_inputs)
    plan = planner.set_dtype(planner.propose(graph, n_members=3), "bfloat16")
    members = src.members(3)
    inputs = executor.batched_inputs(plan, src.example_inputs)
    report = executor.profile(plan, members, inputs, repeats=3)
    assert all(s.result.ok for s in report.stages), [s.result.error for s in report.stages]
    assert report.end_to_end.ok and 1e-4 < report.end_to_end.max_rel_err < 3e-2
    tuned = executor.autotune(plan, members, inputs, repeats=3, strategies=["vmap", "wide", "loop"])
    assert tuned.dtype == "bfloat16" and all(s.options.note.startswith("autotune chose") for s in tuned.stages)


def test_tf32_scope_turns_tf32_on_only_for_tf32_plans_on_cuda_and_puts_it_back():
    from stagewise.executor.build import tf32_scope

    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision())
    with tf32_scope("tf32", torch.device("cuda")):  # only flags: no CUDA needed to set them
        assert torch.backends.cuda.matmul.allow_tf32 and torch.get_float32_matmul_precision() == "high"
    for dtype, device in (("float32", "cuda"), ("tf32", "cpu"), ("bfloat16", "cuda")):
        with tf32_scope(dtype, torch.device(device)):
            assert torch.backends.cuda.matmul.allow_tf32 == before[0]
    after = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision())
    assert after == before


def test_tf32_scope_works_where_the_caller_used_torchs_newer_precision_flags():
    from stagewise.executor.build import tf32_scope

    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    saved = (matmul.fp32_precision, conv.fp32_precision)
    try:
        matmul.fp32_precision, conv.fp32_precision = "tf32", "ieee"
        with pytest.raises(RuntimeError, match="mix of the legacy and new APIs"):
            torch.backends.cuda.matmul.allow_tf32  # noqa: B018 -- what torch refuses to read after such a mix
        with tf32_scope("tf32", torch.device("cuda")):
            assert (matmul.fp32_precision, conv.fp32_precision) == ("tf32", "tf32")
        assert (matmul.fp32_precision, conv.fp32_precision) == ("tf32", "ieee")
    finally:
        matmul.fp32_precision, conv.fp32_precision = saved


def test_a_call_under_autocast_warns_that_vmap_does_not_apply_it():
    """Was silent: the member loop under torch.autocast answers in bfloat16, the batched module in float32."""
    import warnings

    from stagewise.executor.build import AUTOCAST_WARNING

    members = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(2)]
    x = torch.randn(3, 8)
    ens = executor.build(planner.propose(planner.trace(members[0], (x,)), 2), members)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ens(x)
        assert not seen
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ens(x)
    assert [str(w.message) for w in seen] == [AUTOCAST_WARNING] and seen[0].filename == __file__


def test_an_op_with_no_bfloat16_kernel_is_named_as_such_not_blamed_on_the_inputs():
    """Was: InputError "check the input shapes" for torch.fft.rfft in a bfloat16 plan."""
    class Spectrum(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.fft.rfft(self.l(x)).abs()

    members = [Spectrum() for _ in range(2)]
    x = torch.randn(3, 8)
    plan = planner.set_dtype(planner.propose(planner.trace(members[0], (x,)), 2), "bfloat16")
    from stagewise.planner.errors import ExecutionError

    with pytest.raises(ExecutionError, match="does not run in bfloat16 on cpu; keep this plan float32"):
        executor.build(plan, members)(x)


class _RMSNormed(torch.nn.Module):
    """An RMSNorm as Hugging Face writes it: the variance in float32, the result cast back to the input's dtype.
    torch.export bakes the trace's dtypes (float32) into both casts and into its dtype checks."""

    def __init__(self):
        super().__init__()
        self.l, self.out = torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)

    def forward(self, x):
        h = self.l(x)
        if h.shape[0] > 1:  # a branch on a size: fx cannot trace it, torch.export can
            h = h + 1
        variance = h.to(torch.float32).pow(2).mean(-1, keepdim=True)
        return self.out((h * torch.rsqrt(variance + 1e-6)).to(h.dtype))


def _export_plan(members, x, dtype):
    graph = planner.trace(members[0], (x,))
    assert graph.tracer == "export"
    return planner.set_dtype(planner.propose(graph, len(members)), dtype)


def _low_loop(members, dtype, *inputs):
    """Each member cast to `dtype` and run on its own: what eager forward() computes in that dtype."""
    import copy

    cast = [t.to(getattr(torch, dtype)) if t.is_floating_point() else t for t in inputs]
    with torch.no_grad():
        return torch.stack([copy.deepcopy(m).to(getattr(torch, dtype))(*cast) for m in members])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_low_precision_plan_of_an_export_graph_casts_where_forward_would_in_that_dtype(dtype):
    """Was: ExecutionError (a Hugging Face Llama in bfloat16): torch.export baked the cast back to the input's dtype
    (float32 at trace time) into the graph, and float32 values met the low-precision weights. The dtypes are now
    those of a trace in the plan's dtype: the module computes what each member cast to that dtype computes."""
    torch.manual_seed(0)
    members = [_RMSNormed() for _ in range(N)]
    x = torch.randn(3, 8)
    plan = _export_plan(members, x, dtype)
    with torch.no_grad():
        got = executor.build(plan, members)(x)
    assert got.dtype == torch.float32  # back in the caller's dtype
    torch.testing.assert_close(got, _low_loop(members, dtype, x).float(), rtol=0, atol=2e-2 if dtype == "bfloat16" else 2e-3)
    report = executor.verify(plan, members, (x,), grads=True)
    assert report.ok, report.to_text()


class _Rotary(torch.nn.Module):
    """Positions up to 1000 in float32 on purpose (bfloat16 holds integers exactly only up to 256), the result cast
    to the activations' dtype: a cast-everything-to-the-plan's-dtype rule would compute the angles in bfloat16."""

    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(8, 8)
        self.register_buffer("inv_freq", 1.0 / 10.0 ** torch.arange(0, 8, dtype=torch.float32), persistent=False)

    def forward(self, x):
        h = self.l(x)
        if h.shape[0] > 1:
            h = h * 2
        pos = torch.arange(1000 - h.shape[-2], 1000, device=h.device).float()
        angles = pos[:, None] * self.inv_freq.float()[None, :]
        return h * angles.cos().to(h.dtype)


def test_a_models_own_float32_upcasts_stay_float32_in_a_bfloat16_plan():
    torch.manual_seed(0)
    members = [_Rotary() for _ in range(N)]
    x = torch.randn(4, 5, 8)
    plan = _export_plan(members, x, "bfloat16")
    with torch.no_grad():
        got = executor.build(plan, members)(x)
        want = torch.stack([m(x) for m in members])
    torch.testing.assert_close(got, _low_loop(members, "bfloat16", x).float(), rtol=0, atol=3e-2)
    # angles of ~1000 rad in bfloat16 would be off by up to 2 rad: cos off by O(1), not by bfloat16's rounding
    assert (got - want).abs().max() < 0.1 * want.abs().max()


class _Exported(torch.nn.Module):
    """A Linear, then a branch on a size, which fx cannot trace and torch.export can; subclasses say what follows."""

    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(8, 8)

    def trunk(self, x):
        h = self.q(x)
        if h.shape[0] > 1:
            h = h + 1
        return h


class _ScaledAttention(_Exported):
    """DeBERTa's `torch.tensor(head_dim, dtype=torch.float)` made in forward(): float32 in eager whatever the model's
    dtype, and torch.export checks it is, so the batched module must not cast it with the weights."""

    def forward(self, x):
        h = self.trunk(x)
        scale = torch.sqrt(torch.tensor(h.size(-1), dtype=torch.float) * 2)
        return h / scale.to(dtype=h.dtype)


def test_a_float32_constant_forward_makes_stays_float32_in_a_bfloat16_plan():
    """Was: 'Tensor dtype mismatch! Expected: Float, Got: BFloat16': build's cast reached the graph's constant."""
    torch.manual_seed(0)
    members = [_ScaledAttention() for _ in range(N)]
    x = torch.randn(3, 8)
    plan = _export_plan(members, x, "bfloat16")
    ens = executor.build(plan, members)
    with torch.no_grad():
        got = ens(x)
    torch.testing.assert_close(got, _low_loop(members, "bfloat16", x).float(), rtol=0, atol=2e-2)
    ens.to("cpu")  # moved, not cast, by .to(): still float32, still runs
    with torch.no_grad():
        torch.testing.assert_close(ens(x), got)


class _BranchesOnDtype(_RMSNormed):
    """T5's layer norm: an extra cast only when the weights are low precision. The two traces are then different
    programs; a rewrite of one by the other could mismatch nodes, so none is made and the error says why."""

    def forward(self, x):
        h = self.l(x)
        if h.shape[0] > 1:
            h = h + 1
        if self.out.weight.dtype == torch.bfloat16:
            h = h.to(self.out.weight.dtype) * 1.0
        variance = h.to(torch.float32).pow(2).mean(-1, keepdim=True)
        return self.out((h * torch.rsqrt(variance + 1e-6)).to(h.dtype))


def test_a_model_tracing_to_another_program_in_the_plans_dtype_says_so():
    from stagewise.planner.errors import ExecutionError

    members = [_BranchesOnDtype() for _ in range(2)]
    x = torch.randn(3, 8)
    plan = _export_plan(members, x, "bfloat16")
    with pytest.raises(ExecutionError, match="traced member 0 again in bfloat16 to take its dtypes, but its trace in "
                                             "torch.bfloat16 is another program: at node"):
        executor.build(plan, members)(x)


class _MaskedSweep(_Exported):
    """A number per member (an eps sweep) and an additive mask of torch.finfo(dtype).min, no cast of its own."""

    def __init__(self, eps):
        super().__init__()
        self.eps = eps

    def per_member(self, h):
        return h / (h.abs().mean(-1, keepdim=True) + self.eps)

    def forward(self, x, mask):
        h = self.trunk(x)
        h = self.per_member(h)
        scores = h @ h.transpose(-1, -2)
        scores = scores + (1.0 - mask) * torch.finfo(scores.dtype).min
        return scores.softmax(-1) @ h


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_members_differing_in_a_number_keep_their_own_in_a_low_precision_export_plan(dtype):
    """Was (review of the dtype rewrite): NaN for members 1 and 2, no error. The members' numbers were compared after
    member 0's graph took the low-precision trace's, so float32's finfo.min counted as a per-member difference and
    became -inf in the plan's dtype."""
    torch.manual_seed(0)
    members = [_MaskedSweep(eps) for eps in (0.5, 0.25, 1.0)]
    x, mask = torch.randn(2, 5, 8), torch.ones(2, 1, 5)
    mask[:, :, 3:] = 0
    plan = planner.set_dtype(planner.propose(planner.trace(members[0], (x, mask)), N), dtype)
    with torch.no_grad():
        got = executor.build(plan, members)(x, mask)
    assert not got.isnan().any()
    torch.testing.assert_close(got, _low_loop(members, dtype, x, mask).float(), rtol=0,
                               atol=3e-2 if dtype == "bfloat16" else 5e-3)


class _UpcastWithoutGrad(_Exported):
    def forward(self, x):
        h = self.trunk(x)
        with torch.no_grad():  # torch.export keeps the region as a graph of its own
            s = h.float().pow(2).mean(-1, keepdim=True).to(h.dtype)
        return h * s


def test_an_upcast_inside_a_no_grad_region_is_another_program_in_bfloat16_and_says_so():
    """The region hands out two values in the float32 trace (`h.float()` is `h` there) and one in the bfloat16 trace:
    not one program, so nothing is taken, and the float32 dtypes left in the graph fail loudly, naming the region."""
    from stagewise.planner.errors import ExecutionError

    members = [_UpcastWithoutGrad() for _ in range(N)]
    x = torch.randn(3, 8)
    plan = _export_plan(members, x, "bfloat16")
    with torch.no_grad(), pytest.raises(ExecutionError, match=r"is another program: in submod_\d+: output takes other"):
        executor.build(plan, members)(x)


class _DtypeMin(_Exported):
    """HF's padding mask: a tensor of torch.finfo(dtype).min, made in forward(), with a fully masked row."""

    def forward(self, x, mask):
        h = self.trunk(x)
        scores = h @ h.transpose(-1, -2)
        return torch.where(mask > 0, scores, torch.tensor(torch.finfo(scores.dtype).min, dtype=scores.dtype)).softmax(-1) @ h


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_tensor_constant_whose_value_depends_on_the_dtype_takes_the_plans(dtype):
    """Was: float32's finfo.min kept as the constant, -inf in float16, NaN for the fully masked row; and verify
    failed the boundary holding it (float16's min against float32's) where every output matched."""
    torch.manual_seed(0)
    members = [_DtypeMin() for _ in range(N)]
    x, mask = torch.randn(2, 5, 8), torch.ones(2, 5, 5)
    mask[:, 4, :] = 0
    plan = planner.set_dtype(planner.propose(planner.trace(members[0], (x, mask)), N), dtype)
    with torch.no_grad():
        got = executor.build(plan, members)(x, mask)
    assert not got.isnan().any()
    torch.testing.assert_close(got, _low_loop(members, dtype, x, mask).float(), rtol=0,
                               atol=5e-2 if dtype == "bfloat16" else 5e-3)
    report = executor.verify(plan, members, (x, mask))
    assert report.ok, report.to_text()


class _PowSweep(_MaskedSweep):
    """An exponent per member (lifted to pow.Tensor_Tensor), and the finfo(dtype).min mask."""

    def per_member(self, h):
        return h.abs() ** self.eps


def test_a_number_lifted_per_member_into_another_op_form_still_takes_the_plans_dtypes():
    """Review: the lifted exponent made pow.Tensor_Scalar pow.Tensor_Tensor, the traces no longer paired, the rewrite
    was dropped without a word, and float32's finfo.min became -inf: 120 NaN in the fully masked row."""
    torch.manual_seed(0)
    members = [_PowSweep(p) for p in (1.0, 0.5, 2.0)]
    x, mask = torch.randn(2, 5, 8), torch.ones(2, 1, 5)
    mask[1] = 0
    plan = planner.set_dtype(planner.propose(planner.trace(members[0], (x, mask)), N), "bfloat16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # taken: nothing to warn of
        with torch.no_grad():
            got = executor.build(plan, members)(x, mask)
    assert not got.isnan().any()
    want = _low_loop(members, "bfloat16", x, mask).float()
    assert (got - want).abs().max() < 0.05 * want.abs().max()


class _ElementSized(_Exported):
    def forward(self, x):
        h = self.trunk(x)
        return h * h.element_size()  # 4 at float32, 2 at bfloat16: an int the dtype decides


def test_a_low_precision_export_plan_whose_dtypes_cannot_be_taken_warns_at_build():
    """Review: ×4 where eager bfloat16 gives ×2, silently (no float or dtype constant: the second trace was skipped)."""
    members = [_ElementSized() for _ in range(N)]
    x = torch.randn(3, 8)
    plan = _export_plan(members, x, "bfloat16")
    with pytest.warns(UserWarning, match=r"traced member 0 again in bfloat16 .* but its trace in torch.bfloat16 is another "
                                         r"program: mul takes other arguments"):
        executor.build(plan, members)


class _ScaledSweep(_Exported):
    def __init__(self, t):
        super().__init__()
        self.t = t

    def forward(self, x):
        h = self.trunk(x)
        return h / torch.sqrt(torch.tensor(self.t, dtype=torch.float)).to(h.dtype)


def test_a_float32_constant_members_make_differently_stays_float32_in_a_bfloat16_plan():
    """Review: 'Tensor dtype mismatch! Expected: Float': the per-member copies in the stacked state were cast."""
    torch.manual_seed(0)
    members = [_ScaledSweep(t) for t in (2.0, 3.0, 5.0)]
    x = torch.randn(4, 8)
    plan = _export_plan(members, x, "bfloat16")
    ens = executor.build(plan, members)
    with torch.no_grad():
        got = ens(x)
        torch.testing.assert_close(got, _low_loop(members, "bfloat16", x).float(), rtol=0, atol=3e-2)
        ens.to("cpu")
        torch.testing.assert_close(ens(x), got)


class _CountsIn(torch.nn.Module):
    """Integer counts made float32 in forward() (`x.float()`) and handed to a Linear: in bfloat16 the member fails too."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 2)

    def forward(self, x):
        h = x.float()
        if h.shape[0] > 1:
            h = h + 1
        return self.fc(h)


def test_a_float32_cast_in_forward_before_a_layer_is_named_not_blamed_on_a_converted_state():
    """Was: "its state is no longer in that dtype (converted since build...)", which nothing had done."""
    members = [_CountsIn() for _ in range(N)]
    x = torch.randint(0, 5, (3, 8))
    ens = executor.build(_export_plan(members, x, "bfloat16"), members)
    with pytest.raises(Exception):  # as eager forward() of a member in bfloat16 fails
        copy.deepcopy(members[0]).to(torch.bfloat16)(x)
    with torch.no_grad(), pytest.raises(planner.ExecutionError, match=r"forward\(\) makes float32 values itself .* member 0 cast "
                                                                      r"to bfloat16 .* fails alike; cast to the weights' dtype"):
        ens(x)
    ens.double()  # a state converted since build keeps its own message
    with torch.no_grad(), pytest.raises(planner.ExecutionError, match="its state is no longer in that dtype"):
        ens(x)


def test_a_low_precision_plans_module_converted_with_float_runs_in_float32():
    """Was: every call failed ("expected scalar type Float but found BFloat16 ... check the input shapes"): the
    inputs still entered in bfloat16 while the state was float32."""
    members = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)) for _ in range(N)]
    x = torch.randn(5, 8)
    plan = planner.set_dtype(planner.propose(planner.trace(members[0], (x,)), N), "bfloat16")
    ens = executor.build(plan, members).float()
    rounded = [copy.deepcopy(m).to(torch.bfloat16).float() for m in members]  # the state as build cast it, then widened
    with torch.no_grad():
        torch.testing.assert_close(ens(x), torch.stack([m(x) for m in rounded]))


class _ImageIn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c = torch.nn.Conv2d(3, 4, 3)

    def forward(self, img):
        return self.c(img.float() / 255).mean((2, 3))  # uint8 images made float32 in forward()


def test_a_float32_cast_in_forward_of_an_fx_low_precision_plan_is_named():
    """Was: "Input type (float) and bias type (c10::BFloat16) should be the same ... Check the input shapes"."""
    members = [_ImageIn() for _ in range(N)]
    img = torch.randint(0, 255, (2, 3, 8, 8), dtype=torch.uint8)
    graph = planner.trace(members[0], (img,))
    assert graph.tracer == "fx"
    ens = executor.build(planner.set_dtype(planner.propose(graph, N), "bfloat16"), members)
    with torch.no_grad(), pytest.raises(planner.ExecutionError, match=r"forward\(\) makes float32 values itself"):
        ens(img)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_verify_grads_takes_a_zero_gradient_at_the_plans_precision(dtype):
    """The Linear bias before a training-mode BatchNorm has a zero gradient in exact arithmetic; at low precision it
    comes out as rounding noise of a few 1e-3 of the member's gradient, which verify measured against float32's floor."""
    n = 5
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4)).train() for _ in range(n)]
    x = torch.randn(32, 8) + 3.0
    plan = planner.set_dtype(planner.propose(planner.trace(members[0], (x,)), n), dtype)
    report = executor.verify(plan, members, (x,), grads=True)
    assert report.ok, [(r.name, r.max_rel) for r in report.gradients if not r.ok]


class AutocastInside(nn.Module):
    """A model that runs its own body under torch.autocast (bfloat16 on CPU)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.fc2(torch.relu(self.fc1(x)))


def test_an_autocast_region_inside_forward_runs_as_each_member_runs_it():
    torch.manual_seed(0)
    members = [AutocastInside() for _ in range(3)]
    x = torch.randn(5, 8)
    plan = planner.propose(planner.trace(copy.deepcopy(members[0]), (x,)), 3)
    ens = executor.build(plan, members)
    with torch.no_grad():
        got, want = ens(x), torch.stack([m(x) for m in members])
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_low_precision_plan_says_it_keeps_updated_state_in_its_dtype():
    torch.manual_seed(0)
    make = lambda: nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16, momentum=0.01), nn.ReLU()).train()  # noqa: E731
    members = [make() for _ in range(3)]
    x = torch.randn(32, 8)
    plan = planner.propose(planner.trace(members[0], (x,)), 3)
    with pytest.warns(UserWarning, match=r"keeps the state forward\(\) updates in bfloat16.*1.running_mean"):
        executor.build(planner.set_dtype(plan, "bfloat16"), members)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        executor.build(plan, members)  # float32: nothing to say
        frozen = [nn.Sequential(nn.Linear(8, 16), nn.ReLU()) for _ in range(3)]
        executor.build(planner.set_dtype(planner.propose(planner.trace(frozen[0], (x,)), 3), "bfloat16"), frozen)


def test_a_low_precision_plan_of_eval_batchnorm_says_nothing_of_state():
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU()).eval() for _ in range(3)]
    x = torch.randn(32, 8)
    plan = planner.set_dtype(planner.propose(planner.trace(members[0], (x,)), 3), "bfloat16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        executor.build(plan, members)


def test_a_low_precision_plan_built_in_eval_says_it_when_trained():
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU()).eval() for _ in range(3)]
    x = torch.randn(32, 8)
    ens = executor.build(planner.set_dtype(planner.propose(planner.trace(members[0], (x,)), 3), "bfloat16"), members)
    with pytest.warns(UserWarning, match="keeps the state forward"):
        ens.train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ens.eval()
        ens.train()  # once


def test_members_already_in_the_plans_low_precision_are_named_with_the_fix():
    """A 'made for another model, re-plan' refusal before: the plan casts float32 members itself."""
    members = [torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)) for _ in range(2)]
    x = torch.randn(3, 4)
    plan = planner.set_dtype(planner.propose(planner.trace(members[0], (x,)), 2), "bfloat16")
    with pytest.raises(planner.PlanMismatchError, match=r"in bfloat16 already.*Pass the float32 members"):
        executor.build(plan, [m.bfloat16() for m in members])
