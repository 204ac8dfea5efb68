"""The member axis sharded over ranks (executor.distributed), on CPU under gloo, 127.0.0.1 only.

The tests start their own ranks: this file run as a script is one rank
(`python tests/test_distributed.py JOB RANK WORLD PORT OUT`). A job runs several
scenarios in one process group (starting processes costs seconds on a small
machine) and writes each scenario's result to OUT/rank{r}.json as soon as it has it;
the tests read those. Each scenario compares on the ranks themselves: the gathered
sharded outputs against the single-process plan and the loop over members, the
sharded parameters after training against the single-process run and N torch.optim runs.
"""
from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PYTHON = sys.executable
TIMEOUT_S = 30  # the process group's: a collective waits at most this long for a rank
JOB_LIMIT_S = 150  # a whole job (imports, tracing, every scenario) on a busy 2-core machine


# ---- the parent side: start ranks, collect what they wrote ------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env() -> dict:
    # loopback only; one thread per rank (2 cores shared by all ranks); no GPU even where there is one
    return {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}  # the caller's path too (make test-gpu imports the checkout through it)


def run_torchrun(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """Run a torchrun command line; once more if a rank aborted in gloo's teardown after its work ("terminate called
    without an active exception", seen only on a loaded machine: torch's worker threads at process exit; twice in a
    row once, with a test tier running beside). Any other failure, or the abort three times, is the test's to report."""
    for attempt in range(3):
        done = subprocess.run(cmd, env={**rank_env(), "STAGEWISE_DIST_TIMEOUT_S": str(TIMEOUT_S)}, capture_output=True,
                              text=True, timeout=JOB_LIMIT_S, cwd=cwd)
        if done.returncode == 0 or "terminate called without an active exception" not in done.stdout + done.stderr:
            return done
    return done


def run_job(job: str, world: int, out: Path, script: str = __file__) -> list[dict]:
    """Start `world` ranks of `job` (run by `script`: this file's jobs, or another file's), wait for all (bounded),
    return what each rank wrote."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = [subprocess.Popen([PYTHON, script, job, str(r), str(world), str(port), str(out)], env=rank_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    logs = []
    deadline = time.monotonic() + JOB_LIMIT_S
    for p in procs:
        try:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"job {job}: a rank hung past {JOB_LIMIT_S}s")
    results = []
    for r, p in enumerate(procs):
        path = out / f"rank{r}.json"
        assert path.is_file(), f"job {job} rank {r} wrote nothing (exit {p.returncode}):\n{logs[r][-3000:]}"
        results.append(json.loads(path.read_text()))
    return results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_job("two", 2, tmp_path_factory.mktemp("two"))


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory, two_ranks):
    out = tmp_path_factory.mktemp("three")
    (out / "checkpoint_from").write_text(two_ranks[0]["checkpoint"]["folder"])
    return run_job("three", 3, out)


def scenario(results: list[dict], name: str) -> list[dict]:
    """Every rank's result of one scenario; fails with the rank's traceback if it raised unexpectedly."""
    got = []
    for r, res in enumerate(results):
        assert name in res, f"rank {r} has no result for {name!r} (it stopped earlier: {res.get('_stopped', '')})"
        assert "unexpected" not in res[name], f"rank {r}, {name}:\n{res[name]['unexpected']}"
        got.append(res[name])
    return got


# ---- tests --------------------------------------------------------------------------------------

def test_member_slice_is_contiguous_and_uneven_sizes_lead():
    from stagewise.executor.distributed import DistributedError, member_slice

    assert [len(member_slice(7, r, 3)) for r in range(3)] == [3, 2, 2]
    assert [list(member_slice(5, r, 2)) for r in range(2)] == [[0, 1, 2], [3, 4]]
    assert [i for r in range(4) for i in member_slice(10, r, 4)] == list(range(10))
    with pytest.raises(DistributedError, match="use at most 2 ranks"):
        member_slice(2, 0, 3)


def test_ranks_for_n_members_under_a_device_memory():
    from stagewise.planner import MemoryBudgetError
    from stagewise.planner.budget import USABLE_FRACTION, ranks_for

    gib = 2 ** 30
    device = int(10 * gib / USABLE_FRACTION)  # 10 GiB usable
    assert ranks_for(100, gib // 10, device) == 1  # 100 x 0.1 GiB fits one device
    assert ranks_for(1000, gib // 10, device) == 10
    assert ranks_for(1001, gib // 10, device) == 11  # one member more: one rank more (the first ranks hold 91)
    assert ranks_for(1000, gib // 10, device, fixed=5 * gib) == 20  # half of each device taken by activations
    with pytest.raises(MemoryBudgetError, match="one member needs"):
        ranks_for(4, 11 * gib, device)


@pytest.mark.parametrize("case", ["mlp N=4 per_member", "cnn N=4 shared", "data_dependent N=4 shared", "mlp N=5 per_member"])
def test_sharded_forward_on_2_ranks_equals_single_process_and_loop(two_ranks, case):
    for r, res in enumerate(scenario(two_ranks, f"forward {case}")):
        assert res["vs_single"] <= 1e-5 and res["vs_loop"] <= 1e-4 and res["mean"] <= 1e-5, f"rank {r}: {res}"
    assert [res["members"] for res in scenario(two_ranks, "forward mlp N=5 per_member")] == [[0, 1, 2], [3, 4]]


@pytest.mark.parametrize("case", ["mlp N=7 per_member", "data_dependent N=7 shared"])
def test_uneven_7_members_over_3_ranks(three_ranks, case):
    results = scenario(three_ranks, f"forward {case}")
    assert [res["members"] for res in results] == [[0, 1, 2], [3, 4], [5, 6]]
    for r, res in enumerate(results):
        assert res["vs_single"] <= 1e-5 and res["vs_loop"] <= 1e-4 and res["mean"] <= 1e-5, f"rank {r}: {res}"


def test_sharded_training_equals_single_process_and_per_member_sgd(two_ranks):
    for r, res in enumerate(scenario(two_ranks, "train")):
        assert res["vs_single"] <= 1e-5, f"rank {r}: {res}"
        assert res["vs_loop"] <= 1e-4, f"rank {r}: {res}"
        assert res["changed"] > 1e-3, f"rank {r}: the parameters did not move ({res})"


def test_dp_dimension_averages_gradients_over_dp_only(two_ranks):
    for r, res in enumerate(scenario(two_ranks, "dp mesh")):
        assert res["vs_averaged"] <= 1e-5, f"rank {r}: {res}"
        assert res["members"] == [0, 1, 2], "a 1 x 2 (member x dp) mesh gives every rank all members"


def test_checkpoint_saved_with_2_ranks_loads_with_3(two_ranks, three_ranks):
    saved = scenario(two_ranks, "checkpoint")
    assert sorted(n for res in saved for n in res["wrote"]) == [f"member_{i:03d}.safetensors" for i in range(5)]
    for r, res in enumerate(scenario(three_ranks, "load checkpoint")):
        assert res["vs_saved"] <= 1e-6, f"rank {r}: {res}"
        assert res["vs_fresh"] > 1e-3, f"rank {r}: the loaded members equal untrained ones ({res})"


def test_a_failing_rank_raises_one_clear_error_on_every_rank(two_ranks):
    for r, res in enumerate(scenario(two_ranks, "factory fails on rank 1")):
        assert res["error"] == "DistributedError", f"rank {r}: {res}"
        assert "failed on rank 1" in res["message"] and "no member weights here" in res["message"], res["message"]
        assert res["seconds"] < TIMEOUT_S / 2, f"rank {r} waited {res['seconds']:.1f}s: it hit the timeout instead of the flag"


def test_ranks_given_other_batches_are_refused_on_every_rank(two_ranks):
    for r, res in enumerate(scenario(two_ranks, "ranks given other batches")):
        assert res["error"] == "DistributedError", f"rank {r}: {res}"
        assert "differs between member rank" in res["message"] and "same whole batch" in res["message"], res["message"]


def test_a_batch_in_another_order_is_another_batch(two_ranks):
    for r, res in enumerate(scenario(two_ranks, "a batch flipped on one rank")):
        assert res["error"] == "DistributedError" and "differs between member rank" in res["message"], f"rank {r}: {res}"


def test_the_same_batch_in_another_layout_is_the_same_batch(two_ranks):
    for r, res in enumerate(scenario(two_ranks, "one batch in two layouts")):
        assert res["error"] is None, f"rank {r}: {res}"


def test_a_sharded_module_copies_and_says_what_it_cannot_do(two_ranks):
    for r, res in enumerate(scenario(two_ranks, "copies and surfaces")):
        assert res["twin"] == 0.0 and res["swa"] == 0.0, f"rank {r}: {res}"
        errors = res["errors"]
        assert errors["save"].startswith("DistributedError") and "save_checkpoint" in errors["save"], errors
        assert errors["capture"].startswith("ExecutionError") and "sharded.module" in errors["capture"], errors
        assert errors["keywords"].startswith("InputError") and "positionally" in errors["keywords"], errors
        assert res["local"] == [float(i) for i in res["members"]], res


def test_a_rank_that_dies_makes_the_others_raise_not_hang(three_ranks):
    for r, res in enumerate(scenario(three_ranks, "rank 2 exits")[:2]):
        assert res["error"] == "DistributedError", f"rank {r}: {res}"
        assert "crashed or is stuck" in res["message"] or "failed on rank" in res["message"], res["message"]


def test_torchrun_cli_verifies_each_slice_and_prints_one_table(tmp_path):
    from stagewise import planner
    from conftest import load_sample

    src, graph = load_sample("mlp")
    plan_path = tmp_path / "plan.json"
    planner.propose(graph, n_members=5, input_mode="per_member", model="mlp").save(plan_path)
    # the installed console script where there is one (make test); a checkout imported through PYTHONPATH
    # (make test-gpu on a CUDA machine as it is) has none, and runs the same CLI as a module
    stagewise = Path(PYTHON).with_name("stagewise")
    entry = ["--no-python", str(stagewise)] if stagewise.exists() else ["-m", "stagewise.app.cli"]
    cmd = [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), *entry, "run", str(plan_path),
           str(ROOT / "sample_models" / "mlp.py"), "--distributed"]
    done = run_torchrun(cmd, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stdout.count("all-gather of the outputs") == 1, done.stdout  # rank 0 alone prints
    assert "MATCH: 5 members over 2 ranks" in done.stdout, done.stdout
    rows = [line.split() for line in done.stdout.splitlines() if line.strip()[:1].isdigit() and "MATCH" in line]
    assert [(row[0], row[1]) for row in rows] == [("0", "0-2"), ("1", "3-4")], done.stdout


def test_torchrun_cli_profiles_each_slice_and_prints_one_table(tmp_path):
    from stagewise import planner
    from conftest import load_sample

    src, graph = load_sample("mlp")
    plan_path = tmp_path / "plan.json"
    planner.propose(graph, n_members=5, input_mode="per_member", model="mlp").save(plan_path)
    cmd = [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "stagewise.app.cli", "profile", str(plan_path),
           str(ROOT / "sample_models" / "mlp.py"), "--distributed", "--repeats", "3"]
    done = run_torchrun(cmd, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stdout.count("one forward of all 5 members over 2 ranks") == 1, done.stdout
    rows = [line.split() for line in done.stdout.splitlines() if line.strip()[:1].isdigit() and "cpu" in line]
    assert [(row[0], row[1]) for row in rows] == [("0", "0-2"), ("1", "3-4")], done.stdout


def test_cli_distributed_outside_torchrun_says_how_to_start_it(tmp_path, capsys, monkeypatch):
    from stagewise.app.cli import main

    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    assert main(["run", str(tmp_path / "plan.json"), str(ROOT / "sample_models" / "mlp.py"), "--distributed"]) == 2
    assert "torchrun --nproc-per-node" in capsys.readouterr().err
    assert main(["profile", str(tmp_path / "plan.json"), str(ROOT / "sample_models" / "mlp.py"), "--distributed", "--trace", "t.json"]) == 2
    assert "does not take --trace; drop it" in capsys.readouterr().err


# ---- the rank side ------------------------------------------------------------------------------

def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)


def setup(name: str, n: int, mode: str):
    from stagewise import executor
    from stagewise import planner
    from conftest import load_sample

    src, graph = load_sample(name)
    plan = planner.propose(graph, n_members=n, input_mode=mode)
    return src, plan, executor.batched_inputs(plan, src.example_inputs)


def check_forward(name: str, n: int, mode: str) -> dict:
    """Gathered sharded outputs vs the single-process plan and the loop; the all-reduced mean vs the single one."""
    from stagewise import executor
    from stagewise.executor.distributed import build_sharded

    src, plan, inputs = setup(name, n, mode)
    members = src.members(n)
    # a factory that builds only this rank's members from their global indices (seeded per index)
    sharded = build_sharded(plan, lambda idx: src.members(idx.stop)[idx.start:])
    with torch.no_grad():
        out = sharded(*inputs)
        gathered = sharded.gather(out)
        mean = sharded.mean(out)
        single = executor.build(plan, members)(*inputs)
    loop = torch.stack(executor.loop_outputs(plan, members, inputs))
    return {"members": list(sharded.member_indices), "vs_single": rel(gathered, single), "vs_loop": rel(gathered, loop),
            "mean": rel(mean, single.mean(0))}


def check_training() -> dict:
    """3 SGD steps with per-member lr: sharded vs one process vs each member with its own torch.optim.SGD."""
    from stagewise import executor
    from stagewise.executor.distributed import build_sharded
    from stagewise.executor.optim import StackedSGD

    n, steps = 5, 3
    src, plan, inputs = setup("mlp", n, "per_member")
    members = src.members(n)
    lrs = [0.02 * (i + 1) for i in range(n)]
    full = executor.build(plan, copy.deepcopy(members)).train()
    sharded = build_sharded(plan, copy.deepcopy(members)).train()
    idx = sharded.member_indices
    loop = [copy.deepcopy(members[i]).train() for i in idx]
    opt_full = StackedSGD(list(full.parameters()), n, lr=lrs, momentum=0.9)
    opt = StackedSGD(list(sharded.parameters()), len(idx), lr=sharded.local_values(lrs), momentum=0.9)
    opts_loop = [torch.optim.SGD(m.parameters(), lr=lrs[i], momentum=0.9) for i, m in zip(idx, loop)]
    for _ in range(steps):
        for module, o, k in ((full, opt_full, n), (sharded, opt, len(idx))):
            o.zero_grad()
            (module(*inputs) ** 2).reshape(k, -1).mean(1).sum().backward()
            if module is sharded:
                sharded.sync_gradients()  # no "dp": nothing to do, no traffic between member shards
            o.step()
        for i, m, o in zip(idx, loop, opts_loop):
            o.zero_grad()
            (m(inputs[0][i]) ** 2).mean().backward()
            o.step()
    got, want = sharded.member_state_dicts(), full.member_state_dicts()
    keys = list(got[0])
    return {"vs_single": max(rel(got[j][k], want[i][k]) for j, i in enumerate(idx) for k in keys),
            "vs_loop": max(rel(got[j][k], dict(loop[j].named_parameters())[k].detach()) for j in range(len(idx)) for k in keys),
            "changed": max(rel(got[j][k], members[i].state_dict()[k]) for j, i in enumerate(idx) for k in keys)}


def check_dp_mesh(rank: int) -> dict:
    """A 1 x 2 (member x dp) mesh: both ranks hold all members and see other data; after sync_gradients
    one SGD step equals one step on the average of both ranks' losses."""
    from stagewise import executor
    from stagewise.executor.distributed import build_sharded
    from stagewise.executor.optim import StackedSGD
    from torch.distributed.device_mesh import init_device_mesh

    n = 3
    src, plan, inputs = setup("mlp", n, "per_member")
    members = src.members(n)
    data = [inputs[0], inputs[0].flip(1) * 0.5]  # dp rank r's batch
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("member", "dp"))
    sharded = build_sharded(plan, copy.deepcopy(members), mesh).train()
    opt = StackedSGD(list(sharded.parameters()), n, lr=0.1)
    (sharded(data[rank]) ** 2).reshape(n, -1).mean(1).sum().backward()
    sharded.sync_gradients()
    opt.step()
    full = executor.build(plan, copy.deepcopy(members)).train()
    opt_full = StackedSGD(list(full.parameters()), n, lr=0.1)
    sum(0.5 * (full(x) ** 2).reshape(n, -1).mean(1).sum() for x in data).backward()
    opt_full.step()
    got, want = sharded.member_state_dicts(), full.member_state_dicts()
    return {"members": list(sharded.member_indices), "vs_averaged": max(rel(g[k], w[k]) for g, w in zip(got, want) for k in g)}


