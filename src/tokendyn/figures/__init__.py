"""matplotlib/seaborn figures from the records alone (no torch model), and the HTML report.

One function per figure, each taking polars frames of the records (a ``run`` column tells runs apart; `load_runs`
adds it) and returning a matplotlib Figure, or raising `MissingRecords` when its record kinds are absent:

    token_share            (a) tokens per probability interval + density of pi_old       binstats [, tokens]
    advantage_by_bin       (b) advantage per interval (violins)                           tokens
    prob_change_by_bin     (c) delta pi per interval after the full update                prob_change [, token_shares]
    gradient_norm_by_bin   (d) gradient norm per interval vs all tokens                   shares | binstats
    layer_bin_heatmap      (d) per layer and interval                                     shares | binstats
    isolation              (e) update one interval only                                   influence
    influence_matrix       (e) the whole influence matrix                                 influence
    bound                  (f) ||delta_l|| / |w| against pi, envelope and theory          tokens [, bound, checks]
    correct_ratio          (g) correct ratio per interval, per run                        prob_change
    update_shares          (h) projection shares per layer and over steps                 shares
    training_curves        (i) reward and accuracy per puzzle size                        metrics
    accuracy_table         (i) the accuracy table (a DataFrame)                           metrics

`build_report(run_dirs, out_dir)` draws all of them and writes report.html; `tokendyn figures` is its command.
"""

from tokendyn.figures.data import MissingRecords, Records, RunDirError, load_runs
from tokendyn.figures.dynamics import correct_ratio, influence_matrix, isolation, prob_change_by_bin
from tokendyn.figures.gradients import gradient_norm_by_bin, layer_bin_heatmap, update_shares
from tokendyn.figures.paired import paired_differences
from tokendyn.figures.report import FIGURES, ReportResult, build_report
from tokendyn.figures.tokens import advantage_by_bin, bound, token_share
from tokendyn.figures.training import accuracy_table, training_curves

__all__ = [
    "paired_differences",
    "FIGURES",
    "MissingRecords",
    "Records",
    "ReportResult",
    "RunDirError",
    "accuracy_table",
    "advantage_by_bin",
    "bound",
    "build_report",
    "correct_ratio",
    "gradient_norm_by_bin",
    "influence_matrix",
    "isolation",
    "layer_bin_heatmap",
    "load_runs",
    "prob_change_by_bin",
    "token_share",
    "training_curves",
    "update_shares",
]
