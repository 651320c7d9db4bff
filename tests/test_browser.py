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
import math
import time
from pathlib import Path

import pytest
import torch

import chromium
from attnlab.cli import visualize as vis
from attnlab.viz.attention_view import save_attention_html

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "tests" / "artifacts"
selenium = pytest.importorskip(
    "selenium", reason="selenium is part of the dev extra: pip install -e '.[dev]'"
)
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture(scope="module")
def driver():
    yield from chromium.driver("attnlab-chromium-", window=(1500, 1000))


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


# ------------------------------------------------------------------- notebooks: many viewers
def block_lines(data: dict, layer: int, head: int, pair: str) -> set:
    """`expected_lines` kept to a sentence-pair block: "AB" = queries in A, keys in B."""
    sb = data["sentence_b_start"]
    side = lambda i: "A" if i < sb else "B"  # noqa: E731
    return {
        (q, k, w)
        for q, k, w in expected_lines(data, layer, head)
        if pair == "all" or side(q) + side(k) == pair
    }


def notebook_page(path: Path, *fragments: str) -> Path:
    """A page like a notebook's: its own heading and text around the viewers' fragments. The
    last fragment is inserted the way JupyterLab does it: innerHTML (scripts inert), then each
    script replaced by a fresh copy so that it runs."""
    *static, dynamic = fragments
    body = "\n<p>a markdown cell</p>\n".join(static)
    later = json.dumps(dynamic).replace("<", "\\u003c")  # inert inside <script>
    path.write_text(
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>notebook</title></head>\n'
        f'<body><h1 id="nb-title">Notebook</h1>\n{body}\n<div id="output"></div>\n'
        f'<script type="application/json" id="later">{later}'
        "</script>\n<script>\n"
        "const out = document.getElementById('output');\n"
        "out.innerHTML = JSON.parse(document.getElementById('later').textContent);\n"
        "for (const old of out.querySelectorAll('script')) {\n"
        "  const s = document.createElement('script');\n"
        "  for (const a of old.attributes) s.setAttribute(a.name, a.value);\n"
        "  s.textContent = old.textContent;\n"
        "  old.replaceWith(s);\n"
        "}\n</script></body></html>\n",
        encoding="utf-8",
    )
    return path


def open_viewers(driver, path: Path, n: int) -> list[tuple[str, dict]]:
    """Opens a page with ``n`` viewers; returns ``(root selector, data)`` of each, in order."""
    driver.get(path.as_uri())
    WebDriverWait(driver, 15).until(
        lambda d: len(d.find_elements(By.CSS_SELECTOR, '.attnlab-viewer[data-ready="1"]')) == n
    )
    uids = driver.execute_script(
        "return [...document.querySelectorAll('.attnlab-viewer')].map(e => e.id)"
    )
    out = []
    for uid in uids:
        data = driver.execute_script(
            "return JSON.parse(document.getElementById(arguments[0])"
            ".querySelector('[data-role=attnlab-data]').textContent)",
            uid,
        )
        out.append((f"#{uid}", data))
    return out


def root_state(driver, sel: str) -> dict[str, str]:
    root = driver.find_element(By.CSS_SELECTOR, sel)
    return {
        a: root.get_attribute(f"data-{a}") for a in ("layer", "head", "token", "view", "filter")
    }


def lines_of(driver, sel: str) -> set:
    return {(q, k, w) for q, k, w, _ in drawn(driver, sel)}


