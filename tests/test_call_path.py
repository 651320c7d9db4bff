"""The length of the flash call path (issue #39 item 1), walked by benchmarks/call_path.py.

One warm `attnlab.attention` call on the flash backend — causal, sliding window, packed documents,
a bool tensor mask and ALiBi; without and with grad (the backward included); with attnlab's C++
kernels on and off (a subprocess each) — may enter at most `MAX_FILES` library files
(`MAX_FILES_GRAD` with grad), and no function on its path may be longer than `MAX_LINES` lines
(docstring excluded).

The issue's targets are 12 files, 15 with grad and 60 lines, and the code meets them: the bounds
are the targets.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"

TARGET_FILES, TARGET_FILES_GRAD, TARGET_LINES = 12, 15, 60
"""Issue #39's targets."""

MAX_FILES, MAX_FILES_GRAD, MAX_LINES = TARGET_FILES, TARGET_FILES_GRAD, TARGET_LINES
"""The bounds the tests hold the path to."""


def _call_path():
    spec = importlib.util.spec_from_file_location("call_path", BENCH / "call_path.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return _call_path().measure_all()


def test_bounds_never_exceed_what_was_reached_nor_undercut_the_targets():
    assert TARGET_FILES <= MAX_FILES and TARGET_FILES_GRAD <= MAX_FILES_GRAD
    assert TARGET_LINES <= MAX_LINES


def test_every_case_and_setting_is_measured(records):
    cases = _call_path().CASES
    seen = {(r["case"], r["grad"], r["ext"]) for r in records}
    assert seen == {(c, g, e) for c in cases for g in (False, True) for e in ("auto", "off")}


def test_a_warm_call_enters_few_library_files(records):
    too_many = [
        f"{r['case']} grad={r['grad']} ext={r['ext']}: {len(r['files'])} files {r['files']}"
        for r in records
        if len(r["files"]) > (MAX_FILES_GRAD if r["grad"] else MAX_FILES)
    ]
    assert not too_many, "\n".join(too_many)


def test_no_function_on_the_path_is_long(records):
    long = {
        f"{r['longest'][1]} ({r['longest'][0]} lines)"
        for r in records
        if r["longest"][0] > MAX_LINES
    }
    assert not long, sorted(long)
