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
