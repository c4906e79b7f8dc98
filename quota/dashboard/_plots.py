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
