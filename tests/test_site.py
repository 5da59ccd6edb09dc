"""The docs site builds strictly and renders. `mkdocs build --strict` (what `make docs` runs) turns every dead link,
missing anchor, missing page and unparsable docstring into a failure: it replaces hand-written link checks of docs/.
The generated reference holds every command's own help; a page with a dead link fails the build (the check can
fail). Headless Chromium (found as tests/test_browser.py finds it) loads the built first page and the reading page
from files and screenshots them: the theme's stylesheet applied, the navigation and the figures loaded, no console
error.

Needs mkdocs-material and mkdocstrings (the `docs` extra: `pip install -e ".[docs]"`); without them the tests are
skipped. The browser part skips without Chromium unless TOKENDYN_REQUIRE_BROWSER=1."""

from __future__ import annotations

import http.server
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _mkdocs() -> list[str]:
    pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install -e '.[docs]')")
    pytest.importorskip("material", reason="mkdocs-material is not installed (pip install -e '.[docs]')")
    pytest.importorskip("mkdocstrings_handlers.python", reason="mkdocstrings[python] is not installed")
    return [sys.executable, "-m", "mkdocs"]


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [*_mkdocs(), "build", "--strict", "--config-file", str(config), "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site") / "site"
    done = build(ROOT / "mkdocs.yml", out)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stderr[-4000:]}"
    assert "WARNING" not in done.stderr, done.stderr[-4000:]
    return out


def test_the_site_builds_strictly_with_every_page(site):
    for page in ("index.html", "reading.html", "glossary.html", "faq.html", "paper.html", "kk.html",
                 "remedies.html", "changelog.html", "reference/cli.html", "reference/api.html"):  # fmt: skip
        assert (site / page).is_file(), page
    # the copies of the repository files the pages link to
    assert (site / "_repo" / "examples" / "custom_loop.py").is_file()


def test_the_cli_reference_is_the_parsers_own_help(site):
    from tokendyn.cli import COMMANDS

    html = (site / "reference" / "cli.html").read_text()
    for command in COMMANDS:
        assert f"tokendyn {command}" in html, command
    assert "--lopti_eta" in html and "--advantage_reweight_alpha" in html  # train's TRL parser
    assert "--rollouts" in html  # probe's own parser


def test_the_api_reference_renders_the_docstrings(site):
    html = (site / "reference" / "api.html").read_text()
    assert "doc-function" in html or "doc-class" in html  # mkdocstrings rendered objects, not the directives
    assert ":::" not in html
    for name in ("instrument", "ProbeConfig", "load_run", "TokendynGRPOConfig"):
        assert name in html, name


def test_a_dead_link_fails_the_strict_build(tmp_path):
    """The same configuration with one more page whose link points nowhere: the build fails and names the page."""
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs, ignore=shutil.ignore_patterns("*.parquet", "runs", "start"))
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    shutil.copy(ROOT / "CHANGELOG.md", tmp_path / "CHANGELOG.md")
    (tmp_path / "src").symlink_to(ROOT / "src")
    (docs / "broken.md").write_text(
        "# Broken\n\nSee [nowhere](no_such_page.md) and [x](reading.md#no-such-anchor).\n"
    )
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    done = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0
    assert "broken.md" in done.stderr and "no_such_page.md" in done.stderr
    assert "no-such-anchor" in done.stderr


# ---- the built pages in headless Chromium ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(site):
    """The built site over HTTP on the loopback interface, as a browser reads a docs site (search fetches its index)."""
    import functools
    import threading

    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # no request log on the test's output
        pass


@pytest.fixture(scope="module")
def page(site):
    from test_browser import LAUNCH_ARGS, _need_browser

    path = _need_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=path, args=LAUNCH_ARGS)
        pg = browser.new_page(viewport={"width": 1280, "height": 900})
        errors: list[str] = []
        pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        pg.on("pageerror", lambda e: errors.append(str(e)))
        yield pg, errors
        browser.close()


@pytest.mark.parametrize(
    ("name", "heading", "figure"),
    [
        ("index.html", "tokendyn", "h_update_shares.png"),
        ("reading.html", "Reading the report", "a_token_share.png"),
    ],
)
def test_the_page_renders_in_chromium(served, page, name, heading, figure, tmp_path):
    page, errors = page
    errors.clear()
    outside: list[str] = []
    page.on("request", lambda r: outside.append(r.url) if not r.url.startswith(served) else None)
    page.goto(f"{served}/{name}")
    page.wait_for_load_state("load")
    assert page.locator("h1").first.inner_text().rstrip("¶").strip() == heading
    # the theme's stylesheet is applied: the header bar is coloured and the navigation is drawn
    header_bg = page.evaluate("getComputedStyle(document.querySelector('.md-header')).backgroundColor")
    assert header_bg not in ("", "rgba(0, 0, 0, 0)", "transparent"), header_bg
    assert page.locator("nav.md-nav--primary a").count() > 10
    # the figure loaded (a broken image has naturalWidth 0)
    widths = page.evaluate(
        "(f) => [...document.images].filter(i => i.src.endsWith(f)).map(i => i.naturalWidth)", figure
    )
    assert widths and all(w > 100 for w in widths), (figure, widths)
    shot = tmp_path / f"{name}.png"
    page.screenshot(path=str(shot), full_page=False)
    from PIL import Image

    with Image.open(shot) as im:
        assert im.size == (1280, 900)
        colours = im.convert("RGB").resize((64, 45)).getcolors(64 * 45)
        assert colours is not None and len(colours) > 20  # not a blank page
    assert not errors, errors
    assert not outside, f"requests that left the site: {outside}"
