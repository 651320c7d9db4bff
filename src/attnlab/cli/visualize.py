"""``attnlab visualize``: see what a real model attends to, as HTML, PNG or text.

The command runs a model on a text (`attnlab.apps.attentions.collect`), takes every
layer's attention weights ``(layers, heads, T, T)`` and writes

- ``--format html`` (default): one self-contained page (`attnlab.viz.save_attention_html`) with
  a head view, a model view, per-head entropies and hover details;
- ``--format text``: per head, each token's top-3 attended tokens with weights;
- ``--png [FILE]``: additionally a grid of heatmaps, layers × heads (`attnlab.viz.attention_png`);
  for a model with attention sinks (GPT-OSS) also ``STEM_sinks.png``, the sink's share per head
  and per row (`attnlab.viz.plot_sinks`).

Models: ``minilm`` (default, the pretrained all-MiniLM-L6-v2), ``gpt`` (a character-level
checkpoint written by ``attnlab train``, ``--checkpoint PATH``), or ``--model FOLDER``: a local
transformers checkpoint (encoder, decoder or encoder–decoder, with its tokenizer), read from
safetensors only and checked against its config before loading; an encoder–decoder shows its
encoder self-attention and its decoder cross-attention, two viewers on one page; its inputs over
64 tokens keep each row's exact top-k weights, computed without the L×S matrix. A checkpoint of
``attnlab train translate`` (recognised by the kind stored in the file) shows its decoder
cross-attention on its own translation of TEXT: output characters × source characters
(non-square), every layer and head in the viewer, the mean over them with ``--png``; with
``--compare B`` a second translate checkpoint (e.g. the RNN of ``--arch rnn``) translates the
same TEXT and the two alignments are drawn side by side (``--png``,
`attnlab.viz.alignment.plot_alignment_comparison`) or shown one after the other (html, text).

Example:
    $ attnlab visualize "The animal didn't cross the street because it was too tired"
    $ attnlab visualize --checkpoint runs/alice/ckpt.safetensors "Alice was" --format text
    $ attnlab visualize --model ./my-bart "The cat sat on the mat." --out bart.html
    $ attnlab visualize --checkpoint runs/translate/ckpt.safetensors "twenty-three" --png
    $ attnlab visualize --checkpoint runs/translate/ckpt.safetensors \
          --compare runs/translate-rnn/ckpt.safetensors "twenty-three" --png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ._args import (
    UsageError,
    add_device_argument,
    check_output_file,
    existing_file,
    nonnegative_int,
    positive_int,
)
from ._lazy import lazy_attributes
from ._output import wrap

if TYPE_CHECKING:  # the library is imported by the functions that run (--help imports no torch)
    from ..analysis.model_attentions import Attentions, LongAttentions

#: `attnlab.apps.attentions.collect`, imported on first use (`attnlab.cli._lazy`).
__getattr__ = lazy_attributes(__name__, {"collect": "..apps.attentions"})

DEFAULT_TEXT = "The animal didn't cross the street because it was too tired"


def _short(text: str, limit: int = 80) -> str:
    """The text on one line, cut to ``limit`` characters with an ellipsis."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _shape(run: Attentions | LongAttentions) -> tuple[int, ...]:
    from ..analysis.model_attentions import LongAttentions

    return run.shape if isinstance(run, LongAttentions) else tuple(run.weights.shape)


def _long_text(run: LongAttentions, layers: list[int] | None, heads: list[int] | None) -> str:
    """`attention_text`'s report from a long run's top-k rows (top-3 per query)."""
    keys = run.key_tokens or run.tokens
    Ly, H = run.shape[:2]
    out = []
    for li in layers if layers is not None else range(Ly):
        for h in heads if heads is not None else range(H):
            ent = run.row_entropy[li, h].nanmean().item()
            out.append(f"layer {li}, head {h} · entropy {ent:.3f} nats")
            for i, token in enumerate(run.tokens):
                vals, idx = run.top_val[li, h, i, :3], run.top_idx[li, h, i, :3]
                pairs = zip(vals.tolist(), idx.tolist(), strict=True)
                top = "   ".join(f"{keys[j]} {v:.3f}" for v, j in pairs if v > 0)
                out.append(f"  {token} → {top}")
    return "\n".join(out)


def _summary(run: Attentions | LongAttentions) -> str:
    Ly, H, T, S = _shape(run)
    size = f"{T} tokens" if run.key_tokens is None else f"{T} queries × {S} keys"
    part = f" · {run.part}" if run.part else ""
    return f"{run.model}{part} · {size} · {Ly} layers × {H} heads"


