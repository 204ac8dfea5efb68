"""executor.distributed: the member axis sharded over the ranks of a torch.distributed process group.

Each rank builds the plan (`plan.with_n_members(k)`) for its contiguous slice of
the N members (`member_slice`: N=7 over 3 ranks -> 3, 2, 2) on its own device
(cpu under gloo, cuda:LOCAL_RANK under nccl) and runs it; only results cross
ranks (`gather`, `mean`), and with a DeviceMesh `"dp"` dimension gradients are
averaged over `"dp"` by an explicit `sync_gradients()` call before `opt.step()`
(no hook: the caller decides when, e.g. once after several accumulation steps), which
also copies dp rank 0's buffers to the other replicas, as DDP's broadcast_buffers does
(build_sharded starts every replica from dp rank 0's members, as DDP's construction does).
There is no gradient traffic between member shards: members are independent.

Layout: `forward` takes the whole model's inputs (shared as one member takes them,
per_member [N, ...], of which each rank runs its rows) and returns this rank's
outputs, [k, ...] for its k members; `gather` turns them into [N, ...] on every rank.

No hangs: every step that is followed by a collective runs inside `agreed(what)`,
which all-reduces a failure flag per rank; when any rank failed, every rank raises
one DistributedError naming the failing rank(s) and their message. A rank that dies
without reaching the flag shows up as the process group's timeout, also as a
DistributedError. Set the timeout in `init_process_group(timeout=...)` (`init_from_env`
sets DEFAULT_TIMEOUT_S). executor.distributed_check verifies and profiles a sharded plan rank by rank.
"""
from __future__ import annotations

import contextlib
import copy
import os
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from stagewise.planner.errors import InputError, MemberError, ModelLoadError, StagewiseError
from stagewise.planner.files import fsync_folder, mode_for
from stagewise.planner.plan import InputMode, Plan
from stagewise.executor.build import BatchedModule, build, check_member_folder, file_tensors
from stagewise.executor.members import slice_of

DEFAULT_TIMEOUT_S = float(os.environ.get("STAGEWISE_DIST_TIMEOUT_S", "300"))  # a collective waits this long for a slow or dead rank
_RANK_MIX = 0x9E3779B97F4A7C15  # spreads ranks over the seed space (forward's per-rank random stream)
MemberFactory = Callable[[range], Sequence[nn.Module]]  # this rank's global member indices -> its members, in order


class DistributedError(StagewiseError):
    """A rank failed, timed out, or the process group / mesh does not fit the plan."""


def member_slice(n: int, rank: int, world: int) -> range:
    """Global indices of the members `rank` holds: contiguous, the first n % world ranks one more (7 over 3 -> 0-2, 3-4, 5-6)."""
    if world < 1 or not 0 <= rank < world:
        raise DistributedError(f"rank {rank} of a world of {world}: a rank must be in 0..world-1")
    if n < world:
        raise DistributedError(f"{n} members over {world} ranks leaves ranks without members; use at most {n} ranks "
                               f"(or plan.with_n_members({world}) or more)")
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


# ---- groups, devices and the failure agreement -------------------------------------------------

def resolve_groups(group) -> tuple[Any, Any]:
    """(member group, dp group or None) from None (the world), a ProcessGroup, or a DeviceMesh."""
    from torch.distributed.device_mesh import DeviceMesh

    if not dist.is_available() or not dist.is_initialized():
        raise DistributedError("torch.distributed is not initialised; call dist.init_process_group(...) first "
                               "(or executor.distributed.init_from_env() under torchrun)")
    if group is None:
        return dist.group.WORLD, None
    if isinstance(group, DeviceMesh):
        names = tuple(group.mesh_dim_names or ())
        if "member" not in names or set(names) - {"member", "dp"}:
            raise DistributedError(f"the device mesh has dimensions {names}; name them ('member',) or ('member', 'dp') "
                                   "with init_device_mesh(..., mesh_dim_names=...)")
        return group.get_group("member"), (group.get_group("dp") if "dp" in names else None)
    return group, None


def _collective_device(group) -> torch.device:
    """Where the flag and padding tensors of a collective live: cuda under nccl, else cpu."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def rank_device(group=None, device: str | torch.device | None = None) -> torch.device:
    """`device` if given; else cuda:LOCAL_RANK under nccl, cpu otherwise."""
    if device is not None:
        return torch.device(device)
    member_group, _ = resolve_groups(group)
    if dist.get_backend(member_group) == "nccl":
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank() % max(torch.cuda.device_count(), 1)))
        return torch.device("cuda", local)
    return torch.device("cpu")


@contextlib.contextmanager
def collective_guard(what: str) -> Iterator[None]:
    """Turn a collective's timeout or broken connection into one DistributedError."""
    try:
        yield
    except RuntimeError as e:  # DistBackendError and gloo's timeouts are RuntimeErrors
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise DistributedError(f"{what}: rank {dist.get_rank()} got no answer from the other ranks ({first}); "
                               "another rank probably crashed or is stuck: check its output (the process group's "
                               "timeout bounds this wait)") from e


