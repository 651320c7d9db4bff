"""The documentation site: built strictly by ``make docs``, complete, self-contained, and
working in a real browser.

- The build (``make docs``: Sphinx with ``-W``, running the tutorials) succeeds.
- Every name in the ``__all__`` of every public module is in the site's ``objects.inv``; the
  public modules are found by walking the package, not listed here.
- No built page, style sheet or script loads anything from the network (links to the web are
  fine; loads are not): the site works offline.
- Headless Chromium, served from 127.0.0.1, opens the front page, a tutorial and an API page:
  every image loaded, math rendered, no console errors; screenshots in tests/artifacts/.

Marked ``docs`` (excluded from the default run): ``pytest -m docs tests/test_docs_site.py``.
The first test builds the site (incrementally, so after ``make docs`` it costs seconds).
"""

from __future__ import annotations

import functools
import http.server
import importlib
import pkgutil
import re
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest

import attnlab
import chromium

pytestmark = pytest.mark.docs

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "docs" / "_build" / "html"
ARTIFACTS = ROOT / "tests" / "artifacts"


@pytest.fixture(scope="module")
def site() -> Path:
    """The site as ``make docs`` builds it (strict: a warning fails the build)."""
    proc = subprocess.run(
        ["make", "docs", f"PYTHON={sys.executable}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "build succeeded" in out, f"make docs failed:\n{out[-8000:]}"
    assert (SITE / "index.html").is_file() and (SITE / "objects.inv").is_file()
    return SITE


# ----------------------------------------------------------------- every public name documented
def public_modules() -> dict[str, types.ModuleType]:
    """``attnlab``, every module one level below it without a leading underscore (files,
    subpackages and names registered in sys.modules), and every module those list in
    ``__all__`` — found by walking the package."""
    found = {"attnlab": attnlab}
    for info in pkgutil.iter_modules(attnlab.__path__, "attnlab."):
        if not info.name.split(".")[1].startswith("_"):
            found[info.name] = importlib.import_module(info.name)
    for attr in attnlab.__all__:  # the names that are not files are imported on first use
        getattr(attnlab, attr)
    for name, module in list(sys.modules.items()):
        if name.count(".") == 1 and name.startswith("attnlab.") and name[8] != "_":
            found[name] = module
    todo = list(found.values())
    while todo:
        module = todo.pop()
        for attr in getattr(module, "__all__", ()):
            obj = getattr(module, attr)
            if isinstance(obj, types.ModuleType) and obj.__name__ not in found:
                found[obj.__name__] = obj
                todo.append(obj)
    return found


def inventory_names(path: Path) -> set[str]:
    from sphinx.util.inventory import InventoryFile

    inventory = InventoryFile.loads(path.read_bytes(), uri="")
    return {name for items in inventory.data.values() for name in items}


def test_every_public_name_is_in_the_inventory(site):
    modules = public_modules()
    # the walk reaches the registered names and the subpackages
    assert {"attnlab.linear", "attnlab.pos", "attnlab.functional", "attnlab.masks"} <= set(modules)
    names = inventory_names(site / "objects.inv")
    expected = {
        f"{m}.{attr}" for m, module in modules.items() for attr in getattr(module, "__all__", ())
    }
    expected |= set(modules)  # each module has its page
    assert len(expected) > 300
    missing = sorted(expected - names)
    assert not missing, f"{len(missing)} public names missing from objects.inv: {missing[:30]}"


def test_an_alias_points_at_the_documented_object(site):
    """``attnlab.attention`` is ``attnlab.functional.attention``: its inventory entry leads to
    that object's documentation (one description, several names)."""
    from sphinx.util.inventory import InventoryFile

    inventory = InventoryFile.loads((site / "objects.inv").read_bytes(), uri="")
    functions = inventory.data["py:function"]
    alias, home = functions["attnlab.attention"], functions["attnlab.functional.attention"]
    assert alias.uri == home.uri
    assert home.uri.split("#")[0] == "api/generated/attnlab.functional.html"
    page = (site / "api" / "generated" / "attnlab.functional.html").read_text(encoding="utf-8")
    assert 'id="attnlab.functional.attention"' in page


# ------------------------------------------------------------------------ nothing from the web
_EXTERNAL = r"""["']?\s*(?:https?:)?//[^\s"'<>)]+"""
_LOADS = [
    # HTML: scripts, images, frames, media, embedded objects
    re.compile(
        r"<(?:script|img|iframe|source|audio|video|embed|track|input)\b[^>]*?\bsrc\s*=\s*"
        + _EXTERNAL,
        re.I,
    ),
    re.compile(r"<object\b[^>]*?\bdata\s*=\s*" + _EXTERNAL, re.I),
    re.compile(r"\bsrcset\s*=\s*[\"'][^\"']*(?:https?:)?//", re.I),
    # <link> that loads: stylesheet, preload, modulepreload, icon, manifest, prefetch, ...
    re.compile(
        r"<link\b(?=[^>]*\brel\s*=\s*[\"']?(?:stylesheet|preload|modulepreload|prefetch|"
        r"preconnect|dns-prefetch|icon|shortcut icon|apple-touch-icon|manifest))[^>]*?"
        r"\bhref\s*=\s*" + _EXTERNAL,
        re.I,
    ),
    # CSS, inline or in files: url(...) and @import
    re.compile(r"url\(\s*" + _EXTERNAL, re.I),
    re.compile(r"@import\s+(?:url\()?\s*" + _EXTERNAL, re.I),
    # scripts that set a source or import a module from the web
    re.compile(r"\.(?:src|href)\s*=\s*[\"'](?:https?:)?//", re.I),
    re.compile(r"\b(?:import|importScripts|fetch)\s*\(\s*[\"'](?:https?:)?//", re.I),
    re.compile(r"\bimport\s+[^;\n]*?\bfrom\s*[\"'](?:https?:)?//", re.I),
]


def external_loads(text: str) -> list[str]:
    return [m.group(0)[:160] for pattern in _LOADS for m in pattern.finditer(text)]


def test_no_page_loads_anything_from_the_network(site):
    # the scanner finds each kind of load, and lets links and local files be
    page = (
        '<script src="https://cdn.example.org/x.js"></script>'
        '<link rel="stylesheet" href="https://fonts.example.org/css">'
        '<link href="//cdn.example.org/a.css" rel="preload">'
        '<img class="a" src="http://example.org/a.png">'
        "<style>body{background:url('https://example.org/b.png')} @import "
        '"https://example.org/c.css";</style>'
    )
    assert len(external_loads(page)) == 6
    links = (
        '<a href="https://pytorch.org/docs">PyTorch</a><script src="_static/x.js"></script>'
        '<link rel="canonical" href="https://example.org/"><img src="_images/a.png">'
        "url(../fonts/a.woff2) svg.setAttribute('xmlns', 'http://www.w3.org/2000/svg')"
    )
    assert external_loads(links) == []
    files = [p for p in site.rglob("*") if p.suffix in (".html", ".css", ".js") and p.is_file()]
    assert len(files) > 50
    found = {}
    for path in files:
        loads = external_loads(path.read_text(encoding="utf-8", errors="replace"))
        if loads:
            found[str(path.relative_to(site))] = loads[:3]
    assert not found, f"external loads in {len(found)} files: {dict(list(found.items())[:10])}"
    # the math renderer is on the site itself
    assert (site / "_static" / "mathjax" / "tex-chtml.js").is_file()
    tutorial = (site / "gallery" / "plot_quickstart.html").read_text(encoding="utf-8")
    assert 'src="../_static/mathjax/tex-chtml.js' in tutorial


# ------------------------------------------------------------------------------ in a browser
@pytest.fixture(scope="module")
def driver():
    yield from chromium.driver("attnlab-docs-")


@pytest.fixture(scope="module")
def server(site):
    """The site over HTTP on 127.0.0.1 (as it is served; fonts do not load from file://)."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


_CHECK_PAGE = """
const done = arguments[arguments.length - 1];
(async () => {
  // images below the fold load when they come into view
  for (const img of document.images) { img.loading = "eager"; img.scrollIntoView(); }
  await Promise.all([...document.images].map(img => img.complete ? null :
      new Promise(r => { img.onload = img.onerror = r; })));
  window.scrollTo(0, 0);
  const math = document.querySelectorAll(".math").length;
  if (math && window.MathJax && MathJax.startup) await MathJax.startup.promise;
  done({
    images: [...document.images].map(i => [i.getAttribute("src"), i.naturalWidth]),
    math: math,
    rendered: document.querySelectorAll("mjx-container").length,
    mathErrors: document.querySelectorAll("mjx-merror").length,
    mathjax: !!window.MathJax,
    title: document.title,
  });
})();
"""

PAGES = {
    "index": "index.html",
    "tutorial": "gallery/plot_quickstart.html",
    "api": "api/generated/attnlab.functional.html",
}


@pytest.mark.parametrize("page", list(PAGES))
def test_pages_render_in_chromium(driver, server, page):
    driver.set_script_timeout(60)
    driver.get(f"{server}/{PAGES[page]}")
    state = driver.execute_async_script(_CHECK_PAGE)
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / f"docs-{page}.png"
    assert driver.save_screenshot(str(shot))
    print(f"\nscreenshot: {shot}")
    assert "attnlab" in state["title"]
    broken = [src for src, width in state["images"] if width == 0]
    assert not broken, f"images that did not load: {broken}"
    if state["math"]:
        assert state["mathjax"], "the page has math but MathJax did not load"
        assert state["rendered"] >= state["math"] and state["mathErrors"] == 0, state
    assert errors == [], errors
    if page == "tutorial":  # the gallery ran the script and kept its figure and its math
        assert state["math"] >= 1
        assert any("sphx_glr_plot_quickstart" in src for src, _ in state["images"])
    if page == "api":
        assert driver.find_elements("id", "attnlab.functional.attention")
