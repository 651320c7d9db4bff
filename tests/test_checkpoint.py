"""Checkpoints (RELIABILITY K1–K11, H14): verified safetensors, atomic writes, never pickle."""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import os
import pickle
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import attnlab._files as ckfiles
import attnlab.checkpoint as ckmod
from attnlab._files import load_json, save_json
from attnlab.checkpoint import CheckpointError, load_checkpoint, read_safetensors, save_checkpoint
from attnlab.models import GPT, TransformerConfig

DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def _bits(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor (for bit-exact comparisons, NaN payloads and -0.0 included)."""
    t = t.detach().contiguous().reshape(-1)
    return bytes(t.view(torch.uint8).tolist()) if t.numel() else b""


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and _bits(a) == _bits(b)


def _sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for dt in DTYPES:
        if dt.is_floating_point:
            t = torch.randn(3, 5, generator=g, dtype=torch.float64).to(dt)
            t[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
        elif dt == torch.bool:
            t = torch.rand(3, 5, generator=g) > 0.5
        else:
            info = torch.iinfo(dt)
            t = torch.randint(info.min, info.max, (3, 5), generator=g, dtype=torch.int64).to(dt)
            t[0, 0], t[0, 1] = info.min, info.max
        out[f"t.{str(dt).split('.')[-1]}"] = t
    out["empty"] = torch.empty(2, 0)
    out["scalar"] = torch.tensor(3.25, dtype=torch.float64)
    out["scalar_int"] = torch.tensor(-7, dtype=torch.int32)
    return out


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "model.safetensors"
    tensors = _sample_tensors()
    save_checkpoint(path, tensors, {"note": "héllo ✓", "empty": "", "json": '{"a": [1, 2]}'})
    return path, tensors


# ---------------------------------------------------------------------------- K10 round trip
def test_k10_round_trip_is_bit_exact_for_every_dtype_and_metadata_survives(saved):
    path, tensors = saved
    ck = load_checkpoint(path)
    assert set(ck.tensors) == set(tensors)
    for name, t in tensors.items():
        assert _same(ck.tensors[name], t), name
    assert ck.metadata == {"note": "héllo ✓", "empty": "", "json": '{"a": [1, 2]}'}


def test_files_are_plain_safetensors_that_safetensors_itself_reads(saved):
    from safetensors.torch import load_file

    path, tensors = saved
    other = load_file(str(path))
    assert set(other) == set(tensors)
    assert all(_same(other[k], tensors[k]) for k in tensors)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert (8 + n) % 8 == 0  # the data region is 8-byte aligned


def test_header_records_a_sha256_per_tensor(saved):
    path, tensors = saved
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    digests = json.loads(header["__metadata__"]["attnlab.sha256"])
    assert set(digests) == set(tensors)
    begin, end = header["t.float32"]["data_offsets"]
    assert digests["t.float32"] == hashlib.sha256(raw[8 + n + begin : 8 + n + end]).hexdigest()


FIXTURE = Path(__file__).parent / "fixtures" / "format_v1.safetensors"


def _fixture_tensors() -> dict[str, torch.Tensor]:
    """What ``tests/fixtures/format_v1.safetensors`` holds: it was written by the hand-written
    writer of attnlab 0.x (before checkpoint.py moved onto the safetensors library) with
    ``save_checkpoint(FIXTURE, _fixture_tensors(), FIXTURE_METADATA)``."""
    emb = (torch.arange(12, dtype=torch.float32).reshape(4, 3) / 8 - 0.7).to(torch.bfloat16)
    emb.view(torch.int16)[0, :3] = torch.tensor([-1, -128, -32768])  # bits of NaN, -inf, -0.0
    return {
        "emb.weight": emb,
        "head.weight": emb,  # tied: the same tensor
        "steps": torch.tensor([2**40 + 3, -5, 0, 2**63 - 1], dtype=torch.int64),
        "ln.bias": torch.tensor([0.5, -1.25, 3.0], dtype=torch.float32),
        "scale": torch.tensor(1.5, dtype=torch.float16),
        "mask": torch.tensor([[True, False], [False, True]]),
        "empty": torch.empty(2, 0),
    }


FIXTURE_METADATA = {"note": "written by the hand-written writer ✓", "step": "7"}


def test_a_checkpoint_written_by_the_old_hand_written_writer_still_loads(tmp_path):
    ck = load_checkpoint(FIXTURE)
    want = _fixture_tensors()
    assert set(ck.tensors) == set(want) and ck.metadata == FIXTURE_METADATA
    for name, t in want.items():
        assert _same(ck.tensors[name], t), name
    assert ck.tensors["head.weight"] is ck.tensors["emb.weight"]  # the tie is restored
    assert _bits(ck.tensors["emb.weight"][0, :3]) == b"\xff\xff\x80\xff\x00\x80"
    raw = bytearray(FIXTURE.read_bytes())  # the old header checksum is still verified
    raw[raw.index(b"hand-written")] ^= 0x20
    (tmp_path / "f.safetensors").write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="header sha256 mismatch"):
        load_checkpoint(tmp_path / "f.safetensors")


def test_k8_a_tie_holding_nan_loads_into_a_tied_module():
    """Found with the fixture: the tie check compared with torch.equal, for which NaN != NaN."""

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Linear(3, 4, bias=False, dtype=torch.bfloat16)
            self.head = nn.Linear(3, 4, bias=False, dtype=torch.bfloat16)
            self.head.weight = self.emb.weight

    dst = Tied()
    ck = load_checkpoint(FIXTURE, dst, strict=False)
    assert dst.head.weight is dst.emb.weight
    assert _same(dst.emb.weight.detach(), _fixture_tensors()["emb.weight"])
    assert ck.unexpected_keys == ["empty", "ln.bias", "mask", "scale", "steps"]
    cast = Tied().float()  # with allow_cast, the two casts of one NaN-holding tensor still agree
    load_checkpoint(FIXTURE, cast, strict=False, allow_cast=True)
    assert _same(cast.head.weight.detach(), _fixture_tensors()["emb.weight"].float())


# ---------------------------------------------------------------------------- K1, K2, K3
@pytest.mark.parametrize(
    "cut,pattern",
    [
        (0, r"not a valid safetensors file \(.*header too small\)"),
        (4, r"not a valid safetensors file \(.*header too small\)"),
        (8, r"not a valid safetensors file \(.*invalid header length\)"),
        (20, r"not a valid safetensors file \(.*invalid header length\)"),
        (-1, r"not a valid safetensors file \(.*file not fully covered\)"),
    ],
)
def test_k1_truncation_raises_checkpoint_error_with_path_and_cause(saved, cut, pattern):
    path, _ = saved
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) - 1] if cut == -1 else raw[:cut])
    with pytest.raises(CheckpointError, match=pattern) as info:
        load_checkpoint(path)
    assert info.value.path == str(path) and str(path) in str(info.value)
    assert info.value.cause and info.value.cause in str(info.value)


def test_k2_trailing_junk_is_rejected(saved):
    path, _ = saved
    path.write_bytes(path.read_bytes() + b"PK\x03\x04 polyglot")
    with pytest.raises(
        CheckpointError, match=r"not a valid safetensors file \(.*file not fully covered\)"
    ):
        load_checkpoint(path)


def test_k3_every_single_byte_flip_anywhere_is_detected(tmp_path):
    path = tmp_path / "small.safetensors"
    save_checkpoint(
        path,
        {"a": torch.arange(6, dtype=torch.float32), "b": torch.tensor([True, False])},
        {"k": "v"},
    )
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data_start = 8 + n
    owner = {}
    for name in ("a", "b"):
        begin, end = header[name]["data_offsets"]
        owner.update({data_start + i: name for i in range(begin, end)})
    assert len(owner) == len(raw) - data_start == 26
    bad = tmp_path / "flipped.safetensors"
    for pos in range(len(raw)):
        flipped = bytearray(raw)
        flipped[pos] ^= 0x01 if pos % 2 else 0x80
        bad.write_bytes(bytes(flipped))
        pattern = rf"sha256 mismatch for tensor\(s\) \['{owner[pos]}'\]" if pos in owner else None
        with pytest.raises(CheckpointError, match=pattern):
            load_checkpoint(bad)


def test_k3_plain_safetensors_loads_a_flipped_byte_silently_which_is_why_we_hash(saved):
    from safetensors.torch import load_file

    path, _ = saved
    raw = bytearray(path.read_bytes())
    raw[-20] ^= 0x01
    path.write_bytes(bytes(raw))
    load_file(str(path))  # P: no error from safetensors
    with pytest.raises(CheckpointError, match="sha256 mismatch"):
        load_checkpoint(path)


# ---------------------------------------------------------------------------- K4 bad headers
def _raw(path: Path, header: bytes | dict, data: bytes = b"", n: int | None = None) -> Path:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body) if n is None else n) + body + data)
    return path


F32x4 = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}


@pytest.mark.parametrize(
    "header,data,n,pattern",
    [
        (b"{}", b"", 200_000_000, r"\(.*header too large\)"),
        (b'{"\xff\xfe": 1}', b"", None, r"\(.*invalid UTF-8 in header"),
        (b'{"a": {"dtype": ', b"", None, r"\(.*invalid JSON in header: EOF while parsing"),
        (b"[1, 2]", b"", None, r"\(.*invalid type: sequence, expected struct"),
        (
            b'{"a": 1, "a": 2}',
            b"",
            None,
            r"\(.*invalid type: integer `1`, expected struct TensorInfo",
        ),
        (b'{"a": NaN}', b"", None, r"\(.*invalid JSON in header: expected value"),
        (
            {"a": F32x4, "b": {"dtype": "F32", "shape": [2, 2], "data_offsets": [8, 24]}},
            bytes(24),
            None,
            r"\(.*invalid offset for tensor `b`\)",
        ),
        (
            {"a": {"dtype": "F32", "shape": [2**62, 2**62], "data_offsets": [0, 16]}},
            bytes(16),
            None,
            r"\(.*overflow computing buffer size",
        ),
        (
            {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}},
            bytes(12),
            None,
            r"\(.*invalid shape, data type, or offset for tensor\)",
        ),
        (
            {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [16, 0]}},
            bytes(16),
            None,
            r"\(.*invalid offset for tensor `a`\)",
        ),
        (
            {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [4, 20]}},
            bytes(20),
            None,
            r"\(.*invalid offset for tensor `a`\)",
        ),
        (
            {"a": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}},
            bytes(16),
            None,
            r"\(.*unknown variant `F128`",
        ),
        (
            {"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}},
            bytes(4),
            None,
            r"\(.*invalid value: integer `-1`, expected usize",
        ),
        (
            {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "extra": 1}},
            bytes(4),
            None,
            r"tensor 'a': expected exactly dtype, shape, data_offsets",
        ),
        (
            {"__metadata__": {"k": 1}},
            b"",
            None,
            r"\(.*invalid type: integer `1`, expected a string",
        ),
        (  # safetensors reads it; attnlab stores and reads only `DTYPES`
            {"a": {"dtype": "F8_E8M0", "shape": [1], "data_offsets": [0, 1]}},
            bytes(1),
            None,
            r"unknown dtype 'F8_E8M0'",
        ),
        ({"a": F32x4}, bytes(16), None, r"not an attnlab checkpoint"),
    ],
)
def test_k4_hand_made_bad_headers_are_rejected_with_a_message(tmp_path, header, data, n, pattern):
    path = _raw(tmp_path / "bad.safetensors", header, data, n)
    with pytest.raises(CheckpointError, match=pattern):
        load_checkpoint(path)


def test_the_header_sha256_catches_edits_that_keep_the_file_well_formed(tmp_path):
    """A swapped shape or an edited metadata string leaves every tensor's bytes (and sha256) as
    they were and the file valid safetensors: only the header's own sha256 catches them."""
    from safetensors.torch import load_file

    path = tmp_path / "s.safetensors"
    save_checkpoint(path, {"w": torch.arange(6.0).reshape(2, 3)}, {"lr": "0.001"})
    raw = path.read_bytes()
    for old, new in [(b"[2,3]", b"[3,2]"), (b'"0.001"', b'"0.002"')]:
        assert raw.count(old) == 1
        path.write_bytes(raw.replace(old, new))
        load_file(str(path))  # P: safetensors loads the edited file
        with pytest.raises(CheckpointError, match="header sha256 mismatch"):
            load_checkpoint(path)


@pytest.mark.parametrize(
    "header,pattern",
    [
        (
            b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
            b'"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',
            r"not valid JSON \(duplicate keys \['a'\]\)",
        ),
        (
            b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "scale": 2}}',
            r"tensor 'a': expected exactly dtype, shape, data_offsets",
        ),
    ],
)
def test_headers_that_safetensors_accepts_but_attnlab_refuses(tmp_path, header, pattern):
    """Why the header is checked before safetensors decodes it: safetensors keeps the last of two
    tensors with one name and ignores unknown fields."""
    from safetensors.torch import load_file

    path = _raw(tmp_path / "d.safetensors", header, bytes(4))
    assert set(load_file(str(path))) == {"a"}  # P: no error from safetensors
    with pytest.raises(CheckpointError, match=pattern):
        read_safetensors(path)


