"""attnlab's streaming linear for decode steps (`functional.gemv`, `modules.StreamLinear`).

The kernel is checked against the float64 product (float32: to float32 rounding of a K-term
sum; bfloat16: one rounding of a float32 sum of exact products), on odd sizes, rows at a stride,
with and without bias; `StreamLinear` against ``nn.Linear``; and every condition that keeps
torch's kernel: autograd, many rows, other dtypes, meta, ``ATTNLAB_GEMV=off``, a bad setting.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from attnlab import _ext
from attnlab.functional import gemv
from attnlab.modules import StreamLinear


@pytest.fixture
def kernel(monkeypatch):
    """The extension built and selected; skipped where this CPU has no kernel for a dtype."""
    if _ext.mode() == "off" or not _ext.load(gemv.EXT):
        pytest.skip(f"C++ extension unavailable: {_ext.status(gemv.EXT)}")
    monkeypatch.setenv(gemv.ENV, "auto")


def _count(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = torch.ops.attnlab_gemv.linear

    class Spy:
        @staticmethod
        def linear(*a):
            calls.append(1)
            return real(*a)

        supported = torch.ops.attnlab_gemv.supported

    monkeypatch.setattr(torch.ops, "attnlab_gemv", Spy)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("K", [1, 37, 512, 1000])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 2, 4])  # weight rows per pass (0: the CPU's default)
def test_kernel_matches_the_float64_product(kernel, dtype, M, K, bias, rows) -> None:
    if not torch.ops.attnlab_gemv.supported(dtype):
        pytest.skip(f"no {dtype} kernel on this CPU")
    g = torch.Generator().manual_seed(M * 1000 + K)
    N = 45
    big = torch.randn(M, K + 5, generator=g).to(dtype)
    x = big[:, 2 : 2 + K]  # rows at a stride of K + 5
    w = torch.randn(N, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    with torch.no_grad():
        y = torch.ops.attnlab_gemv.linear(x, w, b, rows)  # N = 45: every remainder path
    assert y.dtype == dtype and y.shape == (M, N)
    want = x.double() @ w.double().T + (b.double() if bias else 0)
    scale = (x.double().abs() @ w.double().abs().T) + (b.double().abs() if bias else 0)
    if dtype == torch.float32:
        tol = 4 * K * 2.0**-24 * scale + 1e-30  # a K-term float32 sum, any order
    else:  # exact products, a float32 sum, one rounding to bfloat16
        tol = 2.0**-8 * want.abs() + 4 * K * 2.0**-24 * scale + 1e-30
    assert ((y.double() - want).abs() <= tol).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_stream_linear_is_nn_linear_with_a_decode_kernel(kernel, monkeypatch, dtype) -> None:
    """Same parameters and state_dict as nn.Linear; a few rows without autograd take the kernel
    (3-D input, bias), within rounding of nn.Linear; training, many rows and gradients do not
    (bit-equal to nn.Linear there)."""
    if not torch.ops.attnlab_gemv.supported(dtype):
        pytest.skip(f"no {dtype} kernel on this CPU")
    torch.manual_seed(0)
    ref = nn.Linear(96, 40).to(dtype)
    lin = StreamLinear(96, 40).to(dtype)
    lin.load_state_dict(ref.state_dict())
    assert isinstance(lin, nn.Linear) and lin.state_dict().keys() == ref.state_dict().keys()
    calls = _count(monkeypatch)
    x = torch.randn(2, 3, 96, dtype=dtype)
    with torch.no_grad():
        y, want = lin(x[:, :1]), ref(x[:, :1])
    assert calls == [1]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y, want, atol=tol, rtol=tol)
    x9 = torch.randn(3, 3, 96, dtype=dtype)
    with torch.no_grad():
        assert torch.equal(lin(x9), ref(x9))  # 9 rows: torch's kernel
    xg = x[:, :1].clone().requires_grad_(True)
    out = lin(xg)
    out.sum().backward()
    assert calls == [1] and torch.equal(out, ref(xg))  # autograd: torch's kernel
    assert lin.weight.grad is not None


def test_torch_kernel_for_other_cases(monkeypatch) -> None:
    """float16/float64, meta tensors, ``ATTNLAB_GEMV=off`` and a non-contiguous weight keep
    torch's kernel; a bad setting is named."""
    w = torch.randn(4, 8)
    with torch.no_grad():
        assert not gemv.usable(torch.randn(1, 8, dtype=torch.float16), w.half(), None)
        assert not gemv.usable(torch.randn(1, 8, dtype=torch.float64), w.double(), None)
        assert not gemv.usable(torch.empty(1, 8, device="meta"), w.to("meta"), None)
        assert not gemv.usable(torch.randn(2, 4), torch.randn(4, 8).T, None)
        assert not gemv.usable(torch.randn(2, 8), w, torch.zeros(4, dtype=torch.float64))
        monkeypatch.setenv(gemv.ENV, "off")
        assert not gemv.usable(torch.randn(2, 8), w, None)
        x = torch.randn(2, 8)
        assert torch.equal(gemv.linear(x, w), torch.nn.functional.linear(x, w))
    monkeypatch.setenv(gemv.ENV, "fast")
    with pytest.raises(ValueError, match=r"ATTNLAB_GEMV must be 'auto' or 'off', got 'fast'"):
        gemv.usable(torch.randn(2, 8), w, None)


