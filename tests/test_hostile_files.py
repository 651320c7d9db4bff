"""Issue 15, items 1, 3 and 4: hostile checkpoint files and the temp files a killed save leaves.

1. header checks are linear (a 40,000-entry header is handled in well under a second) and the
   header's size, tensor count and nesting are bounded with a clear `CheckpointError`;
3. devices, FIFOs and directories are refused before any read, every read is bounded, and deep
   JSON nesting never escapes as RecursionError;
4. stale temp files of our naming are removed by the next save, a live writer's never, and
   outputs respect the umask.
"""

from __future__ import annotations

import ast
import json
import os
import stat
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import attnlab._files as ckfiles
import attnlab.checkpoint as ckmod
from attnlab._files import load_json
from attnlab.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

ENTRY = '"t{:06d}":{{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}'


def _file(path: Path, header: str, data: bytes = b"") -> Path:
    body = header.encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)
    return path


def _sealed(path: Path, meta: dict[str, str]) -> Path:
    """An attnlab-looking file with one empty tensor and a correct header sha256."""
    meta = {"attnlab.format_version": "1", **meta, ckmod.HEADER_KEY: "0" * 64}
    header = {"__metadata__": meta, "a": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}}
    body = json.dumps(header).encode()
    path.write_bytes(ckmod.seal_header_sha256(struct.pack("<Q", len(body)) + body))
    return path


# ------------------------------------------------------------------ item 1: linear header checks
@pytest.mark.parametrize(
    "names,pattern",
    [
        (lambda i: i, r"not an attnlab checkpoint"),
        (lambda i: i % 2, r"duplicate keys \['t000000', 't000001'\]\)$"),
        (lambda i: i % 20_000, r"duplicate keys \['t000000', .*'t000004'\] and 19995 more\)$"),
    ],
    ids=["distinct", "two-names", "half-duplicates"],
)
def test_a_crafted_40000_entry_header_is_refused_in_well_under_a_second(tmp_path, names, pattern):
    header = "{" + ",".join(ENTRY.format(names(i)) for i in range(40_000)) + "}"
    assert len(header) > 2_300_000
    path = _file(tmp_path / "crafted.safetensors", header)
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=pattern):  # the message stays short, too
        load_checkpoint(path)
    elapsed = time.perf_counter() - start
    assert elapsed < 3.0, f"{elapsed:.2f} s (quadratic duplicate check? 20 s before the fix)"


@pytest.mark.slow  # the save of 40,000 tensors takes seconds
def test_a_real_40000_tensor_checkpoint_loads_in_linear_time(tmp_path):
    path = tmp_path / "many.safetensors"
    save_checkpoint(path, {f"t{i:06d}": torch.full((1,), float(i)) for i in range(40_000)})
    start = time.perf_counter()
    ck = load_checkpoint(path)
    elapsed = time.perf_counter() - start
    assert len(ck.tensors) == 40_000 and ck.tensors["t039999"].item() == 39_999.0
    assert elapsed < 6.0, f"{elapsed:.2f} s"


def _loops_calling(tree: ast.AST, methods: set[str]) -> list[str]:
    loops = (ast.For, ast.While, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
    found = []
    for loop in ast.walk(tree):
        if isinstance(loop, loops):
            for node in ast.walk(loop):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in methods
                ):
                    found.append(f"line {node.lineno}: .{node.func.attr}() inside a loop")
    return found


@pytest.mark.parametrize("module", [ckfiles, ckmod])
def test_no_linear_list_search_runs_inside_a_loop_in_the_checkpoint_code(module):
    tree = ast.parse(Path(module.__file__).read_text())
    assert _loops_calling(tree, {"count", "index", "remove"}) == []


def test_the_structural_check_catches_the_old_quadratic_duplicate_check():
    old = "def f(keys):\n    return sorted({k for k in keys if keys.count(k) > 1})\n"
    assert _loops_calling(ast.parse(old), {"count"}) == ["line 2: .count() inside a loop"]


