"""Silent wrong answers on the less-reviewed surfaces: verify's comparison, member weights saved and loaded,
hand-edited plan files, n_sweep's answers, and the member axis sharded over ranks (gloo on CPU).

Every probe is a regression test: the batched answer equals the member loop, or a clear StagewiseError.
This file run as a script is one rank of the distributed job (`python tests/test_review_surfaces.py RANK WORLD PORT OUT`).
"""
from __future__ import annotations

import copy
import importlib
import json
import os
import socket
import subprocess
import sys
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch import nn

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from stagewise import executor, planner  # noqa: E402
from stagewise.executor.stages import RUNNERS, VmapRunner  # noqa: E402
from stagewise.executor.values import Batched  # noqa: E402
from stagewise.planner.plan import Strategy  # noqa: E402

verify_module = importlib.import_module("stagewise.executor.verify")


# ---- verify: does it ever say MATCH when the batched outputs differ? ------------------------------

class Scaled(nn.Module):
    """A sweep of output scales: member outputs differ by orders of magnitude."""

    def __init__(self, scale: float):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("scale", torch.tensor(scale))

    def forward(self, x):
        return self.fc(x) * self.scale


class Ids(nn.Module):
    """Integer outputs: the argmax over a large vocabulary, plus a bool mask."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 30000)

    def forward(self, x):
        y = self.fc(x)
        return y.argmax(-1), y.max(-1).values > 0


class TwoLeaves(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        return {"y": y, "z": y.log()}  # log of negative values: nan in both the loop and the batched module


def _plan(members, inputs, mode="shared"):
    return planner.propose(planner.trace(members[0], inputs), len(members), input_mode=mode)


class TamperedRunner(VmapRunner):
    """A vmap runner whose output is wrong for one member only, by `how`."""

    how = staticmethod(lambda t: t)

    def run(self, args):
        return [Batched(type(self).how(v.tree)) for v in super().run(args)]


def tampered(monkeypatch, how):
    cls = type("Tampered", (TamperedRunner,), {"how": staticmethod(how)})
    monkeypatch.setitem(RUNNERS, Strategy.VMAP, cls)


def test_a_wrong_small_member_next_to_a_large_one_is_a_mismatch(monkeypatch):
    """Normwise over all members, member 1's outputs (1e-6 of member 0's) could be entirely wrong and pass."""
    torch.manual_seed(0)
    members = [Scaled(1e3).eval(), Scaled(1e-3).eval(), Scaled(1.0).eval()]
    x = torch.randn(4, 8)
    plan = _plan(members, (x,))
    assert executor.verify(plan, members, (x,)).ok

    def zero_member_1(t):
        t = t.clone()
        t[1] = 0
        return t

    tampered(monkeypatch, zero_member_1)
    report = executor.verify(plan, members, (x,))
    assert not report.ok and not report.outputs[0].ok and report.outputs[0].max_rel == pytest.approx(1.0)


def test_integer_outputs_must_be_equal(monkeypatch):
    """An argmax id off by one among ids up to 30000 is a relative error of 3e-5 < 1e-4: it passed."""
    torch.manual_seed(0)
    members = [Ids().eval() for _ in range(2)]
    x = torch.randn(5, 8)
    plan = _plan(members, (x,))
    assert executor.verify(plan, members, (x,)).ok
    real = verify_module.build

    def build(*args, **kwargs):  # the batched module returns one id off by one
        module = real(*args, **kwargs)
        forward = module.forward

        def wrong(*a):
            ids, mask = forward(*a)
            ids = ids.clone()
            ids[1, 0] += 1
            return ids, mask
        module.forward = wrong
        module.run_stages = lambda *a, keep=False, run=None: (wrong(*a), real_env(module, a, keep))
        return module

    def real_env(module, a, keep):
        return type(module).run_stages(module, *a, keep=keep)[1]

    monkeypatch.setattr(verify_module, "build", build)
    report = executor.verify(plan, members, (x,))
    assert not report.ok
    ids_rows = [r.ok for r in report.outputs if "out[0]" in r.name]
    assert len(ids_rows) >= 2 and not any(ids_rows)
    assert all(r.ok for r in report.outputs if "out[1]" in r.name)


def test_compare_integers_bools_complex_nan_and_inf():
    cmp = verify_module.compare
    assert not cmp("v", torch.tensor([20000, 5]), torch.tensor([20000, 6]), 1e-4)[0].ok
    big = 2 ** 60
    assert not cmp("v", torch.tensor([big]), torch.tensor([big + 1]), 1e-4)[0].ok  # not equal as doubles
    assert not cmp("v", torch.tensor([True, False]), torch.tensor([True, True]), 1e-4)[0].ok
    assert cmp("v", torch.tensor([True, False]), torch.tensor([True, False]), 0.0)[0].ok
    assert not cmp("v", torch.tensor([1 + 1j]), torch.tensor([1 + 2j]), 1e-4)[0].ok  # double() dropped the imaginary part
    nan, inf = float("nan"), float("inf")
    assert cmp("v", torch.tensor([nan, inf, -inf, 1.0]), torch.tensor([nan, inf, -inf, 1.0]), 1e-4)[0].ok
    assert not cmp("v", torch.tensor([nan, 1.0]), torch.tensor([0.0, 1.0]), 1e-4)[0].ok
    assert not cmp("v", torch.tensor([0.0, 1.0]), torch.tensor([nan, 1.0]), 1e-4)[0].ok
    assert not cmp("v", torch.tensor([inf, 1.0]), torch.tensor([-inf, 1.0]), 1e-4)[0].ok
    assert not cmp("v", torch.tensor([1.0, 1.0]), torch.tensor([inf, 1.0]), 1e-4)[0].ok
    assert cmp("v", torch.zeros(0, 3), torch.zeros(0, 3), 1e-4)[0].ok
    assert not cmp("v", torch.zeros(2, 0), torch.zeros(0, 2), 1e-4)[0].ok
    # a zero loop output: the error is absolute
    assert not cmp("v", torch.full((2,), 1e-3), torch.zeros(2), 1e-4)[0].ok


def test_nan_in_the_loop_and_the_batched_module_alike_matches_one_wrong_leaf_does_not(monkeypatch):
    torch.manual_seed(0)
    members = [TwoLeaves().eval() for _ in range(3)]
    x = torch.randn(4, 8)
    plan = _plan(members, (x,))
    report = executor.verify(plan, members, (x,))
    assert report.ok, report.to_text()

    def shift_member_2(t):
        t = t.clone()
        t[2] += 1.0
        return t

    tampered(monkeypatch, shift_member_2)
    report = executor.verify(plan, members, (x,))
    assert not report.ok


def test_a_dropped_output_leaf_is_a_mismatch(monkeypatch):
    """Leaves were compared for as many as the batched module returned: one it dropped went unchecked."""
    torch.manual_seed(0)
    members = [TwoLeaves().eval() for _ in range(2)]
    x = torch.randn(4, 8)
    plan = _plan(members, (x,))
    real = verify_module.build

    def build(*args, **kwargs):
        module = real(*args, **kwargs)
        real_run = module.run_stages

        def fewer(*a, keep=False, run=None):
            out, env = real_run(*a, keep=keep, run=run)
            return {"y": out["y"]}, env
        module.run_stages = fewer
        return module

    monkeypatch.setattr(verify_module, "build", build)
    report = executor.verify(plan, members, (x,))
    assert not report.ok and "1 output leaves" in report.outputs[0].name


def test_members_equal_to_each_other_still_match():
    torch.manual_seed(0)
    one = Scaled(2.0).eval()
    members = [copy.deepcopy(one) for _ in range(3)]
    x = torch.randn(4, 8)
    assert executor.verify(_plan(members, (x,)), members, (x,)).ok




# ---- member weights out of a trained batched module ----------------------------------------------------------

class SweepTied(nn.Module):
    """A sweep (a per-member Python scale, lifted into per-member state), tied weights, BatchNorm statistics."""

    def __init__(self, scale: float):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 20, bias=False)
        self.head.weight = self.emb.weight
        nn.init.uniform_(self.bn.bias, -0.5, 0.5)
        self.scale = scale

    def forward(self, t):
        return self.head(self.bn(self.emb(t).mean(1)) * self.scale)


def test_saved_member_weights_of_a_trained_sweep_load_into_the_members_and_answer_like_the_loop(tmp_path):
    from safetensors.torch import load_file

    scales = (0.5, 1.0, 2.0)
    members = _seeded(lambda i: SweepTied(scales[i]), 3)
    t = torch.randint(0, 20, (3, 6, 5), generator=torch.Generator().manual_seed(1))
    plan = _plan(members, (t[0],), "per_member")
    ens = executor.build(plan, copy.deepcopy(members)).train()
    loop = [copy.deepcopy(m).train() for m in members]
    lrs = [0.05, 0.1, 0.2]
    opt = executor.StackedSGD(ens.parameters(), 3, lr=lrs, momentum=0.9)
    opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9) for m, lr in zip(loop, lrs)]
    for _ in range(2):
        opt.zero_grad()
        (ens(t) ** 2).mean(dim=(1, 2)).sum().backward()
        opt.step()
        for i, (m, o) in enumerate(zip(loop, opts)):
            o.zero_grad()
            (m(t[i]) ** 2).mean().backward()
            o.step()
    paths = executor.save_member_weights(ens, tmp_path)
    for i, path in enumerate(paths):
        fresh = SweepTied(scales[i])
        fresh.load_state_dict(load_file(str(path)))
        assert fresh.head.weight is fresh.emb.weight
        for k, v in loop[i].state_dict().items():
            torch.testing.assert_close(fresh.state_dict()[k], v, rtol=1e-5, atol=1e-6)
        with torch.no_grad():
            torch.testing.assert_close(fresh.eval()(t[i]), loop[i].eval()(t[i]), rtol=1e-5, atol=1e-6)


# ---- members that differ in a leaf module's setting (closed, or opened), in eval and training -------------

class Holder(nn.Module):
    def __init__(self, mod: nn.Module):
        super().__init__()
        self.m = mod

    def forward(self, x):
        return self.m(x)


def _enc(**kw):
    return nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, **kw)


@pytest.mark.parametrize("first, other, shape, train, opened", [
    (lambda: nn.Conv2d(3, 4, 3), lambda: nn.Conv2d(3, 4, 3, stride=2), (2, 3, 8, 8), False, ()),
    (lambda: nn.Conv2d(3, 4, 3, padding=1), lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), (2, 3, 8, 8), False, ()),
    (lambda: nn.BatchNorm2d(3), lambda: nn.BatchNorm2d(3, momentum=0.5), (2, 3, 8, 8), True, ()),
    (lambda: nn.GELU(), lambda: nn.GELU(approximate="tanh"), (2, 8), False, ()),
    (lambda: nn.Embedding(10, 4, padding_idx=0), lambda: nn.Embedding(10, 4, padding_idx=3), (2, 5), True, ()),
    (lambda: nn.LayerNorm(8), lambda: nn.LayerNorm(8, eps=1.0), (2, 8), False, ("m",)),
    (lambda: _enc(), lambda: _enc(norm_first=True), (2, 5, 8), False, ("m",)),
    (lambda: _enc(), lambda: _enc(activation="gelu"), (2, 5, 8), False, ("m",)),
], ids=["conv_stride", "conv_padding_mode", "bn_momentum_train", "gelu_approximate", "embedding_padding_idx_train",
        "layernorm_eps_opened", "encoder_norm_first_opened", "encoder_activation_opened"])
def test_members_that_differ_in_a_leaf_setting_are_refused(first, other, shape, train, opened):
    torch.manual_seed(0)
    members = [Holder(first()).train(train), Holder(other()).train(train)]
    x = torch.randint(0, 10, shape) if len(shape) == 2 and "Embedding" in type(members[0].m).__name__ else torch.randn(*shape)
    plan = planner.propose(planner.trace(members[0], (x,), open_modules=list(opened)), 2)
    with pytest.raises(planner.StagewiseError, match="members differ|another graph"):
        executor.build(plan, members)


# ---- plan files edited by hand: a correct answer or a clear error ------------------------------------------

def _edited(plan, edit):
    d = json.loads(plan.dumps())
    edit(d)
    return planner.Plan.loads(json.dumps(d))


def _set_all(key, value):
    def edit(d):
        for st in d["stages"]:
            st["options"][key] = value
    return edit


def _move_last_node_of_s0_to_s1(d):
    d["stages"][1]["nodes"].insert(0, d["stages"][0]["nodes"].pop())


def _first_node_into_last_stage(d):
    d["stages"][-1]["nodes"].append(d["stages"][0]["nodes"].pop(0))


def _flip_inputs(d):
    for i in d["inputs"]:
        i["mode"] = "per_member"


@pytest.mark.parametrize("edit, error", [
    (lambda d: d["stages"].reverse(), None),
    (_move_last_node_of_s0_to_s1, None),
    (_set_all("chunk_size", 7), None),
    (_set_all("chunk_size", 2), None),
    (_flip_inputs, None),
    (_set_all("strategy", "wide"), "item"),  # the .item() stage cannot run batched: named, not answered
    (_first_node_into_last_stage, "not convex"),
    (_set_all("chunk_size", 0), "chunk_size"),
    (_set_all("strategy", "fast"), "unknown strategy"),
], ids=["reordered", "node_moved", "chunk_over_n", "chunk_2", "inputs_per_member", "wide_on_item", "not_convex",
        "chunk_0", "unknown_strategy"])
def test_hand_edited_plans_match_the_loop_or_fail_clearly(edit, error):
    from conftest import load_sample

    src, graph = load_sample("data_dependent")  # batched | .item() | batched | branch | batched
    plan = planner.propose(graph, 3)
    if error is None:
        edited = _edited(plan, edit)
        report = executor.verify(edited, src.members(3), executor.batched_inputs(edited, src.example_inputs))
        assert report.ok, report.to_text()
        return
    with pytest.raises(planner.StagewiseError, match=error):
        edited = _edited(plan, edit)
        executor.verify(edited, src.members(3), executor.batched_inputs(edited, src.example_inputs))


# ---- the member axis over ranks (gloo on CPU, 127.0.0.1): one job of 2 ranks, N=3 (slices 0-1 and 2) -------

JOB_LIMIT_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks")
    port, world = _free_port(), 2
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1",
           "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT.parent), os.environ.get("PYTHONPATH")]))}  # the caller's path too (make test-gpu imports the checkout through it)
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(world), str(port), str(out)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    deadline, logs = time.monotonic() + JOB_LIMIT_S, []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"a rank hung past {JOB_LIMIT_S}s")
    results = []
    for r in range(world):
        path = out / f"rank{r}.json"
        assert path.is_file(), f"rank {r} wrote nothing:\n{logs[r][-3000:]}"
        results.append(json.loads(path.read_text()))
    return results


def _scenario(results, name):
    got = []
    for r, res in enumerate(results):
        assert name in res, f"rank {r} has no result for {name!r}: {res.get('_stopped', '')}"
        assert "unexpected" not in res[name], f"rank {r}, {name}:\n{res[name]['unexpected']}"
        got.append(res[name])
    return got


def test_sharded_python_value_outputs_that_differ_across_ranks_are_refused(two_ranks):
    """Members 0-1 return k=1, member 2 k=2: each rank's members agree, so each rank built; gather/mean
    returned the rank's own k as every member's (one process refuses these members at build)."""
    for res in _scenario(two_ranks, "python value output"):
        assert res["gather"]["error"] == "DistributedError" and "differ" in res["gather"]["message"], res
        assert res["mean"]["error"] == "DistributedError", res


def test_sharded_python_value_outputs_that_agree_pass_through(two_ranks):
    for res in _scenario(two_ranks, "python value output, equal"):
        assert res["k"] == 3 and res["vs_loop"] <= 1e-5, res


def test_sharded_outputs_of_another_shape_per_rank_are_refused(two_ranks):
    for res in _scenario(two_ranks, "shape differs across ranks"):
        assert res["error"] == "DistributedError", res


def test_sharded_dict_outputs_per_member_inputs_gather_and_mean_like_the_loop(two_ranks):
    results = _scenario(two_ranks, "dict outputs")
    assert [r["members"] for r in results] == [[0, 1], [2]]
    for res in results:
        assert res["gather"] <= 1e-5 and res["mean"] <= 1e-5 and res["keys"] == ["y", "z"], res


def test_sharded_training_and_checkpoint_of_tied_weights_and_batchnorm_equal_the_loop(two_ranks):
    for res in _scenario(two_ranks, "train and checkpoint"):
        assert res["trained_vs_loop"] <= 1e-5, res
        assert res["loaded_vs_loop"] <= 1e-5 and res["loaded_out_vs_loop"] <= 1e-5, res
        assert res["tie_kept"] and res["files_vs_loop"] <= 1e-5, res


def test_verify_sharded_with_per_member_inputs(two_ranks):
    for res in _scenario(two_ranks, "verify_sharded"):
        assert res["ok"] and res["ranks"] == [[0, 2], [2, 3]], res


# ---- the rank side ----------------------------------------------------------------------------------------

class PyOut(nn.Module):
    def __init__(self, k: int):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.k = k

    def forward(self, x):
        return self.fc(x), self.k


class Reshape(nn.Module):
    def __init__(self, k: int):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.k = k

    def forward(self, x):
        return self.fc(x).reshape(x.shape[0], self.k, -1)


class DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        return {"y": y, "z": y.sum(-1)}


class TiedBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 20, bias=False)
        self.head.weight = self.emb.weight
        nn.init.uniform_(self.bn.bias, -0.5, 0.5)  # a zero bias gets a zero gradient here (noise, relatively)

    def forward(self, t):
        return self.head(self.bn(self.emb(t).mean(1)))


def _rel(a, b) -> float:
    return (a.double() - b.double()).abs().max().item() / max(b.double().abs().max().item(), 1e-12)


def _error_of(fn) -> dict:
    try:
        fn()
    except Exception as e:  # the point: which error and what it says
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None, "message": ""}


def _seeded(make, n):
    out = []
    for i in range(n):
        torch.manual_seed(100 + i)
        out.append(make(i))
    return out


def _python_value(equal: bool) -> dict:
    from stagewise.executor.distributed import build_sharded

    members = _seeded(lambda i: PyOut(3 if equal else (1 if i < 2 else 2)).eval(), 3)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    plan = _plan(members[:1] * 3, (x,))
    sharded = build_sharded(plan, members)
    with torch.no_grad():
        out = sharded(x)
        if not equal:
            return {"gather": _error_of(lambda: sharded.gather(out)), "mean": _error_of(lambda: sharded.mean(out))}
        y, k = sharded.gather(out)
        loop = torch.stack([m(x)[0] for m in members])
    return {"k": k, "vs_loop": _rel(y, loop)}


def _shape_differs() -> dict:
    from stagewise.executor.distributed import build_sharded

    members = _seeded(lambda i: Reshape(2 if i < 2 else 4).eval(), 3)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    sharded = build_sharded(_plan(members[:1] * 3, (x,)), members)
    with torch.no_grad():
        out = sharded(x)
        return _error_of(lambda: sharded.gather(out))


def _dict_outputs() -> dict:
    from stagewise.executor.distributed import build_sharded

    members = _seeded(lambda i: DictOut().eval(), 3)
    x = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(0))
    plan = _plan(members, (x[0],), "per_member")
    sharded = build_sharded(plan, members)
    with torch.no_grad():
        out = sharded(x)
        gathered, mean = sharded.gather(out), sharded.mean(out)
        loop = [m(x[i]) for i, m in enumerate(members)]
    return {"members": list(sharded.member_indices), "keys": sorted(gathered),
            "gather": max(_rel(gathered[k], torch.stack([o[k] for o in loop])) for k in ("y", "z")),
            "mean": max(_rel(mean[k], torch.stack([o[k] for o in loop]).mean(0)) for k in ("y", "z"))}


def _train_and_checkpoint(out: Path) -> dict:
    import torch.distributed as dist
    from safetensors.torch import load_file
    from stagewise.executor.distributed import build_sharded
    from stagewise.executor.optim import StackedSGD

    n, steps = 3, 2
    members = _seeded(lambda i: TiedBN(), n)
    t = torch.randint(0, 20, (n, 6, 5), generator=torch.Generator().manual_seed(1))
    plan = _plan(members, (t[0],), "per_member")
    lrs = [0.05, 0.1, 0.2]
    sharded = build_sharded(plan, copy.deepcopy(members)).train()
    idx = sharded.member_indices
    opt = StackedSGD(list(sharded.parameters()), len(idx), lr=sharded.local_values(lrs), momentum=0.9)
    loop = [copy.deepcopy(m).train() for m in members]
    opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9) for m, lr in zip(loop, lrs)]
    for _ in range(steps):
        opt.zero_grad()
        (sharded(t) ** 2).reshape(len(idx), -1).mean(1).sum().backward()
        opt.step()
        for i, (m, o) in enumerate(zip(loop, opts)):
            o.zero_grad()
            (m(t[i]) ** 2).mean().backward()
            o.step()
    want = [loop[i].state_dict() for i in idx]
    got = sharded.member_state_dicts()
    folder = out / "checkpoint"
    sharded.save_checkpoint(folder)
    fresh = build_sharded(plan, _seeded(lambda i: TiedBN(), n)).eval()
    fresh.load_checkpoint(folder)
    loaded = fresh.member_state_dicts()
    with torch.no_grad():
        y = fresh.gather(fresh(t))
        y_loop = torch.stack([m.eval()(t[i]) for i, m in enumerate(loop)])
    dist.barrier()
    files = []
    for i in range(n):  # every member file into an ordinary model
        m = TiedBN()
        m.load_state_dict(load_file(str(folder / f"member_{i:03d}.safetensors")))
        files.append(m)
    return {"trained_vs_loop": max(_rel(g[k], w[k]) for g, w in zip(got, want) for k in w),
            "loaded_vs_loop": max(_rel(g[k], w[k]) for g, w in zip(loaded, want) for k in w),
            "loaded_out_vs_loop": _rel(y, y_loop),
            "tie_kept": all(m.head.weight is m.emb.weight for m in files),
            "files_vs_loop": max(_rel(f.state_dict()[k], loop[i].state_dict()[k]) for i, f in enumerate(files)
                                 for k in f.state_dict())}


def _verify_sharded() -> dict:
    from stagewise.executor.distributed_check import verify_sharded

    members = _seeded(lambda i: DictOut().eval(), 3)
    x = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(0))
    report = verify_sharded(_plan(members, (x[0],), "per_member"), members, (x,), rtol=None, repeats=1)
    return {"ok": report.ok, "ranks": [[r.start, r.stop] for r in report.ranks]}


def _rank_main(rank: int, world: int, port: int, out: Path) -> None:
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    results: dict = {}
    path = out / f"rank{rank}.json"
    scenarios = [("python value output", lambda: _python_value(False)),
                 ("python value output, equal", lambda: _python_value(True)),
                 ("shape differs across ranks", _shape_differs),
                 ("dict outputs", _dict_outputs),
                 ("train and checkpoint", lambda: _train_and_checkpoint(out)),
                 ("verify_sharded", _verify_sharded)]
    for name, thunk in scenarios:
        try:
            results[name] = thunk()
        except Exception:
            results[name] = {"unexpected": traceback.format_exc()}
        path.write_text(json.dumps(results))
        try:
            dist.barrier()  # a rank that raised unexpectedly may be out of step: stop all together
        except Exception:
            results["_stopped"] = f"after {name}"
            break
    path.write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))


def test_profile_and_autotune_error_measure_has_no_holes():
    """was: max_rel_error (profile and autotune's check of every candidate) let a finite value pass where the loop
    had NaN, gave integer outputs a tolerance, and dropped the imaginary part of complex outputs."""
    import math

    from stagewise.executor.candidates import max_rel_error

    want = torch.tensor([[1.0, float("nan")], [2.0, 3.0]])
    assert max_rel_error(torch.tensor([[1.0, 5.0], [2.0, 3.0]]), want) == math.inf
    assert max_rel_error(want.clone(), want) == 0.0
    ids = torch.tensor([[30000, 2], [3, 4]])
    assert max_rel_error(ids + torch.tensor([[1, 0], [0, 0]]), ids) == math.inf  # 3e-5 relative: still wrong
    assert max_rel_error(ids.clone(), ids) == 0.0 and max_rel_error(ids.float(), ids) == math.inf
    z = torch.tensor([[1 + 1j, 2j]])
    assert max_rel_error(z.conj(), z) > 1 and max_rel_error(z.clone(), z) == 0.0
    inf = torch.tensor([[float("inf"), 1.0]])
    assert max_rel_error(-inf, inf) == math.inf and max_rel_error(inf.clone(), inf) == 0.0
