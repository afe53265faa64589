"""``--html``: one offline, self-contained page (inline SVG and CSS, no script, no URL).

Two pictures of the reported device: the allocated bytes over the recorded trace with the top allocation
sites stacked and the OOM (or the peak) marked, and the segment map at that moment (every segment, its blocks
allocated / awaiting free / free). PyTorch's own ``_memory_viz`` HTML loads its viewer from a CDN; this page
needs nothing. Every string from the snapshot is HTML-escaped.
"""

from __future__ import annotations

from html import escape
from typing import Any

from . import model as M
from .analyze import Moment, Report, gib
from .replay import Replayer, Rounding
from .sites import Attributor

WIDTH, HEIGHT, LEFT = 1000, 320, 70
SAMPLES = 1000
MAX_SEGMENTS = 300
COLORS = ("#4e79a7", "#f28e2c", "#e15759", "#76b7b2", "#59a14f", "#edc949", "#af7aa1", "#ff9da7", "#9c755f",
          "#bab0ab")
OTHER, PENDING, FREE = "#d9d9d9", "#555555", "#ffffff"   # pending: dark grey, unlike any site colour


def _samples(n: int, allocated, must: list[int]) -> list[int]:
    """Positions 0..n to draw: per bucket the position of its highest allocation, plus ``must``."""
    if n + 1 <= SAMPLES:
        return list(range(n + 1))
    picks = set(p for p in must if 0 <= p <= n) | {0, n}
    step = (n + 1) / SAMPLES
    for k in range(SAMPLES):
        lo, hi = int(k * step), min(n + 1, int((k + 1) * step) or 1)
        if hi > lo:
            picks.add(max(range(lo, hi), key=allocated.__getitem__))
    return sorted(picks)


def timeline_series(snap: M.Snapshot, report: Report, top: int) -> dict[str, Any] | None:
    """The stacked series of the reported device: sampled positions, per top site its bytes, the rest."""
    m = report.moment
    if m is None or not m.entries:
        return None
    device = m.device
    trace = snap.traces.get(device, M.Trace())
    rounding = Rounding.from_settings(snap.allocator_settings, "expandable segments" in snap.format.features)
    replayer = Replayer(snap.segments.get(device, []), trace, rounding)
    tl = replayer.timeline()
    attributor = Attributor()
    names = [s.name for s in m.sites[:top]]
    index = {name: i for i, name in enumerate(names)}
    per_site = [0] * len(names)
    for b in replayer.state_at(0).blocks.values():
        if not b.pending:
            i = index.get(attributor.site(b.frames).text)
            if i is not None:
                per_site[i] += b.size
    positions = _samples(len(trace), tl.allocated, [m.position])
    wanted = iter(positions)
    nxt = next(wanted)
    series = []
    for p in range(len(trace) + 1):
        if p == nxt:
            series.append((p, tl.allocated[p], tl.reserved[p], tuple(per_site)))
            nxt = next(wanted, None)
            if nxt is None:
                break
        if p < len(trace) and tl.delta_bytes[p]:
            i = index.get(attributor.site(tl.delta_frames[p]).text)
            if i is not None:
                per_site[i] += tl.delta_bytes[p]
    return {"names": names, "series": series, "n": len(trace)}


def _timeline_svg(data: dict[str, Any], moment: Moment) -> str:
    series = data["series"]
    n = max(1, data["n"])
    ymax = max(max(r for _, _, r, _ in series), 1)
    plot_w, plot_h = WIDTH - LEFT - 10, HEIGHT - 40

    def x(p: int) -> float:
        return LEFT + plot_w * p / n

    def y(v: float) -> float:
        return 10 + plot_h * (1 - v / ymax)

    parts = [f'<svg width="{WIDTH}" height="{HEIGHT}" role="img" aria-label="allocated memory over the trace">']
    for k in range(5):
        v = ymax * k / 4
        parts.append(f'<line x1="{LEFT}" x2="{WIDTH - 10}" y1="{y(v):.1f}" y2="{y(v):.1f}" class="grid"/>'
                     f'<text x="{LEFT - 6}" y="{y(v) + 4:.1f}" class="axis" text-anchor="end">{gib(v)}</text>')
    layers = len(data["names"]) + 1
    bottoms = [0.0] * len(series)
    for layer in range(layers):
        tops = []
        for j, (_, alloc, _, per) in enumerate(series):
            value = per[layer] if layer < len(per) else alloc - sum(per)
            tops.append(bottoms[j] + max(0, value))
        pts = [f"{x(p):.1f},{y(t):.1f}" for (p, *_), t in zip(series, tops)]
        pts += [f"{x(p):.1f},{y(b):.1f}" for (p, *_), b in reversed(list(zip(series, bottoms)))]
        color = COLORS[layer % len(COLORS)] if layer < len(data["names"]) else OTHER
        label = escape(data["names"][layer]) if layer < len(data["names"]) else "other sites"
        parts.append(f'<polygon points="{" ".join(pts)}" fill="{color}"><title>{label}</title></polygon>')
        bottoms = tops
    reserved = " ".join(f"{x(p):.1f},{y(r):.1f}" for p, _, r, _ in series)
    parts.append(f'<polyline points="{reserved}" class="reserved"><title>reserved</title></polyline>')
    mx = x(moment.position)
    label = "OOM" if moment.kind == "oom" else "peak"
    parts.append(f'<line x1="{mx:.1f}" x2="{mx:.1f}" y1="10" y2="{10 + plot_h}" class="mark"/>'
                 f'<text x="{mx + 4:.1f}" y="22" class="marklabel">{label}: {gib(moment.totals.allocated)} allocated'
                 f'</text>')
    parts.append(f'<text x="{LEFT}" y="{HEIGHT - 8}" class="axis">trace entry 0</text>'
                 f'<text x="{WIDTH - 10}" y="{HEIGHT - 8}" class="axis" text-anchor="end">{data["n"]:,}</text></svg>')
    return "".join(parts)