def test_the_tensor_count_is_bounded_before_and_after_parsing(tmp_path, monkeypatch):
    monkeypatch.setattr(ckmod, "MAX_TENSORS", 100)
    ok = "{" + ",".join(ENTRY.format(i) for i in range(100)) + ',"__metadata__":{}}'
    with pytest.raises(CheckpointError, match="not an attnlab checkpoint"):  # 100 pass the bound
        load_checkpoint(_file(tmp_path / "ok.safetensors", ok))
    over = "{" + ",".join(ENTRY.format(i) for i in range(101)) + "}"
    with pytest.raises(CheckpointError, match=r"header lists 101 tensors, more than the 100-tens"):
        load_checkpoint(_file(tmp_path / "over.safetensors", over))
    header = "{" + ",".join(ENTRY.format(i) for i in range(102)) + "}"
    path = _file(tmp_path / "many.safetensors", header)
    calls = []
    monkeypatch.setattr(ckfiles.json, "loads", lambda *a, **k: calls.append(1))
    with pytest.raises(CheckpointError, match=r"header lists 102 tensors, more than the 100-tens"):
        load_checkpoint(path)
    assert calls == []  # refused before attnlab parses the header itself
    monkeypatch.undo()
    assert ckmod.MAX_TENSORS >= 40_000 and ckmod.MAX_HEADER_BYTES == 100_000_000


def test_the_header_size_is_bounded_before_anything_is_read_into_json(tmp_path):
    path = tmp_path / "big.safetensors"
    path.write_bytes(struct.pack("<Q", ckmod.MAX_HEADER_BYTES + 1) + b"{}")
    with pytest.raises(
        CheckpointError, match=r"not a valid safetensors file \(.*header too large\)"
    ):
        load_checkpoint(path)


# ---------------------------------------------------------------- item 3: deep nesting
DEEP = 200_000


@pytest.mark.parametrize(
    "header",
    [
        '{"a": ' + "[" * DEEP + "]" * DEEP + "}",
        '{"a": ' + "[" * DEEP,
        '{"a": {"b": {"c": [1]}}}',
        '{"__metadata__": {"x": {"y": ["z"]}}}',
    ],
    ids=["deep-balanced", "deep-unclosed", "four-levels", "nested-metadata"],
)
def test_headers_nesting_deeper_than_safetensors_allows_are_refused(tmp_path, header):
    path = _file(tmp_path / "deep.safetensors", header)
    with pytest.raises(
        CheckpointError, match=r"not a valid safetensors file \(.*invalid JSON in header"
    ):
        load_checkpoint(path)


def test_brackets_inside_strings_do_not_count_as_nesting(tmp_path):
    name = "[[[[{{{{" + '\\"]]]' * 3
    path = tmp_path / "s.safetensors"
    save_checkpoint(path, {json.loads(f'"{name}"'): torch.ones(2)}, {"m": "[[[[[[{{{"})
    ck = load_checkpoint(path)
    assert ck.metadata == {"m": "[[[[[[{{{"}
    assert torch.equal(ck.tensors[json.loads(f'"{name}"')], torch.ones(2))


@pytest.mark.parametrize("field", ["attnlab.sha256", "attnlab.ties"])
def test_deeply_nested_attnlab_metadata_is_a_checkpoint_error(tmp_path, field):
    meta = {"attnlab.sha256": "{}", "attnlab.ties": "{}"}
    meta[field] = "[" * DEEP + "]" * DEEP
    path = _sealed(tmp_path / "m.safetensors", meta)
    with pytest.raises(CheckpointError, match=rf"{field} nests deeper than 1 levels"):
        load_checkpoint(path)


@pytest.mark.parametrize("body", ["[" * DEEP + "]" * DEEP, "[" * DEEP, '{"a": ' * DEEP])
def test_deeply_nested_json_files_are_a_checkpoint_error(tmp_path, body):
    path = tmp_path / "config.json"
    path.write_text(body)
    with pytest.raises(CheckpointError, match=r"the file nests deeper than 64 levels"):
        load_json(path)


def test_json_within_the_depth_limit_still_round_trips(tmp_path):
    data: object = "leaf"
    for _ in range(60):
        data = {"k": [data]}  # 121 levels of JSON
    shallow = {"shallow": [1, {"a": "[{"}], "n": 3}
    ckfiles.save_json(tmp_path / "ok.json", shallow)
    assert load_json(tmp_path / "ok.json") == shallow
    ckfiles.save_json(tmp_path / "deep.json", data)
    with pytest.raises(CheckpointError, match="nests deeper than 64"):
        load_json(tmp_path / "deep.json")


# -------------------------------------------------- item 3: devices, FIFOs, directories
def _finishes(fn, seconds: float = 10.0):
    """Runs ``fn`` in a daemon thread; returns its exception (a hung call fails the test)."""
    out: list[BaseException | None] = []

    def run():
        try:
            fn()
            out.append(None)
        except BaseException as e:  # handed to the test
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert out, f"still running after {seconds} s (blocked or reading without end)"
    return out[0]


@pytest.mark.parametrize("loader", [load_checkpoint, load_json, ckmod.read_safetensors])
def test_dev_zero_is_refused_before_any_read(loader):
    err = _finishes(lambda: loader("/dev/zero"))
    assert isinstance(err, CheckpointError)
    assert str(err) == "/dev/zero: refusing a character device: expected a regular file"