def test_two_viewers_in_one_notebook_page_keep_their_own_state(driver, tmp_path):
    from attnlab import show

    g = torch.Generator().manual_seed(0)
    w1 = torch.softmax(torch.randn(2, 3, 5, 5, generator=g) * 3, dim=-1)
    w2 = torch.softmax(torch.randn(1, 2, 7, 7, generator=g) * 3, dim=-1)
    v1 = show(["a", "b", "c", "d", "e"], w1, title="first")
    v2 = show([f"x{i}" for i in range(7)], w2, title="second")
    f1, f2 = v1._repr_html_(), v2._repr_html_()  # what Jupyter receives
    (one, d1), (two, d2) = open_viewers(driver, notebook_page(tmp_path / "nb.html", f1, f2), 2)
    assert d1 == v1.data and d2 == v2.data
    # The "needs JavaScript" notes are gone: both scripts ran.
    assert driver.find_elements(By.CSS_SELECTOR, role("no-script")) == []
    # Every id on the page is unique; the registry holds both viewers, the global the last.
    ids = driver.execute_script("return [...document.querySelectorAll('[id]')].map(e => e.id)")
    assert len(ids) == len(set(ids))
    assert (
        driver.execute_script(
            "return Object.keys(window.attnlabViewers).sort().join(' ') + '|' + "
            "window.attnlabViewer.uid"
        )
        == " ".join(sorted([one[1:], two[1:]])) + "|" + two[1:]
    )
    # The viewers' styles do not reach the notebook's own elements.
    h1 = driver.find_element(By.ID, "nb-title")
    assert h1.value_of_css_property("font-size") == "32px"  # the browser default, not 20px
    assert driver.execute_script("return getComputedStyle(document.body).margin") == "8px"
    assert lines_of(driver, one) == expected_lines(d1, 0, 0)
    assert lines_of(driver, two) == expected_lines(d2, 0, 0)

    # A click on viewer one's thumbnail selects that head in viewer one only.
    driver.find_element(By.CSS_SELECTOR, f'{one} .thumb[data-layer="1"][data-head="2"]').click()
    assert root_state(driver, one)["layer"] == "1" and root_state(driver, one)["head"] == "2"
    assert root_state(driver, two)["layer"] == "0" and root_state(driver, two)["head"] == "0"
    assert lines_of(driver, one) == expected_lines(d1, 1, 2)
    assert lines_of(driver, two) == expected_lines(d2, 0, 0)
    # Viewer two's head select changes viewer two only.
    sel = driver.find_element(By.CSS_SELECTOR, f"{two} {role('head-select')}")
    sel.find_element(By.CSS_SELECTOR, 'option[value="1"]').click()
    assert root_state(driver, two)["head"] == "1" and root_state(driver, one)["head"] == "2"
    assert lines_of(driver, two) == expected_lines(d2, 0, 1)

    # Pin a query token in each; Esc unpins only the viewer that has the focus (the last one).
    driver.find_element(By.CSS_SELECTOR, f'{one} g.tok.q[data-i="3"]').click()
    driver.find_element(By.CSS_SELECTOR, f'{two} g.tok.q[data-i="5"]').click()
    assert root_state(driver, one)["token"] == "3" and root_state(driver, two)["token"] == "5"
    assert lines_of(driver, one) == expected_lines(d1, 1, 2, 3)
    assert lines_of(driver, two) == expected_lines(d2, 0, 1, 5)
    ActionChains(driver).move_to_element(h1).perform()
    ActionChains(driver).send_keys(Keys.ESCAPE).perform()
    assert root_state(driver, two)["token"] == "-1" and root_state(driver, one)["token"] == "3"
    assert lines_of(driver, one) == expected_lines(d1, 1, 2, 3)
    assert lines_of(driver, two) == expected_lines(d2, 0, 1)
    # Titles and details stay in their own viewer.
    assert driver.find_element(By.CSS_SELECTOR, f"{one} {role('title')}").text == "first"
    assert driver.find_element(By.CSS_SELECTOR, f"{two} {role('title')}").text == "second"
    assert "“d” (#3)" in driver.find_element(By.CSS_SELECTOR, f"{one} {role('details')}").text
    assert driver.title == "notebook"
    assert errors(driver) == []


