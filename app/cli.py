"""The `stagewise` command: plan | run | show | diff | profile | ui.

Every StagewiseError becomes one line on stderr and exit code 2; a verification
mismatch exits 1. Nothing here imports streamlit (`ui` starts it in a subprocess).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

from stagewise import planner
from stagewise import executor
from stagewise.planner import StagewiseError, budget
from stagewise.planner.files import temp_beside, writable_problem
from stagewise.executor.verify import resized_inputs

EXIT_MISMATCH = 1
EXIT_ERROR = 2


def _load(model: str, weights: list[str] | None, trust_archive: bool = False, open_modules=()):
    src = planner.load_source(model, weights=weights or None, trust_archive=trust_archive)
    graph = planner.trace(src.model, src.example_inputs, open_modules=open_modules or ())
    return src, graph


def _same_file(a: str | None, b: str | None) -> bool:
    try:
        return bool(a and b) and Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def _one_of_the_inputs(path: str | None, args, *, plan_too: bool) -> str | None:
    """Which of the command's own input files `path` is ("the model file", ...), or None."""
    named = [("the model file", getattr(args, "model", None))]
    named += [("a weights file", w) for w in (getattr(args, "weights", None) or [])]
    if plan_too:
        named.append(("the plan file", getattr(args, "plan", None)))
    return next((what for what, other in named if _same_file(path, other)), None)


def _check_plan_output(path: str | None, args=None) -> None:
    """Refuse an -o destination that cannot be written, or that is the model or a weights file, before any slow
    work (the plan given to `profile` may be replaced by the tuned one: that is what -o there is for)."""
    problem = path and writable_problem(path)
    if problem:
        raise planner.PlanFileError(f"cannot write plan file {path}: {problem}; "
                                    "check that the folder exists and is writable, or pass another -o path")
    clash = args is not None and _one_of_the_inputs(path, args, plan_too=False)
    if clash:
        raise planner.PlanFileError(f"-o {path} is {clash} of this command, which the plan would replace; "
                                    "pass another -o path (plan files end in .json)")


def _check_trace_output(path: str | None, args=None) -> None:
    problem = path and writable_problem(path)
    if problem:
        raise planner.OutputFileError(f"cannot write the chrome trace {path}: {problem}; "
                                      "pass --trace a path in an existing, writable folder")
    clash = args is not None and (_one_of_the_inputs(path, args, plan_too=True)
                                  or ("the -o plan file" if _same_file(path, getattr(args, "output", None)) else None))
    if clash:
        raise planner.OutputFileError(f"--trace {path} is {clash} of this command, which the trace would replace; "
                                      "pass another --trace path (chrome traces end in .json)")


def cmd_plan(args) -> int:
    _check_plan_output(args.output, args)
    src, graph = _load(args.model, args.weights, args.trust_archive, args.open)
    if graph.tracer_note:
        print(f"note: {graph.tracer_note}")
    modes = _parse_modes(args.input_mode, graph.input_names)
    plan = planner.set_dtype(planner.propose(graph, n_members=args.n, input_mode=modes, model=str(args.model)), args.dtype)
    plan = planner.set_capture(plan, args.capture)
    print(planner.format_stage_table(plan, graph))
    if args.output:
        plan.save(args.output)
        print(f"plan written to {args.output}")
    return 0


def _parse_modes(values: list[str] | None, names: list[str]):
    """--input-mode shared | per_member | name=mode ... -> a mode or a dict."""
    if not values:
        return "shared"
    if len(values) == 1 and "=" not in values[0]:
        return values[0]
    modes = {}
    for v in values:
        name, sep, mode = v.partition("=")
        if not sep:
            raise planner.PlanMismatchError(f"--input-mode {v!r}: give one mode for all inputs, or name=mode per input (inputs: {names})")
        if name in modes and modes[name] != mode:  # the last would win without a word
            raise planner.PlanMismatchError(f"--input-mode gives {name!r} two modes ({modes[name]} and {mode}); "
                                            "give each input one")
        modes[name] = mode
    return modes


def _members_and_inputs(plan, args):
    src = planner.load_source(args.model, weights=args.weights or None, trust_archive=args.trust_archive)
    # the whole run's members and stacked state, before building any (on the CPU both are held at once)
    budget.check_run(plan.n_members, budget.state_bytes(src.model), getattr(args, "device", None), src.name)
    members = src.members(plan.n_members)
    inputs = executor.batched_inputs(plan, src.example_inputs)
    return src, members, inputs