def test_read_safetensors_accepts_foreign_files_but_validates_structure(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "foreign.safetensors"
    save_file({"w": torch.arange(4.0)}, str(path), metadata={"format": "pt"})
    tensors, meta = read_safetensors(path)
    assert torch.equal(tensors["w"], torch.arange(4.0)) and meta == {"format": "pt"}
    with pytest.raises(CheckpointError, match="not an attnlab checkpoint"):
        load_checkpoint(path)
    path.write_bytes(path.read_bytes() + b"junk")
    with pytest.raises(CheckpointError, match="file not fully covered"):
        read_safetensors(path)


# ------------------------------------------------------------------------ K5, K6, K7 modules
class Net(nn.Module):
    def __init__(self, out: int = 3, dtype=torch.float32) -> None:
        super().__init__()
        self.lin = nn.Linear(4, out, dtype=dtype)
        self.register_buffer("steps", torch.tensor(5))


def test_module_round_trip_loads_parameters_and_buffers(tmp_path):
    src, dst = Net(), Net()
    src.steps.fill_(9)
    save_checkpoint(tmp_path / "n.safetensors", src)
    ck = load_checkpoint(tmp_path / "n.safetensors", dst)
    assert ck.missing_keys == ck.unexpected_keys == []
    for k, v in src.state_dict().items():
        assert _same(dst.state_dict()[k], v)


def test_k5_shape_mismatch_names_key_expected_and_received_and_leaves_module_untouched(tmp_path):
    save_checkpoint(tmp_path / "n.safetensors", Net(out=3))
    dst = Net(out=2)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(
        CheckpointError,
        match=r"lin.weight: shape mismatch, the module expects \(2, 4\) and the file has \(3, 4\)",
    ) as info:
        load_checkpoint(tmp_path / "n.safetensors", dst)
    assert "lin.bias: shape mismatch, the module expects (2,) and the file has (3,)" in str(
        info.value
    )
    assert all(torch.equal(before[k], v) for k, v in dst.state_dict().items())


def test_k6_dtype_mismatch_raises_unless_allow_cast(tmp_path):
    src = Net()
    save_checkpoint(tmp_path / "n.safetensors", src)
    dst = Net(dtype=torch.float16)
    with pytest.raises(
        CheckpointError,
        match=r"lin.weight: dtype mismatch, the module expects torch.float16 and the file has "
        r"torch.float32 \(pass allow_cast=True",
    ):
        load_checkpoint(tmp_path / "n.safetensors", dst)
    load_checkpoint(tmp_path / "n.safetensors", dst, allow_cast=True)
    assert torch.equal(dst.lin.weight, src.lin.weight.half())


def test_k7_missing_and_unexpected_keys_are_all_listed_when_strict(tmp_path):
    many = nn.ParameterDict({f"p{i:02d}": nn.Parameter(torch.zeros(1)) for i in range(30)})
    file = {f"p{i:02d}": torch.ones(1) for i in range(10)}
    file.update({f"extra{i}": torch.ones(1) for i in range(12)})
    save_checkpoint(tmp_path / "m.safetensors", file)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path / "m.safetensors", many)
    msg = str(info.value)
    assert all(f"'p{i:02d}'" in msg for i in range(10, 30))
    assert all(f"'extra{i}'" in msg for i in range(12))
    assert all(float(p.detach()) == 0 for p in many.values())  # nothing was loaded
    ck = load_checkpoint(tmp_path / "m.safetensors", many, strict=False)
    assert ck.missing_keys == [f"p{i:02d}" for i in range(10, 30)]
    assert ck.unexpected_keys == sorted(f"extra{i}" for i in range(12))
    assert [float(many[f"p{i:02d}"].detach()) for i in (0, 9, 10)] == [1.0, 1.0, 0.0]