def trained_mlp_members(n: int) -> list:
    """Members that differ from src.members(n), so a checkpoint that was not loaded shows."""
    from conftest import load_sample

    members = load_sample("mlp")[0].members(n)
    with torch.no_grad():
        for i, m in enumerate(members):
            for p in m.parameters():
                p.mul_(1.5).add_(0.01 * (i + 1))
    return members


def check_save(out: Path) -> dict:
    from stagewise.executor.distributed import build_sharded

    src, plan, inputs = setup("mlp", 5, "per_member")
    sharded = build_sharded(plan, trained_mlp_members(5))
    folder = out / "checkpoint"
    wrote = sharded.save_checkpoint(folder)
    with torch.no_grad():
        gathered = sharded.gather(sharded(*inputs))
    if torch.distributed.get_rank() == 0:
        torch.save(gathered, out / "checkpoint_outputs.pt")
    return {"folder": str(out), "wrote": [p.name for p in wrote]}


def check_load(out: Path) -> dict:
    from stagewise.executor.distributed import build_sharded

    saved = Path((out / "checkpoint_from").read_text())
    src, plan, inputs = setup("mlp", 5, "per_member")
    sharded = build_sharded(plan, lambda idx: src.members(idx.stop)[idx.start:])
    with torch.no_grad():
        fresh = sharded.gather(sharded(*inputs))
        sharded.load_checkpoint(saved / "checkpoint")
        loaded = sharded.gather(sharded(*inputs))
    want = torch.load(saved / "checkpoint_outputs.pt")
    return {"members": list(sharded.member_indices), "vs_saved": rel(loaded, want), "vs_fresh": rel(fresh, want)}


