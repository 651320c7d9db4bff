"""The just-in-time C++ operators (`attnlab._ext`, ``_ext/nan_rule.cpp``) and their fallback.

The NaN-rule operators must give bit-for-bit the results of the pure-PyTorch paths they replace
(sdpa's prefix calls, `nan_rule.poison_prefix`, RoPE's rows), on finite inputs and with NaN/±inf
planted anywhere; the decode step's own kernel (one pass per k/v head) follows the tolerance rule
against the float64 reference with the tensor-op path as the naive and the same NaN positions;
without a compiler (or with ``ATTNLAB_EXT=0``) everything runs on the fallback; a build is keyed
on the CPU's flags.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnlab
from attnlab import _ext, masks
from attnlab.functional import nan_rule
from attnlab.functional.decode import decode_run, decode_step_ready, rope_decode_run
from attnlab.functional.reference import attention as reference_attention
from attnlab.functional.request import build_request, trusted_request
from attnlab.positional import RoPE
from attnlab.testing import FIXED_TABLE, assert_close_rule

SRC = str(Path(attnlab.__file__).resolve().parent.parent)
NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def ext() -> None:
    """Builds (first run on a machine: about a minute) or loads the operators, else skips."""
    if _ext.mode() == "off" or not _ext.load("nan_rule"):
        pytest.skip(f"C++ extension unavailable: {_ext.status('nan_rule')}")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal: the same NaN positions and the same bits everywhere else (sign of 0 too)."""
    if not torch.equal(torch.isnan(a), torch.isnan(b)):
        return False
    a0, b0 = a.nan_to_num(0.0, INF, -INF), b.nan_to_num(0.0, INF, -INF)
    return torch.equal(a0, b0) and torch.equal(torch.signbit(a0), torch.signbit(b0))


def _plant(ts: tuple[torch.Tensor, ...], n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    values = (NAN, INF, -INF)
    for t in ts:
        for _ in range(n):
            idx = tuple(int(torch.randint(0, s, (1,), generator=g)) for s in t.shape)
            t[idx] = values[int(torch.randint(0, 3, (1,), generator=g))]


def _both(monkeypatch: pytest.MonkeyPatch, fn):
    """``fn()`` on the fallback (ATTNLAB_EXT=0), then on the operators (require)."""
    monkeypatch.setenv(_ext.ENV, "0")
    off = fn()
    monkeypatch.setenv(_ext.ENV, "require")
    on = fn()
    return off, on


MASKS = {
    "none": lambda B, S: None,  # prefill without a mask: sdpa_prefix before `_sliced`
    "causal": lambda B, S: masks.causal(),
    "causal&padding": lambda B, S: masks.causal() & masks.padding([S - 3 * b for b in range(B)]),
}
SHAPES = [  # B, H, H_kv, L, S, D, Dv
    (2, 4, 2, 33, 33, 16, 16),  # causal L == S: torch's fused is_causal kernel
    (1, 2, 1, 70, 70, 8, 8),
    (3, 4, 4, 20, 45, 16, 16),  # L < S: a dense bottom-right mask
    (2, 2, 1, 9, 9, 8, 12),  # Dv != D: torch's math kernel, k cleaned
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16])
@pytest.mark.parametrize("mask", list(MASKS))
def test_sdpa_prefix_bit_equal_to_tensor_ops(ext, monkeypatch, dtype, mask) -> None:
    """``sdpa_prefix`` (scan, conditional clean, kernel, poison) equals sdpa's tensor-op path bit
    for bit, and both follow the NaN rule (non-finite pattern of the float64 reference)."""
    torch.manual_seed(0)
    for B, H, H_kv, L, S, D, Dv in SHAPES:
        for planted in (0, 1, 3):
            q = torch.randn(B, H, L, D, dtype=dtype)
            k = torch.randn(B, H_kv, S, D, dtype=dtype)
            v = torch.randn(B, H_kv, S, Dv, dtype=dtype)
            _plant((q, k, v), planted, seed=planted + S)
            m = MASKS[mask](B, S)
            off, on = _both(
                monkeypatch, lambda q=q, k=k, v=v, m=m: attnlab.attention(q, k, v, mask=m)
            )
            if m is None:
                # the fallback is `_unmasked` (the kernel on the raw inputs: a planted ±inf in v
                # may come out ±inf where the operator writes NaN; the rule allows either), so
                # the same non-finite positions and bit-equal finite values
                fin = torch.isfinite(on)
                assert torch.equal(torch.isfinite(off), fin) and _same(off[fin], on[fin])
            else:
                assert _same(off, on), (B, H, H_kv, L, S, D, Dv, planted)
            ref = attnlab.attention(q.double(), k.double(), v.double(), mask=m, backend="reference")
            assert torch.equal(torch.isfinite(on), torch.isfinite(ref))


