"""The sharded run (executor.distributed) against the loop over all N members: what one rank cannot see alone.

Each was a silent difference: a checkpoint saved over a folder of a larger set (a later load mixed two runs),
state shared by members on different ranks (each rank updated its own copy), a per_member input forward() writes
in place (each rank wrote only its rows), a square input transposed on one rank (passed the same-input check), and
global member indices given to a shard's `opt.step(active=...)` (read as local positions). Like
tests/test_distributed.py, this file run as a script is one rank (`python tests/test_distributed_s31.py JOB RANK
WORLD PORT OUT`); one job of two gloo ranks runs every scenario and writes OUT/rank{r}.json.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from test_distributed import expect_error, rel, run_job, scenario  # noqa: E402


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_job("s31", 2, tmp_path_factory.mktemp("s31"), script=__file__)


# ---- tests --------------------------------------------------------------------------------------

def test_a_checkpoint_over_a_folder_of_a_larger_set_is_refused_before_any_rank_writes(two_ranks):
    for r, res in enumerate(scenario(two_ranks, "save over a larger set")):
        assert res["error"] == "DistributedError", f"rank {r}: {res}"  # old: accepted, and a later load mixed the runs
        assert "OutputFileError" in res["message"] and "member files of a larger set" in res["message"], res["message"]
        assert res["single"] in res["message"], (res["single"], res["message"])  # save_member_weights' own words
        assert res["unchanged"], f"rank {r}: the refused save wrote files ({res})"
        assert res["refill"] is None, f"rank {r}: saving the same set again was refused ({res['refill']})"


def test_a_buffer_members_on_two_ranks_share_is_refused_as_in_one_process(two_ranks):
    for r, res in enumerate(scenario(two_ranks, "shared batchnorm")):
        assert res["error"] == "DistributedError", f"rank {r}: {res}"  # old: built, each rank its own statistics
        assert "MemberError: " + res["single"][:200] in res["message"], (res["single"], res["message"])
        assert "members [0, 1] hold one tensor as buffer `backbone.1.running_mean`" in res["message"], res["message"]


def test_a_shared_batchnorm_built_in_eval_refuses_train_on_every_rank_and_runs_inference(two_ranks):
    for r, res in enumerate(scenario(two_ranks, "shared batchnorm in eval")):
        assert res["vs_loop"] <= 1e-6, f"rank {r}: {res}"
        assert res["train"]["error"] == res["single_train"]["error"] != None, f"rank {r}: {res}"  # noqa: E711
        assert res["train"]["message"] == res["single_train"]["message"], res


def test_a_trainable_backbone_members_on_two_ranks_share_is_refused_in_training(two_ranks):
    for r, res in enumerate(scenario(two_ranks, "shared backbone")):
        assert res["vs_loop"] <= 1e-6, f"rank {r}: inference {res}"  # inference of a shared backbone is fine
        assert res["training"]["error"] == "DistributedError", f"rank {r}: {res}"  # old: each rank trained its copy
        assert "ExecutionError: " + res["single"][:200] in res["training"]["message"], (res["single"], res["training"])
        assert "members share the trainable parameter(s) ['backbone.weight', 'backbone.bias']" in res["single"]


def test_a_frozen_backbone_members_on_two_ranks_share_still_trains_as_the_loop(two_ranks):
    for r, res in enumerate(scenario(two_ranks, "shared frozen backbone")):
        assert res["vs_loop"] <= 1e-5, f"rank {r}: {res}"


def test_a_per_member_input_forward_writes_is_written_whole_on_every_rank(two_ranks):
    for r, res in enumerate(scenario(two_ranks, "written per_member input")):
        # old: each rank wrote its own rows only, and the second call blamed the data ("give every rank the same data")
        assert res["error"] is None, f"rank {r}: {res}"
        assert res["outputs"] <= 1e-6 and res["input"] == 0.0, f"rank {r}: {res}"
        assert res["trained"] <= 1e-5 and res["input_after_training"] == 0.0, f"rank {r}: {res}"


def test_a_square_input_transposed_on_one_rank_is_refused(two_ranks):
    for r, res in enumerate(scenario(two_ranks, "transposed square input")):
        assert res["error"] == "DistributedError", f"rank {r}: {res}"  # old: accepted, members 2-3 ran on x.T
        assert "differs between member rank" in res["message"] and "checksums" in res["message"], res["message"]


def test_a_step_of_some_members_takes_global_indices_through_local_active(two_ranks):
    for r, res in enumerate(scenario(two_ranks, "step of member 1")):
        assert res["masks"] == ([[False, True], [False, True]] if r == 0 else [[False, False], [False, False]]), res
        assert max(res["per_member"]) <= 1e-5, f"rank {r}: {res}"


# ---- the rank side ------------------------------------------------------------------------------

def linear(i: int) -> nn.Module:
    torch.manual_seed(100 + i)
    return nn.Linear(8, 4)


class Member(nn.Module):
    """A head over a backbone, which several members may hold as one module."""

    def __init__(self, backbone: nn.Module, i: int):
        super().__init__()
        self.backbone = backbone
        torch.manual_seed(100 + i)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.backbone(x)))


def shared_bn_members(n: int) -> list:
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16))  # one object: one set of running statistics
    return [Member(backbone, i) for i in range(n)]


def backbone_members(n: int) -> list:
    torch.manual_seed(0)
    backbones = [nn.Linear(8, 16), nn.Linear(8, 16)]
    return [Member(backbones[i % 2], i) for i in range(n)]  # members 0, 2 share one; 1, 3 the other: across ranks


def plan_for(member: nn.Module, x: torch.Tensor, n: int, mode: str = "per_member"):
    from stagewise import planner

    return planner.propose(planner.trace(member, (x,)), n_members=n, input_mode=mode)


def check_save_over_larger_set(out: Path) -> dict:
    import torch.distributed as dist
    from stagewise import executor
    from stagewise.executor.distributed import build_sharded

    x = torch.randn(4, 3, 8)
    folder = out / "larger"
    build_sharded(plan_for(linear(0), x[0], 4), lambda idx: [linear(i) for i in idx]).save_checkpoint(folder)
    before = {p.name: p.read_bytes() for p in sorted(folder.iterdir())}
    small = build_sharded(plan_for(linear(0), x[0], 2), lambda idx: [linear(i + 10) for i in idx])
    got = expect_error(lambda: small.save_checkpoint(folder))
    dist.barrier()
    got["unchanged"] = {p.name: p.read_bytes() for p in sorted(folder.iterdir())} == before
    single = expect_error(lambda: executor.save_member_weights(executor.build(plan_for(linear(0), x[0], 2),
                                                                               [linear(10), linear(11)]), folder))
    got["single"] = single["message"]
    dist.barrier()
    again = expect_error(lambda: build_sharded(plan_for(linear(0), x[0], 4),
                                               lambda idx: [linear(i + 20) for i in idx]).save_checkpoint(folder))
    got["refill"] = None if again["error"] is None else again["message"]
    return got


def batches(n: int) -> list:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(n, 6, 8, generator=g) * (1 + torch.arange(n).view(n, 1, 1)) for _ in range(3)]


def check_shared_batchnorm() -> dict:
    from stagewise import executor
    from stagewise.executor.distributed import build_sharded

    x = batches(2)[0]
    members = shared_bn_members(2)
    plan = plan_for(members[0], x[0], 2)
    single = expect_error(lambda: executor.build(plan, shared_bn_members(2)))
    got = expect_error(lambda: build_sharded(plan, members))
    got["single"] = single["message"]
    return got


def check_shared_batchnorm_in_eval() -> dict:
    from stagewise import executor
    from stagewise.executor.distributed import build_sharded

    x = batches(2)[0]
    members = [m.eval() for m in shared_bn_members(2)]
    plan = plan_for(members[0], x[0], 2)
    sharded = build_sharded(plan, members)
    with torch.no_grad():
        got = sharded.gather(sharded(x))
        loop = torch.stack([m(x[i]) for i, m in enumerate(members)])
    single = executor.build(plan, [m.eval() for m in shared_bn_members(2)])
    return {"vs_loop": rel(got, loop), "train": expect_error(lambda: sharded.train()),
            "single_train": expect_error(lambda: single.train())}


def check_shared_backbone() -> dict:
    from stagewise import executor
    from stagewise.executor.distributed import build_sharded

    x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(1))
    members = backbone_members(4)
    plan = plan_for(members[0], x[0], 4)
    sharded = build_sharded(plan, members)  # builds: frozen or not, inference is fine
    with torch.no_grad():
        got = sharded.gather(sharded(x))
        loop = torch.stack([m(x[i]) for i, m in enumerate(members)])
    single = executor.build(plan, backbone_members(4))
    return {"vs_loop": rel(got, loop), "training": expect_error(lambda: sharded(x)),
            "single": expect_error(lambda: single(x))["message"]}


def sgd_steps(forward, params, x: torch.Tensor, steps: int = 3) -> None:
    opt = torch.optim.SGD(params, lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        (forward(x) ** 2).reshape(len(x), -1).mean(1).sum().backward()
        opt.step()


def check_shared_frozen_backbone() -> dict:
    """The members hold two frozen backbones across the ranks; their heads train as N torch optimizers train them."""
    from stagewise.executor.distributed import build_sharded
    from stagewise.executor.optim import StackedSGD

    x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(1))

    def frozen():
        members = backbone_members(4)
        for m in members:
            m.backbone.requires_grad_(False)
        return members

    members = frozen()
    sharded = build_sharded(plan_for(members[0], x[0], 4), members)
    opt = StackedSGD([p for p in sharded.parameters() if p.requires_grad], len(sharded.member_indices), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        (sharded(x) ** 2).reshape(len(sharded.member_indices), -1).mean(1).sum().backward()
        opt.step()
    loop = frozen()
    for i, m in enumerate(loop):
        sgd_steps(lambda v, m=m: m(v[0])[None], list(m.head.parameters()), x[i:i + 1])
    with torch.no_grad():
        return {"vs_loop": rel(sharded.gather(sharded(x)), torch.stack([m(x[i]) for i, m in enumerate(loop)]))}


class Doubles(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        x.mul_(2)
        return self.fc(x)


def doubles(i: int) -> nn.Module:
    torch.manual_seed(100 + i)
    return Doubles()


def check_written_per_member_input() -> dict:
    """forward() doubles its per_member input: after each call the caller's x is the loop's, on every rank."""
    from stagewise.executor.distributed import build_sharded
    from stagewise.executor.optim import StackedSGD

    def fresh():
        return torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(0))

    members = [doubles(i) for i in range(4)]
    sharded = build_sharded(plan_for(doubles(0), fresh()[0].clone(), 4), lambda idx: [doubles(i) for i in idx])
    x, x_loop, outs, ref = fresh(), fresh(), [], []
    try:
        with torch.no_grad():
            for _ in range(2):
                outs.append(sharded.gather(sharded(x)))
                ref.append(torch.stack([m(x_loop[i]) for i, m in enumerate(members)]))
    except Exception as e:  # noqa: BLE001 - the old code's second call: the result
        return {"error": f"{type(e).__name__}: {e}"}
    got = {"error": None, "outputs": rel(torch.stack(outs), torch.stack(ref)), "input": (x - x_loop).abs().max().item()}
    # training through it: the other ranks' rows are written without moving the version counter autograd checks
    x, x_loop = fresh(), fresh()
    opt = StackedSGD(list(sharded.parameters()), len(sharded.member_indices), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        (sharded(x) ** 2).reshape(len(sharded.member_indices), -1).mean(1).sum().backward()
        opt.step()
    for i, m in enumerate(members):
        sgd_steps(lambda v, m=m: m(v[0])[None], list(m.parameters()), x_loop[i:i + 1], steps=2)
    with torch.no_grad():
        got["trained"] = rel(sharded.gather(sharded(x.clone())), torch.stack([m(x_loop[i].clone()) for i, m in enumerate(members)]))
    got["input_after_training"] = (x - x_loop).abs().max().item()
    return got


def transposed_square_input(rank: int) -> None:
    from stagewise.executor.distributed import build_sharded

    def square(i):
        torch.manual_seed(100 + i)
        return nn.Linear(6, 3)

    x = torch.randn(6, 6, generator=torch.Generator().manual_seed(0))
    sharded = build_sharded(plan_for(square(0), x, 4, "shared"), lambda idx: [square(i) for i in idx])
    with torch.no_grad():
        sharded(x.T.contiguous() if rank else x)  # one rank got the matrix the other way round


def check_step_of_member_1() -> dict:
    """PBT-like: only global member 1 steps (weight decay would move the others): local_active picks it on its rank."""
    from stagewise.executor.distributed import build_sharded
    from stagewise.executor.optim import StackedSGD

    x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(0))
    sharded = build_sharded(plan_for(linear(0), x[0], 4), lambda idx: [linear(i) for i in idx])
    opt = StackedSGD(list(sharded.parameters()), len(sharded.member_indices), lr=0.1, weight_decay=0.5)
    mask = torch.zeros(4, dtype=torch.bool)
    mask[1] = True
    loss = (sharded(x) ** 2).reshape(len(sharded.member_indices), -1).mean(1)
    (loss * sharded.local_values(mask)).sum().backward()
    active = sharded.local_active([1])
    opt.step(active=active)
    loop = [linear(i) for i in range(4)]
    opt1 = torch.optim.SGD(loop[1].parameters(), lr=0.1, weight_decay=0.5)
    (loop[1](x[1]) ** 2).mean().backward()
    opt1.step()
    with torch.no_grad():
        got = sharded.gather(sharded(x))
        want = torch.stack([m(x[i]) for i, m in enumerate(loop)])
    return {"masks": [active.tolist(), sharded.local_active(mask).tolist()],
            "per_member": (got - want).abs().amax(dim=(1, 2)).tolist()}


def scenarios(job: str, rank: int, out: Path):
    """(name, thunk) in the order every rank runs them (each is collective)."""
    assert job == "s31", job
    yield "save over a larger set", lambda: check_save_over_larger_set(out)
    yield "shared batchnorm", check_shared_batchnorm
    yield "shared batchnorm in eval", check_shared_batchnorm_in_eval
    yield "shared backbone", check_shared_backbone
    yield "shared frozen backbone", check_shared_frozen_backbone
    yield "written per_member input", check_written_per_member_input
    yield "transposed square input", lambda: expect_error(lambda: transposed_square_input(rank))
    yield "step of member 1", check_step_of_member_1


def rank_main(job: str, rank: int, world: int, port: int, out: Path) -> None:
    from test_distributed import rank_main as run_rank

    run_rank(job, rank, world, port, out, lambda job, rank, out, results: scenarios(job, rank, out))


if __name__ == "__main__":
    rank_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]))
