"""Train a deep ensemble of 16 small MLPs on scikit-learn's handwritten digits, through a stagewise plan.

    python examples/train_ensemble.py [--members 16] [--epochs 30] [--device cpu] [--seed 0] [--threads 1] [--save DIR]

What it does, top to bottom:

1. loads `sklearn.datasets.load_digits` (1797 images of 8x8 pixels, bundled with scikit-learn: no
   download), splits it into a training and a test set;
2. makes N MLPs 64-128-64-10 with their own initial weights, and gives member i its own learning
   rate, log-spaced between --lr-min and --lr-max (a sweep: some members train well, some do not);
3. plans the N members as batched stages (`planner.trace` + `planner.propose`), builds the batched
   module (`executor.build`) and trains it with one `executor.StackedAdam` whose lr is the length-N
   sweep; every member sees its own shuffle of the training set (the input is planned `per_member`:
   [N, batch, 64]);
4. trains the plain reference on the same batches for the same steps: N separate models, each with
   its own `torch.optim.Adam`; both are timed;
5. reports each member's test accuracy, the ensemble's (mean of the members' softmax), the training
   throughput of both ways (samples/s, one sample = one image seen by one member) and how far the
   two ways' members are apart after the first `check_steps` steps. (After hundreds of Adam steps
   they drift apart: both ways round differently, and Adam turns rounding-level gradients into
   steps of size lr; each way's ensemble accuracy is reported.)

`main(argv)` returns the result as a dict (tests/test_examples.py calls it with a tiny config).
"""
from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from stagewise import executor
from stagewise import planner


@dataclass
class Config:
    members: int = 16
    epochs: int = 20
    batch: int = 64
    lr_min: float = 3e-4  # the sweep spans two decades of Adam's lr: the slowest members underfit in 30 epochs
    lr_max: float = 3e-2
    device: str = "cpu"
    seed: int = 0
    max_steps: int | None = None  # stop early (tests)
    check_steps: int = 10  # steps after which stagewise and loop members are compared (see run())
    test_fraction: float = 0.25
    save: str | None = None  # folder for one .safetensors per member
    threads: int = 0  # torch intra-op threads; 0 = torch's default (1 is steadier on a machine other jobs share)


class DigitsMLP(nn.Module):
    """64 pixels -> 128 -> 64 -> 10 logits."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 64)
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        return self.head(F.relu(self.fc2(F.relu(self.fc1(x)))))


# --- data --------------------------------------------------------------------------------------

def load_data(seed: int, test_fraction: float = 0.25) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train [M, 64], y_train [M], x_test [T, 64], y_test [T]); pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits  # scikit-learn: `pip install -e '.[test]'`

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(x) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def member_batches(n_members: int, n_train: int, batch: int, epochs: int, seed: int) -> list[torch.Tensor]:
    """Index tensors [N, batch], one per step: every member walks its own shuffle of the training set each epoch."""
    g = torch.Generator().manual_seed(seed + 1)
    per_epoch = n_train // batch  # drop the last partial batch: every step has the same shape
    steps = []
    for _ in range(epochs):
        orders = torch.stack([torch.randperm(n_train, generator=g) for _ in range(n_members)])
        steps += [orders[:, s * batch:(s + 1) * batch] for s in range(per_epoch)]
    return steps


# --- members -----------------------------------------------------------------------------------

def make_members(n: int, seed: int) -> list[nn.Module]:
    """N MLPs with their own initial weights (seed, seed+1, ...)."""
    members = []
    for i in range(n):
        torch.manual_seed(seed * 1000 + i)
        members.append(DigitsMLP())
    return members


def member_lrs(cfg: Config) -> list[float]:
    """Log-spaced learning rates, lr_min for member 0 up to lr_max for member N-1."""
    n = cfg.members
    if n == 1:
        return [math.sqrt(cfg.lr_min * cfg.lr_max)]
    return [cfg.lr_min * (cfg.lr_max / cfg.lr_min) ** (i / (n - 1)) for i in range(n)]


# --- the two ways of training ------------------------------------------------------------------

def ensemble_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Sum over members of each member's mean cross-entropy. logits [N, B, 10], y [N, B]."""
    n, b, c = logits.shape
    return F.cross_entropy(logits.reshape(n * b, c), y.reshape(n * b), reduction="sum") / b


