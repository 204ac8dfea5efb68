"""Proposal: group batchable nodes into maximal convex stages.

Batchable nodes are keyed by the set of non-batchable nodes among their
ancestors; nodes with the same key form one batched stage. Such groups are
convex (a path that leaves a group and returns would pass a non-batchable node,
which only the later end has as an ancestor) and the stage graph is acyclic,
so no repair pass is needed. Each non-batchable node becomes an excluded stage
of its own, keeping its reason; it starts as the member loop, or as `wide` where
that strategy batches it exactly without vmap (excluded_default). Parameter fetches (get_attr) join the stage of
their consumers when those are all in one stage.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from torch import nn

from stagewise.planner.capability import base_name
from stagewise.planner.errors import PlanMismatchError
from stagewise.planner.graph import ModelGraph
from stagewise.planner.plan import InputMode, InputSpec, Plan, Stage, StageMode, StageOptions, Strategy
from stagewise.planner.validate import renumber, validate


def propose(
    graph: ModelGraph,
    n_members: int,
    input_mode: str | InputMode | Mapping[str, str | InputMode] = "shared",
    *,
    model: str = "",
) -> Plan:
    """Propose stages for `graph` run across `n_members` members.

    Args:
        graph: from planner.trace.
        n_members: N >= 1.
        input_mode: "shared" / "per_member" for all inputs, or a dict input name -> mode.
        model: a label for the plan file (e.g. the model file's path).
    Returns:
        A validated Plan with stages s0, s1, ... in topological order.
    """
    inputs = _input_specs(graph, input_mode)
    dag = graph.dag
    compute = graph.compute_nodes
    excluded_anc: dict[str, frozenset[str]] = {}
    for n in graph.node_names:  # graph order is topological
        acc: set[str] = set()
        for p in dag.predecessors(n):
            acc |= excluded_anc[p]
            if not dag.nodes[p].get("batchable", True) and dag.nodes[p]["op"] != "placeholder":
                acc.add(p)
        excluded_anc[n] = frozenset(acc)

    groups: dict[frozenset[str], list[str]] = {}
    excluded: list[Stage] = []
    for n in compute:
        if dag.nodes[n]["batchable"]:
            groups.setdefault(excluded_anc[n], []).append(n)
        else:
            excluded.append(Stage(id="", nodes=(n,), mode=StageMode.EXCLUDED, reason=dag.nodes[n]["reason"],
                                  options=excluded_default(graph, n)))
    stages = [Stage(id="", nodes=tuple(nodes)) for nodes in groups.values()] + excluded
    stages = _attach_params(stages, graph)
    plan = Plan(
        fingerprint=graph.fingerprint,
        tracer=graph.tracer,
        n_members=n_members,
        inputs=inputs,
        stages=tuple(renumber(stages, graph)),
        model=model,
        opened_modules=graph.opened_modules,
    )
    return validate(plan, graph)


# Excluded nodes the `wide` strategy runs batched without vmap, computing what the member loop computes, start as
# wide: the stage is still excluded (never under vmap), the note says why, verify and autotune check it like any
# strategy, and excluding the stage by hand makes it the loop. Every other excluded node starts as the loop.
# scaled_dot_product_attention without dropout takes any leading dims, so the members fold into its batch axis
# (executor.strategies.wide_ops.sdpa). vmap has no batching rule for it (its fallback is a loop of N calls), and
# N calls from Python cost more than the rest of a small attention block on a GPU (transformer block, N=16, H100:
# the untuned plan 1.35x the vmap recipe with the loop there).
WIDE_BY_DEFAULT = "wide by default: the members fold into the attention's batch axis, one call instead of N"
_SDPA_DROPOUT_ARG = 4  # (query, key, value, attn_mask, dropout_p, is_causal, ...)
# torch's attention modules as leaves (fx keeps them whole), which `wide` computes without vmap
# (executor.strategies.wide_attention): the members' projections as batched GEMMs, their heads folded into one
# attention call. Where wide refuses a configuration (add_bias_kv, an unusual activation) the stage runs vmap of the
# module, and a member loop of it while it trains with dropout: never an error where the loop would run.
# The exact classes only: a subclass may compute something else.
WIDE_MODULES = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerEncoder)
WIDE_MODULE_BY_DEFAULT = ("wide by default: the members' projections as batched GEMMs, their heads folded into one "
                          "attention call (dropout while training: a member loop of the module)")
# nn.GRU / nn.LSTM (unidirectional, no LSTM projection): the input projection of all steps one batched GEMM, each
# step one more (fused gates on a GPU). Tuned that way on the H100 9x and 11x the loop; on the 2-core CPU (N=16,
# torch's 2 threads) GRU 5.6 vs 16.4 ms, LSTM 8.6 vs 11.2, while with one thread the LSTM is faster as the loop (autotune
# finds it). What wide refuses at run time (dropout between layers while training, an unbatched input) runs as a
# member loop of the module.
WIDE_RNN_BY_DEFAULT = ("wide by default: the members' recurrences as batched GEMMs, one per step (dropout between "
                       "layers while training, or an unbatched input: a member loop of the module)")


def excluded_default(graph: ModelGraph, name: str) -> StageOptions:
    """The starting options of excluded node `name`'s stage: wide for an attention call without dropout, torch's
    attention modules and unidirectional GRU/LSTM (see the notes above), else the member loop. Only nodes excluded
    for want of a batching rule qualify (not randomness, .item(), in-place state, ...)."""
    loop = StageOptions(strategy=Strategy.LOOP)
    if not graph.dag.nodes[name].get("reason", "").startswith("no batching rule"):
        return loop
    node = graph.fx_node(name)
    if node.op == "call_module":
        module = graph.gm.get_submodule(node.target)
        if type(module) in WIDE_MODULES:
            return StageOptions(strategy=Strategy.WIDE, note=WIDE_MODULE_BY_DEFAULT)
        if type(module) in (nn.GRU, nn.LSTM) and not module.bidirectional and not getattr(module, "proj_size", 0):
            return StageOptions(strategy=Strategy.WIDE, note=WIDE_RNN_BY_DEFAULT)
    elif node.op == "call_function" and base_name(node) == "scaled_dot_product_attention":
        dropout = node.kwargs.get("dropout_p", node.args[_SDPA_DROPOUT_ARG] if len(node.args) > _SDPA_DROPOUT_ARG else 0.0)
        if isinstance(dropout, (int, float)) and not isinstance(dropout, bool) and dropout == 0:
            return StageOptions(strategy=Strategy.WIDE, note=WIDE_BY_DEFAULT)
    return loop


def _input_specs(graph: ModelGraph, input_mode) -> tuple[InputSpec, ...]:
    if isinstance(input_mode, (str, InputMode)):
        modes = {name: input_mode for name in graph.input_names}
    else:
        unknown = set(input_mode) - set(graph.input_names)
        if unknown:
            raise PlanMismatchError(f"input_mode names unknown inputs {sorted(unknown)}; the model's inputs are {graph.input_names}")
        modes = {name: input_mode.get(name, "shared") for name in graph.input_names}
    specs = []
    for name in graph.input_names:
        try:
            traced = graph.input_specs.get(name, InputSpec(name))  # shape, dtype and dynamic dims as traced
            specs.append(replace(traced, mode=InputMode(modes[name])))  # an input traced as None stays shared (InputSpec)
        except ValueError:
            raise PlanMismatchError(f"input mode {modes[name]!r} for {name!r} is not one of 'shared', 'per_member'") from None
    return tuple(specs)


def _attach_params(stages: list[Stage], graph: ModelGraph) -> list[Stage]:
    """Move each get_attr node into the stage of its consumers when they share one stage."""
    owner = {n: i for i, s in enumerate(stages) for n in s.nodes}
    moves: dict[str, int] = {}
    for i, s in enumerate(stages):
        for n in s.nodes:
            if graph.dag.nodes[n]["op"] != "get_attr":
                continue
            consumers = {owner[c] for c in graph.dag.successors(n) if c in owner}
            if len(consumers) == 1 and consumers != {i}:
                moves[n] = next(iter(consumers))
    if not moves:
        return stages
    members: list[list[str]] = [[n for n in s.nodes if n not in moves] for s in stages]
    for n, target in moves.items():
        members[target].append(n)
    out = []
    for s, nodes in zip(stages, members):
        if nodes:
            out.append(Stage(id="", nodes=tuple(nodes), mode=s.mode, reason=s.reason, options=s.options))
    return out
