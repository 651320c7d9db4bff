"""End to end: the attention viewer in headless Chromium (system chromium + chromedriver).

The page written by ``attnlab visualize`` (the real all-MiniLM-L6-v2) is opened from disk; the
test clicks a model-view thumbnail and a token, hovers, presses Esc, and checks that the drawn
lines (their set, weights and opacities) and the selection attributes follow; that the browser
logged no errors; and saves a screenshot under tests/artifacts/.

Chromium comes from Debian (``scripts/install_browser.sh``, which `.ci/run` calls); the test
runs that script itself if the browser is missing and skips only if it cannot install it.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch

from attnlab.cli import visualize as vis
from attnlab.viz.attention_view import save_attention_html

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "tests" / "artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--window-size=1500,1000",
]

selenium = pytest.importorskip(
    "selenium", reason="selenium is part of the dev extra: pip install -e '.[dev]'"
)
from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


def _have_browser() -> bool:
    return os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)


@pytest.fixture(scope="module")
def driver():
    if not _have_browser():
        proc = subprocess.run(
            ["bash", str(ROOT / "scripts" / "install_browser.sh")],
            capture_output=True,
            text=True,
            timeout=1200,
            check=False,
        )
        if not _have_browser():
            pytest.skip(
                "Chromium could not be installed (scripts/install_browser.sh exited "
                f"{proc.returncode}: {(proc.stderr or proc.stdout).strip()[-400:]})"
            )
    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager must never download
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="attnlab-chromium-")
    for flag in [*FLAGS, f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield d
    finally:
        d.quit()


@pytest.fixture(scope="module")
def minilm_page():
    """``attnlab visualize`` on the default text with the real encoder, written to artifacts."""
    try:
        import attnlab.models.minilm  # noqa: F401
    except ImportError as e:
        pytest.skip(f"the pretrained encoder is not installed ({e})")
    import argparse

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    out = ARTIFACTS / "visualize_minilm.html"
    parser = argparse.ArgumentParser(prog="attnlab")
    vis.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["visualize", "--out", str(out)])
    assert args.func(args) == 0
    return out


def open_page(driver, path: Path) -> dict:
    driver.get(path.as_uri())
    WebDriverWait(driver, 15).until(
        lambda d: (
            d.find_element(By.CSS_SELECTOR, ".attnlab-viewer").get_attribute("data-ready") == "1"
        )
    )
    return driver.execute_script(
        "return JSON.parse(document.querySelector('[data-role=attnlab-data]').textContent)"
    )


def role(name: str) -> str:
    """The CSS selector of a viewer element by its data-role (ids are per viewer)."""
    return f'[data-role="{name}"]'


def by_role(driver, name: str):
    return driver.find_element(By.CSS_SELECTOR, role(name))


def drawn(driver, within: str = "") -> list[tuple[int, int, float, float]]:
    """``(query, key, weight, stroke-opacity)`` of every line in the head view (of the viewer
    matched by the CSS selector ``within``, default the page's only one)."""
    rows = driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map(l => [l.getAttribute('data-q'),"
        " l.getAttribute('data-k'), l.getAttribute('data-w'), l.getAttribute('stroke-opacity')])",
        f"{within} [data-role=lines] line".strip(),
    )
    return [(int(q), int(k), float(w), float(o)) for q, k, w, o in rows]


def view(driver) -> dict[str, str]:
    svg = by_role(driver, "head-view")
    return {a: svg.get_attribute(f"data-{a}") for a in ("layer", "head", "token", "focus")}


def expected_lines(data: dict, layer: int, head: int, query: int | None = None) -> set:
    """What the head view must draw: weights >= min_line, from real query tokens."""
    out = set()
    for i in range(data["T"]) if query is None else [query]:
        if not data["mask"][i]:
            continue
        if data["mode"] == "full":
            row = list(enumerate(data["weights"][layer][head][i]))
        else:
            row = list(
                zip(data["top_idx"][layer][head][i], data["top_val"][layer][head][i], strict=True)
            )
        out |= {(i, j, w) for j, w in row if w >= data["min_line"]}
    return out


def errors(driver) -> list[dict]:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def test_viewer_follows_clicks_and_hovers_without_console_errors(driver, minilm_page):
    data = open_page(driver, minilm_page)
    tokens = data["tokens"]
    assert view(driver) == {"layer": "0", "head": "0", "token": "-1", "focus": ""}
    before = drawn(driver)
    assert {(q, k, w) for q, k, w, _ in before} == expected_lines(data, 0, 0)
    assert all(abs(o - 0.85 * w) < 1e-3 for _, _, w, o in before)

    # Click the thumbnail of the head where "it" attends most to "animal".
    it, animal = tokens.index("it"), tokens.index("animal")
    w = torch.tensor(data["weights"])  # (layers, heads, T, T)
    order = torch.argsort(w[:, :, it, animal].flatten(), descending=True).tolist()
    layer, head = divmod(next(n for n in order if n != 0), data["heads"])
    thumb = driver.find_element(
        By.CSS_SELECTOR, f'{role("model-view")} .thumb[data-layer="{layer}"][data-head="{head}"]'
    )
    thumb.click()
    assert view(driver)["layer"] == str(layer) and view(driver)["head"] == str(head)
    assert "selected" in thumb.get_attribute("class")
    assert by_role(driver, "layer-select").get_attribute("value") == str(layer)
    assert by_role(driver, "head-select").get_attribute("value") == str(head)
    after = drawn(driver)
    assert {(q, k, w) for q, k, w, _ in after} == expected_lines(data, layer, head)
    assert after != before
    info = by_role(driver, "selection-info").text
    assert f"Layer {layer}, head {head}" in info and f"{data['entropy'][layer][head]:.3f}" in info

    # Click the query token "it": only its row is drawn, at full opacity, and its top weights
    # are listed largest first.
    driver.find_element(By.CSS_SELECTOR, f'{role("head-view")} g.tok.q[data-i="{it}"]').click()
    assert view(driver)["token"] == str(it)
    pinned = drawn(driver)
    assert {(q, k, w) for q, k, w, _ in pinned} == expected_lines(data, layer, head, it)
    assert all(q == it and abs(o - w) < 1e-3 for q, _, w, o in pinned)
    row = data["weights"][layer][head][it]
    listed = driver.find_elements(By.CSS_SELECTOR, f"{role('top-weights')} li")
    best = sorted(range(len(row)), key=lambda j: (-row[j], j))[: len(listed)]
    assert [int(li.get_attribute("data-index")) for li in listed] == best
    shown = [float(li.get_attribute("data-w")) for li in listed]
    assert shown == sorted(shown, reverse=True) and len(listed) == min(8, len(pinned))
    details = by_role(driver, "details").text
    assert "“it” (#" in details and f"{row[best[0]]:.3f}" in details

    # Hovering another token shows its row; leaving it returns to the pinned token.
    other = driver.find_element(By.CSS_SELECTOR, f'{role("head-view")} g.tok.q[data-i="1"]')
    ActionChains(driver).move_to_element(other).perform()
    assert view(driver)["focus"] == "q1"
    assert {q for q, *_ in drawn(driver)} == {1}
    ActionChains(driver).move_to_element(by_role(driver, "title")).perform()
    assert view(driver)["focus"] == f"q{it}" and {q for q, *_ in drawn(driver)} == {it}

    # Hovering a key token draws the attention it receives.
    key = driver.find_element(By.CSS_SELECTOR, f'{role("head-view")} g.tok.k[data-i="{animal}"]')
    ActionChains(driver).move_to_element(key).perform()
    assert view(driver)["focus"] == f"k{animal}"
    assert {k for _, k, *_ in drawn(driver)} == {animal}

    # Esc unpins; pin "it" again for the screenshot.
    ActionChains(driver).move_to_element(by_role(driver, "title")).perform()
    ActionChains(driver).send_keys(Keys.ESCAPE).perform()
    assert view(driver)["token"] == "-1"
    assert {(q, k, w) for q, k, w, _ in drawn(driver)} == expected_lines(data, layer, head)
    driver.find_element(By.CSS_SELECTOR, f'{role("head-view")} g.tok.q[data-i="{it}"]').click()
    driver.execute_script("window.scrollTo(0, 0)")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "visualize_minilm.png"
    assert driver.save_screenshot(str(shot))
    print(f"\nscreenshot: {shot}")
    assert shot.stat().st_size > 20_000
    assert errors(driver) == []


def test_long_input_page_stays_responsive(driver, tmp_path):
    T, k = 300, 8
    g = torch.Generator().manual_seed(0)
    w = torch.softmax(torch.randn(2, 4, T, T, generator=g) * 3, dim=-1)
    tokens = [f"tok{i}" for i in range(T)]
    path = save_attention_html(tokens, w, tmp_path / "long.html", title="long", topk=k)
    start = time.perf_counter()
    data = open_page(driver, path)
    load_seconds = time.perf_counter() - start
    assert data["mode"] == "topk"
    notes = by_role(driver, "notes").text
    assert f"Long input ({T} tokens > 64)" in notes and f"top {k}" in notes
    first = {(q, k_, w_) for q, k_, w_, _ in drawn(driver)}
    assert first == expected_lines(data, 0, 0) and len(first) <= T * k
    thumb = f'{role("model-view")} .thumb[data-layer="1"][data-head="3"]'
    driver.find_element(By.CSS_SELECTOR, thumb).click()
    assert view(driver)["head"] == "3"
    ms = driver.execute_script(
        "const g = document.querySelector('[data-role=head-view] g.tok.q[data-i=\"150\"]');"
        "const t = performance.now(); g.dispatchEvent(new MouseEvent('mouseenter'));"
        "return performance.now() - t;"
    )
    lines = drawn(driver)
    assert {(q, k_, w_) for q, k_, w_, _ in lines} == expected_lines(data, 1, 3, 150)
    assert 0 < len(lines) <= k
    print(
        f"\nlong page: {path.stat().st_size / 1e6:.1f} MB, load {load_seconds:.2f} s, "
        f"hover {ms:.1f} ms"
    )
    assert ms < 1000 and load_seconds < 15
    assert errors(driver) == []
    json.dumps(data)  # the page's data round-trips


def test_hostile_text_renders_as_text(driver, tmp_path):
    """Tokens and a title that spell the page's placeholders or HTML render as plain text."""
    tokens = ["__JS__", "__DATA__", "__CSS__", "__TITLE__", "</script><b>x</b>", "<img src=x>"]
    title = "t __JS__ __DATA__ </title><script>window.pwned=1</script>"
    g = torch.Generator().manual_seed(0)
    w = torch.softmax(torch.randn(1, 2, len(tokens), len(tokens), generator=g), dim=-1)
    path = save_attention_html(tokens, w, tmp_path / "hostile.html", title=title)
    data = open_page(driver, path)
    assert driver.title == title
    assert driver.execute_script("return window.pwned === undefined")
    assert data["title"] == title and len(data["tokens"]) == len(tokens)
    assert driver.find_elements(By.TAG_NAME, "img") == []
    assert driver.execute_script("return document.querySelectorAll('script').length") == 2
    # the viewer's code and data are in the page once (not pulled into the title or a token)
    source = driver.execute_script("return document.documentElement.outerHTML")
    assert source.count('"use strict"') == 1
    assert source.count('data-role="attnlab-data"') == 1
    assert errors(driver) == []