def test_a_symlink_to_a_device_is_refused(tmp_path):
    link = tmp_path / "model.safetensors"
    link.symlink_to("/dev/zero")
    err = _finishes(lambda: load_checkpoint(link))
    assert isinstance(err, CheckpointError) and "refusing a character device" in str(err)


@pytest.mark.parametrize("loader", [load_checkpoint, load_json])
def test_a_fifo_is_refused_without_blocking(tmp_path, loader):
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    err = _finishes(lambda: loader(fifo))
    assert isinstance(err, CheckpointError) and "refusing a FIFO (named pipe)" in str(err)


def test_a_fifo_swapped_in_after_the_stat_is_caught_by_fstat_without_blocking(
    tmp_path, monkeypatch
):
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    regular = os.stat(__file__)
    real_stat = os.stat
    monkeypatch.setattr(
        ckfiles.os, "stat", lambda p, *a, **k: regular if Path(p) == fifo else real_stat(p, *a, **k)
    )
    err = _finishes(lambda: load_checkpoint(fifo))  # open() must not wait for a writer
    assert isinstance(err, CheckpointError) and "refusing a FIFO (named pipe)" in str(err)


def test_a_directory_is_refused(tmp_path):
    d = tmp_path / "model.safetensors"
    d.mkdir()
    with pytest.raises(CheckpointError, match=r"model.safetensors: refusing a directory"):
        load_checkpoint(d)


def test_a_read_never_goes_past_the_size_fstat_reported(tmp_path, monkeypatch):
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, {"a": torch.ones(4)})
    size = path.stat().st_size
    real_fstat = os.fstat

    class Shrunk:  # fstat claims 10 bytes fewer: the reader must stop there
        def __init__(self, st):
            self.st_mode, self.st_size = st.st_mode, st.st_size - 10

    monkeypatch.setattr(ckfiles.os, "fstat", lambda fd: Shrunk(real_fstat(fd)))
    raw = ckfiles.read_regular_file(path)
    assert len(raw) == size - 10 and raw == path.read_bytes()[:-10]


# ------------------------------------------------------- item 4: stale temp files, umask
def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _temp(directory: Path, target: str, pid: int, age: float = 0.0, tag: str = "0a1b2c3d") -> Path:
    """A temp directory as a killed writer leaves it: our half file and safetensors' own."""
    d = directory / f".{target}.attnlab.{pid}.{tag}.tmp"
    d.mkdir()
    (d / target).write_bytes(b"partial")
    (d / ".tmpAbC123").write_bytes(b"partial, safetensors' own temp file")
    if age:
        t = time.time() - age
        for p in (d / target, d / ".tmpAbC123", d):
            os.utime(p, (t, t))
    return d


def test_stale_temp_files_of_our_naming_are_removed_by_the_next_save(tmp_path):
    dead, live = _dead_pid(), os.getpid()
    old = ckfiles.STALE_SECONDS + 60
    removed = [
        _temp(tmp_path, "ckpt.safetensors", dead),  # writer gone
        _temp(tmp_path, "other.safetensors", dead, tag="11111111"),  # another target, same dir
        _temp(tmp_path, "ckpt.safetensors", live, age=old, tag="22222222"),  # pid reused, old
    ]
    legacy_old = tmp_path / ".ckpt.safetensors.ab_cd12x.tmp"  # mkstemp naming, before pids
    legacy_old.write_bytes(b"x")
    os.utime(legacy_old, (time.time() - old, time.time() - old))
    removed.append(legacy_old)
    kept = [
        _temp(tmp_path, "ckpt.safetensors", live, tag="33333333"),  # live pid, young: a writer
        tmp_path / ".ckpt.safetensors.abcd1234.tmp",  # legacy but young
        tmp_path / ".notes.tmp",  # not our naming
        tmp_path / ".ckpt.safetensors.123.abcd1234.tmp",  # no attnlab mark
        tmp_path / "ckpt.safetensors.attnlab.1.0a1b2c3d.tmp",  # no leading dot
        tmp_path / ".ckpt.safetensors.attnlab.1.4a1b2c3d.tmp",  # our naming but a plain file
    ]
    victim = tmp_path / "victim"  # a symlink of our naming: neither it nor its target is touched
    victim.mkdir()
    (victim / "keep").write_bytes(b"x")
    link = tmp_path / f".ckpt.safetensors.attnlab.{dead}.5a1b2c3d.tmp"
    link.symlink_to(victim, target_is_directory=True)
    kept += [victim, link]
    for i, p in enumerate(kept[1:-2]):
        p.write_bytes(b"x")
        if i:  # files not of our naming stay, however old
            os.utime(p, (time.time() - old, time.time() - old))
    save_checkpoint(tmp_path / "ckpt.safetensors", {"a": torch.ones(2)})
    names = {p.name for p in tmp_path.iterdir()}
    assert not names & {p.name for p in removed}
    assert names == {p.name for p in kept} | {"ckpt.safetensors"}
    assert (victim / "keep").read_bytes() == b"x"