def test_all_heads_overlay_with_head_toggles(driver, tmp_path):
    g = torch.Generator().manual_seed(3)
    w = torch.softmax(torch.randn(2, 3, 6, 6, generator=g) * 2, dim=-1)
    path = save_attention_html([f"t{i}" for i in range(6)], w, tmp_path / "all.html", layer=1)
    data = open_page(driver, path)
    toggles = by_role(driver, "head-toggles")
    assert not toggles.is_displayed()
    by_role(driver, "view-select").find_element(By.CSS_SELECTOR, 'option[value="all"]').click()
    assert view(driver)["layer"] == "1" and toggles.is_displayed()
    assert by_role(driver, "head-view").get_attribute("data-view") == "all"

    def per_head() -> dict[int, set]:
        rows = driver.execute_script(
            "return [...document.querySelectorAll('[data-role=lines] line')].map(l => "
            "[l.getAttribute('data-h'), l.getAttribute('data-q'), l.getAttribute('data-k'), "
            "l.getAttribute('data-w'), l.getAttribute('stroke')])"
        )
        out: dict[int, set] = {}
        colours: dict[int, set] = {}
        for h, q, k, w_, colour in rows:
            out.setdefault(int(h), set()).add((int(q), int(k), float(w_)))
            colours.setdefault(int(h), set()).add(colour)
        assert all(len(c) == 1 for c in colours.values())  # one colour per head
        assert len({next(iter(c)) for c in colours.values()}) == len(colours)  # all different
        return out

    assert per_head() == {h: expected_lines(data, 1, h) for h in range(3)}
    box = driver.find_element(By.CSS_SELECTOR, f'{role("head-toggle")}[data-head="1"]')
    box.click()  # hide head 1
    assert per_head() == {h: expected_lines(data, 1, h) for h in (0, 2)}
    # Pinning a query shows its row in every visible head.
    driver.find_element(By.CSS_SELECTOR, f'{role("head-view")} g.tok.q[data-i="4"]').click()
    assert per_head() == {h: expected_lines(data, 1, h, 4) for h in (0, 2)}
    box.click()
    assert per_head() == {h: expected_lines(data, 1, h, 4) for h in range(3)}
    # Back to one head: the selected head's lines only, and the legend hides.
    by_role(driver, "view-select").find_element(By.CSS_SELECTOR, 'option[value="head"]').click()
    assert {(q, k, w_) for q, k, w_, _ in drawn(driver)} == expected_lines(data, 1, 0, 4)
    assert not toggles.is_displayed()
    assert errors(driver) == []


def test_sentence_pair_filters_draw_only_their_block(driver, tmp_path):
    tokens = ["[CLS]", "the", "cat", "sat", "[SEP]", "it", "was", "tired", "[SEP]"]
    T, sb = len(tokens), 5
    g = torch.Generator().manual_seed(5)
    w = torch.softmax(torch.randn(1, 2, T, T, generator=g) * 1.5, dim=-1)
    path = save_attention_html(tokens, w, tmp_path / "pair.html", sentence_b_start=sb)
    data = open_page(driver, path)
    assert data["sentence_b_start"] == sb and by_role(driver, "pair-control").is_displayed()
    pick = by_role(driver, "pair-filter")
    counts = {}
    for pair in ("AA", "AB", "BA", "BB", "all"):
        pick.find_element(By.CSS_SELECTOR, f'option[value="{pair}"]').click()
        assert by_role(driver, "head-view").get_attribute("data-filter") == pair
        got = {(q, k, w_) for q, k, w_, _ in drawn(driver)}
        assert got == block_lines(data, 0, 0, pair), pair
        counts[pair] = len(got)
    # The four blocks partition the lines; every block has some above min_line here.
    assert counts["all"] == sum(counts[p] for p in ("AA", "AB", "BA", "BB"))
    assert min(counts.values()) > 0
    # The filter holds for the all-heads view and for a pinned token.
    pick.find_element(By.CSS_SELECTOR, 'option[value="BA"]').click()
    by_role(driver, "view-select").find_element(By.CSS_SELECTOR, 'option[value="all"]').click()
    got = {(q, k, w_) for q, k, w_, _ in drawn(driver)}
    assert got == block_lines(data, 0, 0, "BA") | block_lines(data, 0, 1, "BA")
    driver.find_element(By.CSS_SELECTOR, f'{role("head-view")} g.tok.q[data-i="6"]').click()
    got = {(q, k, w_) for q, k, w_, _ in drawn(driver)}
    assert got == {
        (q, k, w_) for h in (0, 1) for q, k, w_ in block_lines(data, 0, h, "BA") if q == 6
    }
    assert got and all(k < sb for _, k, _ in got)
    # A page without a pair has no filter.
    plain = open_page(driver, save_attention_html(tokens, w, tmp_path / "plain.html"))
    assert plain["sentence_b_start"] is None and not by_role(driver, "pair-control").is_displayed()
    assert errors(driver) == []