def test_prefix_selects_a_submodule_state(tmp_path):
    src = Net()
    save_checkpoint(
        tmp_path / "p.safetensors",
        {**{f"model.{k}": v for k, v in src.state_dict().items()}, "optim.x": torch.zeros(2)},
    )
    dst = Net()
    load_checkpoint(tmp_path / "p.safetensors", dst, prefix="model.")
    assert torch.equal(dst.lin.weight, src.lin.weight)


# -------------------------------------------------------------------- K8 ties, non-contiguous
def _tiny_gpt(seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(TransformerConfig(vocab_size=11, d_model=8, n_layers=1, n_heads=2, max_seq_len=8))


def test_k8_tied_weights_are_stored_once_and_ties_are_restored(tmp_path):
    from safetensors.torch import save_file

    src = _tiny_gpt(0)
    assert src.lm_head.weight is src.tok_emb.weight
    with pytest.raises(RuntimeError, match="share memory"):  # P: raw save_file refuses ties
        save_file(src.state_dict(), str(tmp_path / "raw.safetensors"))
    path = tmp_path / "gpt.safetensors"
    save_checkpoint(path, src)
    stored, meta = read_safetensors(path)
    assert "lm_head.weight" not in stored and "tok_emb.weight" in stored
    assert json.loads(meta["attnlab.ties"]) == {"lm_head.weight": "tok_emb.weight"}
    ck = load_checkpoint(path)
    assert ck.tensors["lm_head.weight"] is ck.tensors["tok_emb.weight"]
    dst = _tiny_gpt(1)
    load_checkpoint(path, dst)
    assert dst.lm_head.weight is dst.tok_emb.weight
    for k, v in src.state_dict().items():
        assert _same(dst.state_dict()[k], v), k
    idx = torch.randint(0, 11, (1, 5))
    assert torch.equal(dst(idx), src(idx))


def test_k8_a_file_with_different_values_for_a_module_tie_is_rejected(tmp_path):
    src = _tiny_gpt(0)
    state = {k: v.clone() for k, v in src.state_dict().items()}
    state["lm_head.weight"] += 1
    save_checkpoint(tmp_path / "g.safetensors", state)
    with pytest.raises(CheckpointError, match=r"ties it to tok_emb.weight but the file holds"):
        load_checkpoint(tmp_path / "g.safetensors", _tiny_gpt(1))


def test_k8_non_contiguous_parameters_save_and_load(tmp_path):
    from safetensors.torch import save_file

    class T(nn.Module):
        def __init__(self, seed):
            super().__init__()
            g = torch.Generator().manual_seed(seed)
            self.w = nn.Parameter(torch.randn(4, 3, generator=g).t())  # (3, 4), strides (1, 3)
            self.s = nn.Parameter(torch.randn(6, 4, generator=g)[::2])  # a strided row slice

    src, dst = T(0), T(1)
    assert not src.w.is_contiguous() and not src.s.is_contiguous()
    with pytest.raises(ValueError, match="non contiguous"):  # P: raw save_file refuses
        save_file({"w": src.w.detach()}, str(tmp_path / "raw.safetensors"))
    save_checkpoint(tmp_path / "t.safetensors", src)
    load_checkpoint(tmp_path / "t.safetensors", dst)
    assert torch.equal(dst.w, src.w) and torch.equal(dst.s, src.s)
    assert dst.w.stride() == (1, 3)  # loaded in place: the module keeps its layout


def test_partially_overlapping_views_are_stored_as_separate_copies(tmp_path):
    base = torch.arange(10.0)
    save_checkpoint(tmp_path / "v.safetensors", {"x": base[:6], "y": base[4:]})
    ck = load_checkpoint(tmp_path / "v.safetensors")
    assert torch.equal(ck.tensors["x"], base[:6]) and torch.equal(ck.tensors["y"], base[4:])


# ---------------------------------------------------------------------------- K9 pickle
class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",))


@pytest.fixture
def no_unpickling(monkeypatch):
    """Any unpickling (or torch.load) during the test fails it."""

    def boom(*args, **kwargs):
        raise AssertionError("the checkpoint loader tried to unpickle")

    monkeypatch.setattr(pickle, "load", boom)
    monkeypatch.setattr(pickle, "loads", boom)
    monkeypatch.setattr(pickle, "Unpickler", boom)
    monkeypatch.setattr(torch, "load", boom)


def test_k9_the_payload_is_live(tmp_path):
    """Sanity: unpickling the payload really writes the marker (so the next test means it)."""
    marker = tmp_path / "live_marker"
    pickle.loads(pickle.dumps(_Evil(marker)))
    assert marker.read_text() == "pwned"


@pytest.mark.parametrize(
    "name", ["model.pt", "pytorch_model.bin", "x.pth", "disguised.safetensors"]
)
def test_k9_malicious_pickles_are_refused_and_never_executed(tmp_path, no_unpickling, name):
    marker = tmp_path / "marker"
    path = tmp_path / name
    path.write_bytes(pickle.dumps({"weight": _Evil(marker)}, protocol=4))
    with pytest.raises(CheckpointError, match=r"refusing"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match=r"refusing"):
        read_safetensors(path)
    assert not marker.exists()


def test_k9_torch_save_zip_is_refused_by_content(tmp_path, no_unpickling):
    path = tmp_path / "weights.safetensors"
    with open(path, "wb") as f:
        torch.serialization.save({"w": torch.zeros(2)}, f)  # a zip with a pickle inside
    with pytest.raises(CheckpointError, match=r"refusing a zip archive"):
        load_checkpoint(path)


def test_a_header_whose_length_starts_like_a_pickle_is_not_refused(tmp_path):
    """Found by H14: a 896-byte header makes the file start 80 03, a pickle protocol-3 magic."""
    path = tmp_path / "p.safetensors"
    for pad in range(1, 400):
        save_checkpoint(path, {"x" * pad: torch.zeros(1)})
        if path.read_bytes()[:2] == b"\x80\x03":
            break
    assert path.read_bytes()[:2] == b"\x80\x03"
    assert torch.equal(load_checkpoint(path).tensors["x" * pad], torch.zeros(1))


def test_a_valid_file_is_never_judged_by_its_first_bytes(tmp_path, no_unpickling):
    """Content is judged as zip or pickle only once safetensors has refused the file: a valid
    header of 896 bytes that opens with spaces (safetensors accepts them) makes the file start
    ``80 03`` and not ``… {`` (it was refused as a pickle when attnlab judged the bytes first).
    A refused file with such a prefix is still refused as safetensors, quoting its cause."""
    info = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    data = struct.pack("<2f", 1.5, -2.0)
    path = _raw(tmp_path / "spaces.safetensors", b" " * (896 - len(info)) + info, data)
    assert path.read_bytes()[:2] == b"\x80\x03" and path.read_bytes()[8:9] == b" "
    tensors, meta = read_safetensors(path)
    assert torch.equal(tensors["w"], torch.tensor([1.5, -2.0])) and meta == {}
    _raw(path, info + b" " * (896 - len(info)), data[:-1])  # truncated
    assert path.read_bytes()[:2] == b"\x80\x03"
    with pytest.raises(CheckpointError, match=r"not a valid safetensors file \(.*fully covered"):
        read_safetensors(path)


def test_k9_good_files_load_without_any_unpickling(saved, no_unpickling):
    path, tensors = saved
    ck = load_checkpoint(path)
    assert _same(ck.tensors["t.float32"], tensors["t.float32"])


@pytest.mark.parametrize("module", [ckmod, ckfiles])
def test_k9_the_loader_modules_never_import_pickle_or_call_torch_load(module):
    tree = ast.parse(inspect.getsource(module))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {m for m in imported if m and ("pickle" in m or m == "torch.serialization")}
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert "load" not in attrs  # no torch.load / pickle.load anywhere


def test_saving_to_a_pickle_suffix_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"path must not use a pickle suffix .* got '.*model.pt'"):
        save_checkpoint(tmp_path / "model.pt", {"a": torch.zeros(1)})
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------------------- K10 atomicity
_CHILD = textwrap.dedent(
    """
    import os, sys, time, torch, safetensors.torch
    from attnlab.checkpoint import save_checkpoint

    path, mode = sys.argv[1], sys.argv[2]
    real_save_file = safetensors.torch.save_file

    def stalling_save_file(tensors, filename, metadata=None):  # stops half-way through the data
        real_save_file(tensors, filename, metadata=metadata)
        os.truncate(filename, os.path.getsize(filename) // 2)
        print("STALLED", flush=True)
        time.sleep(120)

    def stalling_fsync(fd):
        print("STALLED", flush=True)
        time.sleep(120)

    if mode == "mid-data":
        safetensors.torch.save_file = stalling_save_file
    elif mode == "before-rename":
        os.fsync = stalling_fsync
    if mode == "loop":
        print("STALLED", flush=True)
        v = 2.0
        while True:
            save_checkpoint(path, {"a": torch.full((4_000_000,), v), "b": torch.full((3,), v)})
            v += 1
    save_checkpoint(path, {"a": torch.full((100_000,), 2.0), "b": torch.full((3,), 2.0)})
    """
)


