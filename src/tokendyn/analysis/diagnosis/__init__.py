"""The diagnosis of a run: findings (a measured value with its interval, the reference it is judged against and its
source, a verdict fine / watch / act, what to try) from any stack's records. Polars and numpy only, no torch.

    from tokendyn.analysis.diagnosis import diagnose, render_text
    doc = diagnose(["runs/demo/grpo"])        # the JSON document of `tokendyn doctor --json`
    print(render_text(doc))

One module per family of findings: dominance, bound, sampler, concentration, remedies, health; the thresholds and
their sources in `thresholds`, the JSON schema in `schema`.
"""

from tokendyn.analysis.diagnosis.diagnose import any_act, diagnose, diagnose_run, render_text, summary_line
from tokendyn.analysis.diagnosis.finding import ACT, FINE, WATCH, Finding, judge
from tokendyn.analysis.diagnosis.schema import SCHEMA, validate
from tokendyn.analysis.diagnosis.thresholds import THRESHOLDS, TRY

__all__ = [
    "ACT",
    "FINE",
    "SCHEMA",
    "THRESHOLDS",
    "TRY",
    "WATCH",
    "Finding",
    "any_act",
    "diagnose",
    "diagnose_run",
    "judge",
    "render_text",
    "summary_line",
    "validate",
]