def test_cross_attention_page_is_non_square(driver, tmp_path):
    q_tokens = ["</s>", "<s>", "le", "chat"]
    k_tokens = ["<s>", "the", "cat", "sat", "on", "the", "mat", "</s>", "<pad>"]
    T, S = len(q_tokens), len(k_tokens)
    g = torch.Generator().manual_seed(7)
    w = torch.softmax(torch.randn(2, 2, T, S, generator=g) * 2, dim=-1)
    w[..., -1] = 0.0  # the padded key
    w = w / w.sum(-1, keepdim=True)
    key_mask = [True] * (S - 1) + [False]
    path = save_attention_html(
        q_tokens, w, tmp_path / "cross.html", key_tokens=k_tokens, key_mask=key_mask
    )
    data = open_page(driver, path)
    assert (data["T"], data["S"]) == (T, S)
    # Queries on the left, keys on the right, the padded key dimmed.
    left = driver.find_elements(By.CSS_SELECTOR, f"{role('head-view')} g.tok.q")
    right = driver.find_elements(By.CSS_SELECTOR, f"{role('head-view')} g.tok.k")
    assert [e.text for e in left] == q_tokens and [e.text for e in right] == k_tokens
    assert "dim" in right[-1].get_attribute("class")
    assert "dim" not in right[0].get_attribute("class")
    assert {(q, k, w_) for q, k, w_, _ in drawn(driver)} == expected_lines(data, 0, 0)
    # Thumbnails and the matrix are T × S pixels, drawn wider than tall.
    sizes = driver.execute_script(
        "return [...document.querySelectorAll('.attnlab-viewer canvas')].map(c => "
        "[c.width, c.height, c.getBoundingClientRect().width, c.getBoundingClientRect().height])"
    )
    assert len(sizes) == 2 * 2 + 1
    assert all((cw, ch) == (S, T) and bw > bh for cw, ch, bw, bh in sizes)
    # Hovering a key shows the attention it receives from the queries.
    key = driver.find_element(By.CSS_SELECTOR, f'{role("head-view")} g.tok.k[data-i="2"]')
    ActionChains(driver).move_to_element(key).perform()
    got = {(q, k, w_) for q, k, w_, _ in drawn(driver)}
    assert got == {(q, k, w_) for q, k, w_ in expected_lines(data, 0, 0) if k == 2} and got
    assert "Attention to “cat” (#2)" in by_role(driver, "details").text
    legend = by_role(driver, "entropy-legend").text
    assert f"log S = {math.log(S - 1):.2f}" in legend and f"all {S - 1} keys" in legend
    assert errors(driver) == []


def test_entropy_table_says_nats_and_names_the_normalised_entropy(driver, tmp_path):
    """The one unit: a cell's tooltip gives the head's entropy in nats and its normalised entropy
    (entropy / log S, the cell's shade), and the legend says so."""
    tokens = ["a", "b", "c", "d"]
    S = len(tokens)
    uniform = torch.full((S, S), 1.0 / S)
    one_hot = torch.eye(S)
    w = torch.stack([uniform, one_hot]).unsqueeze(0)  # (1 layer, 2 heads, S, S)
    data = open_page(driver, save_attention_html(tokens, w, tmp_path / "entropy.html"))
    cells = driver.find_elements(By.CSS_SELECTOR, f"{role('entropy-table')} td")
    titles = [c.get_attribute("title") for c in cells]
    assert titles == [
        f"{math.log(S):.4f} nats · normalised entropy 1.00",
        "0.0000 nats · normalised entropy 0.00",
    ]
    assert data["entropy"] == [[round(math.log(S), 4), 0.0]]
    legend = by_role(driver, "entropy-legend").text
    assert "−Σ p log p in nats" in legend
    assert "normalised entropy = entropy / log S" in legend
    assert errors(driver) == []
