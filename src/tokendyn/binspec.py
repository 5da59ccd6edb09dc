"""Bin specs, parsed and checked without torch (a leaf module), so that the configuration checks (`tokendyn.config`)
run before torch is imported: ``"0,0.25,0.5,0.75,1"`` / ``"edges:0,0.1,1"`` (edges), ``"intervals:K"`` (K equal
intervals), ``"quantiles:K"`` (K bins at the step's quantiles of pi_old), an int K (K intervals) or a sequence of
edges."""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_EDGES: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)


# ---- bin specs ---------------------------------------------------------------------------------------------------
def interval_edges(n: int) -> tuple[float, ...]:
    """Edges of n equal intervals of [0, 1]: e_k = k / n, k = 0..n."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"bins: the number of intervals must be an integer >= 1, got {n!r}")
    return tuple(k / n for k in range(n + 1))


def validate_edges(edges: Sequence[float]) -> tuple[float, ...]:
    """Check custom edges: at least two, strictly increasing, first 0 and last 1 (they must cover [0, 1])."""
    try:
        out = tuple(float(e) for e in edges)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bins: edges must be numbers in [0, 1], got {edges!r}") from exc
    if len(out) < 2:
        raise ValueError(f"bins: need at least two edges, got {list(out)}")
    if out[0] != 0.0 or out[-1] != 1.0:
        raise ValueError(f"bins: edges must start at 0 and end at 1 (they cover [0, 1]), got {list(out)}")
    if any(b <= a for a, b in zip(out, out[1:], strict=False)):
        raise ValueError(f"bins: edges must be strictly increasing, got {list(out)}")
    return out


def parse_bins(spec: str | int | Sequence[float] | None) -> tuple[str, int, tuple[float, ...] | None]:
    """(kind, n, edges) of a bin spec (module docstring); kind "edges", "intervals" or "quantiles" (edges None)."""
    if spec is None:
        return "edges", len(DEFAULT_EDGES) - 1, DEFAULT_EDGES
    if isinstance(spec, bool):
        raise ValueError(f"bins: expected intervals:N, quantiles:N or a list of edges, got {spec!r}")
    if isinstance(spec, int):
        return "intervals", spec, interval_edges(spec)
    if isinstance(spec, str):
        text = spec.strip()
        head, _, tail = text.partition(":")
        head = head.strip().lower()
        if head in ("intervals", "quantiles") and tail:
            try:
                n = int(tail)
            except ValueError as exc:
                raise ValueError(f"bins: '{spec}': the count after ':' must be an integer >= 1") from exc
            if n < 1:
                raise ValueError(f"bins: '{spec}': the count after ':' must be an integer >= 1")
            return (head, n, interval_edges(n) if head == "intervals" else None)
        body = tail if head == "edges" else text
        try:
            values = [float(x) for x in body.split(",") if x.strip()]
        except ValueError as exc:
            raise ValueError(
                f"bins: cannot parse {spec!r}; use intervals:N, quantiles:N or comma-separated edges"
            ) from exc
        edges = validate_edges(values)
        return "edges", len(edges) - 1, edges
    edges = validate_edges(spec)
    return "edges", len(edges) - 1, edges


def describe_bins(kind: str, n: int, edges: tuple[float, ...] | None) -> str:
    """The canonical spec text of parsed bins: "quantiles:K", else the comma-separated edges."""
    return f"quantiles:{n}" if kind == "quantiles" else ",".join(_edge_text(e) for e in edges or ())


def _edge_text(e: float) -> str:
    """The shortest text that reads back as exactly ``e`` (0.9999999 stays 0.9999999; 1.0 is written 1)."""
    text = repr(float(e))
    return text.removesuffix(".0")
