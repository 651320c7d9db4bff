"""Auto's per-dtype thresholds: built-in defaults, the per-machine cache, explain() (issue 19.5).

The suite runs with ``ATTNLAB_THRESHOLDS=off`` (tests/conftest.py); each test here that needs the
cache turns it on for itself with a cache file under tmp_path, and `thresholds.reset` runs around
every test so nothing loaded here leaks into other tests.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import attnlab
from attnlab import masks
from attnlab.analysis import calibrate
from attnlab.functional import thresholds
from attnlab.functional.backends import flash_declines
from attnlab.functional.request import build_request

BUILTIN = thresholds.BUILTIN


@pytest.fixture(autouse=True)
def _fresh():
    thresholds.reset()
    yield
    thresholds.reset()


@pytest.fixture
def cache_on(monkeypatch, tmp_path):
    """The cache turned on, at tmp_path/thresholds.json; returns that path."""
    path = tmp_path / "thresholds.json"
    monkeypatch.setenv(thresholds.ENV, "auto")
    monkeypatch.setenv(thresholds.FILE_ENV, str(path))
    return path


def entry(of: torch.dtype, band=1 << 10, sparse=1 << 12, long=1 << 20, **key) -> dict:
    """A cache entry for this machine and dtype ``of`` (``key`` overrides fields of the key)."""
    return {
        **thresholds.machine_key(of),
        "band": band,
        "sparse": sparse,
        "long": long,
        "measured_at": "2026-11-24 06:00 UTC",
        **key,
    }


def write(path, entries) -> None:
    path.write_text(
        json.dumps({"format": thresholds.FORMAT, "version": 1, "entries": entries}),
        encoding="utf-8",
    )


def window_request(L: int, dtype: torch.dtype = torch.float32):
    q = torch.zeros(1, 2, L, 8, dtype=dtype)
    return build_request(
        q, q, q, mask=masks.sliding_window(16), bias=None, scale=None,
        temperature=1.0, score="dot", dropout_p=0.0, return_weights=False, softcap=None,
    )  # fmt: skip


def test_the_suite_runs_with_the_cache_off(tmp_path, monkeypatch):
    """conftest.py turns the cache off; then not even a corrupt file is opened."""
    assert thresholds.enabled() is False
    bad = tmp_path / "t.json"
    bad.write_text("{not json", encoding="utf-8")
    monkeypatch.setenv(thresholds.FILE_ENV, str(bad))
    write_ok = tmp_path / "ok.json"
    write(write_ok, [entry(torch.float32)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert thresholds.for_dtype(torch.float32) is BUILTIN
        monkeypatch.setenv(thresholds.FILE_ENV, str(write_ok))
        thresholds.reset()
        assert thresholds.for_dtype(torch.float32) is BUILTIN  # a matching entry, unused
    assert "ATTNLAB_THRESHOLDS=off turns the cache off" in thresholds.describe(torch.float32)


def test_a_matching_entry_is_used_for_its_dtype_only(cache_on):
    write(cache_on, [entry(torch.bfloat16, band=1 << 10, sparse=1 << 11, long=1 << 30)])
    got = thresholds.for_dtype(torch.bfloat16)
    assert (got.band, got.sparse, got.long) == (1 << 10, 1 << 11, 1 << 30)
    cpu = thresholds.machine_key(torch.bfloat16)["cpu"]
    assert got.source == f"the cache file {cache_on}, measured on {cpu} at 2026-11-24 06:00 UTC"
    assert thresholds.for_dtype(torch.float32) is BUILTIN  # float32 was never measured
    # auto follows: a window at L·S = 48² (< the built-in 2¹⁶, > the cached 2¹⁰) goes to flash
    # in bfloat16 only
    assert flash_declines(window_request(48, torch.bfloat16)) is None
    assert "< 65536" in flash_declines(window_request(48, torch.float32))


@pytest.mark.parametrize(
    "field,value",
    [
        ("cpu", "Intel(R) Xeon(R) Platinum 8480+"),
        ("flags", "x86_64:0123456789abcdef"),
        ("torch", "2.99.0+cpu"),
        ("dtype", "float32"),
    ],
)
def test_an_entry_for_another_key_is_ignored(cache_on, field, value):
    write(cache_on, [entry(torch.bfloat16, **{field: value})])
    assert thresholds.for_dtype(torch.bfloat16) is BUILTIN
    assert thresholds.describe(torch.bfloat16).endswith(
        f"built-in defaults (docs/results/bench_crossover.md); the cache file {cache_on} has no "
        "bfloat16 entry for this machine"
    )


def test_the_key_follows_the_cpu_flags_and_model():
    base = "model name\t: Zen 4\nflags\t\t: fpu avx512f avx512_bf16\n"
    amx = "model name\t: Zen 4\nflags\t\t: fpu avx512f avx512_bf16 amx_tile\n"
    other = "model name\t: Xeon\nflags\t\t: avx512_bf16 fpu avx512f\n"
    k = thresholds.machine_key(torch.float32, base)
    assert k["cpu"] == "Zen 4" and k["torch"] == torch.__version__ and k["dtype"] == "float32"
    assert thresholds.machine_key(torch.float32, amx)["flags"] != k["flags"]
    assert thresholds.machine_key(torch.float32, other)["flags"] == k["flags"]  # order-free
    assert thresholds.machine_key(torch.float32, other)["cpu"] == "Xeon"
    assert thresholds.machine_key(torch.float16, base)["dtype"] == "float16"


@pytest.mark.parametrize(
    "content,problem",
    [
        (b"{not json", "not JSON"),
        (b"\xff\xfe\x00", "not UTF-8"),
        (b"[]", "not a thresholds cache"),
        (json.dumps({"format": thresholds.FORMAT, "version": 7}).encode(), "version 7"),
        (json.dumps({"format": thresholds.FORMAT, "version": 1, "entries": 3}).encode(), "list"),
        (None, "band"),  # a matching entry with band = -1
        (b"", "not JSON"),  # an empty (truncated) file
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),  # issue 38: was RecursionError
    ],
)
def test_a_corrupt_cache_gives_defaults_with_one_warning(cache_on, content, problem):
    if content is None:
        write(cache_on, [entry(torch.float32, band=-1)])
    else:
        cache_on.write_bytes(content)
    with pytest.warns(UserWarning, match="ignoring the auto-threshold cache") as record:
        assert thresholds.for_dtype(torch.float32) is BUILTIN
    assert len(record) == 1
    message = str(record[0].message)
    assert str(cache_on) in message and problem in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # read once: no second warning, and auto still runs
        q = torch.randn(1, 2, 40, 8)
        out = attnlab.attention(q, q, q, mask=masks.sliding_window(8))
        ref = attnlab.attention(q, q, q, mask=masks.sliding_window(8), backend="reference")
        torch.testing.assert_close(out, ref)


def test_a_directory_instead_of_a_file_is_a_warning_not_a_crash(cache_on):
    cache_on.mkdir()
    with pytest.warns(UserWarning, match="using the built-in defaults"):
        assert thresholds.for_dtype(torch.float32) is BUILTIN


def test_the_file_is_read_once_and_never_inside_a_compiled_region(cache_on, monkeypatch):
    write(cache_on, [entry(torch.float32)])
    reads = []
    real = thresholds.read_cache
    monkeypatch.setattr(thresholds, "read_cache", lambda p: reads.append(p) or real(p))
    # compiling before anything was loaded: the defaults, no read
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert thresholds.for_dtype(torch.float32) is BUILTIN and reads == []
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    q = torch.randn(1, 2, 48, 8)
    for _ in range(3):
        attnlab.attention(q, q, q, mask=masks.sliding_window(16))
    assert reads == [cache_on]
    cache_on.write_text("{broken", encoding="utf-8")  # changed on disk: not seen until reset
    assert thresholds.for_dtype(torch.float32).band == 1 << 10 and reads == [cache_on]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert thresholds.for_dtype(torch.float32).band == 1 << 10  # loaded values, no I/O
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    thresholds.reset()
    with pytest.warns(UserWarning, match="not JSON"):
        assert thresholds.for_dtype(torch.float32) is BUILTIN
    assert reads == [cache_on, cache_on]


def test_write_entries_replaces_its_key_and_keeps_the_others(tmp_path):
    path = tmp_path / "sub" / "t.json"
    other = entry(torch.float32, cpu="another CPU", band=7)
    thresholds.write_entries(path, [other, entry(torch.float32, band=5)])
    merged = thresholds.write_entries(path, [entry(torch.float32, band=9)])
    assert [(e["cpu"], e["band"]) for e in merged] == [("another CPU", 7), (merged[1]["cpu"], 9)]
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data["entries"] == merged and data["format"] == thresholds.FORMAT
    assert thresholds.read_cache(path)[torch.float32].band == 9


def _timing(L: int, ratios: tuple[float, ...], cls: str = "sparse") -> list[calibrate.Timing]:
    return [calibrate.Timing("float32", cls, f"case {i}", L, 1.0, r) for i, r in enumerate(ratios)]


def test_crossover_is_where_flash_wins_every_case_from_there_on():
    rows = (
        _timing(128, (1.2, 1.1))  # a win below a loss does not count
        + _timing(256, (1.3, 0.9))
        + _timing(512, (1.0, 1.5))
        + _timing(1024, (2.0, 1.4))
        + _timing(128, (0.5,), "band")
        + _timing(1024, (0.9,), "band")
    )
    assert calibrate.crossovers(rows) == {"band": None, "sparse": 512}
    e = calibrate.entry_for(torch.float32, rows, threads=1)
    assert (e["sparse"], e["band"], e["long"]) == (512**2, 2048**2, BUILTIN.long)
    assert {k: e[k] for k in ("cpu", "flags", "torch", "dtype")} == thresholds.machine_key(
        torch.float32
    )


def test_calibrate_measures_writes_and_auto_uses_the_entry(cache_on):
    lines: list[str] = []
    entries = calibrate.calibrate(["bfloat16"], lengths=[32, 64], repeats=1, out=lines.append)
    assert "bfloat16  window 64" in lines[0] and lines[-1] == f"wrote 1 entries to {cache_on}"
    (e,) = entries
    assert e["dtype"] == "bfloat16" and e["lengths"] == [32, 64]
    cross = e["crossover_L"]
    for cls in ("band", "sparse"):
        want = cross[cls] ** 2 if cross[cls] is not None else 128**2
        assert e[cls] == want
    got = thresholds.for_dtype(torch.bfloat16)
    assert (got.band, got.sparse, got.long) == (e["band"], e["sparse"], BUILTIN.long)
    assert got.source.startswith(f"the cache file {cache_on}, measured on ")


def test_explain_states_where_the_thresholds_came_from(cache_on):
    q = torch.randn(1, 2, 48, 8)
    text = attnlab.explain(q, q, q, mask=masks.sliding_window(16))
    assert text.backend == "sdpa"
    assert text.thresholds == (
        "auto's float32 thresholds (L·S: band 65536, sparse 262144, long 16777216) are built-in "
        f"defaults (docs/results/bench_crossover.md); no cache file {cache_on}"
    )
    write(cache_on, [entry(torch.float32, band=1 << 10)])
    thresholds.reset()
    text = attnlab.explain(q, q, q, mask=masks.sliding_window(16))
    cpu = thresholds.machine_key(torch.float32)["cpu"]
    assert text.backend == "flash"
    assert text.thresholds == (
        "auto's float32 thresholds (L·S: band 1024, sparse 4096, long 1048576) are the cache "
        f"file {cache_on}, measured on {cpu} at 2026-11-24 06:00 UTC"
    )
    named = attnlab.explain(q, q, q, mask=masks.sliding_window(16), backend="sdpa")
    assert named.thresholds is None  # a named backend involves no threshold
    assert "thresholds" not in str(named)
