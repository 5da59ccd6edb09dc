"""The token view opens at the spikes: from a run folder with `token_view` records and planted `spikes` records, the
page `tokendyn view` writes opens at the first spike's top token (its step selected, the token highlighted and
focused), lists the spike's tokens with links to their places, says which token is not among the view's sequences,
and `--spike STEP` is checked in one line. `tokendyn doctor` names the command that opens each spike, and that
command works. The page is also driven in headless Chromium where one is installed (`test_browser`)."""

from __future__ import annotations

import json
import re
import shlex

import polars as pl
from test_spike_doctor import new_run, spike_rows

from tokendyn.analysis.diagnosis import diagnose, render_text
from tokendyn.cli import main
from tokendyn.records import to_frame, write_frames

# the view's two sampled sequences at step 4: (seq, pos, text); position 1 of sequence 1 is not scored (a tool's
# output), so the planted token " knave" at position 2 is the second token of its sequence, not the third
VIEW = [(0, 0, "Zoey"), (0, 1, " says"), (1, 0, " Oliver"), (1, 2, " knave"), (1, 3, ".")]
PLANTED = (1, 2, " knave")


def view_rows(step: int) -> pl.DataFrame:
    n = len(VIEW)
    cols = {
        "step": [step] * n, "stage": ["train"] * n, "seq": [v[0] for v in VIEW], "pos": [v[1] for v in VIEW],
        "token_id": list(range(n)), "text": [v[2] for v in VIEW], "special": [False] * n, "bin": [1, 2, 2, 0, 3],
        "pi_old": [0.3, 0.6, 0.5, 1e-4, 0.9], "advantage": [-1.0, -1.0, 3.0, 3.0, 3.0], "group": [None] * n,
        "share": [0.1, 0.05, 0.2, 0.4, 0.25], "dpi_cf": [0.0] * n, "dpi_real": [None] * n, "head_ratio": [1.0] * n,
        "log_rho": [None] * n, "is_weight": [None] * n,
    }  # fmt: skip
    return to_frame("token_view", cols)


def spiky_run(tmp_path):
    """Spikes at steps 4 (top token the planted one, then " Oliver", then a token of sequence 5, which the view does
    not hold) and 9 (no view recorded at that step)."""
    run = new_run(tmp_path, "spiky", probe_spike_k=3.0)
    write_frames(run, {"token_view": view_rows(4)}, rank=0)
    spikes = spike_rows(4, [(" knave", 1e-4, 0.4, 0), (" Oliver", 0.5, 0.2, 2), (" lie", 0.01, 0.1, 0)])
    spikes = spikes.with_columns(
        seq=pl.Series([1, 1, 5], dtype=pl.Int32), pos=pl.Series([2, 0, 1], dtype=pl.Int32)
    )
    write_frames(run, {"spikes": spikes}, rank=0)
    write_frames(run, {"spikes": spike_rows(9, [(" truth", 0.2, 0.5, 1)], ratio=5.0)}, rank=0)
    return run


def page_data(html: str) -> dict:
    text = re.search(r"<script type='application/json' id='tv-data'>(.*?)</script>", html, re.S).group(1)
    return json.loads(text)


def token_at(data: dict, at: list[int]) -> tuple[int, int, str]:
    """(step, pos, text) of the view's token at [step index, seq, token index]."""
    step = data["runs"][0]["steps"][at[0]]
    seq = next(s for s in step["seqs"] if s["seq"] == at[1])
    return step["step"], seq["pos"][at[2]], seq["text"][at[2]]