def _check_all(groups: Sequence[Any], what: str, error: BaseException | None) -> None:
    """Collective over `groups`: raise the same DistributedError on every rank when any rank passed an error."""
    me = dist.get_rank()
    flags = torch.zeros(dist.get_world_size(), dtype=torch.int32, device=_collective_device(groups[0]))
    flags[me] = int(error is not None)
    with collective_guard(f"checking that every rank finished {what}"):
        for g in groups:  # member group, then dp: disjoint rows, so MAX spreads every rank's flag to all
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=g)
    failed = [r for r, f in enumerate(flags.tolist()) if f]
    if not failed:
        return
    messages: dict[int, str] = {me: f"{type(error).__name__}: {error}"} if error is not None else {}
    with collective_guard(f"collecting the errors of {what}"):
        for g in groups:
            gathered: list[Any] = [None] * dist.get_world_size(g)
            dist.all_gather_object(gathered, messages, group=g)
            messages = {k: v for d in gathered for k, v in d.items()}
    first = failed[0]
    detail = (messages.get(first, "no message").splitlines() or [""])[0][:800]
    ranks = ("rank " if len(failed) == 1 else "ranks ") + ", ".join(str(r) for r in failed)
    raise DistributedError(f"{what} failed on {ranks} (rank {first}: {detail}); fix that rank's problem and run again "
                           "(every rank stopped here)") from error


@contextlib.contextmanager
def agreed(what: str, group=None) -> Iterator[None]:
    """Run a block on every rank; afterwards every rank raises DistributedError if the block raised on any rank.

    A collective step: every rank of `group` (None: the world; a ProcessGroup; a DeviceMesh)
    must enter it. Example: `with agreed("loading the data"): x = load(rank)`.
    """
    member_group, dp_group = resolve_groups(group)
    groups = [member_group] + ([dp_group] if dp_group is not None else [])
    error = None
    try:
        yield
    except Exception as e:  # this rank's failure: reported to all ranks below instead of leaving them waiting
        error = e
    _check_all(groups, what, error)


def init_from_env(device: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Initialise the default process group from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...).

    Backend nccl for a cuda `device` (each rank on cuda:LOCAL_RANK), gloo otherwise; collectives time
    out after `timeout_s`. Returns False when a group was already initialised (then nothing changes).
    """
    if dist.is_initialized():
        return False
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise DistributedError(f"--distributed needs the torchrun environment ({', '.join(missing)} not set); "
                               "start it as: torchrun --nproc-per-node K --no-python stagewise run plan.json MODEL --distributed")
    cuda = device is not None and torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    return True


# ---- the sharded module ------------------------------------------------------------------------

def local_members(members: Union[Sequence[nn.Module], MemberFactory], indices: range, n: int) -> list[nn.Module]:
    """This rank's members: from a factory called with `indices`, or sliced out of all N."""
    if callable(members) and not isinstance(members, nn.Module):
        local = list(members(indices))
        if len(local) != len(indices):
            raise MemberError(f"the member factory returned {len(local)} modules for members {indices.start}-{indices.stop - 1}; "
                              f"it must return one per index ({len(indices)})")
        return local
    if isinstance(members, nn.Module):
        raise MemberError("pass a list of N members or a factory (indices) -> members, not one module")
    members = list(members)
    if len(members) != n:
        raise MemberError(f"the plan is for {n} members but {len(members)} were given; pass all {n} "
                          "(each rank takes its slice) or a factory (indices) -> members")
    return [members[i] for i in indices]


def _value_print(x: Any) -> tuple:
    """How a non-tensor input is compared across ranks."""
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return ("value", type(x).__name__, repr(x), "")
    if isinstance(x, (int, float)):
        v = float(x)
        return ("value", "number", "nan" if v != v else repr(v + 0.0), "")
    return ("value", type(x).__name__, "", "")


