"""The dashboard's SVG plots: shapes in proportion, every label escaped."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from quota.dashboard._plots import bars_svg, usage_svg


def test_bars_are_in_proportion_and_labels_escaped() -> None:
    svg = bars_svg([("<b>&hot</b>", 10), ("cold", 5)])
    root = ET.fromstring(svg)  # well-formed: every label escaped
    widths = [int(r.get("width", "0")) for r in root.iter("{http://www.w3.org/2000/svg}rect")]
    assert widths[0] == 2 * widths[1]
    assert "<b>" not in svg and "&lt;b&gt;&amp;hot&lt;/b&gt;" in svg
    assert bars_svg([]) == ""


def test_usage_fills_to_the_share_used_and_marks_a_quota_used_up() -> None:
    svg = usage_svg([("a <x>", 25, 100), ("b", 100, 100), ("c", 3, None)])
    ET.fromstring(svg)
    fills = re.findall(r'<rect class="(used|over)" x="\d+" y="\d+" width="(\d+)"', svg)
    track = int(re.search(r'class="track" x="\d+" y="\d+" width="(\d+)"', svg).group(1))  # type: ignore[union-attr]
    assert fills[0] == ("used", str(track // 4))
    assert fills[1] == ("over", str(track))
    assert fills[2] == ("used", str(track))
    assert "25 / 100" in svg and "a &lt;x&gt;" in svg
