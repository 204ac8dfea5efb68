"""The sharded run (executor.distributed) against the loop over all N members, continued from test_distributed_s31.py.

Each was a silent difference or a wrong refusal: data-parallel replicas (a DeviceMesh "dp" dimension) of the same
members kept their own BatchNorm running statistics (and a factory's members built apart), so replicas evaluated
differently; a save_checkpoint that failed on one rank left the folder half replaced by the others (a later load mixed
two steps); a per_member dict input, which one process takes, was refused sharded. Like tests/test_distributed.py,
this file run as a script is one rank (`python tests/test_distributed_s31b.py JOB RANK WORLD PORT OUT`); one job of
two gloo ranks runs every scenario and writes OUT/rank{r}.json.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from test_distributed import expect_error, run_job, scenario  # noqa: E402
from test_distributed_s31 import linear, plan_for  # noqa: E402

N = 2  # members of the dp scenario; 4 elsewhere


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_job("s31b", 2, tmp_path_factory.mktemp("s31b"), script=__file__)


# ---- tests --------------------------------------------------------------------------------------

def test_dp_replicas_keep_dp_rank_0s_buffers_as_ddp_does(two_ranks):
    got = scenario(two_ranks, "dp buffers")
    # old: the replicas' running statistics drifted apart (eval outputs 0.17 apart)
    assert got[0]["outputs"] == got[1]["outputs"], "dp replicas of the same members evaluate differently"
    assert got[0]["state"] == got[1]["state"], "dp replicas of the same members hold other state"
    for r, res in enumerate(got):  # the loop: gradients averaged over both batches, statistics from dp rank 0's
        assert res["vs_loop"] < 1e-5, f"rank {r}: {res['vs_loop']}"


def test_dp_replicas_start_from_dp_rank_0s_members(two_ranks):
    got = scenario(two_ranks, "dp members built apart")
    assert got[0]["state"] == got[1]["state"], "a factory's members built apart on each dp rank stayed apart"
    assert got[1]["vs_rank0_members"] == 0.0, got[1]


def test_a_checkpoint_that_fails_on_one_rank_leaves_the_folder_as_it_was(two_ranks):
    for name in ("save fails writing on rank 1", "save fails replacing on rank 1"):
        for r, res in enumerate(scenario(two_ranks, name)):
            assert res["error"] == "DistributedError" and "No space left" in res["message"], f"{name}, rank {r}: {res}"
            # old: rank 0 had replaced its members' files, and a load mixed step 2's members 0-1 with step 1's 2-3
            assert res["unchanged"], f"{name}, rank {r}: the folder changed: {res['files']}"
            assert res["loaded_vs_step1"] < 1e-6, f"{name}, rank {r}: {res['loaded_vs_step1']}"
            assert res["again_vs_step2"] < 1e-6, f"{name}, rank {r}: a later save: {res['again_vs_step2']}"


def test_a_per_member_dict_input_runs_sharded_as_in_one_process(two_ranks):
    for r, res in enumerate(scenario(two_ranks, "per_member dict input")):
        assert res["vs_loop"] < 1e-6, f"rank {r}: {res}"  # old: InputError "got dict"
        assert res["numbers_vs_loop"] < 1e-6, f"rank {r}: {res}"  # a list of N numbers, per_member
        bad = res["short_leaf"]
        assert bad["error"] == "DistributedError" and "InputError" in bad["message"], bad
        assert "a dict whose tensors are shaped [[4, 6, 8], [3, 6, 1]]" in bad["message"], bad["message"]


# ---- the ranks' side ----------------------------------------------------------------------------

def bn_member(i: int) -> nn.Module:
    torch.manual_seed(100 + i)
    return nn.Sequential(nn.Linear(8, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def dp_batch(dp: int) -> torch.Tensor:
    return torch.randn(N, 6, 8, generator=torch.Generator().manual_seed(10 + dp)) * (1 + 2 * dp)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return (out ** 2).reshape(len(out), -1).mean(1).sum()


def ddp_loop(steps: int) -> list[nn.Module]:
    """The members trained one by one as DDP trains them over two replicas: each step the gradient averaged over
    both dp batches, the running statistics those of dp rank 0's batch (DDP broadcasts rank 0's buffers)."""
    members = [bn_member(i) for i in range(N)]
    for _ in range(steps):
        for i, m in enumerate(members):
            m.train()
            m.zero_grad()
            first = (m(dp_batch(0)[i]) ** 2).mean()
            kept = {k: b.clone() for k, b in m.named_buffers()}
            second = (m(dp_batch(1)[i]) ** 2).mean()
            (0.5 * (first + second)).backward()
            with torch.no_grad():
                for k, b in m.named_buffers():
                    b.copy_(kept[k])
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.1 * p.grad
    return members


def check_dp_buffers() -> dict:
    from stagewise.executor.distributed import build_sharded
    from stagewise.executor.optim import StackedSGD
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("member", "dp"))
    dp = mesh.get_local_rank("dp")
    ens = build_sharded(plan_for(bn_member(0), dp_batch(0)[0], N), lambda idx: [bn_member(i) for i in idx], mesh)
    opt = StackedSGD(list(ens.parameters()), len(ens.member_indices), lr=0.1)
    ens.train()
    for _ in range(3):
        opt.zero_grad()
        loss_of(ens(dp_batch(dp))).backward()
        ens.sync_gradients()
        opt.step()
    ens.eval()
    loop = ddp_loop(3)
    for m in loop:
        m.eval()
    with torch.no_grad():
        out = ens.gather(ens(dp_batch(0)))
        want = torch.stack([m(dp_batch(0)[i]) for i, m in enumerate(loop)])
    state = ens.member_state_dicts()
    return {"outputs": out.flatten().tolist(), "state": [[v.flatten().tolist() for v in s.values()] for s in state],
            "vs_loop": (out - want).abs().max().item()}


def check_dp_members_built_apart() -> dict:
    from stagewise.executor.distributed import build_sharded
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("member", "dp"))
    dp = mesh.get_local_rank("dp")
    built = lambda idx: [bn_member(i + 10 * dp) for i in idx]  # noqa: E731  (a factory seeded by the process)
    ens = build_sharded(plan_for(bn_member(0), dp_batch(0)[0], N), built, mesh)
    state = ens.member_state_dicts()
    rank0 = [bn_member(i).state_dict() for i in range(N)]
    return {"state": [[v.flatten().tolist() for v in s.values()] for s in state],
            "vs_rank0_members": max((s[k] - w[k]).abs().max().item() for s, w in zip(state, rank0) for k in s)}


def failed_save(out: Path, name: str, fail) -> dict:
    """Save step 1, move every member, save again with `fail` (called on rank 1 only) breaking the second save."""
    import torch.distributed as dist
    from stagewise.executor.distributed import build_sharded

    rank = dist.get_rank()
    x = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(0))
    plan = plan_for(linear(0), x[0], 4)
    folder = out / name.replace(" ", "_")
    ens = build_sharded(plan, lambda idx: [linear(i) for i in idx])
    ens.save_checkpoint(folder)
    dist.barrier()
    before = {p.name: p.read_bytes() for p in sorted(folder.iterdir())}
    with torch.no_grad():
        for p in ens.parameters():
            p.add_(1.0)
        step2 = ens.gather(ens(x))
    undo = fail() if rank == 1 else (lambda: None)
    try:
        got = expect_error(lambda: ens.save_checkpoint(folder))
    finally:
        undo()
    dist.barrier()
    after = {p.name: p.read_bytes() for p in sorted(folder.iterdir())}
    got["unchanged"], got["files"] = after == before, sorted(after)
    fresh = build_sharded(plan, lambda idx: [linear(i + 20) for i in idx])
    fresh.load_checkpoint(folder)
    with torch.no_grad():
        step1 = torch.stack([linear(i)(x[i]) for i in range(4)])
        got["loaded_vs_step1"] = (fresh.gather(fresh(x)) - step1).abs().max().item()
    dist.barrier()
    ens.save_checkpoint(folder)  # the same save again, nothing failing: the folder takes it
    fresh.load_checkpoint(folder)
    with torch.no_grad():
        got["again_vs_step2"] = (fresh.gather(fresh(x)) - step2).abs().max().item()
    return got


def disk_full_at_write():
    import safetensors.torch as st

    real = st.save_file

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    st.save_file = full
    return lambda: setattr(st, "save_file", real)


def disk_full_at_replace():
    """The first move of a new file over its member file fails (after the old one was moved aside)."""
    real, calls = os.replace, []

    def replace(src, dst):
        if str(src).endswith(".tmp") and not calls:
            calls.append(src)
            raise OSError(28, "No space left on device")
        return real(src, dst)
    os.replace = replace
    return lambda: setattr(os, "replace", real)


class Weighted(nn.Module):
    def __init__(self, i: int):
        super().__init__()
        torch.manual_seed(100 + i)
        self.fc = nn.Linear(8, 4)

    def forward(self, batch):
        return self.fc(batch["x"]) * batch["w"]


class Scaled(nn.Module):
    def __init__(self, i: int):
        super().__init__()
        torch.manual_seed(100 + i)
        self.fc = nn.Linear(8, 4)

    def forward(self, x, scale: float):
        return self.fc(x) * scale


def check_per_member_dict() -> dict:
    from stagewise import planner
    from stagewise.executor.distributed import build_sharded

    g = torch.Generator().manual_seed(0)
    batch = {"x": torch.randn(4, 6, 8, generator=g), "w": torch.randn(4, 6, 1, generator=g)}
    one = {k: v[0] for k, v in batch.items()}
    plan = planner.propose(planner.trace(Weighted(0), (one,)), n_members=4, input_mode="per_member")
    ens = build_sharded(plan, lambda idx: [Weighted(i) for i in idx])
    with torch.no_grad():
        got = ens.gather(ens(batch))
        want = torch.stack([Weighted(i)({k: v[i] for k, v in batch.items()}) for i in range(4)])
    res = {"vs_loop": (got - want).abs().max().item()}
    scales = [0.5, 1.5, -2.0, 3.0]
    plan = planner.propose(planner.trace(Scaled(0), (batch["x"][0], 1.0)), n_members=4, input_mode="per_member")
    ens = build_sharded(plan, lambda idx: [Scaled(i) for i in idx])
    with torch.no_grad():
        got = ens.gather(ens(batch["x"], scales))
        want = torch.stack([Scaled(i)(batch["x"][i], scales[i]) for i in range(4)])
    res["numbers_vs_loop"] = (got - want).abs().max().item()
    short = {"x": batch["x"], "w": batch["w"][:3]}
    res["short_leaf"] = expect_error(lambda: build_sharded(
        planner.propose(planner.trace(Weighted(0), (one,)), n_members=4, input_mode="per_member"),
        lambda idx: [Weighted(i) for i in idx])(short))
    return res


def scenarios(job: str, rank: int, out: Path):
    """(name, thunk) in the order every rank runs them (each is collective)."""
    assert job == "s31b", job
    yield "dp buffers", check_dp_buffers
    yield "dp members built apart", check_dp_members_built_apart
    yield "save fails writing on rank 1", lambda: failed_save(out, "save fails writing on rank 1", disk_full_at_write)
    yield "save fails replacing on rank 1", lambda: failed_save(out, "save fails replacing on rank 1", disk_full_at_replace)
    yield "per_member dict input", check_per_member_dict


def rank_main(job: str, rank: int, world: int, port: int, out: Path) -> None:
    from test_distributed import rank_main as run_rank

    run_rank(job, rank, world, port, out, lambda job, rank, out, results: scenarios(job, rank, out))


if __name__ == "__main__":
    rank_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]))
