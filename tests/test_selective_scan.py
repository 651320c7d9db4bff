"""Mamba's selective scan: the chunked parallel scan equals the sequential reference forward and
backward on odd sizes (tolerance rule), keeps causality under NaN, compiles with Inductor, refuses
bad input by name; `SelectiveSSM` equals transformers' `MambaMixer` with the same weights."""

from __future__ import annotations

import pytest
import torch

from attnlab.functional import reference
from attnlab.functional.selective_scan import implicit_matrix, selective_scan
from attnlab.modules import SelectiveSSM
from attnlab.testing import check_against_reference, seeded


def _inputs(b, E, L, N, kind, dtype, seed=0):
    """u, delta, A (negative), B, C, D, z, delta_bias with B/C fixed, per position or grouped."""
    u, delta, z = (seeded(b, E, L, dtype=dtype, seed=seed + i) for i in range(3))
    A = -seeded(E, N, dtype=dtype, seed=seed + 3).abs() * 2  # (E, N) < 0
    shape = {"fixed": (E, N), "shared": (b, N, L), "grouped": (b, 1 if E == 1 else 2, N, L)}
    Bm = seeded(*shape[kind], dtype=dtype, seed=seed + 4)
    Cm = seeded(*shape["grouped" if kind == "grouped" and E % 3 else kind], dtype=dtype, seed=5)
    D, bias = seeded(E, dtype=dtype, seed=seed + 6), seeded(E, dtype=dtype, seed=seed + 7)
    return [u, delta, A, Bm, Cm, D, z, bias]


def _ref(*x, compute_dtype, reorder):
    return reference.selective_scan(*x, delta_softplus=True, compute_dtype=compute_dtype)


@pytest.mark.parametrize(
    "b, E, L, N, kind, chunk",
    [
        (1, 1, 1, 1, "shared", 16),
        (2, 3, 17, 5, "shared", 16),
        (1, 4, 97, 3, "fixed", 8),
        (2, 6, 113, 4, "grouped", 16),
        (1, 2, 1025, 2, "shared", 32),
    ],
)
def test_fast_scan_equals_the_reference_forward_and_backward(b, E, L, N, kind, chunk):
    inputs = _inputs(b, E, L, N, kind, torch.float32)

    def fast(*x):
        return selective_scan(*x, delta_softplus=True, chunk_size=chunk)

    # chunks change the order of the sums: the tiled kernels' mean rule (`assert_close_rule`)
    check_against_reference(fast, _ref, inputs, mean_factor=10.0)


def test_last_state_optional_terms_and_chunk_size_do_not_change_the_result():
    u, delta, A, Bm, Cm, D, _, bias = _inputs(2, 3, 41, 4, "shared", torch.float64)
    ref, h_ref = reference.selective_scan(u, delta, A, Bm, Cm, return_last_state=True)
    for chunk in (1, 5, 16, 64):
        out, h = selective_scan(u, delta, A, Bm, Cm, return_last_state=True, chunk_size=chunk)
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(h, h_ref)
    # the implicit matrix: y = M u (before the gate), causal
    M = implicit_matrix(delta, A, Bm, Cm, D, bias, True)
    y = reference.selective_scan(u, delta, A, Bm, Cm, D, None, bias, True)
    torch.testing.assert_close(torch.einsum("beij,bej->bei", M, u), y)
    assert (M.triu(1) == 0).all()


def test_a_nan_at_position_j_reaches_outputs_at_j_and_later_only():
    inputs = _inputs(1, 3, 37, 4, "shared", torch.float64)
    j = 20
    inputs[0] = inputs[0].clone()
    inputs[0][0, 1, j] = float("nan")  # u_j of channel 1
    inputs[1] = inputs[1].clone()
    inputs[1][0, 2, j + 3] = float("inf")  # delta of channel 2, later
    ref = reference.selective_scan(*inputs, delta_softplus=True)
    out = selective_scan(*inputs, delta_softplus=True, chunk_size=8)
    assert torch.isfinite(out[..., :j]).all()
    torch.testing.assert_close(out[..., :j], ref[..., :j])
    assert torch.equal(torch.isnan(out), torch.isnan(ref))


@pytest.mark.parametrize(
    "change, match",
    [
        ({"u": torch.zeros(2, 3)}, r"u: expected \(B, E, L\)"),
        ({"delta": torch.zeros(2, 3, 6)}, r"delta: expected u's shape \(2, 3, 5\)"),
        ({"A": torch.zeros(4, 2)}, r"A: expected \(E, N\) with E = 3, received \(4, 2\)"),
        ({"B": torch.zeros(2, 2, 4)}, r"B: expected .*received \(2, 2, 4\)"),
        ({"C": torch.zeros(2, 2, 2, 2, 5)}, r"C: expected"),
        ({"D": torch.zeros(4)}, r"D: expected shape \(3,\), received \(4,\)"),
        ({"z": torch.zeros(2, 3, 4)}, r"z: expected shape"),
        ({"u": torch.zeros(2, 3, 5, dtype=torch.long)}, r"u: expected a real floating dtype"),
        ({"chunk_size": 0}, r"chunk_size must be >= 1, got 0"),
        ({"delta_softplus": 1}, r"delta_softplus must be a bool"),
    ],
)
def test_bad_input_is_refused_by_name(change, match):
    args = {
        "u": torch.zeros(2, 3, 5),
        "delta": torch.zeros(2, 3, 5),
        "A": -torch.ones(3, 2),
        "B": torch.zeros(2, 2, 5),
        "C": torch.zeros(3, 2),
        "D": None,
        "z": None,
    }
    args.update(change)
    with pytest.raises((ValueError, TypeError), match=match):
        selective_scan(**args)


def test_inductor_compiles_the_scan_fullgraph_forward_and_backward():
    inputs = _inputs(2, 4, 13, 3, "shared", torch.float32)
    compiled = torch.compile(
        lambda *x: selective_scan(*x, delta_softplus=True, chunk_size=8), fullgraph=True
    )
    check_against_reference(compiled, _ref, inputs, mean_factor=10.0)


def test_selective_ssm_equals_transformers_mamba_mixer_with_the_same_weights():
    from transformers import MambaConfig
    from transformers.models.mamba.modeling_mamba import MambaMixer

    torch.manual_seed(0)
    config = MambaConfig(
        hidden_size=16, state_size=4, expand=2, conv_kernel=4, time_step_rank=2, vocab_size=8
    )
    theirs = MambaMixer(config, layer_idx=0).eval()
    ours = SelectiveSSM(16, d_state=4, d_conv=4, expand=2, dt_rank=2)
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0, 0.3)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 37, 16)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-4)


def test_selective_ssm_is_causal_and_refuses_a_wrong_width():
    torch.manual_seed(0)
    ssm = SelectiveSSM(8, d_state=4)
    x = torch.randn(1, 30, 8)
    y = ssm(x)
    x2 = x.clone()
    x2[0, 17] += 1.0
    y2 = ssm(x2)
    torch.testing.assert_close(y[:, :17], y2[:, :17])
    assert not torch.allclose(y[:, 17:], y2[:, 17:])
    M = ssm.implicit_matrix(x)
    assert M.shape == (1, 16, 30, 30) and (M.triu(1) == 0).all()
    with pytest.raises(ValueError, match=r"x: expected \(B, L, 8\), received \(1, 30, 9\)"):
        ssm(torch.randn(1, 30, 9))
    with pytest.raises(ValueError, match="d_state"):
        SelectiveSSM(8, d_state=0)
