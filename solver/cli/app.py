"""The command line: `fitplan solve|estimate|models|gpus|explain` and the `solve` shortcut.

stdout carries only the result (a report, or JSON with --json); progress and errors go to stderr.
Exit codes: 0 plan found, 1 internal error, 2 bad input, 3 nothing fits (with the diagnosis), 4 no plan found
within the time limit (nothing proven; raise --time-limit), 5 `check` measured a difference where the bytes must be
exact.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
from collections.abc import Callable, Iterator
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn

import typer
import typer.rich_utils
from rich.console import Console

from costmodels import cluster as C
from costmodels.packing import read_lengths
from graphs import FitplanError, LoraSpec
from solver.cli.groups import (
    NO_ADAPTERS,
    NO_OUTPUTS,
    STRING_CLUSTER,
    AdapterOptions,
    ClusterOptions,
    OutputOptions,
    option_groups,
)
from solver.cli.knob_options import (
    estimate_parameters,
    knob_values,
    pins_from_options,
    solve_parameters,
    with_knob_options,
)
from solver.cli.options import Text, help_width, number, result_console, text
from solver.cli.post_options import NO_POST, PostTrainingOptions
from solver.cli.progress import status_line
from solver.cli.quiet import captured, user_stderr
from solver.plan.capability import LAUNCHERS
from solver.plan.record import Plan
from solver.search import bounds as B
from solver.search.conflicts import check_pins

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # planning never downloads

typer.rich_utils.MAX_WIDTH = typer.rich_utils.MAX_WIDTH or help_width()  # no truncated option names in --help
HELP = {"max_content_width": help_width()}
app = typer.Typer(help="Plan LLM training on GPUs: what fits, what is fastest, and the launcher configs.",
                  no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False, context_settings=HELP)
out = result_console()
err = Console(file=user_stderr)  # stays the terminal while third-party output is captured (`quiet.captured`)

Model = Annotated[str, text(4096, "Catalog id (see `fitplan models`), a local config.json or folder, or a Hub id "
                             "in the local HF cache.", "--model", "-m")]
Gpus = Annotated[str, text(B.MAX_CLUSTER_CHARS, "Cluster: 8xA100, 1xA10G, 8xH100-80GB, 16xH100, 2x8xH100, 4xL4, or "
                           "a JSON/YAML cluster file, or auto (the GPUs of this machine).", "--gpus", "-g")]
SeqLen = Annotated[int | None, number(int, 1, B.MAX_SEQ_LEN, "Tokens per sequence (default: min(4096, model limit); "
                                      "beyond a fixed position table, e.g. gpt2's 1024, refused).")]
Launcher = Enum("Launcher", {name: name for name in LAUNCHERS}, type=str)  # typer shows the registry's names
AsJson = Annotated[bool, typer.Option("--json", help="Print only JSON on stdout (with a \"log\" list of what "
                                                    "libraries printed).")]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Show what libraries printed (warnings, logs) after "
                                                              "the result; hidden by default.")]
def _fail(error: Exception, *, as_json: bool = False) -> None:
    """One place turns user errors into messages and exit codes."""
    from solver.search.diagnose import Infeasible, NoPlanInTime

    if isinstance(error, NoPlanInTime):  # nothing proven: not a diagnosis of memory, not bad input
        err.print(f"[bold yellow]No plan within the time limit:[/] {error.message}")
        err.print(error.hint)
        if as_json:
            print(json.dumps({"status": "UNKNOWN", "message": error.message, "hint": error.hint,
                              "diagnosis": error.diagnosis}, indent=2))
        raise typer.Exit(code=4)
    # Pins or divisibility that leave no configuration at all are bad input (2), not a memory diagnosis (3).
    if isinstance(error, Infeasible) and error.diagnosis.get("binding") != "pins":
        err.print(f"[bold red]Infeasible:[/] {error.message}")
        if error.hint:
            err.print(error.hint)
        if as_json:  # --json promises JSON on stdout: the diagnosis is the result
            print(json.dumps({"status": "INFEASIBLE", "message": error.message, "hint": error.hint,
                              "diagnosis": error.diagnosis}, indent=2, default=str))
        raise typer.Exit(code=3)
    if isinstance(error, (FitplanError, ValueError, OSError)):  # OSError: e.g. -o into a missing folder
        message = error.message if isinstance(error, FitplanError) else str(error)
        err.print(f"[bold red]Error:[/] {message}")
        if isinstance(error, FitplanError) and error.hint:
            err.print(error.hint)
        raise typer.Exit(code=2)
    raise error


@contextlib.contextmanager
def _quietly(first: str, *, verbose: bool) -> Iterator[tuple[list[str], Callable[[str], None]]]:
    """Run the block with third-party output captured (`quiet.captured`) and a progress line on the terminal;
    with `verbose`, print what was captured once the block is done (also when it failed)."""
    log: list[str] = []
    try:
        with captured() as log, status_line(err, first) as progress:
            yield log, progress
    finally:
        if verbose:
            for line in log:
                err.print(line, markup=False, highlight=False, soft_wrap=True)


@app.command("solve")
@with_knob_options(solve_parameters())
@option_groups
def solve_command(
    model: Model, gpus: Gpus, seq_len: SeqLen = None,
    global_batch: Annotated[int | None, number(int, 1, B.MAX_GLOBAL_BATCH, "Sequences per optimizer step.")] = None,
    tokens_per_step: Annotated[int | None, number(int, 1, B.MAX_TOKENS_PER_STEP, "Tokens per optimizer step "
                                                  "(instead of --global-batch).")] = None,
    launcher: Annotated[Launcher | None, typer.Option(help="Restrict to what one launcher can express.")] = None,
    adapters: AdapterOptions = NO_ADAPTERS, post_training: PostTrainingOptions = NO_POST,
    allow_lora: Annotated[bool, typer.Option(help="Fall back to LoRA if full fine-tuning cannot fit.")] = False,
    allow_savers: Annotated[bool, typer.Option(help="Let the search choose the memory savers that keep the "
                                               "training (--optimizer-in-backward: no gradient clipping; --loss, "
                                               "--activation-offload) where not pinned (Liger's loss needs "
                                               "liger-kernel).")] = False,
    headroom: Annotated[float, number(float, 0, 1, "Fraction of GPU memory kept free.", hi_open=True)] = 0.05,
    time_limit: Annotated[float, number(float, 0, B.MAX_TIME_LIMIT, "Solver time limit in seconds (lowering "
                                        "excluded); with --deterministic, each CP-SAT model's work budget in "
                                        "deterministic seconds.", lo_open=True)] = 10.0,
    deterministic: Annotated[bool, typer.Option(help="Search every configuration with a fixed CP-SAT work budget "
                                                "instead of the wall clock: the same plan under any load (for "
                                                "scripts; may take longer).")] = False,
    attention: Annotated[Literal["sdpa", "eager"] | None, typer.Option(help="Attention implementation.")] = None,
    input_tokens_per_s: Annotated[float | None, number(float, 0, B.MAX_INPUT_TOKENS_PER_S, "Tokens/s one "
                                                       "data-loading worker supplies (default 1M, a fast "
                                                       "tokenizer).", lo_open=True)] = None,
    dataset_lengths: Annotated[Path | None, typer.Option(help="Token lengths of the training sequences: a JSON "
                                                          "{length: count} histogram, a list, or JSON Lines. "
                                                          "Memory is planned on the longest micro-batch.")] = None,
    packing: Annotated[Literal["none", "wrapped", "bfd"], typer.Option(
        help="With --dataset-lengths: none pads each micro-batch to its longest sequence; wrapped and bfd pack "
             "sequences into rows of --seq-len (TRL's packing strategies).")] = "none",
    outputs: OutputOptions = NO_OUTPUTS, cluster: ClusterOptions = STRING_CLUSTER,
    as_json: AsJson = False, verbose: Verbose = False, **knobs: Any,
) -> None:
    """Find the fastest configuration that fits, and optionally write launcher configs."""
    from solver.api import solve
    from solver.cli.outputs import Targets, check_targets, launcher_names, write_outputs

    try:
        lora = adapters.spec()
        targets = Targets(output=outputs.output, launchers=launcher_names(outputs.emit), emit_dir=outputs.emit_dir,
                          plot=outputs.plot)
        check_targets(targets, force=outputs.force)
        # --emit X alone plans for what X runs; several named leave the choice open (those that cannot run the plan
        # are named with their reasons)
        planned_for = launcher.value if launcher else (targets.launchers[0] if len(targets.launchers) == 1 else None)
        pins = pins_from_options(knob_values(knobs), launcher=planned_for)
        check_pins(pins, global_batch=global_batch)  # contradicting pins named before any lowering (exit 2)
        if packing != "none" and dataset_lengths is None:
            raise FitplanError(f"--packing {packing} needs --dataset-lengths.",
                               "Give the lengths of the training sequences (a JSON histogram or JSON Lines).")
        lengths = read_lengths(dataset_lengths) if dataset_lengths is not None else None
        with _quietly(f"Planning {model} on {gpus}", verbose=verbose) as (log, progress):
            plan = solve(model, gpus, seq_len=seq_len, global_batch=global_batch, tokens_per_step=tokens_per_step,
                         headroom=headroom, time_limit=time_limit, deterministic=deterministic, lora=lora,
                         allow_lora=allow_lora, allow_savers=allow_savers, attention=attention,
                         input_tokens_per_s=input_tokens_per_s,
                         cluster_options=cluster.as_dict(), pins=pins, dataset_lengths=lengths, packing=packing,
                         progress=progress, post_training=post_training.spec(),
                         kbit_preparation=adapters.kbit_preparation)
        for line in write_outputs(plan, targets, force=outputs.force).lines():
            err.print(line, markup=False, highlight=False)
    except Exception as error:
        _fail(error, as_json=as_json)
    _print_plan(plan, log, as_json=as_json)


def _print_plan(plan: Plan, log: list[str], *, as_json: bool) -> None:
    """The plan on stdout: JSON with the captured library output under "log", or the report."""
    if as_json:
        print(json.dumps({**plan.to_json(), "log": log}, indent=2))
    else:
        from solver.cli.render import render_plan

        render_plan(plan, out)


@app.command("estimate")
@with_knob_options(estimate_parameters())
@option_groups
def estimate_command(
    model: Model, gpus: Gpus,
    config: Annotated[Path | None, typer.Option(help="A JSON/YAML file with Config fields, or a plan written "
                                                "by `solve -o`.")] = None,
    headroom: Annotated[float | None, number(float, 0, 1, "Fraction of GPU memory kept free, as in solve (default "
                                             "0.05, or the plan's when --config is a plan).", hi_open=True)] = None,
    seq_len: SeqLen = None,
    launcher: Annotated[Launcher | None, typer.Option(help="Price on the code this launcher runs (torchtitan: its own "
                                                      "model code), and refuse what it cannot express.")] = None,
    adapters: AdapterOptions = NO_ADAPTERS, post_training: PostTrainingOptions = NO_POST,
    cluster: ClusterOptions = STRING_CLUSTER, as_json: AsJson = False, verbose: Verbose = False, **knobs: Any,
) -> None:
    """Memory and time of one configuration: will it fit, and where does the memory go?"""
    from solver.cli.commands import estimate_report

    try:
        flags = knob_values(knobs)
        lora = adapters.spec()
        with _quietly(f"Estimating {model} on {gpus}", verbose=verbose) as (log, _progress):
            report = estimate_report(model, gpus, config, flags, seq_len=seq_len, lora=lora, headroom=headroom,
                                     launcher=launcher.value if launcher else None,
                                     cluster_options=cluster.as_dict(), post_training=post_training.spec(),
                                     kbit_preparation=adapters.kbit_preparation)
    except Exception as error:
        _fail(error)
    if as_json:
        print(json.dumps({**report.to_json(), "log": log}, indent=2))
    else:
        report.render(out)
    if not report.fits:  # as solve: 3 means it does not fit
        raise typer.Exit(code=3)


@app.command("models")
def models_command(filter: Annotated[str, typer.Argument(parser=Text(B.MAX_FILTER_CHARS),
                                                         help="Substring to match (case-insensitive).")] = "",
                   as_json: AsJson = False) -> None:
    """List the bundled model catalog."""
    from solver.cli.commands import models_rows

    rows = models_rows(filter)
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    from rich.table import Table

    table = Table(title=f"{len(rows)} catalog models (published config.json values)")
    for column in ("id", "model_type", "published params"):
        table.add_column(column, overflow="fold")  # wrapped where too narrow, never cut
    for row in rows:
        table.add_row(row["id"], row["model_type"], f"{row['published_params']:,}" if row["published_params"] else "-")
    out.print(table)


@app.command("gpus")
def gpus_command(as_json: AsJson = False) -> None:
    """List the GPU catalog (dense peak TFLOP/s, memory, links)."""
    from solver.cli.commands import gpu_rows

    rows = gpu_rows()
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    from rich.table import Table

    table = Table(title="GPU catalog (dense figures; memory in GiB; profile: from `fitplan measure`)")
    for column in ("id", "aliases", "memory GiB", "bf16 TFLOP/s", "fp8 TFLOP/s", "HBM GB/s", "intra-node", "profile"):
        table.add_column(column, overflow="fold")  # wrapped where too narrow, never cut
    for r in rows:
        table.add_row(r["id"], ", ".join(r["aliases"]), f"{r['memory_gib']:.0f}", str(r["bf16_tflops"] or "-"),
                      str(r["fp8_tflops"] or "-"), f"{r['hbm_gbps']:.0f}", r["intra_node"], r["profile"] or "-")
    out.print(table)


@app.command("explain")
def explain_command(plan_file: Annotated[Path, typer.Argument(help="A plan JSON written by `solve -o`.")],
                    as_json: AsJson = False, verbose: Verbose = False) -> None:
    """Why this plan: the binding constraint, what the alternatives cost, and each guide method's decision."""
    from solver.cli.commands import explain_plan

    try:
        with _quietly(f"Explaining {plan_file}", verbose=verbose) as (log, _progress):
            lines = explain_plan(plan_file)
    except Exception as error:
        _fail(error)
    if as_json:
        print(json.dumps({"explanation": lines, "log": log}, indent=2))
    else:
        for line in lines:
            out.print(line)


