"""Every ```python block of README.md and of the user guide (docs/guide/*.md) runs in a fresh
interpreter; so do their attnlab commands.

A Python block runs by itself in a fresh subprocess; a block whose fence is preceded by the line
``<!-- continues -->`` runs after its predecessor in the same interpreter (the chain is one run).
Blocks made of ``>>>`` examples are checked with doctest, also in a fresh subprocess. Shell
commands in ```bash blocks that call ``attnlab`` run in a temporary directory with small
overrides (listed in ``OVERRIDES``) in the default suite and verbatim under ``-m slow``; every
other shell command must be listed in ``EXEMPT`` with the reason it does not run here.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: The pages whose code blocks run: the README and every page of the user guide.
PAGES = [README, *sorted((ROOT / "docs" / "guide").glob("*.md"))]
CONTINUES = "<!-- continues -->"

#: Shell commands that do not run inside the test suite, by the start of the command (after
#: ``.venv/bin/`` is dropped), with the reason.
EXEMPT = {
    "python3 -m venv": "creates the virtual environment the suite itself runs in",
    "pip install": "installs the package (network, minutes); the suite runs on the installed one",
    "{ bash scripts/install_browser.sh": "installs Debian's Chromium with apt (root, network)",
    "ruff check": "the lint step of .ci/run, which runs before the suite",
    "ruff format --check": "the format step of .ci/run, which runs before the suite",
    "python -m pytest": "the test suite itself (it would run this file again)",
    "python -m build": "builds the sdist and wheel (minutes); tests/test_wheel.py does it (slow)",
    "torchrun": "needs two machines; its train.py block runs here on 2 local ranks (LAUNCH)",
}

#: Small settings for the default suite, by the README command; the slow test runs it verbatim.
#: Each value replaces the command's arguments after ``attnlab``.
OVERRIDES = {
    "attnlab bench --case window --dtype float32 --quiet": (
        "bench --case window --dtype float32 --quiet --quick --no-flex --no-backward --repeats 1"
    ),
    "attnlab train --out runs/alice": (
        "train --out runs/alice --steps 4 --batch-size 2 --seq-len 16 --d-model 16 --n-layers 1"
        " --n-heads 2 --eval-interval 2 --eval-batches 1 --save-interval 2 --warmup 1 --quiet"
    ),
}

#: Python blocks that are scripts for a launcher, by their first line: the block is written to
#: the named file and run with the launcher (here two local processes instead of two machines).
LAUNCH = {
    "# train.py": ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "train.py"],
}

#: What a run's output must contain, by a line of its code (the claims the block's comments make).
EXPECTED_STDOUT = {
    "print(attnlab.explain(": ["auto picked"],
    'tokens, w = m.attentions("The cat sat.")': [
        "['[CLS]', 'the', 'cat', 'sat', '.', '[SEP]'] (6, 12, 6, 6)"
    ],
}


@dataclass
class Block:
    """One fenced code block of a page: its index among the page's fences, language and text."""

    index: int
    lang: str
    text: str
    line: int
    continues: bool
    page: str = "README.md"

    @property
    def where(self) -> str:
        return f"{self.page} line {self.line}"

    @property
    def first_line(self) -> str:
        return next((s for s in self.text.splitlines() if s.strip()), "").strip()


def readme_blocks(text: str | None = None, page: Path = README) -> list[Block]:
    """Every fenced block of ``text`` (default: the file ``page``), in order."""
    lines = (page.read_text(encoding="utf-8") if text is None else text).splitlines()
    name = str(page.relative_to(ROOT))
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start = i
        i += 1
        body = []
        while i < len(lines) and lines[i].rstrip() != "```":
            body.append(lines[i])
            i += 1
        prev = next((s.strip() for s in reversed(lines[:start]) if s.strip()), "")
        blocks.append(
            Block(
                len(blocks), m.group(1), "\n".join(body) + "\n", start + 1, prev == CONTINUES, name
            )
        )
        i += 1
    return blocks


BLOCKS = [block for page in PAGES for block in readme_blocks(page=page)]


def python_chains(blocks: list[Block]) -> list[list[Block]]:
    """The Python blocks grouped into runs: a block and the continuations that follow it."""
    chains: list[list[Block]] = []
    for b in blocks:
        if b.lang != "python":
            continue
        if b.continues:
            assert chains and chains[-1][0].page == b.page, (
                f"{b.where}: a continuation with no Python block before it"
            )
            chains[-1].append(b)
        else:
            chains.append([b])
    return chains