def test_sdpa_prefix_runs_and_poisons_exactly(ext, monkeypatch) -> None:
    """The operator itself: a NaN in v[j, d] makes column d NaN exactly from row j on (causal),
    a NaN q_i exactly row i, an inf key j rows ≥ j; everything else equals the finite call."""
    monkeypatch.setenv(_ext.ENV, "require")
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 40, 8) for _ in range(3))
    clean = attnlab.attention(q, k, v, mask=masks.causal())
    v[0, 1, 10, 3] = NAN
    q[0, 0, 5, 0] = NAN
    k[0, 0, 30, 2] = -INF
    hi = (torch.arange(40) + 1).view(1, 1, 40)
    out = torch.ops.attnlab_nan.sdpa_prefix(q, k, v, None, hi, 8**-0.5, True, False, False)
    want = torch.zeros(1, 2, 40, 8, dtype=torch.bool)
    want[0, 1, 10:, 3] = True
    want[0, 0, 5] = True
    want[0, 0, 30:] = True  # k head 0 serves query head 0 only (H = H_kv = 2)
    assert torch.equal(torch.isnan(out), want)
    assert torch.equal(out[~want], clean[~want])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_poison_prefix_bit_equal(ext, monkeypatch, dtype) -> None:
    """`nan_rule.poison_prefix` (used by flash) on the operator equals its tensor ops, out and
    lse, for causal and padding prefixes with GQA; the caller's lse is not modified."""
    torch.manual_seed(2)
    B, H, H_kv, L, S, D = 2, 4, 2, 24, 30, 8
    for planted in (0, 2, 5):
        q = torch.randn(B, H, L, D, dtype=dtype)
        k = torch.randn(B, H_kv, S, D, dtype=dtype)
        v = torch.randn(B, H_kv, S, D, dtype=dtype)
        _plant((q, k, v), planted, seed=planted)
        out = torch.randn(B, H, L, D, dtype=dtype)
        lse = torch.randn(B, H, L, dtype=torch.float64 if dtype == torch.float64 else None)
        for hi in (
            (torch.arange(L) + S - L + 1).view(1, 1, L),
            torch.tensor([S, 7]).view(B, 1, 1),
            torch.tensor([[0] * L, list(range(L))]).view(B, 1, L),
        ):
            lse0 = lse.clone()

            def run(hi=hi, out=out, q=q, k=k, v=v, lse=lse):
                return nan_rule.poison_prefix(out.clone(), q, k, v, hi, own_out=True, lse=lse)

            (o1, l1), (o2, l2) = _both(monkeypatch, run)
            assert _same(o1, o2) and _same(l1, l2)
            assert torch.equal(lse, lse0)


def _decode_rule(on: torch.Tensor, naive: torch.Tensor, golden: torch.Tensor) -> None:
    """The operator's decode step against the float64 tensor-op path (golden) with the
    tensor-op path in the input dtype as the naive: the tolerance rule and the NaN positions
    (float64 inputs, whose naive is the golden: the fixed float64 table)."""
    assert torch.equal(on.isnan(), golden.isnan())
    assert torch.equal(on.isnan(), naive.isnan())
    if on.dtype == torch.float64:
        atol, rtol = FIXED_TABLE[torch.float64][:2]
        torch.testing.assert_close(on, golden, atol=atol, rtol=rtol, equal_nan=True)
    else:
        assert_close_rule(on, golden, naive)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("sizes", [(2, 8, 2, 1, 32, 32), (3, 6, 2, 5, 40, 24)])
def test_decode_attend_follows_the_rule(ext, monkeypatch, dtype, sizes) -> None:
    """The decode step (`decode._attend`) on its C++ kernel: float64 reference, tensor-op naive,
    on a padded batch (n_b = 600 and 411 keys), GQA groups of 4 and 3 query heads, 1 and 5 query
    rows (row groups of 4 and a remainder), head dims that are not a multiple of 16, with
    NaN/±inf planted (rows with a non-finite logit are NaN, as on the tensor-op path)."""
    B, H, H_kv, L, D, Dv = sizes
    torch.manual_seed(3)
    q = torch.randn(B, H, L, D, dtype=dtype)
    k = torch.randn(B, H_kv, 600, D, dtype=dtype)
    v = torch.randn(B, H_kv, 600, Dv, dtype=dtype)
    lengths = [600, 411, 97][:B]

    def run(q, k, v):
        req = build_request(
            q,
            k,
            v,
            mask=masks.padding(lengths),
            bias=None,
            scale=None,
            temperature=0.7,
            score="dot",
            dropout_p=0.0,
            return_weights=False,
        )
        return decode_run(req)[0]

    for planted in (0, 1, 4):
        _plant((q, k, v), planted, seed=planted)
        naive, on = _both(monkeypatch, lambda: run(q, k, v))
        monkeypatch.setenv(_ext.ENV, "0")
        golden = run(q.double(), k.double(), v.double())
        assert on.dtype == dtype
        _decode_rule(on, naive, golden)