def test_operator_refuses_bad_calls(kernel) -> None:
    op = torch.ops.attnlab_gemv.linear
    with pytest.raises(RuntimeError, match="at most 8 rows"):
        op(torch.randn(9, 4), torch.randn(3, 4), None)
    with pytest.raises(RuntimeError, match=r"x \(\.\.\., K\) and w \(N, K\)"):
        op(torch.randn(2, 4), torch.randn(3, 5), None)
    with pytest.raises(RuntimeError, match="share a dtype"):
        op(torch.randn(2, 4), torch.randn(3, 4).double(), None)
    with pytest.raises(RuntimeError, match=r"b must be \(N,\)"):
        op(torch.randn(2, 4), torch.randn(3, 4), torch.randn(4))
    with pytest.raises(RuntimeError, match="rows_per_pass must be 0, 1, 2 or 4, got 3"):
        op(torch.randn(2, 4), torch.randn(3, 4), None, 3)


def test_rows_per_pass_setting(kernel, monkeypatch) -> None:
    """``ATTNLAB_GEMV_ROWS`` reaches the operator (``auto`` → 0: the kernel's default, which is
    1 on AMD, elsewhere 4 in float32 and 2 in bfloat16); a bad value is named."""
    seen: list[int] = []
    spy = torch.ops.attnlab_gemv

    class Args:
        supported = spy.supported

        @staticmethod
        def linear(*a):
            seen.append(a[3])
            return spy.linear(*a)

    monkeypatch.setattr(torch.ops, "attnlab_gemv", Args)
    x, w = torch.randn(2, 64), torch.randn(8, 64)
    for raw, want in (("", 0), ("auto", 0), ("1", 1), ("2", 2), ("4", 4)):
        monkeypatch.setenv(gemv.ROWS_ENV, raw)
        with torch.no_grad():
            y = gemv.linear(x, w)
        assert seen[-1] == want
        torch.testing.assert_close(y, torch.nn.functional.linear(x, w))
    assert len(seen) == 5
    monkeypatch.setenv(gemv.ROWS_ENV, "3")
    with pytest.raises(ValueError, match=r"ATTNLAB_GEMV_ROWS must be 'auto', '1', '2' or '4', got"):
        gemv.linear(x, w)
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        amd = "AuthenticAMD" in cpuinfo.read_text()
        assert spy.default_rows_per_pass(torch.float32) == (1 if amd else 4)
        assert spy.default_rows_per_pass(torch.bfloat16) == (1 if amd else 2)


def test_flop_counter_sees_aten_mm(kernel, monkeypatch) -> None:
    """Under a TorchDispatchMode (here FlopCounterMode) the standard aten product runs, so FLOP
    counts include the projections (2·M·N·K)."""
    from torch.utils.flop_counter import FlopCounterMode

    calls = _count(monkeypatch)
    lin = StreamLinear(64, 32)
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        lin(torch.randn(2, 1, 64))
    assert calls == [] and fc.get_total_flops() == 2 * 2 * 64 * 32