def is_doctest(block: Block) -> bool:
    return block.first_line.startswith(">>>")


def shell_commands(block: Block) -> list[list[str]]:
    """The commands of a bash block: lines joined at ``\\``, comments dropped, split at ``&&``."""
    commands: list[list[str]] = []
    for line in block.text.replace("\\\n", " ").splitlines():
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        current: list[str] = []
        depth = 0
        for tok in lex:
            depth += tok == "{"
            depth -= tok == "}"
            if tok == "&&" and depth == 0:
                commands.append(current)
                current = []
                continue
            if not current and tok.startswith(".venv/bin/"):
                tok = tok.removeprefix(".venv/bin/")
            current.append(tok)
        if current:
            commands.append(current)
    return commands


def exemption(command: list[str]) -> str | None:
    text = " ".join(command)
    return next((k for k in EXEMPT if text == k or text.startswith(k + " ")), None)


CHAINS = python_chains(BLOCKS)
SHELL = [b for b in BLOCKS if b.lang == "bash"]
RUNNABLE = [b for b in SHELL if any(exemption(c) is None for c in shell_commands(b))]


def block_id(block: Block) -> str:
    page = Path(block.page).stem
    return f"{page}-block{block.index}-" + re.sub(r"[^\w.=-]+", "_", block.first_line)[:40]