def expect_error(fn) -> dict:
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # the scenario's point: which error, what it says, how fast
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - t0}
    return {"error": None, "message": "no error", "seconds": time.monotonic() - t0}


def failing_factory(rank: int):
    from stagewise.executor.distributed import build_sharded

    src, plan, _ = setup("mlp", 4, "shared")

    def factory(idx):
        if rank == 1:
            raise FileNotFoundError("no member weights here")
        return src.members(idx.stop)[idx.start:]

    build_sharded(plan, factory)


def other_batches(rank: int):
    """Each rank its own batch (a DistributedSampler's habit): the ranks hold other members of one ensemble."""
    from stagewise.executor.distributed import build_sharded

    src, plan, inputs = setup("mlp", 4, "shared")
    sharded = build_sharded(plan, lambda idx: src.members(idx.stop)[idx.start:])
    with torch.no_grad():
        sharded(*inputs)  # the same batch everywhere: fine
        sharded(*[x + rank for x in inputs])


def flipped_batch(rank: int):
    """The same values in another order on one rank (a per-rank augmentation): not the same batch."""
    from stagewise.executor.distributed import build_sharded

    src, plan, inputs = setup("mlp", 4, "shared")
    sharded = build_sharded(plan, lambda idx: src.members(idx.stop)[idx.start:])
    with torch.no_grad():
        sharded(*[x.flip(-1) if rank else x for x in inputs])


