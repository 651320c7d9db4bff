"""PNG heatmaps of positional encodings (attnlab.viz; matplotlib is the optional `viz` extra)."""

from __future__ import annotations

import struct
import sys
import zlib

import pytest
import torch

from attnlab.positional import ALiBi, RoPE, T5RelativeBias

pytest.importorskip("matplotlib")

from attnlab import viz

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def read_png(path):
    """Checks the PNG structure (signature, chunk CRCs, IHDR, IEND); returns (width, height)."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, "not a PNG signature"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"bad CRC in chunk {kind!r}"
        chunks.append(kind)
        pos += 12 + length
    assert chunks[0] == b"IHDR" and chunks[-1] == b"IEND" and b"IDAT" in chunks
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def pixels(path):
    import matplotlib.image

    return matplotlib.image.imread(str(path))  # (H, W, 4) floats in [0, 1]


def assert_sensible_png(path, min_size=(300, 200), max_size=(4000, 4000)):
    assert path.exists() and path.stat().st_size > 5_000
    width, height = read_png(path)
    assert min_size[0] <= width <= max_size[0] and min_size[1] <= height <= max_size[1]
    img = pixels(path)
    assert img.shape[:2] == (height, width)
    assert float(img[..., :3].std()) > 0.05  # not a blank canvas
    return img


def test_plot_sinusoidal_writes_a_png(tmp_path):
    out = viz.plot_sinusoidal(tmp_path / "sinusoidal.png", length=64, dim=32)
    assert out == tmp_path / "sinusoidal.png"
    img = assert_sensible_png(out)
    # The diverging colormap uses both red (PE > 0) and blue (PE < 0).
    r, b = img[..., 0], img[..., 2]
    assert bool(((r > 0.6) & (b < 0.3)).any()) and bool(((b > 0.6) & (r < 0.3)).any())


def test_plot_rope_spectrum_writes_a_png(tmp_path):
    ropes = {
        "default": RoPE(64),
        "yarn x4": RoPE(
            64,
            scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
        ),
    }
    assert_sensible_png(viz.plot_rope_spectrum(tmp_path / "rope.png", ropes, length=128))
    assert_sensible_png(viz.plot_rope_spectrum(tmp_path / "one.png", RoPE(16), length=32))


@pytest.mark.parametrize(
    "bias",
    [ALiBi(8), ALiBi(4, causal=False), T5RelativeBias(4), T5RelativeBias(2, bidirectional=False)],
    ids=["alibi", "alibi-bi", "t5", "t5-causal"],
)
def test_plot_bias_writes_a_png(tmp_path, bias):
    out = viz.plot_bias(tmp_path / "sub" / "bias.png", bias, 24, 32)  # parent folder is created
    width, height = read_png(out)
    assert_sensible_png(out)
    assert width > height  # a grid of head panels, wider than tall


def test_plot_bias_of_a_plain_function_needs_num_heads(tmp_path):
    def fn(b, h, i, j):
        return -(i - j).abs().double() * (h + 1)

    with pytest.raises(ValueError, match=r"num_heads must be given .*got None"):
        viz.plot_bias(tmp_path / "f.png", fn, 8)
    assert_sensible_png(viz.plot_bias(tmp_path / "f.png", fn, 8, num_heads=2), min_size=(200, 150))
    with pytest.raises(
        ValueError, match=r"heads must be a non-empty list of indices in \[0, 2\), got \[5\]"
    ):
        viz.plot_bias(tmp_path / "g.png", fn, 8, num_heads=2, heads=[5])


def test_heatmap_is_general_and_validates(tmp_path):
    weights = torch.softmax(torch.randn(12, 16), dim=-1)
    assert_sensible_png(viz.heatmap(weights, tmp_path / "w.png", title="attention weights"))
    grid = viz.heatmaps(torch.rand(3, 5, 7), tmp_path / "grid.png", shared_scale=True, ncols=2)
    assert_sensible_png(grid)
    with pytest.raises(ValueError, match=r"must be 2-D \(rows, cols\), got shape \(2, 3, 4\)"):
        viz.heatmap(torch.zeros(2, 3, 4), tmp_path / "x.png")
    with pytest.raises(ValueError, match=r"path must end in .png, got '.*x.jpg'"):
        viz.heatmap(torch.zeros(2, 3), tmp_path / "x.jpg")
    with pytest.raises(ValueError, match=r"titles must have one entry per matrix \(3\), got 1"):
        viz.heatmaps(torch.rand(3, 2, 2), tmp_path / "y.png", titles=["a"])


def test_missing_matplotlib_raises_a_helpful_import_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r'needs matplotlib.*pip install "attnlab\[viz\]"$'):
        viz.plot_sinusoidal(tmp_path / "s.png")
    assert not (tmp_path / "s.png").exists()


def test_importing_attnlab_viz_does_not_import_matplotlib():
    import subprocess

    code = "import attnlab.viz, attnlab.positional, sys; print('matplotlib' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"