def _checksum(x: torch.Tensor) -> torch.Tensor:
    """Two int64 numbers that equal tensors (equal values, any memory layout, any thread count) share: the tensor's
    bits as integers summed, wrapping (exact, in any order), and summed per row (dim 0) weighted by a pseudo-random
    number per place in the row, the row sums by another per row (_place_weights), so another order of the same values
    differs: a flipped image, a shuffled batch, a square matrix transposed (which weights by the places themselves,
    (row + 1) * (column + 1), could not tell)."""
    t = x.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.is_floating_point():  # equal values, one bit pattern: -0.0 as 0.0, every NaN as one NaN
        t = torch.where(torch.isnan(t), torch.full((), float("nan"), dtype=t.dtype, device=t.device), t + 0.0)
    t = t.contiguous()
    if t.dtype is torch.bool:
        t = t.view(torch.uint8)
    bits = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()]
    words = t.view(bits) if t.dtype is not bits else t
    rows = words.reshape(words.shape[0] if words.dim() and words.numel() else 1, -1)
    # integer sums wrap, exactly, in any order
    per_row = (rows.to(torch.int64) * _place_weights(rows.shape[1], rows.device, _IN_ROW)).sum(1)
    return torch.stack([rows.sum(dtype=torch.int64), (per_row * _place_weights(per_row.numel(), rows.device, _ROW)).sum()])


_IN_ROW, _ROW = 0x9E3779B97F4A7C15 - 2 ** 64, 0xC2B2AE3D27D4EB4F - 2 ** 64  # odd 64-bit multipliers, as int64


def _place_weights(n: int, device: torch.device, multiplier: int) -> torch.Tensor:
    """[n] int64: a pseudo-random number per place 1..n (a multiplicative hash, wrapping), the same on every rank and
    device; two multipliers give two sequences that are not multiples of each other."""
    w = torch.arange(1, n + 1, device=device, dtype=torch.int64) * multiplier
    return w ^ (w >> 29)