def test_one_float32_row_needs_a_large_weight(kernel) -> None:
    """One float32 row runs on the kernel only against a weight of `FP32_ONE_ROW_MIN` elements
    or more (torch's single-row kernel is faster on cache-sized weights); two rows or bfloat16
    take it at any size."""
    small = torch.randn(64, 64)
    large = torch.randn(gemv.FP32_ONE_ROW_MIN // 64, 64)
    with torch.no_grad():
        assert not gemv.usable(torch.randn(1, 1, 64), small, None)
        assert gemv.usable(torch.randn(1, 1, 64), large, None)
        assert gemv.usable(torch.randn(2, 1, 64), small, None)
        if torch.ops.attnlab_gemv.supported(torch.bfloat16):
            assert gemv.usable(torch.randn(1, 64).bfloat16(), small.bfloat16(), None)


# ------------------------------------------------------- 16-bit products widened to float32


def test_native_products_follow_the_cpu_flags(monkeypatch) -> None:
    for flags, bf16, fp16 in [
        ("avx2 fma", False, False),
        ("avx2 avx512f avx512_bf16", True, False),
        ("amx_bf16 amx_tile avx512_fp16", True, True),
    ]:
        monkeypatch.setattr(gemv._ext, "cpu_flags", lambda f=flags: f"x86_64|cpu|{f}")
        gemv.native_products.cache_clear()
        assert gemv.native_products(torch.bfloat16) is bf16
        assert gemv.native_products(torch.float16) is fp16
        assert gemv.native_products(torch.float32)
    gemv.native_products.cache_clear()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("setting", ["on", "off", "auto"])
def test_many_16_bit_rows_are_multiplied_widened(monkeypatch, dtype, setting) -> None:
    """Off the streaming kernel (more than `MAX_ROWS` rows, autograd), 16-bit products run in
    float32 with one rounding where the CPU has no native products (or with ``on``): the value
    is that of the float64 product rounded once, and gradients come back in the inputs' dtype;
    float32 and ``off`` keep torch's kernel as is."""
    monkeypatch.setenv(gemv.WIDEN_ENV, setting)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 9, 48, generator=g).to(dtype).requires_grad_(True)
    w = torch.randn(40, 48, generator=g).to(dtype).requires_grad_(True)
    b = torch.randn(40, generator=g).to(dtype).requires_grad_(True)
    widen = setting == "on" or (setting == "auto" and not gemv.native_products(dtype))
    assert gemv.widens(x, w) is widen
    assert not gemv.widens(x.float(), w.float()) and not gemv.widens(x, w.float())
    out = gemv.linear(x, w, b)
    exact = torch.nn.functional.linear(x.double(), w.double(), b.double())
    if widen:  # float32 sums of exact products: within a float32 rounding of float64, then one
        want = exact.float().to(dtype)  # rounding to the 16-bit dtype
        assert (out.double() - want.double()).abs().max() <= exact.abs().max() * 2**-8
        assert out.dtype == dtype
    else:
        assert torch.equal(out, torch.nn.functional.linear(x, w, b))
    out.float().pow(2).sum().backward()
    assert x.grad.dtype == w.grad.dtype == b.grad.dtype == dtype
    monkeypatch.setenv(gemv.WIDEN_ENV, "always")
    with pytest.raises(ValueError, match=r"ATTNLAB_LINEAR_WIDEN must be 'auto', 'on' or 'off'"):
        gemv.linear(x, w, b)


def test_widened_linear_compiles_without_graph_breaks(monkeypatch) -> None:
    """Under `torch.compile` the choice reads no file or setting (torch's op is traced), so a
    bfloat16 `StreamLinear` on many rows compiles with ``fullgraph=True``."""
    monkeypatch.setenv(gemv.WIDEN_ENV, "on")
    m = StreamLinear(48, 40).to(torch.bfloat16)
    x = torch.randn(3, 20, 48, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        eager = m(x)
        compiled = torch.compile(m, fullgraph=True)(x)
    torch.testing.assert_close(compiled, eager)  # bfloat16 tolerances: one rounding apart