_STALLED_WRITER = textwrap.dedent(
    """
    import os, sys, time, torch, safetensors.torch
    from attnlab.checkpoint import save_checkpoint

    def stalling_save_file(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half a file")
        print("STALLED", flush=True)
        time.sleep(120)

    safetensors.torch.save_file = stalling_save_file
    save_checkpoint(sys.argv[1], {"a": torch.ones(3)})
    """
)


def test_a_live_writers_temp_file_is_never_removed_and_a_killed_ones_is(tmp_path):
    target = tmp_path / "ckpt.safetensors"
    child = subprocess.Popen(
        [sys.executable, "-c", _STALLED_WRITER, str(target)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "STALLED"
        (tmp,) = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
        assert tmp.name.startswith(f".ckpt.safetensors.attnlab.{child.pid}.") and tmp.is_dir()
        old = time.time() - ckfiles.STALE_SECONDS - 60
        for p in (tmp / "ckpt.safetensors", tmp):
            os.utime(p, (old, old))  # even old: the writer holds its lock
        save_checkpoint(target, {"a": torch.zeros(3)})
        assert (tmp / "ckpt.safetensors").read_bytes() == b"half a file"
        child.kill()  # kill -9
        child.wait(timeout=30)
        assert tmp.exists()  # nothing cleaned up after the killed writer ...
        save_checkpoint(target, {"a": torch.full((3,), 2.0)})
        assert not tmp.exists()  # ... until the next save into the directory
    finally:
        child.kill()
        child.wait(timeout=30)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.safetensors"]
    assert torch.equal(load_checkpoint(target).tensors["a"], torch.full((3,), 2.0))


def test_an_unlocked_young_temp_file_of_a_live_pid_is_kept(tmp_path):
    # The window between creating a temp file and locking it: the pid is alive, the file new.
    p = _temp(tmp_path, "x.safetensors", os.getpid())
    assert ckfiles.remove_stale_temps(tmp_path, "x.safetensors") == []
    assert (p / "x.safetensors").exists()
    dead = _temp(tmp_path, "x.safetensors", _dead_pid(), tag="ffffffff")
    assert ckfiles.remove_stale_temps(tmp_path, "x.safetensors") == [dead.name]


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002, 0o027])
def test_outputs_respect_the_umask(tmp_path, umask):
    previous = os.umask(umask)
    try:
        save_checkpoint(tmp_path / "c.safetensors", {"a": torch.ones(2)})
        ckfiles.save_json(tmp_path / "c.json", {"a": 1})
    finally:
        os.umask(previous)
    for name in ("c.safetensors", "c.json"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~umask, name
    assert load_json(tmp_path / "c.json") == {"a": 1}


_SAVER = textwrap.dedent(
    """
    import sys, torch
    from attnlab.checkpoint import save_checkpoint
    print("READY", flush=True)
    for i in range(40):
        save_checkpoint(sys.argv[1], {"a": torch.full((1000,), float(i))})
    print("OK", flush=True)
    """
)


@pytest.mark.slow  # three interpreters importing torch
def test_concurrent_savers_in_one_directory_never_remove_each_others_temp_files(tmp_path):
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _SAVER, str(tmp_path / f"c{k}.safetensors")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for k in range(2)
    ]
    try:
        assert [c.stdout.readline() for c in children] == ["READY\n"] * 2
        for i in range(40):  # this process sweeps the directory on every save, too
            save_checkpoint(tmp_path / "p.safetensors", {"a": torch.full((1000,), float(i))})
        outs = [c.communicate(timeout=120) for c in children]
    finally:
        for c in children:
            c.kill()
            c.wait(timeout=30)
    codes = [(c.returncode, out) for c, (out, _) in zip(children, outs, strict=True)]
    assert codes == [(0, "OK\n")] * 2, outs
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "c0.safetensors",
        "c1.safetensors",
        "p.safetensors",
    ]
    for name in ("c0", "c1", "p"):
        assert torch.equal(
            load_checkpoint(tmp_path / f"{name}.safetensors").tensors["a"],
            torch.full((1000,), 39.0),
        )