@app.command("choose")
def choose_command(
    model: Model,
    tokens: Annotated[float, number(float, 0, B.MAX_TRAIN_TOKENS, "Tokens to train on, e.g. 2e9.", lo_open=True)],
    gpu_types: Annotated[str, text(B.MAX_FILTER_CHARS, "GPU types to compare, comma-separated.")
                         ] = "H100,A100-80GB,L40S,A10G",
    max_gpus: Annotated[int, number(int, 1, B.MAX_CHOOSE_GPUS, "Largest cluster tried (whole nodes above one "
                                    "node).")] = 64,
    deadline: Annotated[str | None, text(40, "Finish within, e.g. 24h, 90m, 2d.")] = None,
    budget: Annotated[float | None, number(float, 0, B.MAX_BUDGET_USD, "Spend at most this many USD.",
                                           lo_open=True)] = None,
    prices: Annotated[Path | None, typer.Option(help="Your prices: YAML/JSON {GPU: USD per GPU-hour} or a "
                                                "SkyPilot-style catalog (CSV).")] = None,
    spot: Annotated[bool, typer.Option(help="Use spot prices where the table has them.")] = False,
    seq_len: Annotated[int | None, number(int, 1, B.MAX_SEQ_LEN, "Tokens per sequence.")] = None,
    global_batch: Annotated[int | None, number(int, 1, B.MAX_GLOBAL_BATCH, "Sequences per optimizer step.")] = None,
    precision: Annotated[str | None, text(200, "Allowed precisions, comma-separated.")] = None,
    optimizers: Annotated[str, text(200, "Allowed optimizers, comma-separated.")] = "adamw",
    lora_rank: Annotated[int | None, number(int, 1, B.MAX_LORA_RANK, "Train LoRA adapters of this rank.")] = None,
    allow_lora: Annotated[bool, typer.Option(help="Fall back to LoRA where full fine-tuning cannot fit.")] = False,
    allow_savers: Annotated[bool, typer.Option(help="Let each solve choose the memory savers that keep the "
                                               "training (--optimizer-in-backward, --loss, --activation-offload)."
                                               )] = False,
    time_limit: Annotated[float, number(float, 0, B.MAX_TIME_LIMIT, "Solver time limit per cluster, seconds.",
                                        lo_open=True)] = 10.0,
    as_json: AsJson = False,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG of cost against time.")] = None,
    force: Annotated[bool, typer.Option(help="Overwrite an existing --plot file.")] = False,
    verbose: Verbose = False,
) -> None:
    """Which GPUs, how many, how long and at what cost: the time/cost front over GPU types and counts."""
    from solver.choose import choose, parse_duration
    from solver.cli.choose_report import plot_choice, render_choice
    from solver.plan.staging import refuse_overwrite, write_together

    try:
        if plot is not None:  # before the sweep, not after minutes of solving
            refuse_overwrite([plot], force=force)
        pins = {"pins": pins_from_options({"precision": precision, "optimizer": optimizers}, launcher=None),
                "lora": None if lora_rank is None else LoraSpec(rank=lora_rank, alpha=2 * lora_rank)}
        shown = None if as_json else lambda p: err.print(f"[dim]{p.gpus} x {p.gpu_name}: {p.status}[/]")
        with _quietly(f"Choosing GPUs for {model}", verbose=verbose) as (log, _progress):
            choice = choose(model, tokens, gpu_types=gpu_types.split(","), max_gpus=max_gpus, prices=prices,
                            spot=spot, deadline_hours=None if deadline is None else parse_duration(deadline),
                            budget_usd=budget, progress=shown, seq_len=seq_len, global_batch=global_batch,
                            allow_lora=allow_lora, allow_savers=allow_savers, time_limit=time_limit, **pins)
        if plot:
            write_together({plot: lambda path: plot_choice(choice, path)}, force=force)
            err.print(f"wrote {plot}")
    except Exception as error:
        _fail(error)
    if as_json:
        print(json.dumps({**choice.to_json(), "log": log}, indent=2))
    else:
        render_choice(choice, out)
    if not choice.front:  # nothing fits anywhere in the sweep
        raise typer.Exit(code=3)


