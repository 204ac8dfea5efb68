"""Small stand-ins for planner objects, so layout/figure/history tests need no torch tracing,
and `app_test`: the app under AppTest as `stagewise ui` starts it (token set and presented)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import networkx as nx

from stagewise.planner.plan import InputSpec, Plan, Stage, StageMode

ROOT = Path(__file__).resolve().parents[2]
MAIN = str(ROOT / "app" / "main.py")
TEST_TOKEN = "test-token-not-secret"
APP_TIMEOUT = 60  # the first run imports torch and traces


def app_env(monkeypatch, tmp_path, model: Path | None = None, token: str | None = TEST_TOKEN) -> None:
    """The environment `stagewise ui` gives the app: its token, a model, and (here) private places in tmp_path."""
    from stagewise.app import launch

    monkeypatch.setenv("STAGEWISE_AUTOSAVE", str(tmp_path / "autosave.json"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # uploads land in tmp_path/cache/stagewise/uploads
    monkeypatch.delenv(launch.NO_TOKEN_ENV, raising=False)
    if token is None:
        monkeypatch.delenv(launch.TOKEN_ENV, raising=False)
    else:
        monkeypatch.setenv(launch.TOKEN_ENV, token)
    if model is not None:
        monkeypatch.setenv(launch.MODEL_ENV, str(model))
    monkeypatch.chdir(tmp_path)


def app_test(monkeypatch, tmp_path, model: Path | None = None, present: str | None = TEST_TOKEN,
             token: str | None = TEST_TOKEN):
    """AppTest of app/main.py (not run yet) opened as from the address `stagewise ui` prints (?token=...).

    `token`: the app's token (None: started without one); `present`: what the address carries.
    """
    from streamlit.testing.v1 import AppTest

    app_env(monkeypatch, tmp_path, model, token)
    at = AppTest.from_file(MAIN, default_timeout=APP_TIMEOUT)
    if present is not None:
        at.query_params["token"] = present
    return at


@dataclass
class FakeGraph:
    dag: nx.DiGraph
    node_names: list[str]
    fingerprint: str = "fake"
    tracer: str = "fx"
    tracer_note: str = ""
    input_names: list[str] = field(default_factory=lambda: ["x"])


def _attrs(name: str, op: str = "call_module", module_path: str = "", batchable: bool = True, reason: str = "") -> dict:
    return dict(op=op, target=name, module_path=module_path, shape="[32, 64]", dtype="float32",
                params=100, flops=1000, batchable=batchable, reason=reason)


def residual_graph() -> FakeGraph:
    """x -> block.fc1 -> block.act -> block.fc2 -> add(x, .) -> item (not batchable) -> out -> output."""
    g = nx.DiGraph()
    spec = [
        ("x", "placeholder", ""), ("block_fc1", "call_module", "block.fc1"), ("block_act", "call_module", "block.act"),
        ("block_fc2", "call_module", "block.fc2"), ("add", "call_function", ""), ("item", "call_method", ""),
        ("out", "call_module", "head"), ("output", "output", ""),
    ]
    for name, op, mp in spec:
        g.add_node(name, **_attrs(name, op, mp, batchable=name != "item", reason="calls .item()" if name == "item" else ""))
    for u, v in [("x", "block_fc1"), ("block_fc1", "block_act"), ("block_act", "block_fc2"), ("block_fc2", "add"),
                 ("x", "add"), ("add", "item"), ("item", "out"), ("add", "out"), ("out", "output")]:
        g.add_edge(u, v)
    return FakeGraph(g, [n for n, _, _ in spec])


def transformer_like_graph(blocks: int = 6) -> FakeGraph:
    """x -> `blocks` pre-LN blocks (attention with q/k/v and a residual add, then an MLP with a residual add) -> output."""
    g = nx.DiGraph()
    order: list[str] = []

    def node(name: str, module_path: str = "", op: str = "call_module", target: str = "") -> str:
        g.add_node(name, **dict(_attrs(name, op, module_path), target=target or (f"{module_path} (Linear)" if op == "call_module" else name)))
        order.append(name)
        return name

    prev = node("x", op="placeholder")
    for i in range(blocks):
        p = f"layers.{i}"
        ln = node(f"layers_{i}_ln1", f"{p}.ln1")
        g.add_edge(prev, ln)
        qkv = [node(f"layers_{i}_{k}", f"{p}.{k}") for k in "qkv"]
        for q in qkv:
            g.add_edge(ln, q)
        att = node(f"sdpa_{i}", p, "call_function", "scaled_dot_product_attention")
        for q in qkv:
            g.add_edge(q, att)
        proj = node(f"layers_{i}_proj", f"{p}.proj")
        g.add_edge(att, proj)
        add = node(f"add_{2 * i}", p, "call_function", "add")
        g.add_edges_from([(prev, add), (proj, add)])
        ln2 = node(f"layers_{i}_ln2", f"{p}.ln2")
        fc1 = node(f"layers_{i}_fc1", f"{p}.ffn.fc1")
        fc2 = node(f"layers_{i}_fc2", f"{p}.ffn.fc2")
        g.add_edges_from([(add, ln2), (ln2, fc1), (fc1, fc2)])
        prev = node(f"add_{2 * i + 1}", p, "call_function", "add")
        g.add_edges_from([(add, prev), (fc2, prev)])
    out = node("output", op="output")
    g.add_edge(prev, out)
    return FakeGraph(g, order)


def residual_plan() -> Plan:
    return Plan(
        fingerprint="fake", tracer="fx", n_members=4, inputs=(InputSpec("x"),),
        stages=(
            Stage("s0", ("block_fc1", "block_act", "block_fc2", "add")),
            Stage("s1", ("item",), StageMode.EXCLUDED, reason="calls .item()"),
            Stage("s2", ("out",)),
        ),
    )


def random_dag(n: int, seed: int = 0) -> FakeGraph:
    """A layered random DAG of n nodes resembling a deep model (a chain with skips and branches)."""
    import random

    rng = random.Random(seed)
    g = nx.DiGraph()
    names = [f"n{i}" for i in range(n)]
    for i, name in enumerate(names):
        g.add_node(name, **_attrs(name, "call_function", f"layers.{i // 20}.sub{(i // 5) % 4}"))
        if i:
            g.add_edge(names[i - 1], name)
        if i > 3 and rng.random() < 0.3:
            g.add_edge(names[rng.randrange(max(0, i - 12), i - 1)], name)
    return FakeGraph(g, names, fingerprint=f"random{n}")


def wait_until_listening(proc, port: int, seconds: float = 60) -> None:
    """Wait for a launched app to accept connections on 127.0.0.1:port; fail with its output if it exits first."""
    import socket
    import time

    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.3).close()
            return
        except OSError:
            assert proc.poll() is None, proc.stdout.read().decode()
            time.sleep(0.3)
    raise AssertionError("the app did not start listening")