def cmd_run(args) -> int:
    if args.distributed:
        if args.grads:
            raise StagewiseError("--grads is not yet checked per rank under --distributed; run without --distributed "
                                 "(one process, all members) to compare gradients")
        return _run_distributed(args)
    plan = planner.Plan.load(args.plan)
    _, members, inputs = _members_and_inputs(plan, args)
    other = resized_inputs(plan, inputs)  # a second batch size: a shape baked into the trace shows there
    report = executor.verify(plan, members, inputs, rtol=args.rtol, device=args.device, more_inputs=[other] if other else (),
                             grads=args.grads)
    print(planner.format_stage_table(plan))
    print()
    print(report.to_text())
    return 0 if report.ok else EXIT_MISMATCH


def _run_distributed(args) -> int:
    """One rank of `torchrun ... stagewise run --distributed`: verify this rank's slice of the members; rank 0 prints the table."""
    report = _on_every_rank(args, lambda check, plan, members, inputs, device: check.verify_sharded(
        plan, members, inputs, rtol=args.rtol, device=device))
    return 0 if report.ok else EXIT_MISMATCH


def _on_every_rank(args, run):
    """Under torchrun: load the plan and model on every rank, `run(distributed_check, plan, members, inputs, device)`,
    print the stage table and the report on rank 0; returns the report (the same on every rank)."""
    from stagewise.executor import distributed, distributed_check  # torch.distributed's process group is only wanted here

    started = distributed.init_from_env(device=args.device)
    try:
        with distributed.agreed("loading the plan and the model"):  # a missing file on one host stops every rank
            plan = planner.Plan.load(args.plan)
            src = planner.load_source(args.model, weights=args.weights or None, trust_archive=args.trust_archive)
            inputs = executor.batched_inputs(plan, src.example_inputs)
        # members by global index: build_members(n) and weight files number members of all N, so take the slice of N
        members = lambda idx: src.members(plan.n_members)[idx.start:idx.stop]  # noqa: E731
        report = run(distributed_check, plan, members, inputs, "cpu" if args.device in (None, "cpu") else None)
        if distributed.dist.get_rank() == 0:
            print(planner.format_stage_table(plan))
            print()
            print(report.to_text())
        distributed.dist.barrier()  # leave together: a rank tearing gloo down under a peer's last read can abort it
        return report
    finally:
        if started:
            distributed.dist.destroy_process_group()


def cmd_show(args) -> int:
    plan = planner.Plan.load(args.plan)
    graph = None
    if args.model:
        _, graph = _load(args.model, None, args.trust_archive, plan.opened_modules)  # traced as the plan was
        planner.validate(plan, graph)
    if plan.model:
        print(f"model: {plan.model}  fingerprint: {plan.fingerprint}")
    print(planner.format_stage_table(plan, graph))
    if plan.profile:
        print(f"\nplan holds a profile report ({len(plan.profile.get('stages', []))} stages measured)")
    return 0


def cmd_diff(args) -> int:
    """Compare two plan files of one model; exit 0 when identical, 1 when they differ (like diff(1))."""
    diff = planner.diff_plans(planner.Plan.load(args.before), planner.Plan.load(args.after))
    print(json.dumps(diff.to_json(), indent=2, sort_keys=True) if args.json else planner.format_diff(diff))
    return 0 if diff.identical else EXIT_MISMATCH