def train_stagewise(members: list[nn.Module], lrs: list[float], x: torch.Tensor, y: torch.Tensor,
                    steps: list[torch.Tensor], device: torch.device, progress: Callable = None) -> tuple[executor.BatchedModule, float]:
    """Plan, build and train the N members as one batched module with one stacked Adam. Returns (module, seconds)."""
    n = len(members)
    graph = planner.trace(members[0], (x[: steps[0].shape[1]],))
    plan = planner.propose(graph, n_members=n, input_mode="per_member")
    ens = executor.build(plan, members, device=device)
    ens.train()
    opt = executor.StackedAdam(ens.parameters(), n, lr=lrs)  # member i's lr is lrs[i]
    x, y = x.to(device), y.to(device)
    start = time.perf_counter()
    for idx in _progress(steps, "stagewise", progress):
        idx = idx.to(device)
        opt.zero_grad()
        ensemble_loss(ens(x[idx]), y[idx]).backward()  # x[idx]: [N, B, 64], one batch per member
        opt.step()
    _sync(device)
    return ens, time.perf_counter() - start


def train_loop(members: list[nn.Module], lrs: list[float], x: torch.Tensor, y: torch.Tensor,
               steps: list[torch.Tensor], device: torch.device, progress: Callable = None) -> tuple[list[nn.Module], float]:
    """The plain reference: N models, each with its own torch.optim.Adam, on the same batches. Returns (models, seconds)."""
    models = [copy.deepcopy(m).to(device).train() for m in members]
    opts = [torch.optim.Adam(m.parameters(), lr=lr) for m, lr in zip(models, lrs)]
    x, y = x.to(device), y.to(device)
    start = time.perf_counter()
    for idx in _progress(steps, "loop of N", progress):
        idx = idx.to(device)
        for i, (m, opt) in enumerate(zip(models, opts)):
            opt.zero_grad()
            F.cross_entropy(m(x[idx[i]]), y[idx[i]]).backward()
            opt.step()
    _sync(device)
    return models, time.perf_counter() - start


# --- evaluation --------------------------------------------------------------------------------

@torch.no_grad()
def accuracies(probs: torch.Tensor, y: torch.Tensor) -> tuple[list[float], float]:
    """probs [N, T, 10] (each member's softmax) -> (each member's accuracy, the ensemble's: argmax of the mean)."""
    members = (probs.argmax(-1) == y).float().mean(-1).tolist()
    ensemble = (probs.mean(0).argmax(-1) == y).float().mean().item()
    return members, ensemble


@torch.no_grad()
def stagewise_probs(ens: executor.BatchedModule, x_test: torch.Tensor) -> torch.Tensor:
    """Each member's softmax on the test set, [N, T, 10] (the per_member input takes the test set once per member)."""
    ens.eval()
    n = ens.n_members
    return ens(x_test.unsqueeze(0).expand(n, *x_test.shape).contiguous()).softmax(-1)


def max_param_difference(ens: executor.BatchedModule, models: list[nn.Module]) -> float:
    """Largest |stagewise - loop| over every member's parameters, relative to that tensor's largest value."""
    worst = 0.0
    for state, m in zip(ens.member_state_dicts(), models):
        for k, p in m.named_parameters():
            want = p.detach().cpu()
            got = state[k].cpu()
            worst = max(worst, ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item())
    return worst


# --- the run -----------------------------------------------------------------------------------

def run(cfg: Config, progress: Callable = None) -> dict:
    """Train both ways and evaluate; returns plain data (see the module docstring)."""
    device = executor.resolve_device(cfg.device)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    x_train, y_train, x_test, y_test = load_data(cfg.seed, cfg.test_fraction)
    steps = member_batches(cfg.members, len(x_train), cfg.batch, cfg.epochs, cfg.seed)
    if cfg.max_steps is not None:
        steps = steps[: cfg.max_steps]
    lrs = member_lrs(cfg)
    members = make_members(cfg.members, cfg.seed)
    quiet = lambda *a: None  # noqa: E731
    early = steps[: cfg.check_steps]
    agreement = max_param_difference(train_stagewise(members, lrs, x_train, y_train, early, device, quiet)[0],
                                     train_loop(members, lrs, x_train, y_train, early, device, quiet)[0])
    ens, stagewise_s = train_stagewise(members, lrs, x_train, y_train, steps, device, progress)
    models, loop_s = train_loop(members, lrs, x_train, y_train, steps, device, progress)
    member_acc, ensemble_acc = accuracies(stagewise_probs(ens, x_test.to(device)).cpu(), y_test)
    with torch.no_grad():
        loop_probs = torch.stack([m.eval()(x_test.to(device)).softmax(-1).cpu() for m in models])
    loop_member_acc, loop_ensemble_acc = accuracies(loop_probs, y_test)
    samples = len(steps) * cfg.members * cfg.batch  # one sample = one image seen by one member
    saved = [str(p) for p in executor.save_member_weights(ens, cfg.save)] if cfg.save else []
    return {
        "config": asdict(cfg), "lrs": lrs, "steps": len(steps), "samples": samples,
        "train_size": len(x_train), "test_size": len(x_test),
        "member_accuracy": member_acc, "mean_member_accuracy": sum(member_acc) / len(member_acc),
        "best_member_accuracy": max(member_acc), "ensemble_accuracy": ensemble_acc,
        "loop_member_accuracy": loop_member_acc, "loop_ensemble_accuracy": loop_ensemble_acc,
        "stagewise": {"seconds": stagewise_s, "samples_per_s": samples / stagewise_s},
        "loop": {"seconds": loop_s, "samples_per_s": samples / loop_s},
        "speedup": loop_s / stagewise_s,
        "check_steps": len(early), "max_param_difference": agreement,  # after the first check_steps steps
        "final_param_difference": max_param_difference(ens, models),
        "plan_stages": [f"{s.id}:{s.mode.value}" for s in ens.plan.stages],
        "saved": saved, "device": str(device), "threads": torch.get_num_threads(), "torch": torch.__version__,
    }


