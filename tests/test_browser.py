"""The token view in a real browser: headless Chromium, driven by Playwright, loads the page `tokendyn view` writes
(and the report that embeds it) from a file. No console error, no request leaves the file, hovering a token shows
the numbers of its `token_view` records, switching the quantity recolours, the filters dim, the arrow keys move.

Needs Chromium (Debian's `chromium`, or `TOKENDYN_CHROMIUM=/path/to/chrome`) and Playwright's Python package (a dev
dependency; its own browser downloads are not used). Without a browser the tests are skipped, and the run's summary
says so; with ``TOKENDYN_REQUIRE_BROWSER=1`` (set by `.ci/run`, which installs Chromium) a missing browser fails."""

from __future__ import annotations

import os
import re
import shutil

import polars as pl
import pytest

from tokendyn import load_run

LAUNCH_ARGS = [  # a closed network: no background connections, no first-run or component updates
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
HEX = re.compile(r"^#[0-9a-f]{6}$")


def chromium_path() -> str | None:
    """TOKENDYN_CHROMIUM, else the first of chromium, chromium-browser, google-chrome on PATH."""
    given = os.environ.get("TOKENDYN_CHROMIUM")
    if given:
        return given if os.path.exists(given) else None
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


def _need_browser() -> str:
    path = chromium_path()
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        path = None
        why = "Playwright's Python package is not installed (pip install playwright)"
    else:
        why = "no Chromium found (apt-get install chromium, or set TOKENDYN_CHROMIUM)"
    if path is None:
        if os.environ.get("TOKENDYN_REQUIRE_BROWSER") == "1":
            pytest.fail(f"browser test: {why}, and TOKENDYN_REQUIRE_BROWSER=1")
        pytest.skip(f"browser test not run: {why}")
    return path


@pytest.fixture(scope="module")
def browser():
    path = _need_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=LAUNCH_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def lopti_run(tiny_model_dir, tmp_path_factory):
    """A Lopti run with the view on every analysed sequence and the paired comparison of Reweight."""
    from test_trainer import _config, _trainer

    tmp = tmp_path_factory.mktemp("view")
    options = dict(
        max_steps=4, probe_every=1, probe_sample_sequences=3, probe_view_sequences=3, lopti_eta=0.5
    )
    _trainer(tiny_model_dir, _config(tmp, probe_compare_rules=["reweight"], **options)).train()
    return tmp / "run"


class Page:
    """A page opened from a file, with every console message, page error and request it made."""

    def __init__(self, browser, path) -> None:
        self.page = browser.new_page(viewport={"width": 1200, "height": 900})
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.url = path.resolve().as_uri()
        self.page.goto(self.url)
        self.page.wait_for_load_state("load")

    def left_the_file(self) -> list[str]:
        return [u for u in self.requests if u != self.url]


def _rgb(hex_colour: str) -> str:
    r, g, b = (int(hex_colour[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgb({r}, {g}, {b})"


def _tooltip(page) -> dict[str, str]:
    rows = page.locator("#tv-tip tr")
    return {
        rows.nth(i).get_attribute("data-key"): rows.nth(i).locator("td").nth(1).inner_text()
        for i in range(rows.count())
    }


def _close(shown: str, want) -> bool:
    if want is None:
        return shown == "–"
    if shown == "–":
        return False
    # the record rounded once to the hover's 4 significant digits, exactly (not within half a unit: a value rounded
    # to 6 digits first, then to 4, is one unit off where its 5th and 6th digits round up to ..50)
    return float(shown) == float(f"{want:.4g}")


def test_the_view_page_in_chromium(browser, lopti_run, tmp_path):
    from tokendyn.cli import main

    out = tmp_path / "view.html"
    assert main(["view", str(lopti_run), "--out", str(out)]) == 0
    view = load_run(lopti_run)["token_view"].collect().sort("step", "seq", "pos")
    rules = load_run(lopti_run)["token_view_rules"].collect()
    first = int(view["step"].min())
    p = Page(browser, out)
    page = p.page
    tokens = page.locator("#tv-seqs .tv-tok")
    shown = view.filter(pl.col("step") == first)
    assert tokens.count() == shown.height, "every recorded token of the step is on the page"
    assert set(shown["group"].drop_nulls()) == {"low", "high"}

    # hover: the tooltip shows the token's own numbers, as recorded
    picks = sorted({0, 1, shown.height // 2, shown.height - 1})
    for i in picks:
        tok = tokens.nth(i)
        tok.hover()
        seq, k = int(tok.get_attribute("data-seq")), int(tok.get_attribute("data-k"))
        row = shown.filter(pl.col("seq") == seq).row(k, named=True)
        tip = _tooltip(page)
        assert tip["token_id"] == str(row["token_id"])
        assert tip["token"] == __import__("json").dumps(row["text"], ensure_ascii=False)
        for key in ("pi_old", "advantage", "share", "dpi_cf", "dpi_real", "head_ratio"):
            assert _close(tip[key], row[key]), (key, tip[key], row[key])
        assert tip["group"] == (row["group"] or "–")
        r = rules.filter((pl.col("step") == first) & (pl.col("seq") == seq) & (pl.col("pos") == row["pos"]))
        for rule, mode, dpi in r.select("rule", "mode", "delta_pi").iter_rows():
            assert _close(tip[f"rule:{rule}:{mode}"], dpi), (rule, mode)
        base = r.filter(pl.col("rule") == "base")
        for mode, dpi in r.filter(pl.col("rule") == "reweight").select("mode", "delta_pi").iter_rows():
            diff = dpi - base.filter(pl.col("mode") == mode)["delta_pi"].item()
            assert _close(tip[f"diff:reweight:{mode}"], diff), mode
    page.mouse.move(0, 0)

    # the quantity recolours: pi_old paints each token its bin's colour (the figures' palette), A by its sign
    bins = page.evaluate("JSON.parse(document.getElementById('tv-data').textContent).runs[0].bins")
    assert all(HEX.match(b["color"]) for b in bins)
    page.select_option("#tv-quantity", "pi_old")
    backgrounds = tokens.evaluate_all("ts => ts.map(t => getComputedStyle(t).backgroundColor)")
    assert backgrounds == [_rgb(bins[b]["color"]) for b in shown["bin"]]
    page.select_option("#tv-quantity", "advantage")
    signed = tokens.evaluate_all("ts => ts.map(t => getComputedStyle(t).backgroundColor)")
    assert signed != backgrounds
    for colour, a in zip(signed, shown["advantage"], strict=True):
        r, g, b = map(int, re.findall(r"\d+", colour)[:3])
        assert (r > b) if a > 0 else (b > r) if a < 0 else (r == g == b == 255 or colour.endswith("0)"))
    page.select_option("#tv-quantity", "group")
    grouped = tokens.evaluate_all("ts => ts.map(t => getComputedStyle(t).backgroundColor)")
    assert len(set(grouped)) == 2 and grouped != signed

    # the filters dim what is outside them
    page.uncheck("#tv-bins input[data-bin='0']")
    dim = tokens.evaluate_all("ts => ts.map(t => t.classList.contains('tv-dim'))")
    assert dim == [b == 0 for b in shown["bin"]]
    page.check("#tv-bins input[data-bin='0']")
    page.select_option("#tv-sign", "neg")
    dim = tokens.evaluate_all("ts => ts.map(t => t.classList.contains('tv-dim'))")
    assert dim == [not a < 0 for a in shown["advantage"]]

    # the keyboard: Tab reaches a completion, the arrow keys move token by token, the details follow
    page.keyboard.press("Tab")
    for _ in range(12):
        if page.evaluate("document.activeElement.classList.contains('tv-tok')"):
            break
        page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.dataset.k") == "0"
    page.keyboard.press("ArrowRight")
    assert page.evaluate("document.activeElement.dataset.k") == "1"
    assert "completion token" in page.locator("#tv-details").inner_text()

    # the step selector shows the other probed step
    page.select_option("#tv-step", "1")
    assert tokens.count() == view.filter(pl.col("step") != first).height

    assert p.errors == [], p.errors
    assert p.left_the_file() == [], p.left_the_file()


def test_the_report_embeds_the_view(browser, lopti_run, tmp_path):
    from tokendyn.figures.report import build_report

    report = build_report([lopti_run], tmp_path / "figures", strict=True)
    assert "token_view" not in report.notes
    p = Page(browser, report.path)
    assert p.page.locator("#tv-seqs .tv-tok").count() > 0
    assert p.page.locator("img").count() == len(report.figures)
    assert p.errors == [], p.errors
    assert p.left_the_file() == [], p.left_the_file()


def test_text_from_the_records_is_never_markup(browser, tmp_path):
    """A token whose text is markup is shown as text: no element is made from it, no script runs."""
    from tokendyn.figures.data import Records, RunInfo
    from tokendyn.figures.view import view_page

    evil = ["</script><script>window.pwned=1</script>", "<img src=x onerror='window.pwned=2'>", "&amp; ok"]
    n = len(evil)
    frame = pl.DataFrame(
        {
            "run": ["r"] * n, "step": [1] * n, "stage": ["train"] * n, "seq": [0] * n, "pos": list(range(n)),
            "token_id": list(range(n)), "text": evil, "special": [False] * n, "bin": [0, 1, 2],
            "pi_old": [0.1, 0.4, 0.6], "advantage": [1.0, -1.0, 0.5], "group": [None] * n,
            "share": [0.2, -0.1, 0.05], "dpi_cf": [0.01, 0.0, -0.02], "dpi_real": [None] * n,
            "head_ratio": [1.0, 1.2, 1.3],
        }
    )  # fmt: skip
    page_file = tmp_path / "evil.html"
    page_file.write_text(view_page(Records([RunInfo(tmp_path, "r", "r")], {"token_view": frame})))
    p = Page(browser, page_file)
    assert p.page.evaluate("window.pwned === undefined")
    assert p.page.locator("#tv-seqs img").count() == 0
    shown = p.page.locator("#tv-seqs .tv-tok").all_inner_texts()
    assert shown == evil
    assert p.errors == [] and p.left_the_file() == []


def test_switching_runs_switches_their_bins(browser, lopti_run, tiny_model_dir, tmp_path):
    """A page of two runs binned differently: the second run's bin filters and pi_old colours are its own."""
    from test_trainer import _config, _trainer

    from tokendyn.cli import main

    options = dict(max_steps=1, probe_every=1, probe_sample_sequences=2, probe_view_sequences=2)
    _trainer(tiny_model_dir, _config(tmp_path / "halves", probe_bins="0,0.5,1", **options)).train()
    halves = tmp_path / "halves" / "run"
    out = tmp_path / "two.html"
    assert main(["view", str(lopti_run), str(halves), "--out", str(out)]) == 0
    p = Page(browser, out)
    page = p.page
    assert page.locator("#tv-bins input").count() == 4
    page.select_option("#tv-run", "1")
    assert page.locator("#tv-bins input").count() == 2
    labels = page.locator("#tv-bins label").all_inner_texts()
    assert [t.strip() for t in labels] == ["[0, 0.5)", "[0.5, 1]"]
    bins = page.evaluate("JSON.parse(document.getElementById('tv-data').textContent).runs[1].bins")
    page.select_option("#tv-quantity", "pi_old")
    view = load_run(halves)["token_view"].collect().sort("step", "seq", "pos")
    shown = view.filter(pl.col("step") == int(view["step"].min()))
    tokens = page.locator("#tv-seqs .tv-tok")
    backgrounds = tokens.evaluate_all("ts => ts.map(t => getComputedStyle(t).backgroundColor)")
    assert backgrounds == [_rgb(bins[b]["color"]) for b in shown["bin"]]
    page.uncheck("#tv-bins input[data-bin='1']")  # the filter of run 2's top bin dims exactly its tokens
    dimmed = tokens.evaluate_all("ts => ts.map(t => t.classList.contains('tv-dim'))")
    assert dimmed == [b == 1 for b in shown["bin"]]
    assert not p.errors and not p.left_the_file()


def test_the_demos_report_has_every_section_and_no_warning(browser, tiny_model_dir, tmp_path):
    """`make demo`'s three runs, with the probe settings the demo itself gives them (`tokendyn.commands.demo.FULL`:
    the analyses, the lr sweep, GRPO's paired comparison and both camps with the c / eta sweeps), at toy size on the
    tiny model with a graded reward: the report opens in Chromium with every section drawn (none collapsed as
    absent but the sampler's, which needs a vLLM-sampled run), no WARNING and no page error."""
    from test_trainer import _config, _trainer

    from tokendyn.commands.demo import FULL, _configs
    from tokendyn.figures.report import build_report
    from tokendyn.trainers.callbacks import HeldoutEvalCallback, ParquetLogCallback
    from tokendyn.trainers.runner import method_name

    keep = ("advantage_reweight_alpha", "lopti_eta", "probe_lr_sweep", "probe_compare_rules", "probe_compare_modes",
            "probe_compare_inner_steps", "probe_compare_c_sweep", "probe_compare_eta_sweep", "probe_analyses")  # fmt: skip
    dirs = []
    for name, _, cfg in _configs(tmp_path / "demo", FULL, None, {}):
        fields = {k: getattr(cfg, k) for k in keep}
        steps = 4 if cfg.lopti_eta is not None else 2
        args = _config(tmp_path / name, max_steps=steps, probe_every=1, probe_sample_sequences=4, **fields)
        trainer = _trainer(tiny_model_dir, args)
        # the training log and held-out accuracy the demo's runner writes (tokendyn.trainers.runner.train)
        run = tmp_path / name / "run"
        trainer.add_callback(ParquetLogCallback(run / "metrics.parquet", method=method_name(cfg)))
        trainer.add_callback(HeldoutEvalCallback(trainer, [3], 1, 1, 0.7, "qwen-instruct"))
        trainer.train()
        dirs.append(run)
    report = build_report(dirs, tmp_path / "figures", strict=True)
    # every section, none absent: the sampler's shows the trainer's floor (`generate` keeps no sampler log-probs;
    # a vLLM run's sampler section: tests/test_vllm.py)
    assert not report.notes, report.notes
    html = report.path.read_text()
    assert "WARNING" not in html and "not in these runs" not in html
    p = Page(browser, report.path)
    assert p.page.locator("details.absent").count() == 0
    assert "floor" in p.page.locator("#m_sampler ~ div.reading").first.inner_text()
    assert p.page.locator("img").count() == len(report.figures)
    assert "WARNING" not in p.page.inner_text("body")
    assert p.errors == [], p.errors