def run(args: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """Runs ``python ARGS`` in a fresh interpreter that imports the attnlab under test."""
    import attnlab

    src = str(Path(attnlab.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, MPLBACKEND="Agg")
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_readme_blocks_are_found_and_every_python_run_is_self_contained():
    """The parser sees every page's blocks; a run never starts with a continuation mark."""
    assert len(PAGES) >= 10, PAGES
    assert sum(b.lang == "python" for b in BLOCKS) >= 15
    assert len(SHELL) >= 6
    assert all(not chain[0].continues for chain in CHAINS)
    assert all(not is_doctest(b) for chain in CHAINS for b in chain[1:])
    assert {b.lang for b in BLOCKS} <= {"python", "bash", ""}
    for page in PAGES:  # a fence must open its line, or the block silently never runs
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            assert "```" not in line or line.startswith("```"), f"{page.name} line {n}: {line!r}"
    codes = ["".join(b.text for b in chain) for chain in CHAINS]
    for key in EXPECTED_STDOUT:
        assert sum(key in code for code in codes) >= 1, key
    for key in LAUNCH:
        assert sum(chain[0].first_line == key for chain in CHAINS) == 1, key


def test_a_continuation_runs_after_its_predecessor():
    text = (
        "```python\nx = 1\n```\n\n```bash\nattnlab check\n```\n<!-- continues -->\n"
        "```python\nprint(x)\n```\n\n```python\n>>> 1 + 1\n2\n```\n"
    )
    blocks = readme_blocks(text)
    assert [(b.lang, b.continues) for b in blocks] == [
        ("python", False),
        ("bash", False),
        ("python", True),
        ("python", False),
    ]
    chains = python_chains(blocks)
    assert [[b.text for b in c] for c in chains] == [["x = 1\n", "print(x)\n"], [">>> 1 + 1\n2\n"]]
    assert is_doctest(chains[1][0]) and not is_doctest(chains[0][0])


DOCTEST = (
    "import doctest, sys\n"
    "r = doctest.testfile(sys.argv[1], module_relative=False)\n"
    "sys.exit(1 if r.failed or not r.attempted else 0)\n"
)


@pytest.mark.parametrize("chain", CHAINS, ids=[block_id(c[0]) for c in CHAINS])
def test_python_block_runs_in_a_fresh_interpreter(chain: list[Block], tmp_path: Path):
    first = chain[0]
    code = "".join(b.text for b in chain)
    if is_doctest(first):
        (tmp_path / "block.txt").write_text(code, encoding="utf-8")
        args = ["-c", DOCTEST, "block.txt"]
    elif first.first_line in LAUNCH:
        args = LAUNCH[first.first_line]
        (tmp_path / args[-1]).write_text(code, encoding="utf-8")
    else:
        (tmp_path / "block.py").write_text(code, encoding="utf-8")
        args = ["block.py"]
    r = run(args, tmp_path)
    assert r.returncode == 0, f"{first.where}:\n{r.stdout}\n{r.stderr}"
    for expected in (e for key, lst in EXPECTED_STDOUT.items() if key in code for e in lst):
        assert expected in r.stdout, f"{first.where}: {expected!r} not in {r.stdout!r}"


def test_every_shell_command_runs_or_is_exempt_with_a_reason():
    """No README command is silently skipped, and no exemption or override is stale."""
    used_exempt, used_override = set(), set()
    for block in SHELL:
        for command in shell_commands(block):
            key = exemption(command)
            text = " ".join(command)
            if key is not None:
                used_exempt.add(key)
            else:
                assert command[0] == "attnlab", f"{block.where}: {text!r} needs EXEMPT"
                used_override.add(text)
    assert used_exempt == set(EXEMPT), set(EXEMPT) - used_exempt
    assert set(OVERRIDES) <= used_override, set(OVERRIDES) - used_override
    assert all(reason.strip() for reason in EXEMPT.values())


def check_outputs(text: str, r: subprocess.CompletedProcess, cwd: Path) -> None:
    """The claims the README makes about a command's output files and text."""
    if text.startswith("attnlab visualize"):
        page = (cwd / "attention.html").read_text(encoding="utf-8")
        assert "animal" in page and "tired" in page
    elif text.startswith("attnlab train") and "--resume" in text:
        assert "resumed from runs/alice/ckpt.safetensors" in r.stdout
    elif text.startswith("attnlab train"):
        assert (cwd / "runs/alice/ckpt.safetensors").stat().st_size > 0
        assert (cwd / "runs/alice/loss.png").read_bytes().startswith(b"\x89PNG")
    elif text.startswith("attnlab generate"):
        assert r.stdout.startswith("Alice ") and len(r.stdout) > len("Alice ") + 50


def run_shell_block(block: Block, tmp_path: Path, *, verbatim: bool) -> list[str]:
    """Runs the block's attnlab commands in order in ``tmp_path``; returns their outputs."""
    outputs = []
    for command in shell_commands(block):
        if exemption(command) is not None:
            continue
        text = " ".join(command)
        args = (
            command[1:] if verbatim else shlex.split(OVERRIDES.get(text, shlex.join(command[1:])))
        )
        r = run(["-m", "attnlab.cli", *args], tmp_path, timeout=3600 if verbatim else 600)
        assert r.returncode == 0, f"{block.where}: {text}\n{r.stdout}\n{r.stderr}"
        assert "Traceback" not in r.stderr
        check_outputs(text, r, tmp_path)
        outputs.append(r.stdout)
    return outputs


#: The last line of ``attnlab train``: final validation loss and the text's unigram entropy.
DONE = re.compile(r"^done: step \d+, val loss ([\d.]+) nats/char vs unigram entropy ([\d.]+)", re.M)


def trains(block: Block) -> bool:
    return any(c[:2] == ["attnlab", "train"] for c in shell_commands(block))


@pytest.mark.parametrize("block", RUNNABLE, ids=[block_id(b) for b in RUNNABLE])
def test_shell_block_runs_with_small_settings(block: Block, tmp_path: Path):
    outputs = run_shell_block(block, tmp_path, verbatim=False)
    # the slow test reads the final loss from this line: it must still be printed
    assert not trains(block) or any(DONE.search(out) for out in outputs)


@pytest.mark.slow
@pytest.mark.parametrize("block", RUNNABLE, ids=[block_id(b) for b in RUNNABLE])
def test_shell_block_runs_verbatim(block: Block, tmp_path: Path):
    """The README's commands as written; the default training ends far below unigram entropy."""
    outputs = run_shell_block(block, tmp_path, verbatim=True)
    found = [m for out in outputs for m in DONE.finditer(out)]
    assert found or not trains(block)
    for m in found:
        assert float(m.group(1)) < 0.6 * float(m.group(2)), m.group(0)  # measured: 0.50


def test_the_readme_test_command_is_what_ci_runs():
    """The commands exempted as "CI's steps" really are CI's: .ci/run runs the README's command."""
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    tests = [b for b in SHELL if any(exemption(c) == "python -m pytest" for c in shell_commands(b))]
    assert len(tests) == 1 and tests[0].page == "README.md"
    assert tests[0].text.strip() in ci


def test_the_first_screen_has_a_running_snippet_for_each_job():
    """The README is a front door: short, and its first screen holds the three quickstarts (your
    model, a transformers model, the viewer) as Python blocks that run (the tests above)."""
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, len(lines)
    first = [b for b in BLOCKS if b.page == "README.md" and b.lang == "python"][:3]
    jobs = ["attnlab.attention(", 'attn_implementation="attnlab"', "attnlab.show("]
    for block, job in zip(first, jobs, strict=True):
        assert job in block.text, (job, block.where)
        assert block.line + block.text.count("\n") <= 75, f"{block.where}: below the first screen"