def _segments_svg(moment: Moment, colors: dict[str, str]) -> tuple[str, int]:
    segments = sorted(moment.segments, key=lambda s: -s.size)[:MAX_SEGMENTS]
    segments.sort(key=lambda s: s.address)
    largest = max((s.size for s in segments), default=0) or 1   # a hostile file's segments may all be empty
    row, gap = 14, 4
    plot_w = WIDTH - LEFT - 10
    parts = [f'<svg width="{WIDTH}" height="{len(segments) * (row + gap) + 10}" role="img" aria-label="segment map">']
    for k, s in enumerate(segments):
        top = 5 + k * (row + gap)
        scale = plot_w / largest
        parts.append(f'<text x="{LEFT - 6}" y="{top + row - 3}" class="axis" text-anchor="end">{gib(s.size)}</text>')
        parts.append(f'<rect x="{LEFT}" y="{top}" width="{s.size * scale:.2f}" height="{row}" class="segment">'
                     f'<title>segment 0x{s.address:x}: {gib(s.size)} {s.kind}{" expandable" if s.expandable else ""}'
                     f', stream {s.stream}, largest free {gib(s.largest_free)}</title></rect>')
        run: list[Any] = []   # merged tiny blocks of one state: [start, end, state]

        def flush():
            if run:
                fill = FREE if run[2] == "free" else PENDING if run[2] == "pending" else OTHER
                parts.append(f'<rect x="{LEFT + run[0] * scale:.2f}" y="{top}" width="{(run[1] - run[0]) * scale:.2f}" '
                             f'height="{row}" fill="{fill}" class="block"/>')
                run.clear()
        for offset, size, state, site in s.blocks:
            if size * scale < 0.5:
                if run and run[2] == state and run[1] == offset:
                    run[1] = offset + size
                else:
                    flush()
                    run.extend([offset, offset + size, state])
                continue
            flush()
            fill = FREE if state == "free" else PENDING if state == "pending" else colors.get(site, OTHER)
            what = "free" if state == "free" else f"{escape(site)}{' (awaiting free)' if state == 'pending' else ''}"
            parts.append(f'<rect x="{LEFT + offset * scale:.2f}" y="{top}" width="{size * scale:.2f}" height="{row}" '
                         f'fill="{fill}" class="block"><title>{gib(size)} {what}</title></rect>')
        flush()
    parts.append("</svg>")
    return "".join(parts), len(moment.segments) - len(segments)


STYLE = """body{font-family:system-ui,sans-serif;margin:24px;color:#222}h1{font-size:20px}h2{font-size:16px;margin-top:28px}
.grid{stroke:#eee}.axis{font-size:11px;fill:#555}.reserved{fill:none;stroke:#222;stroke-dasharray:4 3}
.mark{stroke:#d62728;stroke-width:2}.marklabel{font-size:12px;fill:#d62728}.segment{fill:#fff;stroke:#888}
.block{stroke:none}table{border-collapse:collapse;font-size:13px}td,th{padding:3px 8px;border-bottom:1px solid #eee;
text-align:left}.sw{display:inline-block;width:12px;height:12px;margin-right:6px;vertical-align:middle}
pre{background:#f7f7f7;padding:8px;white-space:pre-wrap}"""


def page(snap: M.Snapshot, report: Report, summary_text: str, top: int) -> str:
    m = report.moment
    title = f"memory snapshot: {escape(report.path)}"
    body = [f"<h1>{title}</h1>", f"<pre>{escape(summary_text)}</pre>"]
    if m is None:
        body.append("<p>The snapshot is empty: nothing to draw.</p>")
    else:
        colors = {s.name: COLORS[i % len(COLORS)] for i, s in enumerate(m.sites[:top])}
        data = timeline_series(snap, report, top)
        if data:
            body.append(f"<h2>Allocated memory on device {m.device} over the recorded trace "
                        "(top sites stacked; dashed: reserved)</h2>")
            body.append(_timeline_svg(data, m))
        else:
            body.append("<p>No trace in this snapshot (history was not recorded): no timeline.</p>")
        legend = "".join(f'<tr><td><span class="sw" style="background:{colors[s.name]}"></span>{escape(s.name)}</td>'
                         f"<td>{gib(s.bytes)}</td><td>{s.count:,}</td><td>{escape(s.category)}</td></tr>"
                         for s in m.sites[:top])
        body.append("<h2>Top allocation sites at the " + ("OOM" if m.kind == "oom" else m.kind) + "</h2>"
                    f"<table><tr><th>site</th><th>bytes</th><th>blocks</th><th>category</th></tr>{legend}</table>")
        svg, hidden = _segments_svg(m, colors)
        body.append(f"<h2>Segment map at the {'OOM' if m.kind == 'oom' else m.kind} ({m.totals.segments} segments; "
                    f"white: free, dark grey: awaiting free, light grey: other sites)</h2>" + svg)
        if hidden:
            body.append(f"<p>{hidden} smaller segments are not drawn.</p>")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{title}</title><style>{STYLE}</style></head><body>{''.join(body)}</body></html>\n")