def cmd_profile(args) -> int:
    if args.distributed:
        unsupported = [flag for flag, on in (("-o", args.output), ("--trace", args.trace), ("--compile-baseline", args.compile_baseline)) if on]
        if unsupported:
            from stagewise.executor.distributed import DistributedError

            raise DistributedError(f"profile --distributed does not take {', '.join(unsupported)}; "
                                   f"drop {'it' if len(unsupported) == 1 else 'them'}, or profile one slice without --distributed")
        _on_every_rank(args, lambda check, plan, members, inputs, device: check.profile_sharded(
            plan, members, inputs, device=device, repeats=args.repeats, train=args.train, autotune=args.autotune))
        return 0
    _check_plan_output(args.output, args)  # both checked before the (long) profile, not after it
    _check_trace_output(args.trace, args)
    plan = planner.Plan.load(args.plan)
    _, members, inputs = _members_and_inputs(plan, args)
    progress = _progress_bar() if sys.stderr.isatty() or args.progress else None
    report, trace_error = _profile(plan, members, inputs, args, progress)
    if progress:
        sys.stderr.write("\n")
    print(report.to_text())
    if plan.dtype != "float32":  # the plan's own times above ran at its precision; the loop baseline runs float32
        e2e = report.end_to_end
        print(f"precision: {plan.dtype}: end to end {e2e.ms:.3f} ms at {plan.dtype}" if e2e.ok and e2e.time is not None
              else f"precision: {plan.dtype}: end to end failed at {plan.dtype} ({e2e.error})")
    if args.output:
        # the report carries the profiled (tuned) plan's JSON; store the report inside that plan, not the plan twice
        profiled = planner.Plan.from_json(report.plan, source="profile report") if report.plan else plan
        stored = {k: v for k, v in report.to_json().items() if k != "plan"}
        profiled.with_profile(stored).save(args.output)
        print(f"plan{' (autotuned)' if args.autotune else ''} with its profile written to {args.output}")
    elif args.autotune:
        print("note: the tuned plan was not saved; pass -o tuned.json to keep it")
    if trace_error:
        print(f"stagewise profile: error: {trace_error}", file=sys.stderr)
        return EXIT_ERROR
    return 0


def _profile(plan, members, inputs, args, progress):
    """executor.profile with the chrome trace written beside its destination and moved there only once complete.

    Returns (report, error): error is a one-line reason when --trace was given but no trace
    was written; the report then names no trace file.
    """
    run = lambda trace_path: executor.profile(  # noqa: E731
        plan, members, inputs, device=args.device, repeats=args.repeats, compile_baseline=args.compile_baseline,
        trace_path=trace_path, progress=progress, autotune=args.autotune, train=args.train, budget=args.budget,
    )
    if not args.trace:
        return run(None), None
    report = None
    try:
        with temp_beside(args.trace) as tmp:
            report = run(str(tmp))
    except OSError as e:  # nothing (or nothing complete) was written, or the move failed; a failed profile raises past here
        if report is None:
            raise
        report.trace_path = None
        return report, (f"the chrome trace was not written to {args.trace} ({e.strerror or 'the profiler wrote nothing'}); "
                        "check the folder and disk space and run the profile again")
    report.trace_path = args.trace
    return report, None


def _progress_bar():
    def progress(done: int, total: int, label: str) -> None:
        width = 30
        filled = int(width * done / max(total, 1))
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label[:40]:<40}")
        sys.stderr.flush()

    return progress


def cmd_ui(args) -> int:
    from stagewise.app.launch import main as launch  # the app needs streamlit; import only here

    return launch(model_path=args.model, port=args.port, open_modules=args.open or ()) or 0