def same_batch_other_layout(rank: int):
    """Equal values in another memory layout and summed by other thread counts: the same batch, accepted."""
    from stagewise.executor.distributed import build_sharded

    src, plan, inputs = setup("mlp", 4, "shared")
    sharded = build_sharded(plan, lambda idx: src.members(idx.stop)[idx.start:])
    torch.set_num_threads(1 + rank)
    g = torch.Generator().manual_seed(7)
    for _ in range(10):
        x = torch.randn(64, inputs[0].shape[-1], generator=g) * 100
        with torch.no_grad():
            sharded(x.t().contiguous().t() if rank else x)
    torch.set_num_threads(1)


def check_surfaces() -> dict:
    """A deepcopy (an EMA/SWA copy) runs as the original, sharing the group; what cannot work says so."""
    import copy
    import io

    import numpy as np
    from stagewise import executor
    from stagewise.executor.distributed import build_sharded

    src, plan, inputs = setup("mlp", 4, "shared")
    sharded = build_sharded(plan, lambda idx: src.members(idx.stop)[idx.start:])
    twin = copy.deepcopy(sharded)
    swa = torch.optim.swa_utils.AveragedModel(sharded)
    with torch.no_grad():
        out, out_twin, out_swa = sharded(*inputs), twin(*inputs), swa(*inputs)
    errors = {}
    for name, fn in (("save", lambda: torch.save(sharded, io.BytesIO())),
                     ("capture", lambda: executor.capture(sharded)),
                     ("keywords", lambda: sharded(x=inputs[0]))):
        try:
            fn()
            errors[name] = "no error"
        except Exception as e:  # noqa: BLE001 - the message is the result
            errors[name] = f"{type(e).__name__}: {e}"
    lrs = sharded.local_values(np.arange(4.0))
    return {"twin": rel(out_twin, out), "swa": rel(out_swa, out), "errors": errors,
            "local": [float(v) for v in lrs], "members": list(sharded.member_indices)}


