"""Server-side plots: plain SVG strings, every label escaped (no script, no build step)."""

from __future__ import annotations

from html import escape


def bars_svg(items: list[tuple[str, int]], *, width: int = 640, bar: int = 18) -> str:
    """A horizontal bar chart of `items` (label, value) as an inline SVG element ('' if none)."""
    if not items:
        return ""
    top = max(value for _, value in items) or 1
    label_w = 220
    height = bar * len(items) + 4
    rows = []
    for i, (label, value) in enumerate(items):
        y = i * bar + 2
        w = max(1, int((width - label_w - 60) * value / top))
        short = label if len(label) <= 30 else label[:29] + "…"
        rows.append(
            f'<text x="{label_w - 6}" y="{y + bar - 5}" text-anchor="end">{escape(short)}</text>'
            f'<rect x="{label_w}" y="{y}" width="{w}" height="{bar - 4}"><title>{escape(label)}:'
            f" {value}</title></rect>"
            f'<text x="{label_w + w + 4}" y="{y + bar - 5}">{value}</text>'
        )
    return (
        f'<svg class="plot" role="img" aria-label="busiest keys" width="{width}" height="{height}"'
        f' viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">{"".join(rows)}</svg>'
    )


def usage_svg(items: list[tuple[str, int, int | None]], *, width: int = 640, bar: int = 18) -> str:
    """Each quota's use of its period as a filled bar: `items` are (label, used, allowed).

    `allowed` is the limit with grants (None when unknown: the bar is drawn full width
    and labelled with the count only). '' if there is nothing to draw.
    """
    if not items:
        return ""
    label_w, track = 220, width - 220 - 120
    height = bar * len(items) + 4
    rows = []
    for i, (label, used, allowed) in enumerate(items):
        y = i * bar + 2
        share = 1.0 if not allowed else min(1.0, used / allowed)
        fill = "over" if allowed is not None and used >= allowed else "used"
        short = label if len(label) <= 30 else label[:29] + "…"
        text = f"{used}" if allowed is None else f"{used} / {allowed}"
        rows.append(
            f'<text x="{label_w - 6}" y="{y + bar - 5}" text-anchor="end">{escape(short)}</text>'
            f'<rect class="track" x="{label_w}" y="{y}" width="{track}" height="{bar - 4}"/>'
            f'<rect class="{fill}" x="{label_w}" y="{y}" width="{max(1, int(track * share))}"'
            f' height="{bar - 4}"><title>{escape(label)}: {escape(text)}</title></rect>'
            f'<text x="{label_w + track + 4}" y="{y + bar - 5}">{escape(text)}</text>'
        )
    return (
        f'<svg class="plot" role="img" aria-label="quota usage" width="{width}" height="{height}"'
        f' viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">{"".join(rows)}</svg>'
    )


def _figure(value: float) -> str:
    return f"{value:.2f}"


def rates_svg(
    history: list[dict[str, float]], *, span: float, width: int = 640, height: int = 180
) -> str:
    """Decisions and denials per second over the last `span` seconds, as an inline SVG
    element: one polyline point per sample of `history` (``t`` seconds ago, oldest first).

    Time runs left to right, from `span` seconds ago to now; the vertical scale runs from
    0 to the largest figure. The latest figures are also given as text, and in the
    ``<desc>``. An empty history draws the axes and says so. No style attribute (the
    dashboard's CSP allows its stylesheet only) and no script.
    """
    left, right, top, bottom = 56, 12, 24, 24
    plot_w, plot_h = width - left - right, height - top - bottom
    peak = max((max(s["decisions_per_s"], s["denials_per_s"]) for s in history), default=0.0)
    scale = peak or 1.0

    def x(sample: dict[str, float]) -> str:
        return f"{left + plot_w * (span - min(sample['t'], span)) / span:.1f}"

    def points(name: str) -> str:
        return " ".join(f"{x(s)},{top + plot_h * (1 - s[name] / scale):.1f}" for s in history)

    minutes = f"{span / 60:g}"
    if history:
        latest = history[-1]
        said = (
            f"latest: {_figure(latest['decisions_per_s'])} decisions/s,"
            f" {_figure(latest['denials_per_s'])} denials/s"
        )
        desc = f"{len(history)} samples, the largest {_figure(peak)} per second; {said}."
        base = top + plot_h
        # The area under the decisions, closed down to the axis below the first and last.
        area = f"{x(history[0])},{base} {points('decisions_per_s')} {x(history[-1])},{base}"
        lines = (
            f'<polygon class="area" points="{area}"/>'
            f'<polyline class="decisions" points="{points("decisions_per_s")}"/>'
            f'<polyline class="denials" points="{points("denials_per_s")}"/>'
        )
    else:
        said = "no sample yet: the first comes with the next update"
        desc = said + "."
        lines = ""
    return (
        f'<svg class="plot rates" role="img" aria-labelledby="rates-plot-title rates-plot-desc"'
        f' width="{width}" height="{height}" viewBox="0 0 {width} {height}"'
        f' xmlns="http://www.w3.org/2000/svg">'
        f'<title id="rates-plot-title">Decisions and denials per second, the last'
        f" {escape(minutes)} minutes</title>"
        f'<desc id="rates-plot-desc">{escape(desc)}</desc>'
        f'<line class="axis" x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}"'
        f' y2="{top + plot_h}"/>'
        f'<line class="axis" x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}"/>'
        f'<text x="{left - 4}" y="{top + 4}" text-anchor="end">{_figure(peak)}/s</text>'
        f'<text x="{left - 4}" y="{top + plot_h}" text-anchor="end">0</text>'
        f'<text x="{left}" y="{height - 6}">-{escape(minutes)} min</text>'
        f'<text x="{left + plot_w}" y="{height - 6}" text-anchor="end">now</text>'
        f"{lines}"
        f'<text class="latest" x="{left + 4}" y="{top - 8}">{escape(said)}</text>'
        "</svg>"
    )