OPEN_HELP = ("trace inside this leaf module (repeatable): a module path (encoder.layers.0), a glob (encoder.layers.*) "
             "or a class name (TransformerEncoderLayer); the plan records it. See README 'Opening leaf modules'")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stagewise", description="Plan, check and profile batched (vmap) execution of N copies of one PyTorch model.")
    sub = p.add_subparsers(dest="command", required=True)

    sp = sub.add_parser("plan", help="trace a model and propose stages")
    sp.add_argument("model", help="a .py model file or a .pt2 torch.export archive")
    sp.add_argument("-n", type=int, default=8, help="number of members N (default 8)")
    sp.add_argument("--input-mode", nargs="+", metavar="MODE", help="shared | per_member, or name=mode per input (default shared)")
    sp.add_argument("--weights", nargs="+", help="member weight files (.safetensors or state_dict), one per member")
    sp.add_argument("--dtype", default="float32", choices=planner.DTYPES,
                    help="precision of the batched module (default float32; tf32 only changes CUDA matmuls; see README 'Precision')")
    sp.add_argument("--capture", action="store_true",
                    help="whole-plan capture: on a GPU, inference calls replay the plan as CUDA graphs (see README "
                         "'Whole-plan capture'; autotune sets it where it measures fastest)")
    sp.add_argument("-o", "--output", help="write the plan JSON here")
    sp.add_argument("--open", action="append", metavar="MODULE", help=OPEN_HELP)
    sp.add_argument("--trust-archive", action="store_true",
                    help="load a .pt2 archive even if parts of it must be unpickled (this runs code from the file: only for files you trust)")
    sp.set_defaults(func=cmd_plan)

    sr = sub.add_parser("run", help="build the plan and verify it against the member loop")
    sr.add_argument("plan")
    sr.add_argument("model")
    sr.add_argument("--weights", nargs="+")
    sr.add_argument("--device", default=None, help="cpu (default) or cuda")
    sr.add_argument("--rtol", type=float, default=None,
                    help="max normwise relative error (default: the plan dtype's, float32 1e-4; see README 'Precision')")
    sr.add_argument("--trust-archive", action="store_true",
                    help="load a .pt2 archive even if parts of it must be unpickled (this runs code from the file: only for files you trust)")
    sr.add_argument("--grads", action="store_true",
                    help="also compare one call with gradients on: outputs and every parameter's gradient (for training)")
    sr.add_argument("--distributed", action="store_true",
                    help="under torchrun: each rank verifies its slice of the members; rank 0 prints the table")
    sr.set_defaults(func=cmd_run)

    ss = sub.add_parser("show", help="print a plan's stage table")
    ss.add_argument("plan")
    ss.add_argument("model", nargs="?", help="optional: check the plan against this model and add params/FLOPs")
    ss.add_argument("--trust-archive", action="store_true",
                    help="load a .pt2 archive even if parts of it must be unpickled (this runs code from the file: only for files you trust)")
    ss.set_defaults(func=cmd_show)

    sd = sub.add_parser("diff", help="compare two plans of one model (exit 0 identical, 1 different)")
    sd.add_argument("before", help="plan JSON file")
    sd.add_argument("after", help="plan JSON file of the same model")
    sd.add_argument("--json", action="store_true", help="print the diff as JSON instead of text")
    sd.set_defaults(func=cmd_diff)

    sf = sub.add_parser("profile", help="time each stage and the baselines")
    sf.add_argument("plan")
    sf.add_argument("model")
    sf.add_argument("--weights", nargs="+")
    sf.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    sf.add_argument("--autotune", action="store_true", help="measure every strategy per stage and pick the fastest correct one")
    sf.add_argument("--budget", choices=["default", "quick", "thorough"], default="default",
                    help="how much --autotune measures: quick = fewer samples and no torch.compile; thorough = every "
                         "candidate timed in full (default: losers dropped after a brief timing)")
    sf.add_argument("--trace", help="write a chrome trace (torch.profiler) here")
    sf.add_argument("--repeats", type=int, default=None, help="timed repeats per measurement")
    sf.add_argument("--compile-baseline", action="store_true", help="also time torch.compile of whole-model vmap (slow to compile)")
    sf.add_argument("--train", action="store_true",
                    help="profile a training step (forward + backward + Adam step) against N torch.optim loops and the torch.func recipe")
    sf.add_argument("--progress", action="store_true", help="show the progress bar even when stderr is not a terminal")
    sf.add_argument("-o", "--output", help="write the (tuned) plan with the report inside here")
    sf.add_argument("--trust-archive", action="store_true",
                    help="load a .pt2 archive even if parts of it must be unpickled (this runs code from the file: only for files you trust)")
    sf.add_argument("--distributed", action="store_true",
                    help="under torchrun: each rank profiles its slice of the members; rank 0 prints the table")
    sf.set_defaults(func=cmd_profile)

    su = sub.add_parser("ui", help="open the planner in the browser (localhost only)")
    su.add_argument("model", nargs="?", help="model file to open (default: a bundled sample)")
    su.add_argument("--port", type=int, default=None)
    su.add_argument("--open", action="append", metavar="MODULE", help=OPEN_HELP)
    su.set_defaults(func=cmd_ui)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except StagewiseError as e:
        print(f"stagewise {args.command}: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `stagewise diff a b | head`: the reader stopped reading, as the user meant
        try:  # Python's flush of stdout at exit would raise again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return 0
    except Exception as e:  # a bug in stagewise or torch: one line, the traceback on request
        if os.environ.get("STAGEWISE_DEBUG"):
            traceback.print_exc()
        print(f"stagewise {args.command}: unexpected {type(e).__name__}: {e} "
              "(set STAGEWISE_DEBUG=1 for the traceback and please report it)", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