@pytest.mark.parametrize("mode", ["mid-data", "before-rename", "loop"])
def test_k10_a_writer_killed_mid_write_leaves_the_previous_file_intact(tmp_path, mode):
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, {"a": torch.full((100_000,), 1.0), "b": torch.full((3,), 1.0)})
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(path), mode],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "STALLED"
        if mode == "loop":  # kill while a temp file is being written, whenever that is
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not any(
                p.name.endswith(".tmp") for p in tmp_path.iterdir()
            ):
                pass
        else:
            tmp = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
            assert len(tmp) == 1 and tmp[0].stat().st_size > 0  # the write was under way
        child.kill()
    finally:
        child.kill()
        child.wait(timeout=30)
    ck = load_checkpoint(path)
    a, b = ck.tensors["a"], ck.tensors["b"]
    if mode == "loop":
        assert torch.all(a == a[0]) and torch.all(b == a[0])  # some complete version
    else:
        assert torch.all(a == 1.0) and torch.all(b == 1.0)  # the previous version, intact


def test_k10_a_failed_write_removes_its_temp_file_and_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, {"a": torch.ones(3)})

    def failing_fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(path, {"a": torch.zeros(3)})
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]
    assert torch.equal(load_checkpoint(path).tensors["a"], torch.ones(3))