class ShardedModule(nn.Module):
    """This rank's slice of the members as one BatchedModule (`.module`), plus the collectives over the slices.

    parameters() are this rank's stacked member state ([k, ...] each), ready for a stacked
    optimizer with `local_values(per-member hyper-parameters)`.
    """

    def __init__(self, plan: Plan, module: BatchedModule, indices: range, group, device: torch.device):
        super().__init__()
        self.plan = plan  # the whole plan, for N members
        self.module = module  # this rank's BatchedModule, for len(indices) members
        self.member_indices = indices
        self.device = device
        self._group = group
        self._member_group, self._dp_group = resolve_groups(group)
        self._world = dist.get_world_size(self._member_group)
        self._slices = [member_slice(plan.n_members, r, self._world) for r in range(self._world)]

    @property
    def n_members(self) -> int:
        return self.plan.n_members

    def local_values(self, values: Sequence[Any] | Any) -> Any:
        """This rank's entries of a length-N sequence (per-member lr, ...); anything else as it is."""
        if isinstance(values, (list, tuple)) and len(values) == self.n_members:
            return type(values)(values[i] for i in self.member_indices)
        if isinstance(values, torch.Tensor) and values.dim() >= 1 and values.shape[0] == self.n_members:
            return values[self.member_indices.start:self.member_indices.stop]
        shape = getattr(values, "shape", None)  # a numpy array (np.logspace(-4, -2, N)), or another array type
        if shape is not None and len(shape) >= 1 and shape[0] == self.n_members and hasattr(values, "__getitem__"):
            return values[self.member_indices.start:self.member_indices.stop]
        return values

    def local_active(self, members: Any) -> torch.Tensor:
        """A stacked optimizer's `step(active=...)` for this rank: the bool mask of its k members among `members`,
        the global member indices that step (`[1]` is member 1 of all N, on whichever rank holds it) or a bool mask
        of N. A global index list passed as it is would be read as local positions (0..k-1): other members' rows.
        DistributedError for an index outside 0..N-1 or a mask of another length."""
        n = self.n_members
        given = torch.as_tensor(members.detach().cpu() if isinstance(members, torch.Tensor) else members)
        if given.dtype is torch.bool:
            if given.shape != (n,):
                raise DistributedError(f"local_active: a bool mask of shape {list(given.shape)} for {n} members; pass "
                                       f"one bool per member of all {n}, or the global indices of the members that step")
            mask = given
        else:
            if given.numel() and (given.is_floating_point() or given.dim() > 1 or not bool(((given >= 0) & (given < n)).all())):
                raise DistributedError(f"local_active({members!r}): pass the global indices (0..{n - 1}) of the members "
                                       f"that step, or a bool mask of {n}")
            mask = torch.zeros(n, dtype=torch.bool)
            mask[given.long()] = True
        return mask[self.member_indices.start:self.member_indices.stop].clone()

    def local_inputs(self, inputs: Sequence[Any]) -> tuple:
        """The inputs this rank runs, on its device: per_member ones' rows of its members, shared ones as given.

        A per_member input is taken as one process takes it, whole: a tensor of N rows on dim 0, a dict, list or tuple
        whose every tensor has N rows (each sliced; its other values as they are), or, for one traced as a Python
        number, a list of N numbers. Raises InputError otherwise: a slice of k rows would run on this rank's k members
        (each rank the same rows) and one row would be refused by some ranks only (the refusal BatchedModule makes)."""
        out = [self._member_rows(spec, x) if spec.mode is InputMode.PER_MEMBER else x
               for spec, x in zip(self.plan.inputs, inputs)]
        out += list(inputs[len(out):])  # too many inputs: the module's own InputError says so
        return tuple(tree_map(lambda t: t.to(self.device) if isinstance(t, torch.Tensor) else t, out))

    def _member_rows(self, spec, x: Any) -> Any:
        """This rank's rows of the per_member input `x` (see local_inputs); InputError unless it holds all N."""
        n, start, stop = self.n_members, self.member_indices.start, self.member_indices.stop
        if spec.shape is None and spec.dtype in ("bool", "int", "float") and isinstance(x, (list, tuple)) \
                and len(x) == n and all(isinstance(v, (bool, int, float)) for v in x):
            return type(x)(x[start:stop])  # one Python number per member
        container = spec.shape is None and isinstance(x, (dict, list, tuple))  # (one traced as a tensor takes a tensor)
        leaves = [x] if isinstance(x, torch.Tensor) else \
            [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)] if container else []
        if not leaves or any(t.dim() == 0 or t.shape[0] != n for t in leaves):
            got = (list(x.shape) if isinstance(x, torch.Tensor) else
                   f"a {type(x).__name__} whose tensors are shaped {[list(t.shape) for t in leaves][:4]}" if leaves
                   else type(x).__name__)
            raise InputError(
                f"input {spec.name!r} is per_member, so it needs a leading member axis of size {n}; got {got}. Stack "
                f"one input per member (each tensor of a dict or tuple input; all {n}: each rank takes its rows), or plan "
                "it as 'shared'; for rows already sliced to this rank's members, call `.module`")
        return tree_map(lambda t: t[start:stop] if isinstance(t, torch.Tensor) else t, x)

    def __deepcopy__(self, memo: dict) -> "ShardedModule":
        """A copy of this rank's members and collectives that shares the process group (an EMA or SWA copy,
        `AveragedModel(sharded)`): a group is this process's connection to the others, not a value to copy."""
        for shared in (self._group, self._member_group, self._dp_group):
            if shared is not None:
                memo[id(shared)] = shared
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            new.__dict__[k] = copy.deepcopy(v, memo)
        return new

    def __reduce_ex__(self, protocol):
        raise DistributedError("a ShardedModule holds this process's process group, which cannot be pickled: save its "
                               "members with sharded.save_checkpoint(folder) (or torch.save(sharded.state_dict(), ...) per "
                               "rank), and build_sharded again in the new processes")

    def forward(self, *inputs, **named):
        """Whole-model inputs (per_member [N, ...]) -> this rank's outputs, k-first. Every rank must call it
        (a failure on one rank raises DistributedError on all). For inputs already sliced, call `.module`.

        Random numbers (dropout masks in training, any random op): each rank draws from its own stream,
        seeded by one draw of torch's CPU generator (so the caller's stream advances alike on every rank)
        mixed with this process's global rank, and restored afterwards (`torch.random.fork_rng` on CPU and
        this rank's device). Seeding every rank alike, as usual, therefore still gives members on different
        ranks (and dp replicas) their own masks, and the same seed reproduces the same run for the same
        world layout. It cannot match the single-process loop draw for draw: the masks differ from those
        of one process, but no two members share them.
        """
        if named:
            raise InputError(f"the sharded module takes its inputs positionally, in the plan's order "
                             f"{[i.name for i in self.plan.inputs]}; got keyword(s) {sorted(named)}")
        with agreed("the forward of each rank's members", self._group):
            if self.check_inputs and self._world > 1:
                self._same_inputs_on_every_rank(inputs)
            local = self.local_inputs(inputs)
            with self._own_random_stream():
                out = self.module(*local)
        self._write_back_inputs(inputs, local)
        return out

    def _write_back_inputs(self, inputs: Sequence[Any], local: Sequence[Any]) -> None:
        """The rows every other rank wrote into a per_member input forward() writes in place (`x.mul_(2)`) into the
        caller's tensor, as the member loop writes all N rows (and this rank's, where its rows were a copy on another
        device): each rank wrote only its rows, so the ranks' tensors would differ from the loop's and from each other's.
        Written through `.data`, so no version counter moves: this rank's autograd graph saved only its own rows, which
        keep their values. One all-gather per such input; nothing for a plan that writes no input. Collective."""
        written = self.module.__dict__.get("_written_inputs") or ()
        for spec, whole, mine in zip(self.plan.inputs, inputs, local):
            if spec.mode is not InputMode.PER_MEMBER or spec.name not in written:
                continue
            for t, rows in zip(tree_flatten(whole)[0], tree_flatten(mine)[0]):
                if isinstance(t, torch.Tensor) and isinstance(rows, torch.Tensor):
                    t.data.copy_(self._gather_tensor(rows).to(t.device))

    check_inputs = True  # forward() compares the inputs' fingerprints across member ranks (one small collective a call)

    def _same_inputs_on_every_rank(self, inputs: Sequence[Any]) -> None:
        """DistributedError unless every member rank was given the same whole inputs: ranks holding other members of
        one ensemble must see one batch (a DistributedSampler's per-rank batches, an unseeded torch.randn per process,
        would mix predictions on different data without a word). Compared by shape, dtype and two checksums of each
        tensor's bits (_checksum: their sum, and their sum weighted by place; NaN equal to NaN), other values by value
        or type; the data-parallel replicas of a group may differ. Set `check_inputs = False` on the module to skip it."""
        flat = tree_flatten(list(inputs))[0]
        leaves = [x for x in flat if isinstance(x, torch.Tensor)]
        with torch.no_grad():
            sums = [_checksum(x) for x in leaves]
            values = torch.cat(sums).tolist() if sums else []  # one host read for all of them
        mine = [(tuple(x.shape), str(x.dtype), values[2 * i], values[2 * i + 1]) for i, x in enumerate(leaves)]
        # the other leaves too (a Python number, None, a string: `forward(x, scale)` with another scale per rank);
        # numbers by value (2 as 2.0, -0.0 as 0.0), other objects by type alone (their repr may hold an address)
        mine += [_value_print(x) for x in flat if not isinstance(x, torch.Tensor)]
        got: list[Any] = [None] * self._world
        with collective_guard("comparing the inputs across ranks"):
            dist.all_gather_object(got, mine, group=self._member_group)
        names = [i.name for i in self.plan.inputs]
        order = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)] + \
            [i for i, x in enumerate(flat) if not isinstance(x, torch.Tensor)]
        for r, theirs in enumerate(got):
            if len(theirs) != len(mine):
                raise DistributedError(f"member rank {r} was given {len(theirs)} input values where this rank has "
                                       f"{len(mine)}: every rank must call forward() with the same whole inputs")
            for k, (a, b) in enumerate(zip(theirs, mine)):
                if a != b:
                    at = order[k]  # where in the flattened inputs
                    what = f"input {names[at]!r}" if len(flat) == len(names) else f"input value {at}"
                    shown = (f"{a[2]} vs {b[2]}" if a[0] == "value" else
                             f"shape {list(a[0])} vs {list(b[0])}, checksums {a[2]}/{a[3]} vs {b[2]}/{b[3]}")
                    raise DistributedError(
                        f"{what} differs between member rank {r} and this rank ({dist.get_rank(self._member_group)}) "
                        f"({shown}): the ranks hold different "
                        "members of one ensemble, so every one must get the same whole batch (shared inputs as they "
                        "are, per_member ones [N, ...]). Give every rank the same data (no DistributedSampler across "
                        "member ranks; the same seed before drawing inputs); data-parallel replicas are another group")

    @contextlib.contextmanager
    def _own_random_stream(self) -> Iterator[None]:
        """Inside: CPU and this rank's device generators seeded for this rank alone (see forward); restored after."""
        draw = int(torch.randint(0, 2 ** 62, (), dtype=torch.int64).item())  # the caller's stream: one draw, every rank
        seed = (draw + _RANK_MIX * (dist.get_rank() + 1)) % 2 ** 63  # odd multiplier: low 32 bits differ per rank too
        cuda = [self.device.index if self.device.index is not None else torch.cuda.current_device()] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            torch.default_generator.manual_seed(seed)
            if cuda:
                torch.cuda.default_generators[cuda[0]].manual_seed(seed)
            yield

    def gather(self, out):
        """All ranks' k-first outputs -> N-first outputs (member order), on every rank; not differentiable."""
        leaves, spec = tree_flatten(out)
        with agreed("gathering outputs", self._group):
            self._check_member_axis(leaves, "gather")
        self._same_layout_on_every_rank(leaves, spec, "gather")
        return tree_unflatten([self._gather_tensor(x) if isinstance(x, torch.Tensor) else x for x in leaves], spec)

    def _check_member_axis(self, leaves: list, what: str) -> None:
        """DistributedError unless every tensor leaf leads with this rank's k members (the outputs of forward())."""
        k = len(self.member_indices)
        for x in leaves:
            if isinstance(x, torch.Tensor) and (x.dim() == 0 or x.shape[0] != k):
                raise DistributedError(f"{what}: an output of shape {list(x.shape)} has no member axis of {k} (this rank's "
                                       f"members {self.member_indices.start}-{self.member_indices.stop - 1}); pass the "
                                       "outputs of forward(), not gathered ones")

    def _same_layout_on_every_rank(self, leaves: list, spec, what: str) -> None:
        """DistributedError on every rank unless every rank's outputs have one structure, the same shapes after the
        member axis and dtypes, and the same non-tensor values. Each rank traced its own members: a number a rank's
        members agree on (returned as one plain value, or baked into a size) may differ from another rank's, and
        gloo moves bytes: a [2, 4] slice gathered beside a [4, 2] one would be read in the wrong shape. Collective."""
        mine = (str(spec), [("tensor", tuple(x.shape[1:]), str(x.dtype)) if isinstance(x, torch.Tensor) else ("value", x)
                            for x in leaves])
        got: list[Any] = [None] * self._world
        with collective_guard(f"comparing the outputs' layout before {what}"):
            dist.all_gather_object(got, mine, group=self._member_group)
        for r, theirs in enumerate(got):
            if theirs[0] != mine[0] or len(theirs[1]) != len(mine[1]):
                raise DistributedError(f"{what}: the outputs of member rank {r} have another structure than member rank 0's; "
                                       "every rank must pass the outputs of its forward()")
            for k, (a, b) in enumerate(zip(got[0][1], theirs[1])):
                if a != b:
                    shown = lambda v: (f"a tensor [k, {', '.join(map(str, v[1]))}] {v[2]}" if v[0] == "tensor"  # noqa: E731
                                       else f"the value {v[1]!r}")
                    raise DistributedError(
                        f"{what}: output leaf {k} is {shown(a)} on member rank 0 (members {self._slices[0].start}-"
                        f"{self._slices[0].stop - 1}) but {shown(b)} on member rank {r} (members {self._slices[r].start}-"
                        f"{self._slices[r].stop - 1}): the members differ in a value their outputs depend on, which one "
                        "process refuses at build; give the members one value, or make it a tensor buffer (per-member state)")

    def _gather_tensor(self, x: torch.Tensor) -> torch.Tensor:
        most = max(len(s) for s in self._slices)  # gloo's all_gather needs one size: pad, then cut
        x = x.detach()
        padded = torch.cat([x, x.new_zeros((most - x.shape[0], *x.shape[1:]))]) if x.shape[0] < most else x
        parts = [torch.empty_like(padded) for _ in self._slices]
        with collective_guard("gathering outputs"):
            dist.all_gather(parts, padded.contiguous(), group=self._member_group)
        return torch.cat([p[:len(s)] for p, s in zip(parts, self._slices)])

    def mean(self, out):
        """The ensemble mean over all N members of each floating output, on every rank (an all-reduce, not a gather)."""
        leaves, spec = tree_flatten(out)
        with agreed("averaging outputs", self._group):
            self._check_member_axis(leaves, "mean")  # gathered [N, ...] outputs would count every member world times
            bad = [list(x.shape) for x in leaves if isinstance(x, torch.Tensor) and not x.is_floating_point()]
            if bad:
                raise DistributedError(f"mean: output(s) of shape {bad} are not floating point; use gather() for them")
        self._same_layout_on_every_rank(leaves, spec, "mean")
        result = []
        for x in leaves:
            if isinstance(x, torch.Tensor):
                x = x.detach().sum(0)
                with collective_guard("averaging outputs"):
                    dist.all_reduce(x, group=self._member_group)
                x = x / self.n_members
            result.append(x)
        return tree_unflatten(result, spec)

    def sync_gradients(self) -> None:
        """Average gradients over the mesh's "dp" dimension (replicas of the same members on other data), then make
        every replica's buffers dp rank 0's (`sync_buffers`). Call it after backward and before opt.step(); without
        "dp" it does nothing (member shards never exchange gradients). A backward that may fail on one rank goes
        inside `with agreed("backward", group):`, so the others do not wait here."""
        if self._dp_group is None:
            return
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if grads:
            flat = torch._utils._flatten_dense_tensors(grads)  # one all-reduce for all of them
            with collective_guard("averaging gradients over dp"):
                dist.all_reduce(flat, group=self._dp_group)
            flat /= dist.get_world_size(self._dp_group)
            for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)
        self.sync_buffers()

    def sync_buffers(self) -> None:
        """Copy dp rank 0's buffers (BatchNorm running statistics, num_batches_tracked, ...) to the other replicas
        along "dp", as DDP's broadcast_buffers does: each replica's training forward updates them from its own
        data, so without it replicas of the same members would drift apart and evaluate differently. Collective
        over "dp" (one broadcast of all their bytes); sync_gradients calls it. Call it yourself after buffers change
        without a step (swa_utils.update_bn, a forward in training for statistics only). Nothing without "dp"."""
        if self._dp_group is None:
            return
        state = self.module.stacked_state
        _broadcast_from_first([t for t in state.values() if not isinstance(t, nn.Parameter)], self._dp_group,
                              "copying dp rank 0's buffers to the other dp ranks")

    def member_state_dicts(self) -> list[dict[str, torch.Tensor]]:
        """This rank's members as ordinary state dicts, in member_indices order."""
        return self.module.member_state_dicts()

    def save_checkpoint(self, folder: str | Path) -> list[Path]:
        """Each rank writes its members as `folder/member_{global index:03d}.safetensors` (dp replicas: dp rank 0 only).
        Collective; returns the paths this rank wrote. The folder loads with any number of ranks (load_checkpoint).

        All or nothing over the ranks: each rank first writes its files under temporary names beside them; only when
        every rank wrote all of its own does any rank move them over the old files (keeping those aside until every
        rank moved its own). A rank that fails to write (a full disk) or to move raises DistributedError on every rank
        and the folder keeps the files it had (an earlier checkpoint stays whole), with no temporary file left."""
        from safetensors.torch import save_file

        folder, paths = Path(folder), []
        writes = self._dp_group is None or dist.get_rank(self._dp_group) == 0
        with agreed(f"checking the checkpoint folder {folder}", self._group):  # before any rank writes
            if writes:  # refused as executor.save_member_weights refuses it (a file; member files of a larger set)
                check_member_folder(folder, self.n_members)
        written: list[tuple[Path, Path]] = []  # (temporary file, its member file)
        moved: list[tuple[Path, Path | None]] = []  # (member file now replaced, the old file kept aside or None)
        try:
            with agreed(f"saving the checkpoint to {folder}", self._group):
                if writes:
                    folder.mkdir(parents=True, exist_ok=True)
                    for g, state in zip(self.member_indices, file_tensors(self.member_state_dicts())):
                        path = folder / f"member_{g:03d}.safetensors"
                        target = Path(os.path.realpath(path)) if path.is_symlink() else path  # a link stays a link
                        written.append((_temp_beside(target), target))
                        save_file(state, str(written[-1][0]))
                        paths.append(path)
            with agreed(f"replacing the checkpoint files in {folder}", self._group):  # every rank wrote all of its own
                for tmp, path in written:
                    old = _temp_beside(path) if path.exists() else None
                    if old is not None:
                        os.replace(path, old)
                    moved.append((path, old))
                    os.replace(tmp, path)
        except BaseException:  # this rank or another failed: put back what this rank moved, drop what it wrote
            for path, old in reversed(moved):
                with contextlib.suppress(OSError):
                    if old is not None:
                        os.replace(old, path)
                    elif path.exists():
                        path.unlink()
            for tmp, _ in written:
                with contextlib.suppress(OSError):
                    tmp.unlink(missing_ok=True)
            raise
        for _, old in moved:  # every rank replaced its files: the old ones go
            if old is not None:
                old.unlink(missing_ok=True)
        if written:
            fsync_folder(folder)
        return paths

    def load_checkpoint(self, folder: str | Path) -> None:
        """Load this rank's members from a folder written by save_checkpoint with any number of ranks. Collective.

        Every rank reads its member files and checks each tensor's name, shape and dtype against its stacked
        state first; only when every rank's files fit does any rank write. Raises DistributedError on every
        rank (naming the file, the key, and the expected and found shape or dtype) and leaves every rank's
        members as they were when a file is missing or does not fit.
        """
        from safetensors.torch import load_file

        folder = Path(folder)
        loaded = []
        with agreed(f"loading the checkpoint from {folder}", self._group):
            count = len(list(folder.glob("member_*.safetensors")))
            if count != self.n_members:
                raise ModelLoadError(f"checkpoint {folder} holds {count} member files but the plan has {self.n_members} members; "
                                     f"load it into plan.with_n_members({count}) or pick the right folder")
            stacked, keys = self.module.stacked_state, self.module._member_keys
            for g in self.member_indices:
                path = folder / f"member_{g:03d}.safetensors"
                state = load_file(str(path), device=str(self.device))
                _check_member_file(path, state, {k: stacked[k][0] for k in keys})
                loaded.append(state)
        with torch.no_grad():  # every rank's files fit (agreed above): the copies cannot fail half-way
            for j, state in enumerate(loaded):
                for k in keys:
                    stacked[k][j].copy_(state[k])


