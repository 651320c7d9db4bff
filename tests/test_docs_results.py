"""docs/results: one page per benchmark, reachable, with commands a reader can still type.

benchmarks/RESULTS.md is a short pointer to the pages. Each page has one section per CPU kind,
headed by the date, the torch version and the machine's matmul rate; every command quoted on a
page names a script or `attnlab` subcommand that exists and only options its parser defines;
every benchmark script has a page that names it. The pages, the pointer, the benchmarks' text and
docs/reliability.md say what was measured, not when in the project's history it was.
"""

from __future__ import annotations

import argparse
import ast
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = ROOT / "docs" / "results"
POINTER = ROOT / "benchmarks" / "RESULTS.md"
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
CODE = re.compile(r"`([^`]+)`")
HISTORY = re.compile(r"(?i)\bsessions?\b|\bissues?\s*#?\s*\d|(?<![\w&/])#\d+\b")
CPU_KIND = re.compile(r"^## ((?:AMD EPYC|Intel Xeon).*)$", re.M)


def _pages() -> list[Path]:
    return sorted(PAGES.glob("*.md"))


def _links(path: Path) -> list[Path]:
    text = path.read_text(encoding="utf-8")
    return [
        (path.parent / target).resolve()
        for target in LINK.findall(text)
        if "://" not in target and not target.startswith("mailto:")
    ]


def test_results_md_is_a_pointer_to_the_pages():
    text = POINTER.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 60, "benchmarks/RESULTS.md is a pointer, not the results"
    links = _links(POINTER)
    assert (PAGES / "index.md").resolve() in links
    for target in links:
        assert target.is_file(), f"benchmarks/RESULTS.md links to {target}, which does not exist"


def test_every_page_is_reachable_from_the_index_and_every_link_resolves():
    pages = _pages()
    assert len(pages) >= 10
    from_index = set(_links(PAGES / "index.md"))
    for page in pages:
        if page.name != "index.md":
            assert page.resolve() in from_index, f"docs/results/index.md does not link {page.name}"
        text = page.read_text(encoding="utf-8")
        assert len(re.findall(r"^# ", text, re.M)) == 1, f"{page.name}: one `#` title"
        for target in _links(page):
            assert target.is_file(), f"{page.name} links to {target}, which does not exist"


def test_every_cpu_kind_section_says_when_what_and_against_which_rate():
    pages = [page for page in _pages() if page.name != "index.md"]
    assert pages, "docs/results has no benchmark pages"
    for page in pages:
        text = page.read_text(encoding="utf-8")
        starts = [m.start() for m in CPU_KIND.finditer(text)]
        assert starts, f"{page.name}: no section per CPU kind"
        for start, end in zip(starts, [*starts[1:], len(text)], strict=True):
            section = text[start:end]
            title = section.splitlines()[0]
            for needed in ("Date", "torch 2.", "matmul"):
                assert needed in section, f"{page.name}, {title}: no {needed!r}"
            assert re.search(r"20\d\d-\d\d-\d\d", section), f"{page.name}, {title}: no date"


def test_no_history_words_in_the_pages_the_pointer_and_the_benchmarks():
    texts = [*_pages(), POINTER, ROOT / "docs" / "reliability.md"]
    texts += sorted((ROOT / "benchmarks").glob("*.py"))
    for path in texts:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            found = HISTORY.search(line)
            assert found is None, f"{path.relative_to(ROOT)}:{number}: {found[0]!r} in {line!r}"


def _script_options(path: Path) -> set[str]:
    """The ``--options`` a script's ``add_argument`` calls define (string literals)."""
    options = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            for arg in node.args:
                if isinstance(arg, ast.Constant) and str(arg.value).startswith("-"):
                    options.add(arg.value)
    return options | {"-h", "--help"}


def _parser_options(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


def _cli_options(words: list[str]) -> tuple[set[str], list[str]]:
    """The options of the ``attnlab`` subcommand ``words`` start with, and the words after it."""
    from attnlab.cli import build_parser

    parser = build_parser()
    while words:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or words[0] not in subs[0].choices:
            break
        parser = subs[0].choices[words[0]]
        words = words[1:]
    return _parser_options(parser), words


def _commands() -> list[tuple[str, str]]:
    found = []
    for page in [*_pages(), POINTER]:
        for code in CODE.findall(page.read_text(encoding="utf-8")):
            words = code.split()
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value prefixes
                words = words[1:]
            text = " ".join(words)
            if re.match(r"(python benchmarks/|python -m attnlab\.|attnlab [a-z]|torchrun )", text):
                found.append((page.name, text))
    return found


def test_quoted_commands_exist_with_these_options():
    commands = _commands()
    assert len(commands) >= 30
    bench = _cli_options(["bench"])[0]
    for page, command in commands:
        words = shlex.split(command.replace("$", ""))
        if words[0] == "torchrun":
            words = words[words.index("-m") + 1 :]
        if words[:2] == ["python", "-m"]:
            module = ROOT / "src" / (words[2].replace(".", "/") + ".py")
            assert module.is_file(), f"{page}: `{command}`: no module {words[2]}"
            options, rest = _script_options(module), words[3:]
        elif words[0] == "python":
            script = ROOT / words[1]
            assert script.is_file(), f"{page}: `{command}`: no script {words[1]}"
            options = bench if script.name == "bench_flash.py" else _script_options(script)
            rest = words[2:]
        else:
            assert words[0] == "attnlab", f"{page}: `{command}`"
            options, rest = _cli_options(words[1:])
        for word in rest:
            if word.startswith("-") and not re.fullmatch(r"-\d.*", word):
                option = word.split("=")[0]
                assert option in options, f"{page}: `{command}`: {option} is not an option"


SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name.startswith("bench_"))


@pytest.mark.parametrize("script", [*SCRIPTS, "call_path.py"])
def test_every_benchmark_script_has_a_results_page(script):
    text = "\n".join(p.read_text(encoding="utf-8") for p in _pages())
    assert script in text, f"no page of docs/results names benchmarks/{script}"