TRANSLATE_TEXT = "nine hundred and eighty-seven thousand, six hundred and fifty-four"


def _kind(path: str) -> str:
    from ..apps import read_kind

    return read_kind(path)


def _vit_run(args: argparse.Namespace) -> Attentions:
    """The self-attention of a vit checkpoint on one held-out digit (TEXT: its index in the
    held-out split, default 0): [CLS] and the patches as tokens, every layer and head."""
    import torch

    from ..analysis.model_attentions import Attentions
    from ..apps.vit import digits_split, load
    from ..viz.vit import patch_tokens

    text = "0" if args.text == DEFAULT_TEXT else args.text
    split = digits_split()
    n = len(split.y_test)
    if not text.isdigit() or not 0 <= int(text) < n:
        raise ValueError(f"TEXT must be a held-out image index in [0, {n}) for a vit checkpoint")
    model, _ = load(args.checkpoint, device=args.device)
    image = split.x_test[int(text)].unsqueeze(0).to(args.device)  # (1, 1, H, W)
    with torch.no_grad():
        logits, weights = model(image, need_weights=True)
    stacked = torch.stack([w[0].float().cpu() for w in weights])  # (layers, heads, T, T)
    grid = model.config.grid
    pred, truth = int(logits.argmax(-1)), int(split.y_test[int(text)])
    return Attentions(
        tokens=patch_tokens(grid),
        weights=stacked,
        model="vit",
        notes=[f"held-out digit {text}: true {truth}, predicted {pred}; tokens r<row>c<col>"],
        part="encoder self-attention",
    )


def _translate_run(
    args: argparse.Namespace, path: str | None = None, option: str = "--checkpoint"
) -> Attentions:
    """The cross-attention of a translate checkpoint (``path``, default ``--checkpoint``) on its
    own translation of TEXT: output characters (queries) × source characters (keys), every
    layer and head (an RNN's additive attention: one layer, one head)."""
    from ..analysis.model_attentions import Attentions
    from ..apps.translate import MAX_SOURCE_CHARS, cross_attentions, langs_of, load, vocab_of

    if len(args.text) > MAX_SOURCE_CHARS:
        raise UsageError(
            "TEXT",
            f"has {len(args.text):,} characters; a translate checkpoint takes at most "
            f"{MAX_SOURCE_CHARS} (one number's words)",
        )
    model, ck = load(path or args.checkpoint, device=args.device)
    vocab, langs = vocab_of(ck), langs_of(ck)
    if args.lang not in langs:
        raise ValueError(f"--lang must be one of {langs} for {option}, got {args.lang!r}")
    text = TRANSLATE_TEXT if args.text == DEFAULT_TEXT else args.text
    src, out, weights = cross_attentions(model, vocab, text, args.lang)
    translation = "".join(t for t in out if t != "<eos>")
    arch = ck.metadata.get("arch", "transformer")
    return Attentions(
        tokens=out,
        weights=weights,
        model="translate",
        notes=[f"{text} -> ({args.lang}) {translation}"],
        key_tokens=src,
        part="decoder cross-attention" if arch == "transformer" else f"{arch} additive attention",
    )


def _compare_runs(args: argparse.Namespace) -> list[Attentions]:
    """``--checkpoint A --compare B``: both translate checkpoints' alignments on TEXT."""
    if args.checkpoint is None or args.model is not None:
        raise ValueError("--compare needs --checkpoint (a translate checkpoint) and no --model")
    for option, path in (("--checkpoint", args.checkpoint), ("--compare", args.compare)):
        kind = _kind(path)
        if kind != "translate":
            raise ValueError(
                f"{option} must be a translate checkpoint with --compare, got kind {kind!r}"
            )
    return [
        _translate_run(args, args.checkpoint, "--checkpoint"),
        _translate_run(args, args.compare, "--compare"),
    ]


def _compare_png(args: argparse.Namespace, runs: list[Attentions], png: Path) -> None:
    """The two checkpoints' alignments side by side (mean of layers and heads each)."""
    from ..viz.alignment import plot_alignment_comparison

    paths = (args.checkpoint, args.compare)
    names = [
        r.part.split()[0] if r.part.endswith("additive attention") else "transformer" for r in runs
    ]
    if names[0] == names[1]:
        names = [f"{n} ({_short(str(p), 40)})" for n, p in zip(names, paths, strict=True)]
    columns = [
        (
            name,
            [
                (
                    "→ " + _short(run.notes[0].split(" -> ", 1)[-1], 48),
                    run.key_tokens,
                    run.tokens,
                    run.weights.mean((0, 1)),  # (T, S): the mean of layers and heads
                )
            ],
        )
        for name, run in zip(names, runs, strict=True)
    ]
    plot_alignment_comparison(png, columns)