# ------------------------------------------------------------------------------- K11 + misc
def test_k11_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nope.safetensors"
    with pytest.raises(FileNotFoundError, match=r"checkpoint not found: .*nope.safetensors"):
        load_checkpoint(path)


def test_k11_unknown_format_version_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(ckmod, "FORMAT_VERSION", "7")
    save_checkpoint(tmp_path / "v.safetensors", {"a": torch.zeros(1)})
    monkeypatch.undo()
    with pytest.raises(
        CheckpointError,
        match=r"unknown checkpoint format version '7' \(this attnlab reads version '1'\)",
    ):
        load_checkpoint(tmp_path / "v.safetensors")


@pytest.mark.parametrize(
    "tensors,metadata,exc,pattern",
    [
        ({"a": [1.0]}, None, TypeError, r"tensor 'a' must be a torch.Tensor, got list"),
        ({1: torch.zeros(1)}, None, TypeError, r"tensor names must be str, got int 1"),
        (
            {"c": torch.zeros(2, dtype=torch.complex64)},
            None,
            TypeError,
            r"tensor 'c' has dtype torch.complex64",
        ),
        ({"__metadata__": torch.zeros(1)}, None, ValueError, r"other than '__metadata__'"),
        ({"a": torch.zeros(1)}, {"attnlab.x": "1"}, ValueError, r"reserved, got 'attnlab.x'"),
        (
            {"a": torch.zeros(1)},
            {"k": 1},
            TypeError,
            r"metadata must map str to str, got str 'k' -> int",
        ),
        (
            [torch.zeros(1)],
            None,
            TypeError,
            r"tensors_or_module must be a dict of tensors or an nn.Module, got list",
        ),
    ],
)
def test_save_argument_errors(tmp_path, tensors, metadata, exc, pattern):
    with pytest.raises(exc, match=pattern):
        save_checkpoint(tmp_path / "e.safetensors", tensors, metadata)
    assert not list(tmp_path.iterdir())