@app.command("measure")
def measure_command(
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write the profile here (default: "
                                                "~/.cache/fitplan/profiles/<gpu>.json or $FITPLAN_PROFILE_DIR).")
                      ] = None,
    quick: Annotated[bool, typer.Option(help="Fewer sizes and repeats (under a minute).")] = False,
    device: Annotated[Literal["auto", "cuda", "cpu"], typer.Option(help="cuda, cpu (gloo collectives) or auto.")
                      ] = "auto",
    ranks: Annotated[int | None, number(int, 1, C.MAX_GPUS_PER_NODE, "Processes for the collectives (default: the "
                                        f"local GPUs; 2 on CPU, at most {B.MAX_CPU_RANKS}; 1 skips them).")] = None,
    force: Annotated[bool, typer.Option(help="Overwrite an existing -o file.")] = False,
    as_json: AsJson = False,
    verbose: Verbose = False,
) -> None:
    """Microbenchmark this node (GEMMs, attention, collectives, copies, CPU Adam) into a profile for --profile."""
    from costmodels.profile import profile_json
    from solver.cli.profile_report import profile_lines
    from solver.hardware.measure import measure_to_file

    try:
        with _quietly("Measuring this node", verbose=verbose) as (_log, progress):
            profile, path = measure_to_file(device, quick=quick, ranks=ranks, output=output, force=force,
                                            progress=lambda step: progress(f"Measuring {step}"))
    except Exception as error:
        _fail(error)
    err.print(f"wrote {path}", markup=False, highlight=False)
    if as_json:
        print(profile_json(profile), end="")
    else:
        for line in profile_lines(profile, str(path)):
            out.print(line, markup=False, highlight=False, soft_wrap=True)