def _check_member_file(path: Path, state: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """ModelLoadError unless `state` has exactly `want`'s keys, each with its shape and dtype (one member's row)."""
    if set(state) != set(want):
        raise ModelLoadError(f"{path} has keys that differ from the model's "
                             f"(missing {sorted(set(want) - set(state))[:3]}, extra {sorted(set(state) - set(want))[:3]}); "
                             "it was saved from another architecture")
    for k, row in want.items():
        got = state[k]
        if got.shape != row.shape:
            raise ModelLoadError(f"{path}: {k!r} has shape {list(got.shape)}, the model's member has {list(row.shape)}; "
                                 "it was saved from a model of another size: load it into a plan of that model, or pick "
                                 "the right folder")
        if got.dtype != row.dtype:
            raise ModelLoadError(f"{path}: {k!r} is {str(got.dtype).removeprefix('torch.')}, the model's member holds "
                                 f"{str(row.dtype).removeprefix('torch.')}; it was saved at another precision: load it into "
                                 "a plan of that dtype (planner.set_dtype), or convert the file")


def _temp_beside(path: Path) -> Path:
    """A fresh empty file beside `path` (`.member_000.safetensors.XXXX.tmp`: no member file name, so no load counts
    it), with the mode `path` has or a new file would get."""
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    os.chmod(name, mode_for(path))  # mkstemp makes 0600
    return Path(name)


def _broadcast_from_first(tensors: list[torch.Tensor], group, what: str) -> None:
    """Overwrite `tensors` on every rank of `group` with those of its rank 0: their bytes in one broadcast per device."""
    src = dist.get_global_rank(group, 0)
    on: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            on.setdefault(t.device, []).append(t)
    with torch.no_grad():
        for same in on.values():
            flat = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in same])  # any dtypes at once
            with collective_guard(what):
                dist.broadcast(flat, src=src, group=group)
            if dist.get_rank() == src:
                continue
            at = 0
            for t in same:
                size = t.numel() * t.element_size()
                t.copy_(flat[at:at + size].view(t.dtype).view(t.shape))
                at += size