def _key_masks(B: int, S: int) -> torch.Tensor:
    """Keys per item: every key, left padding (one run), holes (runs), none at all."""
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[1, : S // 3] = False  # left padding: one run, read in place
    keep[2, 5:9] = keep[2, S // 2 : S // 2 + 3] = False  # holes: three runs, gathered
    keep[3] = False  # attends nothing: zeros
    return keep


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("L", [1, 3])
def test_decode_attend_with_keys_follows_the_rule(ext, monkeypatch, dtype, L) -> None:
    """The decode step over a key mask (``decode_attend``'s ``keys``: transformers' padding and
    a static cache's unused slots): the C++ step against the float64 reference with the
    tensor-op path (`decode._attend_keys`) as the naive — every key, left padding, holes, an
    item with no key (zeros, its NaN q included) — and NaN/±inf planted in masked keys (never
    read) and in attended ones (the rule)."""
    B, H, H_kv, S, D, Dv = 4, 6, 2, 77, 24, 40
    torch.manual_seed(5)
    q = torch.randn(B, H, L, D, dtype=dtype)
    k = torch.randn(B, H_kv, S, D, dtype=dtype)
    v = torch.randn(B, H_kv, S, Dv, dtype=dtype)
    keep = _key_masks(B, S)
    mask = masks.from_tensor(keep[:, None, None, :])
    if L == 1:
        mask = masks.causal() & mask  # one row: causal attends every key
    k[1, 0, 3] = NAN  # masked: left padding
    v[2, 1, 6, 2] = INF  # masked: a hole
    q[3, 0, 0, 0] = NAN  # an item with no key: zeros all the same
    for planted in (0, 2, 5):
        _plant((q, k, v), planted, seed=planted + 11)

        def run(q=q, k=k, v=v):
            with torch.no_grad():
                return attnlab.attention(q, k, v, mask=mask, backend="decode")

        naive, on = _both(monkeypatch, run)
        monkeypatch.setenv(_ext.ENV, "0")
        golden = run(q.double(), k.double(), v.double())
        ref, _ = reference_attention(q.double(), k.double(), v.double(), mask=keep[:, None, None])
        assert torch.equal(golden.isnan(), ref.isnan())
        torch.testing.assert_close(golden, ref, equal_nan=True)
        assert on.dtype == dtype
        _decode_rule(on, naive, golden)
        assert not on[3].any()  # no key: zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16])
@pytest.mark.parametrize("layout", ["rotate-half", "interleaved", "partial"])
def test_rope_decode_attend(ext, monkeypatch, dtype, layout) -> None:
    """The module's fused decode step (`decode.rope_decode_run`: RoPE of q and of the cached
    keys from table rows, then the decode step, one operator) against `RoPE` followed by
    `decode_run` on the tensor-op path (naive) and in float64 (golden): both RoPE layouts, a
    partial rotary dim, a strided q, keys rotated or already rotated (``k_start=None``),
    NaN/±inf planted; and the rotation alone (``attnlab_nan::rope_rows``) equals
    `RoPE.forward` bit for bit."""
    torch.manual_seed(6)
    rope = RoPE(
        32, interleaved=layout == "interleaved", rotary_dim=16 if layout == "partial" else None
    )
    q = torch.randn(2, 3, 8, 32, dtype=dtype).transpose(1, 2)  # (2, 8, 3, 32), strided
    k = torch.randn(2, 2, 600, 32, dtype=dtype)
    v = torch.randn(2, 2, 600, 32, dtype=dtype)
    table = torch.float64 if dtype == torch.float64 else torch.float32
    cos, sin = rope.table(700, q.device, table)
    for planted in (0, 3):
        _plant((q, k, v), planted, seed=10 + planted)
        for k_start in (None, 5):

            def python(q, k, v, k_start=k_start):
                keys = k if k_start is None else rope(k, k_start)
                return decode_run(trusted_request(rope(q, 40), keys, v))[0]

            naive, _ = _both(monkeypatch, lambda: python(q, k, v))
            monkeypatch.setenv(_ext.ENV, "0")
            golden = python(q.double(), k.double(), v.double())
            monkeypatch.setenv(_ext.ENV, "require")
            assert decode_step_ready("decode", q, k, v, 0.0)
            on = rope_decode_run(q, k, v, cos, sin, 40, k_start, rope.rotary_dim, rope.interleaved)
            assert on.dtype == dtype
            _decode_rule(on, naive, golden)
        # the rotation alone (a rotate-at-insert cache's new keys) equals RoPE.forward
        rows = torch.ops.attnlab_nan.rope_rows(q, cos, sin, 40, rope.rotary_dim, rope.interleaved)
        assert rows.dtype == dtype and _same(rows, rope(q, 40))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16])