@app.command("check")
def check_command(
    plan_file: Annotated[Path, typer.Argument(help="A plan JSON written by `solve -o`.")],
    steps: Annotated[int, number(int, 1, B.MAX_CHECK_STEPS, "Training steps (the first is a warm-up for the step "
                                 "time).")] = 5,
    device: Annotated[Literal["auto", "cuda", "cpu"], typer.Option(help="cuda, cpu (gloo) or auto.")] = "auto",
    nproc: Annotated[int | None, number(int, 1, B.MAX_GPUS, "Processes; must equal the plan's ranks (the default; "
                                        f"at most {B.MAX_CPU_RANKS} on CPU).")] = None,
    as_json: AsJson = False,
) -> None:
    """Run a plan here for a few steps (random weights, synthetic batch) and compare with its estimate."""
    from solver.cli.validation import checked
    from solver.hardware.check import check_lines, check_plan

    try:
        err.print("[dim]Running the plan's torchrun script...[/]")
        report = check_plan(plan_file, steps=steps, device=device, nproc=nproc, validate=checked(plan_file))
    except Exception as error:
        _fail(error)
    if as_json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        for line in check_lines(report):
            out.print(line, markup=False, highlight=False, soft_wrap=True)
    if not report.exact_ok:  # a reported difference is a failed check, also for scripts that read only the code
        differing = ", ".join(row.name for row in report.rows if row.exact and row.measured != row.estimated)
        err.print(f"[bold red]Check failed:[/] measured differs from the estimate where it must be exact: "
                  f"{differing}.", markup=True, highlight=False)
        raise typer.Exit(code=5)


