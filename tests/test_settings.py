"""`attnlab._settings`: the ``ATTNLAB_*`` variables are read in one module (issue #39 item 1),
and the request resolves its logit scale and mask forms once (`request.LogitTerms`)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import torch

import attnlab
from attnlab import _settings, masks
from attnlab.functional.flash import flash_options
from attnlab.functional.request import build_request, logit_qk, sort_terms

ROOT = Path(attnlab.__file__).resolve().parent


_READ = re.compile(r"os\.environ(\.get\(|\[)")
_STANDARD = r"\"(CXX|XDG_CACHE_HOME|WORLD_SIZE|RANK|LOCAL_RANK|COLUMNS)\"|'CXX'"


def _environment_reads() -> dict[str, int]:
    """``os.environ`` reads per module, except the standard variables (CXX, XDG_CACHE_HOME,
    torchrun's, the terminal's COLUMNS) that are not attnlab settings."""
    found: dict[str, int] = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "_settings.py":
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            if not _READ.search(line):
                continue
            if re.search(_STANDARD, line):
                continue
            found[rel] = found.get(rel, 0) + 1
    return found


def test_attnlab_settings_are_read_in_one_module():
    found = _environment_reads()
    assert not found, f"read the environment through attnlab._settings, not in {found}"


def test_settings_are_read_once_per_process_until_refreshed(monkeypatch):
    monkeypatch.delenv(_settings.FLASH_LOWP, raising=False)  # refreshes (tests/conftest.py)
    first = _settings.settings()
    assert _settings.settings() is first  # nothing read again: the same record
    os.environ[_settings.FLASH_LOWP] = "  widen "  # behind attnlab's back: not seen ...
    try:
        assert _settings.settings() is first and _settings.text("flash_lowp") is None
        assert flash_options().low_precision == "auto"
        changed = _settings.refresh()  # ... until the settings are read again
        assert changed.flash_lowp == "widen" and _settings.settings() is changed
        assert flash_options().low_precision == "widen"  # the derived options were reset
    finally:
        del os.environ[_settings.FLASH_LOWP]
        _settings.refresh()
    monkeypatch.setenv(_settings.FLASH_PLAN_CACHE, "off")
    assert not _settings.settings().plan_cache_on and not flash_options().plan_cache


def test_a_warm_flash_call_reads_no_setting(monkeypatch):
    """Once the settings are read, an attention call does not enter `attnlab._settings`."""
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    attnlab.attention(q, k, v, mask=masks.sliding_window(8), backend="flash")  # warm
    entered: list[str] = []

    def hook(frame, event, _arg):
        if event == "call" and frame.f_code.co_filename == _settings.__file__:
            entered.append(frame.f_code.co_name)

    sys.setprofile(hook)
    try:
        attnlab.attention(q, k, v, mask=masks.sliding_window(8), backend="flash")
    finally:
        sys.setprofile(None)
    assert entered == []


def test_mask_and_bias_are_sorted_by_form_once():
    bool_mask = torch.ones(4, 6, dtype=torch.bool)
    float_mask, bias = torch.zeros(4, 6), torch.zeros(1, 1, 4, 6)
    t = sort_terms(bool_mask, bias)
    assert isinstance(t.structured, masks.TensorMask) and t.bool_mask is bool_mask
    assert t.given_mask is None and t.additive == [bias] and t.bias_fn is None
    t = sort_terms(float_mask, None)
    assert t.structured is None and t.float_mask is float_mask and t.additive == [float_mask]
    causal = masks.causal()
    alibi = attnlab.positional.ALiBi(2)
    t = sort_terms(causal, alibi)
    assert t.structured is causal and t.given_mask is causal and t.bias_fn is alibi
    assert t.additive == []


@pytest.mark.parametrize("scale", [0.5, -0.5])
def test_logit_scale_is_resolved_once_and_its_sign_folded_into_q(scale):
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    kw = dict(mask=None, bias=None, score="dot", dropout_p=0.0)
    req = build_request(q, k, v, scale=scale, temperature=4.0, return_weights=False, **kw)
    assert req.logit_scale == scale / 4.0
    qs, ks, c = logit_qk(req)
    assert c == abs(scale) / 4.0 and ks is req.k
    assert torch.equal(qs, q if scale > 0 else -q)
    want = attnlab.attention(q, k, v, scale=scale, temperature=4.0, backend="reference")
    got = attnlab.attention(q, k, v, scale=scale, temperature=4.0, backend="flash")
    torch.testing.assert_close(got, want)