def build_sharded(plan: Plan, members: Union[Sequence[nn.Module], MemberFactory], group=None,
                  device: str | torch.device | None = None, *, check_memory: bool = True) -> ShardedModule:
    """Build this rank's slice of `plan`'s N members. Collective: every rank of `group` calls it.

    Args:
        plan: the plan for all N members.
        members: all N members (each rank keeps its slice) or a factory `(indices: range) -> members`
            that builds only this rank's (global indices, e.g. range(3, 5)).
        group: None (the default process group), a ProcessGroup, or a DeviceMesh with a "member"
            dimension and optionally "dp" (ranks along "dp" hold the same members).
        device: default cpu under gloo, cuda:LOCAL_RANK under nccl.
    Returns:
        ShardedModule over members `member_slice(N, member rank, member ranks)`.
    Raises:
        DistributedError on every rank when building failed on any rank (naming it), or when
        there are more member ranks than members.
    """
    member_group, _ = resolve_groups(group)
    indices = member_slice(plan.n_members, dist.get_rank(member_group), dist.get_world_size(member_group))
    dev = rank_device(group, device)
    module = None
    with agreed("building each rank's members", group):
        everyone = None if callable(members) else list(members)  # all N given (once: an iterator too), or a factory
        local = local_members(members if everyone is None else everyone, indices, plan.n_members)
        # all N given: the state members share is checked over all of them (a BatchNorm, a trainable backbone held by
        # members on two ranks is one tensor in the loop), so every rank refuses what one process refuses, as it does.
        # A factory's members are this rank's alone: what they would share with another rank's cannot be seen
        with slice_of(everyone, indices) if everyone is not None else contextlib.nullcontext():
            module = build(plan.with_n_members(len(indices)), local, device=dev, check_memory=check_memory)
    sharded = ShardedModule(plan, module, indices, group, dev)
    if sharded._dp_group is not None:  # replicas along "dp" start from dp rank 0's members, as DDP's construction does
        _broadcast_from_first(list(module.stacked_state.values()), sharded._dp_group,
                              "copying dp rank 0's members to the other dp ranks")
    return sharded