def test_checksummed_json_round_trip_and_tamper_detection(tmp_path):
    path = tmp_path / "config.json"
    save_json(path, {"d_model": 128, "vocab": ["a", "é"]})
    assert load_json(path) == {"d_model": 128, "vocab": ["a", "é"]}
    path.write_text(path.read_text().replace("128", "129"))
    with pytest.raises(CheckpointError, match="sha256 mismatch"):
        load_json(path)


# ---------------------------------------------------------------------------- H14 properties
H14 = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@st.composite
def tensor_dicts(draw):
    names = draw(
        st.lists(st.text("abcxyz._/-0123456789é", min_size=1, max_size=10), max_size=5, unique=True)
    )
    out = {}
    for name in names:
        dtype = draw(st.sampled_from(DTYPES))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        nbytes = (
            torch.empty(shape, dtype=dtype).numel() * torch.empty(0, dtype=dtype).element_size()
        )
        raw = draw(st.binary(min_size=nbytes, max_size=nbytes))
        if not nbytes:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        t = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        if dtype == torch.bool:
            t = t % 2
        out[name] = t.view(dtype).reshape(shape)  # any bit pattern: NaN payloads, -0.0, ...
    return out


@H14
@given(tensors=tensor_dicts(), data=st.data())
def test_h14_any_dict_round_trips_and_any_truncation_or_flip_raises(tmp_path, tensors, data):
    path = tmp_path / "h.safetensors"
    save_checkpoint(path, tensors, {"m": "✓"})
    ck = load_checkpoint(path)
    assert set(ck.tensors) == set(tensors) and ck.metadata == {"m": "✓"}
    assert all(_same(ck.tensors[k], v) for k, v in tensors.items())
    raw = path.read_bytes()
    cut = data.draw(st.integers(0, len(raw) - 1), label="cut")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(raw[:cut])
    with pytest.raises(CheckpointError):
        load_checkpoint(bad)
    pos = data.draw(st.integers(0, len(raw) - 1), label="pos")
    xor = data.draw(st.integers(1, 255), label="xor")
    flipped = bytearray(raw)
    flipped[pos] ^= xor
    bad.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError):
        load_checkpoint(bad)