def test_the_view_opens_at_the_first_spikes_top_token_and_lists_its_tokens(tmp_path, capsys):
    run = spiky_run(tmp_path)
    out = tmp_path / "view.html"
    assert main(["view", str(run), "--out", str(out)]) == 0
    html = out.read_text()
    data = page_data(html)
    opened = data["open"]
    assert opened["at"][1] == PLANTED[0] and token_at(data, opened["at"]) == (4, PLANTED[1], PLANTED[2])
    assert data["runs"][0]["steps"][opened["step"]]["step"] == 4
    # the list: the planted token links to its place, marked as the one opened
    link = re.search(
        r"<a class='tv-spike-link tv-spike-open' href='#tv-t-1-(\d+)'[^>]*>([^<]*)</a>([^<]*)", html
    )
    assert link and link.group(2) == repr(PLANTED[2]).replace("'", "&#x27;") and int(link.group(1)) == 1
    assert "π_old 1.0e-04" in link.group(3) and "sequence 1, position 2" in link.group(3)
    assert html.count("tv-spike-open") == 1 and "href='#tv-t-1-0'" in html  # " Oliver": sequence 1, token 0
    # the token the view does not hold is listed, and why
    assert "sequence 5 is not among the view&#x27;s sampled sequences (0, 1)" in html
    assert "&#x27; lie&#x27;" in html
    # the later spike, whose step has no view: listed, not dropped
    assert "spike at step 9" in html and "step 9 has no token view recorded" in html
    assert html.index("spike at step 4") < html.index("spike at step 9")


def test_spike_flag_and_the_doctors_command(tmp_path, capsys):
    run = spiky_run(tmp_path)
    text = render_text(diagnose([run]))
    command = f"tokendyn view {shlex.quote(str(run))} --spike 9"
    assert f"open it: {command}" in text and "--spike 4" in text
    out = tmp_path / "at9.html"
    assert (
        main([*shlex.split(command)[1:], "--out", str(out)]) == 0
    )  # the doctor's command, as printed, works
    data = page_data(out.read_text())
    assert (
        data["open"]["at"] is None and data["runs"][0]["spikes"][1]["step"] == 9
    )  # step 9 is not in the view
    assert main(["view", str(run), "--spike", "4", "--out", str(tmp_path / "at4.html")]) == 0
    capsys.readouterr()
    for bad, want in (
        ("7", "a spiking step of the runs (4, 9), got 7"),
        ("four", "(an integer), got 'four'"),
    ):
        assert main(["view", str(run), "--spike", bad, "--out", str(tmp_path / "bad.html")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("tokendyn view: error: --spike must be"), err
        assert want in err, err
    assert not (tmp_path / "bad.html").exists()


def test_a_run_without_a_view_says_so_in_the_doctor(tmp_path):
    run = new_run(tmp_path, "noview", probe_spike_k=3.0)
    write_frames(run, {"spikes": spike_rows(2, [(" the", 0.95, 0.5, 3)])}, rank=0)
    text = render_text(diagnose([run]))
    assert "no token view recorded (--probe_view_sequences N)" in text and "--spike" not in text


def test_the_page_opens_at_the_spike_in_chromium(tmp_path):
    from test_browser import LAUNCH_ARGS, Page, _need_browser

    path = _need_browser()
    from playwright.sync_api import sync_playwright

    run = spiky_run(tmp_path)
    out = tmp_path / "view.html"
    assert main(["view", str(run), "--out", str(out)]) == 0
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=path, args=LAUNCH_ARGS)
        try:
            page = Page(browser, out)
            active = page.page.evaluate(
                "(() => { const a = document.activeElement; return [a.textContent, a.dataset.seq, "
                "a.classList.contains('tv-spiked'), document.querySelectorAll('.tv-spiked').length] })()"
            )
            assert active == [PLANTED[2], str(PLANTED[0]), True, 1]
            assert page.page.input_value("#tv-step") == "0"
            # the list's second token: a click moves the highlight and the focus there
            page.page.click(".tv-spike-link[href='#tv-t-1-0']")
            assert page.page.evaluate("document.activeElement.textContent") == " Oliver"
            assert page.page.locator(".tv-spiked").all_inner_texts() == [" Oliver"]
            assert page.errors == [] and page.left_the_file() == []
        finally:
            browser.close()