def test_rms_norm_operator_follows_the_rule(ext, monkeypatch, dtype) -> None:
    """`RMSNorm` without autograd runs ``attnlab_nan::rms_norm`` (one call; the spy sees it)
    and equals its tensor-op path (naive; ``ATTNLAB_EXT=0``) and the float64 formula (golden)
    with the tolerance rule, on a strided input, an E that is not a multiple of 16, a batch
    large enough to split between threads, and NaN/±inf planted: NaN where the formula gives
    NaN (a row with ±inf: x·0 is 0, ±inf·0 NaN), and only in the rows holding one."""
    from attnlab.models.blocks import RMSNorm

    torch.manual_seed(7)
    norm = RMSNorm(72, eps=1e-5).to(dtype)
    norm.weight.data.normal_()
    x = torch.randn(3, 72, 1200, dtype=dtype).transpose(1, 2)  # (3, 1200, 72), strided
    _plant((x,), 3, seed=8)
    calls: list[int] = []
    ops = torch.ops.attnlab_nan

    class Spy:  # torch.ops.attnlab_nan, counting rms_norm calls
        def __getattr__(self, name):
            op = getattr(ops, name)
            return (lambda *a: calls.append(1) or op(*a)) if name == "rms_norm" else op

    monkeypatch.setattr(torch.ops, "attnlab_nan", Spy(), raising=False)
    with torch.no_grad():
        naive, on = _both(monkeypatch, lambda: norm(x))
        assert len(calls) == 1  # the operator ran once, on the `require` pass only
        w = norm.weight.double()
        xd = x.double()
        golden = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    bad = ~torch.isfinite(x).all(-1, keepdim=True)  # rows holding a planted value
    assert bad.any() and not (on.isnan() & ~bad).any()  # other rows are untouched by them
    assert on.dtype == dtype and torch.equal(on.isnan(), naive.isnan())
    assert torch.equal(on.isnan(), golden.isnan())
    fin = ~bad.expand_as(on)
    if dtype == torch.float64:
        atol, rtol = FIXED_TABLE[torch.float64][:2]
        torch.testing.assert_close(on[fin], golden[fin], atol=atol, rtol=rtol)
    else:
        assert_close_rule(on[fin], golden[fin], naive[fin])


def test_not_used_with_autograd_compile_or_meta() -> None:
    """`nan_rule.ext_ready` refuses tensors needing a gradient, meta tensors, other dtypes."""
    x = torch.randn(2, 3)
    assert not nan_rule.ext_ready(x.requires_grad_())
    assert not nan_rule.ext_ready(torch.empty(2, 3, device="meta"))
    assert not nan_rule.ext_ready(torch.zeros(2, 3, dtype=torch.int64))
    with torch.no_grad():  # no gradient is recorded: allowed (if built)
        assert nan_rule.ext_ready(x) == (_ext.mode() != "off" and _ext.load("nan_rule"))


def test_off_mode_never_loads(monkeypatch) -> None:
    monkeypatch.setenv(_ext.ENV, "0")
    assert _ext.mode() == "off"
    assert _ext.load("nan_rule") is False
    assert not nan_rule.ext_ready(torch.zeros(2))


def test_build_key_depends_on_cpu_flags_and_source(monkeypatch) -> None:
    """A library built on one CPU is never loaded on another: the key includes its flags."""
    key = _ext.build_key("nan_rule", "src")
    assert _ext.build_key("nan_rule", "src") == key
    assert _ext.build_key("nan_rule", "src2") != key
    monkeypatch.setattr(_ext, "cpu_flags", lambda: "x86_64|Intel Xeon|amx_bf16 avx512f")
    assert _ext.build_key("nan_rule", "src") != key