def report_text(r: dict) -> str:
    lines = [f"deep ensemble of {r['config']['members']} MLPs on sklearn digits ({r['train_size']} train / {r['test_size']} test), "
             f"{r['steps']} steps of batch {r['config']['batch']} per member, Adam, {r['device']} ({r['threads']} threads), torch {r['torch']}",
             "", f"{'member':>6} {'lr':>9} {'test acc':>9}"]
    for i, (lr, acc) in enumerate(zip(r["lrs"], r["member_accuracy"])):
        lines.append(f"{i:>6} {lr:>9.2e} {acc:>9.3f}")
    lines += ["", f"mean member accuracy {r['mean_member_accuracy']:.3f}, best member {r['best_member_accuracy']:.3f}, "
                  f"ensemble (mean of softmax) {r['ensemble_accuracy']:.3f}",
              f"training throughput: stagewise {r['stagewise']['samples_per_s']:,.0f} samples/s ({r['stagewise']['seconds']:.2f} s), "
              f"loop of N torch.optim.Adam {r['loop']['samples_per_s']:,.0f} samples/s ({r['loop']['seconds']:.2f} s): "
              f"{r['speedup']:.2f}x",
              f"stagewise vs loop members after the same {r['check_steps']} steps: max relative parameter difference "
              f"{r['max_param_difference']:.1e}; the loop's ensemble accuracy after training {r['loop_ensemble_accuracy']:.3f}, "
              f"mean member {sum(r['loop_member_accuracy']) / len(r['loop_member_accuracy']):.3f}"]
    if r["saved"]:
        lines.append(f"member weights: {r['saved'][0]} ... ({len(r['saved'])} files)")
    return "\n".join(lines)


# --- progress ----------------------------------------------------------------------------------

def _progress(items: list, label: str, progress: Callable | None) -> Iterable:
    """Yield `items` under a progress bar: `progress(label, i, total)` when given (tests), else tqdm, else a printed bar."""
    if progress is not None:
        for i, item in enumerate(items):
            progress(label, i, len(items))
            yield item
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield from _printed_bar(items, label)
        return
    yield from tqdm(items, desc=f"{label:<10}", unit="step", file=sys.stderr, leave=True)


def _printed_bar(items: list, label: str, width: int = 30) -> Iterable:
    total = max(len(items), 1)
    for i, item in enumerate(items):
        if i % max(total // 50, 1) == 0:
            done = int(width * i / total)
            print(f"\r{label:<10} [{'#' * done}{'.' * (width - done)}] {i}/{total}", end="", file=sys.stderr, flush=True)
        yield item
    print(f"\r{label:<10} [{'#' * width}] {total}/{total}", file=sys.stderr)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def parse_args(argv: list[str] | None) -> Config:
    d = Config()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", type=int, default=d.members, help="ensemble size N")
    ap.add_argument("--epochs", type=int, default=d.epochs)
    ap.add_argument("--batch", type=int, default=d.batch, help="images per member per step")
    ap.add_argument("--lr-min", type=float, default=d.lr_min)
    ap.add_argument("--lr-max", type=float, default=d.lr_max)
    ap.add_argument("--device", default=d.device, help="cpu or cuda")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (a quick try)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's own)")
    ap.add_argument("--save", default=None, help="write each member's weights as FOLDER/member_000.safetensors, ...")
    a = ap.parse_args(argv)
    return Config(members=a.members, epochs=a.epochs, batch=a.batch, lr_min=a.lr_min, lr_max=a.lr_max, device=a.device,
                  seed=a.seed, max_steps=a.max_steps, save=a.save, threads=a.threads)


def main(argv: list[str] | None = None, progress: Callable | None = None) -> dict:
    """Run the example; prints the report and returns it as a dict."""
    result = run(parse_args(argv), progress)
    print(report_text(result))
    return result


if __name__ == "__main__":
    main()
