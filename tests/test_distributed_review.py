"""Silent differences between the sharded run (executor.distributed) and the loop over all N members.

Each was a quiet wrong answer: members on different ranks drawing the same dropout
masks, a checkpoint tensor of another shape broadcast into a member (or a load that
half-completed), a per_member input with k instead of N rows run as if it were the
rank's rows, and already gathered outputs averaged world times over. Like
tests/test_distributed.py, this file run as a script is one rank
(`python tests/test_distributed_review.py JOB RANK WORLD PORT OUT`); one job of two
gloo ranks runs every scenario and writes OUT/rank{r}.json.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from test_distributed import expect_error, rel, run_job, scenario, setup  # noqa: E402


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_job("review", 2, tmp_path_factory.mktemp("review"), script=__file__)


# ---- tests --------------------------------------------------------------------------------------

def test_members_on_different_ranks_draw_their_own_dropout_masks(two_ranks):
    results = scenario(two_ranks, "dropout")
    for r, res in enumerate(results):
        # identical weights and input: only the masks can tell members apart
        assert res["within_rank_same"] is False, f"rank {r}: members of one rank share a mask ({res})"
        assert res["across_ranks_same"] == [], f"rank {r}: members {res['across_ranks_same']} on different ranks got the same mask"
        assert res["same_seed_rel"] == 0.0, f"rank {r}: the same seed gave another run ({res})"
        assert res["other_seed_rel"] > 1e-3, f"rank {r}: another seed gave the same masks ({res})"
    assert results[0]["after"] == results[1]["after"], "the caller's random stream advanced differently on the two ranks"


@pytest.mark.parametrize("rows", [2, 1, 3])
def test_a_per_member_input_without_all_n_rows_is_refused_on_every_rank(two_ranks, rows):
    for r, res in enumerate(scenario(two_ranks, f"per_member {rows} rows")):
        assert res["error"] == "DistributedError", f"rank {r}: {res}"
        assert f"input 'x' is per_member, so it needs a leading member axis of size 4; got [{rows}, 32, 64]" in res["message"], res
        assert "InputError" in res["message"] and "each rank takes its rows" in res["message"], res["message"]


def test_the_sharded_and_single_process_refusals_of_a_short_per_member_input_say_the_same(two_ranks):
    single = scenario(two_ranks, "per_member single process")[0]["message"]
    sharded = scenario(two_ranks, "per_member 2 rows")[0]["message"]
    common = "input 'x' is per_member, so it needs a leading member axis of size 4; got [2, 32, 64]. Stack one input per member"
    assert common in single and common in sharded, (single, sharded)


@pytest.mark.parametrize("case, found", [("bias of one element", "[1]"), ("transposed weight on rank 1", "[128, 64]")])
def test_a_checkpoint_tensor_of_another_shape_is_refused_before_anything_is_written(two_ranks, case, found):
    for r, res in enumerate(scenario(two_ranks, f"load {case}")):
        assert res["unchanged"], f"rank {r}: the load changed the members ({res})"  # old: broadcast, or half written
        assert res["error"] == "DistributedError", f"rank {r}: {res}"
        assert "member_003.safetensors" in res["message"] and found in res["message"] and "another size" in res["message"], res["message"]


def test_a_checkpoint_tensor_of_another_dtype_is_refused_before_anything_is_written(two_ranks):
    for r, res in enumerate(scenario(two_ranks, "load float64 weight")):
        assert res["error"] == "DistributedError", f"rank {r}: {res}"
        assert "member_001.safetensors" in res["message"] and "'fc1.weight' is float64" in res["message"], res["message"]
        assert res["unchanged"], f"rank {r}: the refused load changed the members ({res})"


def test_a_fitting_checkpoint_still_loads(two_ranks):
    for r, res in enumerate(scenario(two_ranks, "load fitting")):
        assert res["vs_saved"] <= 1e-6, f"rank {r}: {res}"


def test_mean_of_already_gathered_outputs_is_refused(two_ranks):
    for r, res in enumerate(scenario(two_ranks, "mean of gathered")):
        assert res["error"] == "DistributedError", f"rank {r}: {res}"
        assert "no member axis of 2" in res["message"] and "not gathered ones" in res["message"], res["message"]


# ---- the rank side ------------------------------------------------------------------------------

class DropNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def check_dropout() -> dict:
    """N=4 identical members in training on 2 ranks seeded alike: every member must get its own mask."""
    import torch.distributed as dist

    from stagewise import planner
    from stagewise.executor.distributed import build_sharded

    n = 4
    torch.manual_seed(0)
    one = DropNet().eval()
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    plan = planner.propose(planner.trace(one, (x,)), n_members=n)
    sharded = build_sharded(plan, [copy.deepcopy(one) for _ in range(n)]).train()

    def run(seed: int) -> torch.Tensor:
        torch.manual_seed(seed)  # every rank alike, the usual habit
        with torch.no_grad():
            return sharded.gather(sharded(x))

    a, b, c = run(7), run(7), run(8)
    after = torch.rand(3).tolist()  # the caller's stream after one forward: alike on every rank
    same = lambda i, j: bool(torch.equal(a[i], a[j]))  # noqa: E731
    return {"within_rank_same": same(0, 1) or same(2, 3),
            "across_ranks_same": [[i, j] for i in (0, 1) for j in (2, 3) if same(i, j)],
            "same_seed_rel": rel(a, b), "other_seed_rel": rel(a, c), "after": after, "rank": dist.get_rank()}


def check_short_per_member_input(rows: int) -> dict:
    from stagewise.executor.distributed import build_sharded

    src, plan, inputs = setup("mlp", 4, "per_member")
    sharded = build_sharded(plan, lambda idx: src.members(idx.stop)[idx.start:])
    with torch.no_grad():
        return expect_error(lambda: sharded(inputs[0][:rows]))


def check_single_process_refusal() -> dict:
    from stagewise import executor

    src, plan, inputs = setup("mlp", 4, "per_member")
    with torch.no_grad():
        return expect_error(lambda: executor.build(plan, src.members(4))(inputs[0][:2]))


def trained_members(n: int) -> list:
    from conftest import load_sample

    members = load_sample("mlp")[0].members(n)
    with torch.no_grad():
        for i, m in enumerate(members):
            for p in m.parameters():
                p.mul_(1.5).add_(0.01 * (i + 1))
    return members


def check_load(out: Path, name: str, corrupt) -> dict:
    """Save trained members, let rank 0 rewrite one file with `corrupt(state) -> state`, load into fresh members."""
    import torch.distributed as dist
    from safetensors.torch import load_file, save_file

    from stagewise.executor.distributed import build_sharded

    src, plan, inputs = setup("mlp", 4, "per_member")
    folder = out / name.replace(" ", "_")
    build_sharded(plan, trained_members(4)).save_checkpoint(folder)
    if corrupt is not None and dist.get_rank() == 0:
        member, change = corrupt
        path = folder / f"member_{member:03d}.safetensors"
        save_file(change(load_file(str(path))), str(path))
    dist.barrier()
    sharded = build_sharded(plan, lambda idx: src.members(idx.stop)[idx.start:])
    before = [{k: v.clone() for k, v in s.items()} for s in sharded.member_state_dicts()]
    got = expect_error(lambda: sharded.load_checkpoint(folder))
    after = sharded.member_state_dicts()
    got["unchanged"] = all(torch.equal(b[k], a[k]) for b, a in zip(before, after) for k in b)
    if corrupt is None:
        want = [trained_members(4)[i].state_dict() for i in sharded.member_indices]
        got["vs_saved"] = max(rel(a[k], w[k]) for a, w in zip(after, want) for k in a)
    return got


def check_mean_of_gathered() -> dict:
    from stagewise.executor.distributed import build_sharded

    src, plan, inputs = setup("mlp", 4, "per_member")
    sharded = build_sharded(plan, lambda idx: src.members(idx.stop)[idx.start:])
    with torch.no_grad():
        gathered = sharded.gather(sharded(*inputs))
        return expect_error(lambda: sharded.mean(gathered))


def scenarios(job: str, out: Path):
    """(name, thunk) in the order every rank runs them (each is collective)."""
    assert job == "review", job
    yield "dropout", check_dropout
    for rows in (2, 1, 3):
        yield f"per_member {rows} rows", lambda rows=rows: check_short_per_member_input(rows)
    yield "per_member single process", check_single_process_refusal
    corruptions = {
        "load bias of one element": (3, lambda s: {**s, "fc1.bias": s["fc1.bias"][:1].clone()}),  # broadcasts under copy_
        "load transposed weight on rank 1": (3, lambda s: {**s, "fc2.weight": s["fc2.weight"].t().contiguous()}),
        "load float64 weight": (1, lambda s: {**s, "fc1.weight": s["fc1.weight"].double()}),  # casts under copy_
        "load fitting": None,
    }
    for name, corrupt in corruptions.items():
        yield name, lambda name=name, corrupt=corrupt: check_load(out, name, corrupt)
    yield "mean of gathered", check_mean_of_gathered


def rank_main(job: str, rank: int, world: int, port: int, out: Path) -> None:
    from test_distributed import rank_main as run_rank

    run_rank(job, rank, world, port, out, lambda job, rank, out, results: scenarios(job, out))


if __name__ == "__main__":
    rank_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]))