def main() -> NoReturn:
    """Entry point of the `fitplan` command."""
    finish(run(app))


def solve_entry() -> NoReturn:
    """Entry point of the `solve` command: `fitplan solve` under a shorter name."""
    single = typer.Typer(add_completion=False, pretty_exceptions_enable=False, context_settings=HELP)
    single.command()(solve_command)
    finish(run(single))


def run(application: typer.Typer) -> int:
    """Run one command in this process and return its exit code. Python's cyclic garbage collector is paused
    meanwhile: a search allocates millions of short-lived tuples and records, which reference counting frees, and
    the collector's passes over them took ~12% of a 405B solve (issue 33). Peak resident memory: the same for that
    solve (305 MB), 5% more where the command lowers a model (Qwen2.5-32B on an empty cache: 680 against 649 MB)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        application()
    except SystemExit as done:
        return _exit_code(done.code)
    except Exception as error:  # an internal error: report it as one (exit 1)
        err.print(f"[bold red]Internal error[/] ({type(error).__name__}): {error}")
        err.print("This is a bug in fitplan; please report it with the command line.")
        return 1
    finally:
        if collecting:
            gc.enable()
    return 0


def finish(code: int) -> NoReturn:
    """End the process once its output is written, without the interpreter's teardown: freeing a large solve's
    objects one by one took ~0.65 s of a 405B solve's ~9.6 s (issue 33). Every file and worker pool a command opens
    is closed by its own `with` before this point, and nothing registers exit hooks."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe (`fitplan ... | head`) has nothing to take
            stream.flush()
    os._exit(code)


def _exit_code(code: object) -> int:
    """The process exit code of a `SystemExit` (as the interpreter derives it)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1