def _run_python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": SRC, **env}
    return subprocess.run(
        [sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=240
    )


FALLBACK_CHECK = """
import torch, attnlab
from attnlab import _ext, masks
torch.manual_seed(0)
q, k, v = (torch.randn(2, 4, 40, 16) for _ in range(3))
v[0, 1, 7, 3] = float("nan")
q64, k64, v64 = q.double(), k.double(), v.double()  # the golden: float64 reference
def check(out, mask):
    ref = attnlab.attention(q64, k64, v64, mask=mask, backend="reference")
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert torch.allclose(out.double().nan_to_num(0), ref.nan_to_num(0), atol=1e-5)
check(attnlab.attention(q, k, v, mask=masks.causal()), masks.causal())
window = masks.sliding_window(9)
check(attnlab.attention(q, k, v, mask=window, backend="flash"), window)
docs = masks.causal() & masks.document.from_lengths([20, 20])
check(attnlab.attention(q, k, v, mask=docs, backend="flash"), docs)
print("status:", _ext.status("nan_rule"))
print("band status:", _ext.status("band_attn"))
"""


def test_no_compiler_falls_back(tmp_path) -> None:
    """With the compiler hidden and an empty cache, attention runs on the PyTorch path (same
    NaN rule) in a fresh process, nothing is built, and ONE stderr line says so."""
    env = {"CXX": str(tmp_path / "no-such-c++"), _ext.CACHE_ENV: str(tmp_path / "cache")}
    r = _run_python(FALLBACK_CHECK, env)
    assert r.returncode == 0, r.stderr
    assert "status: RuntimeError: no C++ compiler found" in r.stdout
    # windows and documents ran on torch's kernel
    assert "band status: RuntimeError: no C++ compiler found" in r.stdout
    assert not list((tmp_path / "cache").glob("*.so"))
    said = [line for line in r.stderr.splitlines() if line.startswith("attnlab:")]
    assert len(said) == 1 and "no C++ compiler found" in said[0], r.stderr
    assert "pure-PyTorch engines run" in said[0]


def test_python_m_attnlab_ext_reports_each_extension(tmp_path) -> None:
    """``python -m attnlab._ext`` (``attnlab build``'s loop): one line per kernel, exit 1 when
    one is unavailable (here: no compiler, so nothing is built or remembered)."""
    env = {
        **os.environ,
        "PYTHONPATH": SRC,
        "CXX": str(tmp_path / "no-such-c++"),
        _ext.CACHE_ENV: str(tmp_path),
    }
    r = subprocess.run(
        [sys.executable, "-m", "attnlab._ext", "nan_rule"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = r.stdout.splitlines()
    assert r.returncode == 1 and lines[0].startswith("attnlab build: 1 C++ kernel(s)"), r.stdout
    assert lines[1].split()[:2] == ["nan_rule", "FAILED"] and "no C++ compiler" in lines[1]
    assert lines[2].startswith("attnlab build: 0 of 1 kernel(s) ready")
    assert not list(tmp_path.iterdir())


def test_no_compiler_reason_and_require(tmp_path, monkeypatch) -> None:
    """The reason names the missing compiler, no ``.failed`` note is left (installing one later
    builds), and ATTNLAB_EXT=require turns the reason into ExtensionUnavailableError."""
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setenv(_ext.CACHE_ENV, str(tmp_path))
    why = _ext._decide("nan_rule")
    assert isinstance(why, str) and "no C++ compiler found" in why
    assert not list(tmp_path.iterdir())
    monkeypatch.setenv(_ext.ENV, "require")
    monkeypatch.setitem(_ext._STATE, "nan_rule_test", why)  # as `load` records it
    with pytest.raises(_ext.ExtensionUnavailableError, match=r"no C\+\+ compiler found"):
        _ext.load("nan_rule_test")


def test_failed_build_is_remembered(tmp_path, monkeypatch) -> None:
    """A compiler that fails leaves a ``.failed`` note for this key: the next process does not
    retry the build (and falls back), until the note is deleted or the key changes."""
    monkeypatch.setenv("CXX", "/bin/false")
    monkeypatch.setenv(_ext.CACHE_ENV, str(tmp_path))
    why = _ext._decide("nan_rule")
    assert why is not True
    notes = list(tmp_path.glob("*.failed"))
    assert len(notes) == 1 and not list(tmp_path.glob("*.so"))
    again = _ext._decide("nan_rule")
    assert isinstance(again, str) and again.startswith("an earlier build failed")