def _check_choice(args: argparse.Namespace, runs: list) -> None:
    for run in runs:
        Ly, H = _shape(run)[:2]
        for name, value, size in (("--layer", args.layer, Ly), ("--head", args.head, H)):
            if value is not None and not 0 <= value < size:
                raise ValueError(f"{name} must be in [0, {size}), got {value}")


def _save(views: list, path: str) -> Path:
    """One page: the single view's own page, or every view's fragment one after another."""
    out = Path(path)
    if len(views) == 1:
        return views[0].save(out)
    page = views[0].html("attnlab-view-0")
    extra = "".join(v.fragment(f"attnlab-view-{i}") for i, v in enumerate(views) if i)
    marker = page.rindex("</body>")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page[:marker] + extra + page[marker:], encoding="utf-8")
    return out


def _quiet_transformers() -> None:
    """No progress bars from transformers on the command's stderr (errors stay one line)."""
    try:
        from transformers.utils import logging
    except ImportError:
        return  # check_hf_folder names the missing extra
    logging.disable_progress_bar()


#: The JSON files of a transformers folder that Python's json module parses (tokenizer.json is
#: parsed by the tokenizers library, which bounds its own nesting).
_FOLDER_JSON = (
    "config.json",
    "generation_config.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


def _config_error(e: BaseException) -> str | None:
    """The one-line cause of a config that transformers refused field by field, else None."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return None
    if not isinstance(e, StrictDataclassError):
        return None
    text = " ".join(str(e).split())
    _, sep, cause = text.partition(": ")  # "Validation error for field 'x': TypeError: ..."
    cause = cause if sep and cause else text
    for prefix in ("TypeError: ", "ValueError: "):
        cause = cause.removeprefix(prefix)
    return cause[:1].lower() + cause[1:]  # "field 'x' expected int, got str (value: '2')"


def check_folder_inputs(folder: str, text: str) -> None:
    """Checks a transformers folder and TEXT before `hf_attentions` loads any weight.

    Refused with `UsageError` naming ``--model`` (one line, exit code 2):

    - a JSON file of the folder that is larger than 16 MB, not UTF-8, not JSON or nested more
      than 64 levels deep (checked before parsing: never a RecursionError);
    - a config field of the wrong type (transformers' own typed fields: the field, the type
      expected and the type received);
    - a tokenizer that turns TEXT into an id the model has no embedding for (a tokenizer of
      another model: the id, the token, the model's ``vocab_size`` and the tokenizer's size).

    A folder that is not one (no config.json, ...) is left to `hf_attentions`' own messages.
    """
    from .._files import read_config_json

    path = Path(folder)
    if not (path / "config.json").is_file():
        return
    for name in _FOLDER_JSON:
        if (path / name).is_file():
            try:
                read_config_json(path / name)
            except ValueError as e:  # CheckpointError: too large, not JSON, too deep
                raise UsageError("--model", " ".join(str(e).split())) from None
    from ..analysis.model_attentions import HF_MAX_TOKENS
    from ..utils.extras import require

    require("transformers", "hf", "attnlab visualize --model PATH")
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(
            path, trust_remote_code=False, local_files_only=True
        )
    except Exception as e:
        cause = _config_error(e)
        if cause is None:
            return  # hf_attentions reports it (unknown model type, remote code, ...)
        raise UsageError("--model", f"{path / 'config.json'}: {cause}") from None
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text_config, "vocab_size", None)
    if isinstance(vocab, bool) or not isinstance(vocab, int):
        return
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            path, trust_remote_code=False, local_files_only=True
        )
    except (OSError, ValueError, KeyError):
        return  # hf_attentions names the missing tokenizer
    limit = min(HF_MAX_TOKENS, getattr(config, "max_position_embeddings", None) or HF_MAX_TOKENS)
    ids = list(tokenizer(text, truncation=True, max_length=limit)["input_ids"])
    start = getattr(config, "decoder_start_token_id", None)
    if getattr(config, "is_encoder_decoder", False) and isinstance(start, int):
        ids.append(start)
    if not ids or max(ids) < vocab:
        return
    bad = max(ids)
    token = tokenizer.convert_ids_to_tokens([bad])[0] if bad != start else "decoder start"
    raise UsageError(
        "--model",
        f"the tokenizer in {str(path)!r} gives TEXT the token id {bad} ({token!r}), but the "
        f"model's vocabulary has {vocab} entries (config.json vocab_size {vocab}; the "
        f"tokenizer has {len(tokenizer)} tokens): the tokenizer belongs to another model",
    )


def _collect_runs(args: argparse.Namespace) -> list:
    """The runs to show: a comparison, a translate or ViT checkpoint, an HF folder or `collect`."""
    from ..apps.attentions import MODELS, hf_attentions

    collect = sys.modules[__name__].collect
    kind = _kind(args.checkpoint) if args.checkpoint and args.model is None else None
    if args.compare is not None:
        return _compare_runs(args)
    if kind == "translate":
        return [_translate_run(args)]
    if kind == "vit":
        return [_vit_run(args)]
    if args.model is not None and args.model not in MODELS:
        if args.checkpoint is not None:
            raise ValueError("--checkpoint is for --model gpt; drop it with --model FOLDER")
        _quiet_transformers()
        check_folder_inputs(args.model, args.text)
        return hf_attentions(args.model, args.text, device=args.device, topk=args.top_k)
    return [collect(args.text, model=args.model, checkpoint=args.checkpoint, device=args.device)]


def _print_text(args: argparse.Namespace, runs: list) -> None:
    """--format text: each run's top-3 attended tokens per query."""
    from ..analysis.model_attentions import LongAttentions
    from ..viz.attention_view import attention_text

    layers = None if args.layer is None else [args.layer]
    heads = None if args.head is None else [args.head]
    for run in runs:
        print(wrap(_summary(run) + " · top-3 attended tokens per query (weight)", indent="  "))
        print()
        for note in run.notes:
            print(wrap(f"note: {note}", indent="  "))
        if isinstance(run, LongAttentions):
            print(wrap(_long_text(run, layers, heads), indent="    "))
            continue
        text = attention_text(
            run.tokens, run.weights, k=3, layers=layers, heads=heads, key_tokens=run.key_tokens
        )
        print(wrap(text, indent="    "))


def _write_html(args: argparse.Namespace, runs: list) -> None:
    """--format html: one viewer page for the runs at --out, and its notes."""
    from ..analysis.model_attentions import LongAttentions
    from ..viz.attention_view import MAX_FULL_TOKENS, AttentionView, long_view_data, show

    views = [
        AttentionView(
            long_view_data(
                run,
                title=f"Attention: {_short(args.text)}",
                subtitle=_summary(run),
                layer=args.layer or 0,
                head=args.head or 0,
            )
        )
        if isinstance(run, LongAttentions)
        else show(
            run.tokens,
            run.weights,
            key_tokens=run.key_tokens,
            title=f"Attention: {_short(args.text)}",
            subtitle=_summary(run),
            notes=run.notes,
            layer=args.layer or 0,
            head=args.head or 0,
            topk=args.top_k,
        )
        for run in runs
    ]
    out = _save(views, args.out)
    size = out.stat().st_size
    summaries = "; ".join(_summary(r) for r in runs)
    print(wrap(f"wrote {out} ({size / 1e6:.2f} MB; {summaries})", indent="  "))
    for run in runs:
        for note in run.notes:
            print(wrap(f"note: {note}", indent="  "))
        if max(_shape(run)[-2:]) > MAX_FULL_TOKENS:
            long = f"note: long input, the viewer keeps each token's top {args.top_k} weights"
            print(wrap(long, indent="  "))


def _write_png(args: argparse.Namespace, runs: list, png: Path) -> None:
    """--png: the comparison grid, a translation's alignment, or the first run's heatmaps."""
    if args.compare is not None:
        _compare_png(args, runs, png)
    elif runs[0].model == "translate":
        from ..viz.alignment import plot_alignments

        run = runs[0]
        title = f"{_short(run.notes[0], 60)} (mean of layers and heads)"
        mean = run.weights.mean((0, 1))  # (T, S)
        plot_alignments(png, [(title, run.key_tokens, run.tokens, mean)])
    else:
        from ..viz.attention_png import attention_png

        run = runs[0]
        attention_png(run.tokens, run.weights, png, title=_summary(run))
    print(wrap(f"wrote {png}", indent="  "))
    if args.compare is None and getattr(runs[0], "sinks", False):
        _sinks_png(args, runs[0], png)


def _sinks_png(args: argparse.Namespace, run: Attentions, png: Path) -> None:
    """--png of a model with attention sinks: also ``STEM_sinks.png``, the sink's share per
    head and per row of layer ``--layer`` (default 0) beside its strongest head's weights."""
    from ..viz.variants import plot_sinks

    layer = args.layer or 0
    out = png.with_name(f"{png.stem}_sinks.png")
    title = f"{_summary(run)} · layer {layer}: the sink's share"
    plot_sinks(out, run.weights[layer], tokens=run.tokens, title=title)
    print(wrap(f"wrote {out}", indent="  "))


def _cmd_visualize(args: argparse.Namespace) -> int:
    from ..analysis.model_attentions import LongAttentions

    if args.format == "html":
        check_output_file(args.out, "--out", (".html", ".htm"))
    png = None
    if args.png is not None:
        png = Path(args.out).with_suffix(".png") if args.png is True else Path(args.png)
        check_output_file(png, "--png", (".png",))
    try:
        runs = _collect_runs(args)
        _check_choice(args, runs)
        if png is not None and any(isinstance(r, LongAttentions) for r in runs):
            raise ValueError(
                "--png draws every weight: with --model FOLDER it needs at most 64 tokens"
            )
        if args.format == "text":
            _print_text(args, runs)
        else:
            _write_html(args, runs)
        if png is not None:
            _write_png(args, runs, png)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as e:
        print(f"attnlab visualize: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Adds ``attnlab visualize`` to the ``attnlab`` command's subparsers."""
    p = sub.add_parser(
        "visualize",
        help="show a model's attention on a text: HTML viewer, PNG heatmaps or text",
        description=(
            "Runs a model on TEXT and writes one self-contained HTML page (no network) with a "
            "head view (lines from each token to the tokens it attends to), a model view "
            "(layers × heads thumbnails; click to select), per-head entropy and hover "
            "details. Default model: the pretrained all-MiniLM-L6-v2; --checkpoint uses a "
            "character-level GPT written by `attnlab train`. With --model FOLDER, before any "
            "weight is read: its JSON files must be at most 16 MB and 64 levels deep, its "
            "config fields of their declared types, and the tokenizer must map TEXT to ids "
            "below the model's vocab_size (each refused in one line, exit code 2)."
        ),
    )
    p.add_argument(
        "text",
        nargs="?",
        default=DEFAULT_TEXT,
        metavar="TEXT",
        help=f"the text to run (default: {DEFAULT_TEXT!r})",
    )
    p.add_argument(
        "--model",
        default=None,
        metavar="minilm|gpt|FOLDER",
        help=(
            "minilm (default), gpt (implied by --checkpoint), or a local transformers checkpoint "
            "folder (safetensors weights + tokenizer; pickle .bin weights are refused)"
        ),
    )
    p.add_argument(
        "--checkpoint",
        type=existing_file,
        metavar="PATH",
        help="a GPT checkpoint (.safetensors) from `attnlab train`, or a translate checkpoint "
        "from `attnlab train translate` (shows its cross-attention: output characters × "
        "source characters, on its own translation of TEXT), or a vit checkpoint from `attnlab "
        "train vit` (TEXT: a held-out image index; [CLS] and the patches as tokens)",
    )
    p.add_argument(
        "--compare",
        type=existing_file,
        metavar="PATH",
        help="a second translate checkpoint (e.g. `train translate --arch rnn`): both "
        "models translate TEXT and their alignments are shown side by side (--png) or one "
        "after the other (html, text)",
    )
    p.add_argument(
        "--lang",
        default="de",
        help="translate checkpoints: the target language (default de)",
    )
    p.add_argument(
        "--out",
        default="attention.html",
        metavar="FILE.html",
        help="where to write the HTML page (default attention.html)",
    )
    p.add_argument(
        "--format",
        choices=("html", "text"),
        default="html",
        help="html (default) or text: per head, each token's top-3 attended tokens",
    )
    p.add_argument(
        "--png",
        nargs="?",
        const=True,
        default=None,
        metavar="FILE.png",
        help="also write a PNG grid of heatmaps, layers × heads (default name: --out as .png)",
    )
    p.add_argument(
        "--layer", type=nonnegative_int, help="text: only this layer; html: the layer shown first"
    )
    p.add_argument(
        "--head", type=nonnegative_int, help="text: only this head; html: the head shown first"
    )
    p.add_argument(
        "--top-k",
        type=positive_int,
        default=8,
        metavar="K",
        help="inputs over 64 tokens: weights kept and lines drawn per token (default 8)",
    )
    add_device_argument(p)
    p.set_defaults(func=_cmd_visualize)