def rank_exits(rank: int, out: Path, results: dict) -> None:
    """Rank 2 leaves without a word before a gather; the others must raise, not wait forever."""
    from stagewise.executor.distributed import build_sharded

    src, plan, inputs = setup("mlp", 6, "per_member")
    sharded = build_sharded(plan, lambda idx: src.members(idx.stop)[idx.start:])
    with torch.no_grad():
        out_local = sharded(*inputs)
    if rank == 2:
        results["rank 2 exits"] = {"error": None, "message": "exited", "seconds": 0.0}
        (out / "rank2.json").write_text(json.dumps(results))
        os._exit(0)
    results["rank 2 exits"] = expect_error(lambda: sharded.gather(out_local))


def scenarios(job: str, rank: int, out: Path, results: dict):
    """(name, thunk) in the order every rank runs them (each is collective)."""
    if job == "two":
        for name, n, mode in (("mlp", 4, "per_member"), ("cnn", 4, "shared"), ("data_dependent", 4, "shared"), ("mlp", 5, "per_member")):
            yield f"forward {name} N={n} {mode}", lambda name=name, n=n, mode=mode: check_forward(name, n, mode)
        yield "train", check_training
        yield "dp mesh", lambda: check_dp_mesh(rank)
        yield "checkpoint", lambda: check_save(out)
        yield "factory fails on rank 1", lambda: expect_error(lambda: failing_factory(rank))
        yield "ranks given other batches", lambda: expect_error(lambda: other_batches(rank))
        yield "copies and surfaces", check_surfaces
        yield "one batch in two layouts", lambda: expect_error(lambda: same_batch_other_layout(rank))
        yield "a batch flipped on one rank", lambda: expect_error(lambda: flipped_batch(rank))
    elif job == "three":
        yield "forward mlp N=7 per_member", lambda: check_forward("mlp", 7, "per_member")
        yield "forward data_dependent N=7 shared", lambda: check_forward("data_dependent", 7, "shared")
        yield "load checkpoint", lambda: check_load(out)
        yield "rank 2 exits", lambda: rank_exits(rank, out, results)


def rank_main(job: str, rank: int, world: int, port: int, out: Path, make_scenarios=None) -> None:
    """One rank: run each (name, thunk) of `make_scenarios(job, rank, out, results)` (this file's `scenarios` by
    default), writing what each returns (or its traceback) to rank{rank}.json as it goes."""
    import warnings

    import torch.distributed as dist

    warnings.simplefilter("ignore")  # vmap-fallback and export warnings are expected in these samples
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=TIMEOUT_S))
    results: dict = {}
    path = out / f"rank{rank}.json"
    for name, thunk in (make_scenarios or scenarios)(job, rank, out, results):
        try:
            got = thunk()
            if got is not None:
                results[name] = got
        except Exception:  # recorded for the test to show; the next scenario may still run
            results[name] = {"unexpected": traceback.format_exc()[-3000:]}
        path.write_text(json.dumps(results))
    if "rank 2 exits" not in results:  # that scenario left one rank dead on purpose: nobody to wait for
        dist.barrier()  # leave together (gloo can abort a rank whose peer tears down under its last read)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    rank_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]))
