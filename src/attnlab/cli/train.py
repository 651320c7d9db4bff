"""``attnlab train``: fit a character-level GPT to a text file (`attnlab.apps.gpt.train`).

Example:
    $ attnlab train --steps 600 --out runs/alice
    $ attnlab train --out runs/alice --resume
    $ attnlab train --schedule noam --warmup 100 --precision fp16 --out runs/noam
    $ attnlab train --steps 200 --out runs/sweep --sweep lr=1e-3,3e-3 warmup=0,50
    $ torchrun --nproc-per-node=2 -m attnlab train --out runs/ddp
    $ torchrun --nproc-per-node=2 -m attnlab train --context-parallel --dropout 0 --out runs/cp
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from . import tasks
from ._args import (
    MAX_THREADS,
    UsageError,
    add_device_argument,
    check_output_dir,
    existing_file,
    int_in,
    nonnegative_float,
    nonnegative_int,
    probability,
    seed_int,
    size_int,
    step_count,
    step_interval,
)
from ._lazy import lazy_attributes
from ._output import fitted, print_json, wrap

if TYPE_CHECKING:  # the library is imported where a command runs: --help imports no torch
    import torch

    from ..analysis.table_parts import TableParts
    from ..apps.gpt import TrainSettings

#: `attnlab.apps.gpt.TrainSettings`' defaults that ``--help`` prints, and the choices of
#: --schedule and --precision and the axes of --sweep (`SCHEDULES`, `PRECISIONS`, `SWEEP_AXES`),
#: written out because ``--help`` imports no torch (a test holds them equal).
DEFAULTS = {
    "out_dir": "runs/alice",
    "steps": 600,
    "batch_size": 16,
    "seq_len": 128,
    "d_model": 128,
    "n_layers": 4,
    "n_heads": 4,
    "n_kv_heads": None,
    "dropout": 0.1,
    "lr": 3e-3,
    "min_lr": 3e-4,
    "warmup": 50,
    "weight_decay": 0.1,
    "grad_clip": 1.0,
    "eval_interval": 100,
    "eval_batches": 8,
    "save_interval": 200,
    "seed": 1337,
    "sliding_window": None,
    "local_per_global": None,
}
SCHEDULES = ("cosine", "noam")
PRECISIONS = ("fp32", "bf16", "fp16")
SWEEP_AXES = ("lr", "warmup")

#: `attnlab.apps.gpt.train`, imported on first use (`attnlab.cli._lazy`).
__getattr__ = lazy_attributes(__name__, {"train": "..apps.gpt"})

#: Characters assumed by the memory estimate (the text's own count is known only once read;
#: the embedding is a small part of any model that does not fit).
_ESTIMATE_VOCAB = 256


def check_memory(settings: TrainSettings, device: torch.device) -> None:
    """Raises `UsageError` (naming the size argument) if the run cannot fit in memory.

    Parameters are counted on the meta device (`parameter_count`), activations estimated for
    one batch (`transformer_activation_bytes`; under torchrun, this rank's part of it).
    """
    from ..apps.gpt import TrainSettings
    from ..distributed.ddp import launched_by_torchrun
    from ._budget import Estimate, check_fits, parameter_count, transformer_activation_bytes

    def build(layers: int) -> torch.nn.Module:
        from ..models import GPT

        return GPT(replace(settings, n_layers=layers).model_config(_ESTIMATE_VOCAB))

    params, buffers = parameter_count(build, settings.n_layers)
    ranks = int(os.environ.get("WORLD_SIZE", "1")) if launched_by_torchrun() else 1
    tokens = -(-settings.batch_size * settings.seq_len // max(1, ranks))
    acts = transformer_activation_bytes(
        tokens,
        settings.n_layers,
        settings.d_model,
        _ESTIMATE_VOCAB,
        checkpointing=settings.grad_checkpointing,
    )
    d = TrainSettings()
    sizes = [
        (f"--{name.replace('_', '-')}", getattr(settings, name), getattr(d, name))
        for name in ("d_model", "n_layers", "batch_size", "seq_len")
    ]
    check_fits(Estimate(params, buffers, acts), sizes, device)


def _check_resume(path: str) -> None:
    """Refuses a checkpoint whose stored settings are malformed (``--resume``, one line)."""
    from ..apps.gpt import stored_settings
    from ..checkpoint import read_header

    try:
        meta = read_header(path).metadata
    except (OSError, ValueError):  # a damaged file: `train` names the fault when it verifies it
        return
    try:
        stored_settings(path, meta)
    except (TypeError, ValueError) as e:  # CheckpointError is a ValueError
        raise UsageError("--resume", " ".join(str(e).split())) from None


def _given_values(args: argparse.Namespace) -> dict:
    """The `TrainSettings` fields given on the command line (``--positional none``: None)."""
    from ..apps.gpt import TrainSettings

    values = {
        f.name: getattr(args, f.name)
        for f in fields(TrainSettings)
        if getattr(args, f.name, None) is not None
    }
    if args.positional == "none":
        values["positional"] = None
    return values


def _check_schedule(values: dict, defaults: TrainSettings) -> None:
    """--bf16 against --precision, noam's unused rates and warmup, --min-lr against --lr."""
    if values.get("bf16") and values.get("precision", "bf16") != "bf16":
        raise UsageError(
            "--bf16", f"is the alias of --precision bf16; got --precision {values['precision']}"
        )
    if values.get("schedule") == "noam":
        given = [n for n in ("lr", "min_lr") if n in values]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise UsageError(
                flag,
                "is not used by --schedule noam (lr = d_model^-0.5 · min(t^-0.5, t · "
                f"warmup^-1.5)); got {flag} {values[given[0]]}",
            )
        if values.get("warmup", defaults.warmup) < 1:
            raise UsageError(
                "--warmup", f"must be >= 1 with --schedule noam, got {values['warmup']}"
            )
    if values.get("min_lr", defaults.min_lr) > values.get("lr", defaults.lr):
        raise UsageError(
            "--min-lr",
            f"must be <= --lr {values.get('lr', defaults.lr)}, "
            f"got {values.get('min_lr', defaults.min_lr)}",
        )


def _check_heads(values: dict, defaults: TrainSettings) -> None:
    """--n-heads divides --d-model and --n-kv-heads divides --n-heads."""
    heads = values.get("n_heads", defaults.n_heads)
    if values.get("d_model", defaults.d_model) % heads:
        raise UsageError(
            "--n-heads",
            f"must divide --d-model {values.get('d_model', defaults.d_model)}, got {heads}",
        )
    kv_heads = values.get("n_kv_heads") or heads
    if heads % kv_heads:
        raise UsageError("--n-kv-heads", f"must divide --n-heads {heads}, got {kv_heads}")


def _check_windows(values: dict) -> None:
    """--local-per-global and --attention local_global need --sliding-window, not each other."""
    if "sliding_window" in values:
        if values.get("attention") == "local_global" and "local_per_global" in values:
            raise UsageError(
                "--local-per-global",
                "interleaves sliding and full layers; --attention local_global puts local heads "
                f"in every layer: drop one (got --local-per-global {values['local_per_global']})",
            )
        return
    for name, flag in (("local_per_global", "--local-per-global"), ("attention", "--attention")):
        if name in values and values[name] != "softmax":
            raise UsageError(flag, f"needs --sliding-window W; got {flag} {values[name]}")


def _run_sweep(args: argparse.Namespace, settings: TrainSettings, values: dict) -> int:
    """--sweep: one run per grid point (every point checked first), then the table and files."""
    import torch

    from ..apps.gpt import sweep, sweep_plan, write_sweep
    from ..distributed.ddp import launched_by_torchrun

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if launched_by_torchrun() and os.environ["WORLD_SIZE"] != "1":
        raise UsageError("--sweep", "trains one process per grid point; run it without torchrun")
    if args.resume is not None:
        raise UsageError("--sweep", "cannot be combined with --resume (each point is a new run)")
    grid = _parse_sweep(args.sweep)
    for name in grid:
        if name in values:
            flag = "--" + name.replace("_", "-")
            raise UsageError("--sweep", f"sweeps {name}; remove {flag} {values[name]}")
    try:
        sweep_plan(settings, grid)  # every point checked before the first run
    except ValueError as e:
        raise UsageError("--sweep", str(e)) from None
    # with --json, stdout holds the JSON alone: the runs' lines go to stderr
    to_stderr = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    with to_stderr:
        result = sweep(settings, grid, progress=not args.quiet, log=_log, device=args.device)
        paths = write_sweep(result, settings.out_dir)
    if args.json:
        print_json(result.to_dict())
        return 0
    print(fitted(_sweep_parts(result)))
    print(wrap("wrote " + ", ".join(str(p) for p in paths), indent="  "))
    return 0


def _sweep_parts(result) -> TableParts:
    """`attnlab.apps.gpt.SweepResult.table`'s cells as `TableParts` (the same cells, a column
    per swept setting, then the final losses and seconds; ``*`` marks the best run)."""
    from ..analysis.table_parts import TableParts

    best = result.best()
    keys = list(result.grid)
    header = [*keys, "final train", "final val", "seconds", ""]
    rows = [
        [
            *(f"{r.point[k]:g}" for k in keys),
            f"{r.final_train:.4f}",
            f"{r.final_val:.4f}",
            f"{r.seconds:.1f}",
            "*" if r is best else "",
        ]
        for r in result.runs
    ]
    s = result.base
    note = (
        f"({s.schedule} schedule, {s.steps} steps of {s.batch_size}×{s.seq_len} characters, "
        f"d_model={s.d_model}, {s.n_layers} layers, {s.precision}; unigram entropy "
        f"{result.unigram_entropy:.3f} nats/char; * = lowest final validation loss)"
    )
    return TableParts(header, rows, ">" * (len(header) - 1) + "<", after=(note,))


def _log(line: str) -> None:
    """Prints a run's log line wrapped to the terminal."""
    print(wrap(line, indent="  "))


def _cmd_train(args: argparse.Namespace) -> int:
    from ..apps.gpt import CHECKPOINT_NAME, TrainSettings
    from ..distributed.ddp import process_group_from_env, rank_device

    if args.json and args.sweep is None:
        raise UsageError("--json", "prints the rows of --sweep; add --sweep or drop --json")
    defaults = TrainSettings()
    values = _given_values(args)
    _check_schedule(values, defaults)
    _check_heads(values, defaults)
    _check_windows(values)
    settings = TrainSettings(**{**asdict(defaults), **values})
    main = os.environ.get("RANK", "0") == "0"  # under torchrun only rank 0 reads and writes files
    if main:
        check_output_dir(settings.out_dir, "--out")
    if args.resume is None:  # a resumed run's sizes are those its checkpoint's tensors hold
        check_memory(settings, args.device)
    if args.sweep is not None:
        return _run_sweep(args, settings, values)
    resume = None
    if args.resume is not None:
        resume = args.resume or str(Path(settings.out_dir) / CHECKPOINT_NAME)
        conflicting = sorted(set(values) - {"out_dir"})
        if conflicting:
            print(
                "attnlab train: error: argument --resume: continues with the checkpoint's "
                f"stored settings; remove {['--' + n.replace('_', '-') for n in conflicting]}",
                file=sys.stderr,
            )
            return 2
        if main and not Path(resume).is_file():
            raise UsageError("--resume", f"no checkpoint file {resume!r}")
        if main:
            _check_resume(resume)
    device = rank_device(args.device)  # under torchrun: cuda -> cuda:LOCAL_RANK
    with process_group_from_env(device):  # torchrun: DistributedDataParallel over its ranks
        result = sys.modules[__name__].train(
            settings,
            resume=resume,
            progress=not args.quiet,
            log=_log,
            device=device,
            context_parallel=args.context_parallel,
            threads=args.threads,
        )
    if main:
        out = Path(settings.out_dir)
        written = f"wrote {result.checkpoint}, {out / 'loss.png'}, {out / 'grad_norm.png'}"
        print(wrap(written, indent="  "))
    return 0


def _parse_sweep(specs: list[str]) -> dict[str, list[float | int]]:
    """``["lr=1e-3,3e-3", "warmup=0,100"]`` -> ``{"lr": [0.001, 0.003], "warmup": [0, 100]}``."""
    grid: dict[str, list[float | int]] = {}
    for spec in specs:
        name, sep, text = spec.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in SWEEP_AXES:
            raise UsageError(
                "--sweep", f"expects AXIS=V1,V2,... with AXIS in {list(SWEEP_AXES)}, got {spec!r}"
            )
        if name in grid:
            raise UsageError("--sweep", f"gives {name} twice, got {spec!r}")
        kind = nonnegative_int if name == "warmup" else nonnegative_float
        try:
            values = [kind(v.strip()) for v in text.split(",")]
        except argparse.ArgumentTypeError as e:
            raise UsageError("--sweep", f"{name}: {e}") from None
        if len(set(values)) != len(values):
            raise UsageError("--sweep", f"{name} has repeated values, got {text!r}")
        grid[name] = values
    return grid


def register(sub: argparse._SubParsersAction) -> None:
    """Adds ``attnlab train`` to the CLI's subparsers."""
    p = sub.add_parser(
        "train",
        help="train a character-level GPT on a text file (default: the shipped Alice text)",
        description=(
            "Trains a character-level GPT with AdamW, warmup + cosine LR (or the 2017 paper's "
            "inverse-square-root 'noam' schedule), gradient clipping and optional bf16 / fp16 "
            "(with loss scaling) autocast and gradient checkpointing. Prints train and validation "
            "loss next to the text's unigram entropy (nats/char) and per-layer gradient norms, "
            "shows a progress bar, and writes OUT/ckpt.safetensors (verified, atomic), "
            "OUT/config.json, OUT/loss.png and OUT/grad_norm.png. With --sweep it trains one run "
            "per grid point into OUT/<point>/ and writes OUT/sweep.{txt,json,png}. Launched by "
            "torchrun (torchrun --nproc-per-node=N -m attnlab train ...) it trains with "
            "DistributedDataParallel: every rank draws the same global batch and takes its "
            "slice (or, with --context-parallel, its shard of every sequence), and rank 0 alone "
            "logs and writes. Sizes are checked before anything is built: a run whose "
            "parameters, gradients, AdamW state and activations need more memory than is "
            "available is refused in one line naming the argument and the estimated bytes; "
            "integer arguments have upper bounds (sizes 2**30, steps 10**9, seeds 2**32 - 1). "
            "Every file is written atomically; a run ended by SIGTERM or Ctrl-C removes its "
            "temp files, and the temp files of a killed run (SIGKILL) are removed by the next "
            "run into the same directory. "
            f"The defaults ({DEFAULTS['steps']} steps) learn visibly in a few minutes on 2 CPU "
            "cores."
        ),
    )
    p.add_argument(
        "--text", type=existing_file, help="UTF-8 text file (default: the shipped alice.txt)"
    )
    p.add_argument(
        "--out", dest="out_dir", help=f"output directory (default {DEFAULTS['out_dir']})"
    )
    p.add_argument(
        "--resume",
        nargs="?",
        const="",
        help="continue from a checkpoint (default path: OUT/ckpt.safetensors); the stored "
        "settings (each field's type checked first) and torch thread count are used",
    )
    for name, kind, text in (
        ("steps", step_count, "optimizer steps"),
        ("batch_size", size_int, "sequences per batch"),
        ("seq_len", size_int, "characters per sequence (= max_seq_len)"),
        ("d_model", size_int, "model width"),
        ("n_layers", size_int, "Transformer blocks"),
        ("n_heads", size_int, "attention heads"),
        ("n_kv_heads", size_int, "key/value heads (GQA)"),
        ("dropout", probability, "dropout probability"),
        ("lr", nonnegative_float, "peak learning rate"),
        ("min_lr", nonnegative_float, "final learning rate of the cosine decay"),
        ("warmup", step_interval, "linear warmup steps"),
        ("weight_decay", nonnegative_float, "AdamW weight decay of matrices"),
        ("grad_clip", nonnegative_float, "max gradient norm (0 = off)"),
        ("eval_interval", step_count, "steps between evaluations"),
        ("eval_batches", step_count, "batches per evaluation"),
        ("save_interval", step_interval, "steps between checkpoints"),
        ("seed", seed_int, "random seed"),
        ("sliding_window", size_int, "sliding layers attend to their last W keys (Mistral)"),
        (
            "local_per_global",
            nonnegative_int,
            "with --sliding-window: sliding layers before each full-attention layer "
            "(Gemma 2: 1, Gemma 3: 5; unset: every layer slides)",
        ),
    ):
        flag = "--" + name.replace("_", "-")
        p.add_argument(flag, dest=name, type=kind, help=f"{text} (default {DEFAULTS[name]})")
    p.add_argument(
        "--positional",
        choices=["rope", "learned", "sinusoidal", "alibi", "t5", "none"],
        help="position encoding (default rope; t5: bucketed relative bias, one table)",
    )
    p.add_argument(
        "--attention",
        choices=["softmax", "local_global"],
        help="local_global: in every layer half the heads attend within --sliding-window, the "
        "others to every key, outputs concatenated (default softmax)",
    )
    p.add_argument(
        "--schedule",
        choices=list(SCHEDULES),
        help="learning-rate schedule: cosine = linear warmup then cosine decay to --min-lr; "
        "noam = d_model^-0.5 · min(step^-0.5, step · warmup^-1.5) (Vaswani et al. 2017; "
        "--lr/--min-lr unused) (default cosine)",
    )
    p.add_argument(
        "--precision",
        choices=list(PRECISIONS),
        help="fp32, bf16 autocast, or fp16 autocast with dynamic loss scaling "
        "(torch.amp.GradScaler; on CPUs without fp16 matmul units it is several times slower "
        "than fp32) (default fp32)",
    )
    p.add_argument("--bf16", action="store_true", default=None, help="alias of --precision bf16")
    p.add_argument(
        "--sweep",
        nargs="+",
        metavar="AXIS=V1,V2",
        help=f"learning-rate / warmup ablation: one run per grid point, axes {list(SWEEP_AXES)}, "
        "e.g. --sweep lr=1e-3,3e-3 warmup=0,100; writes OUT/sweep.txt, sweep.json, sweep.png",
    )
    p.add_argument(
        "--grad-checkpointing",
        dest="grad_checkpointing",
        action="store_true",
        default=None,
        help="recompute each block in backward to save memory",
    )
    p.add_argument(
        "--threads",
        type=int_in(1, MAX_THREADS),
        help="torch intra-op threads (default: torch's choice, one per core; with --resume: "
        "the count stored in the checkpoint, so the continued run is bit-exact; another "
        "count is used with a warning that it will not be); 1 avoids thread stalls when "
        "other processes keep the cores busy",
    )
    p.add_argument(
        "--context-parallel",
        action="store_true",
        help="under torchrun: shard every sequence across the ranks (ring attention; needs "
        "--dropout 0 and --seq-len divisible by the ranks) instead of the batch (default: data "
        "parallel, --batch-size divisible by the ranks); one process: no effect",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="with --sweep: print the runs as JSON (what OUT/sweep.json holds) instead of the "
        "table; the log lines go to stderr",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_device_argument(p)
    p.set_defaults(func=_cmd_train)
    _register_tasks(p)


def _register_tasks(p: argparse.ArgumentParser) -> None:
    """``attnlab train TASK ...``: one sub-command per module of `attnlab.cli.tasks`."""
    modules = tasks.discover()
    if not modules:
        return
    names = [m.__name__.rsplit(".", 1)[1] for m in modules]
    sub = p.add_subparsers(
        dest="task",
        metavar="TASK",
        parser_class=type(p),
        title="tasks (attnlab train TASK --help; without a task: the character-level GPT)",
    )
    for name, module in zip(names, modules, strict=True):
        tp = sub.add_parser(name, help=module.HELP, description=module.DESCRIPTION)
        module.add_arguments(tp)
        tp.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks"
        )
        tp.set_defaults(func=module.run)
