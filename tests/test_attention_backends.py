"""Every backend against the float64 reference, forward and backward, on odd sizes."""

from __future__ import annotations

import itertools

import pytest
import torch

import attnlab
from attnlab import masks
from attnlab.functional import reference
from attnlab.functional.registry import get_backend
from helpers import (
    GENERAL_BACKENDS,
    call_backend,
    check_against_reference,
    mean_factor_for,
    reference_for,
    seeded,
)

# "auto" only dispatches to these; its choices are covered by the semantics and explain tests.
FAST_BACKENDS = [b for b in GENERAL_BACKENDS if b != "reference"]
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def _mask_cases(B: int, L: int, S: int):
    g = torch.Generator().manual_seed(L * 1000 + S)
    rand = torch.rand(B, 1, L, S, generator=g) > 0.3
    add = torch.where(torch.rand(1, 1, L, S, generator=g) > 0.2, 0.0, float("-inf"))
    return {
        "none": None,
        "causal": masks.causal(),
        "window5": masks.sliding_window(5),
        "window3_bidir": masks.sliding_window(3, causal=False),
        "padding": masks.padding([max(0, S - 3), S][:B]),
        "causal&padding": masks.causal() & masks.padding([S, max(1, S // 2)][:B]),
        "strided": masks.strided(4),
        "bool_tensor": rand,
        "additive": add,
    }


def _ref(mask, bias=None, **kw):
    return reference_for(mask, bias, **kw)


@pytest.mark.parametrize("backend", ["reference", *FAST_BACKENDS])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("L,S", [(1, 1), (17, 17), (97, 113), (113, 97), (1, 97)])
def test_backend_matches_reference_all_masks(backend, dtype, L, S):
    B, H, H_kv, D, Dv = 2, 4, 2, 40, 24
    q = seeded(B, H, L, D, dtype=dtype, seed=1)
    k = seeded(B, H_kv, S, D, dtype=dtype, seed=2)
    v = seeded(B, H_kv, S, Dv, dtype=dtype, seed=3)
    for name, mask in _mask_cases(B, L, S).items():
        try:
            check_against_reference(
                call_backend(backend, mask),
                _ref(mask),
                [q, k, v],
                mean_factor=mean_factor_for(backend, dtype),
            )
        except AssertionError as e:
            raise AssertionError(f"mask={name}: {e}") from e


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("L,S", [(1025, 1025), (97, 1025)])
def test_backend_long_odd_sizes_float32(backend, L, S):
    B, H, D = 1, 2, 64
    q = seeded(B, H, L, D, dtype=torch.float32, seed=4)
    k = seeded(B, H, S, D, dtype=torch.float32, seed=5)
    v = seeded(B, H, S, D, dtype=torch.float32, seed=6)
    for mask in (None, masks.causal(), masks.sliding_window(33)):
        check_against_reference(
            call_backend(backend, mask),
            _ref(mask),
            [q, k, v],
            mean_factor=mean_factor_for(backend, torch.float32),
        )


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("D", [8, 64, 80, 128])
def test_head_dims_and_score_options(backend, D):
    q = seeded(2, 3, 19, D, dtype=torch.float32, seed=7)
    k = seeded(2, 3, 23, D, dtype=torch.float32, seed=8)
    v = seeded(2, 3, 23, 16, dtype=torch.float32, seed=9)
    bias = seeded(1, 3, 19, 23, dtype=torch.float32, seed=10)
    mf = mean_factor_for(backend, torch.float32)
    for kw in (
        {"score": "cosine"},
        {"score": "cosine", "scale": 10.0},
        {"temperature": 0.3},
        {"scale": -0.2},
        {"temperature": 2.5, "scale": 0.7},
    ):
        check_against_reference(
            call_backend(backend, masks.causal(), **kw),
            _ref(masks.causal(), **kw),
            [q, k, v],
            mean_factor=mf,
        )
    check_against_reference(
        call_backend(backend, None, bias=bias), _ref(None, bias=bias), [q, k, v], mean_factor=mf
    )


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_function_bias_equals_materialised_bias(backend):
    q = seeded(2, 4, 13, 16, dtype=torch.float64, seed=11)
    k = seeded(2, 2, 21, 16, dtype=torch.float64, seed=12)
    v = seeded(2, 2, 21, 16, dtype=torch.float64, seed=13)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)

    def alibi(b, h, i, j):
        return -slopes[h] * (i - j).abs()

    H, L, S = 4, 13, 21
    dense = (
        -slopes.view(1, H, 1, 1) * ((torch.arange(L) + S - L).view(L, 1) - torch.arange(S)).abs()
    )
    got = attnlab.attention(q, k, v, bias=alibi, backend=backend)
    want, _ = reference.attention(q, k, v, bias=dense)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


def test_backends_listing():
    names = attnlab.backends()
    assert {"reference", "sdpa", "auto"} <= set(names)
    for name in names:
        if name != "auto":
            assert get_backend(name).description


@pytest.mark.parametrize("backend", ["reference", *FAST_BACKENDS])
def test_gradcheck_float64(backend):
    torch.manual_seed(0)
    q = torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 6, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 6, 3, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(1, 2, 5, 6, dtype=torch.float64, requires_grad=True)
    pad = masks.padding([4])
    for mask in (None, masks.causal(), masks.sliding_window(2), pad):
        assert torch.autograd.gradcheck(
            lambda q, k, v, b, m=mask: attnlab.attention(q, k, v, mask=m, bias=b, backend=backend),
            (q, k, v, bias),
        )
    # Cosine score and temperature are differentiable too.
    assert torch.autograd.gradcheck(
        lambda q, k, v: attnlab.attention(
            q, k, v, score="cosine", temperature=0.5, backend=backend
        ),
        (q, k, v),
    )


@pytest.mark.slow
@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_full_odd_size_sweep(backend, dtype):
    sizes = (1, 17, 97, 113, 1025)
    for (L, S), D in itertools.product(itertools.product(sizes, sizes), (8, 40, 64, 80, 128)):
        q = seeded(1, 2, L, D, dtype=dtype, seed=L)
        k = seeded(1, 2, S, D, dtype=dtype, seed=S + 1)
        v = seeded(1, 2, S, D, dtype=dtype, seed=S + 2)
        for mask in (None, masks.causal(), masks.sliding_window(17)):
            check_against_reference(
                call_backend(backend, mask),
                _ref(mask),
                [q, k, v],
                mean_factor=mean_factor_for(backend, dtype),
            )
