"""``mbmem doctor --plot FILE``: the run's per-rank memory as bars against the GPU's capacity (matplotlib,
the ``[plot]`` extra), drawn in memory/steps.py's style: horizontal bars, one row per rank (or per pipeline
stage when many ranks report), the capacity and the margin as lines, each bar's figure at its end, and with
``--plan`` the planned peak as a marker. It draws the report's ``run`` object (the JSON), so the picture
shows exactly what ``--json`` says, and only readable reports (an unreadable memory line is never a row).
Rendered to bytes in memory; the command writes them through core/outfile.py."""

from __future__ import annotations

from typing import Any

from ..core.text import shown

GiB = 1 << 30
PLOT_SUFFIXES = (".png", ".pdf", ".svg")
MAX_ROWS = 48          # more reporting ranks than this: one row per stage (its hottest rank)


def _peak(r: dict) -> int:
    return r.get("max_reserved_bytes") or r.get("max_allocated_bytes") or r.get("reserved_bytes") \
        or r.get("allocated_bytes") or 0


def rows_to_plot(run: dict[str, Any]) -> list[dict]:
    rows = [r for r in run["ranks"] if _peak(r)]
    if len(rows) > MAX_ROWS and any(r["stage"] is not None for r in rows):
        best: dict = {}
        for r in rows:
            if r["stage"] is not None and (r["stage"] not in best or _peak(r) > _peak(best[r["stage"]])):
                best[r["stage"]] = r
        rows = [best[s] for s in sorted(best)]
    return rows[:MAX_ROWS]


def draw_run(run: dict[str, Any], title: str):
    """The figure, or None when no rank has figures to plot."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = rows_to_plot(run)
    if not rows:
        return None
    n = len(rows)
    planned = {p["label"]: p.get("planned_peak_bytes") for p in run.get("planned") or []}
    cap, margin = run.get("capacity_bytes"), run.get("margin", 0.05)
    limit = cap * (1 - margin) if cap else None
    reserved = [(r["max_reserved_bytes"] or 0) / GiB for r in rows]
    allocated = [(r["max_allocated_bytes"] or r["allocated_bytes"] or 0) / GiB for r in rows]
    marks = [planned.get(r["label"]) for r in rows]
    right = max(reserved + allocated + [(m or 0) / GiB for m in marks] + [cap / GiB if cap else 0.0]) * 1.3 or 1.0
    fig, ax = plt.subplots(figsize=(10, 1.9 + 0.42 * n), layout="constrained")
    ys = list(range(n))[::-1]  # the first rank on top
    ax.barh(ys, reserved, height=0.7, color="#aec7e8", edgecolor="white", label="max reserved")
    ax.barh(ys, allocated, height=0.45, color="#1f77b4", edgecolor="white", label="max allocated")
    if any(m is not None for m in marks):
        ax.scatter([m / GiB for m in marks if m is not None], [y for y, m in zip(ys, marks) if m is not None],
                   marker="D", color="#d62728", zorder=5, label="planned peak (--plan)")
    if cap:
        ax.axvline(cap / GiB, color="black", linestyle="--", linewidth=1.2, zorder=1,
                   label=f"GPU capacity {cap / GiB:.1f} GiB")
        ax.axvline(limit / GiB, color="grey", linestyle=":", linewidth=1.2, zorder=1,
                   label=f"{margin:.0%} margin: {limit / GiB:.1f} GiB")
    for y, r, res, alc in zip(ys, rows, reserved, allocated):
        peak = max(res, alc)
        text = f"{peak:.1f} GiB" + ("" if r["headroom_bytes"] is None else f", {r['headroom_bytes'] / GiB:.1f} free")
        color = "black" if limit is None else ("#1a7f37" if _peak(r) <= limit else "#b3261e")
        # a white box, so the capacity lines never run through the text
        ax.text(peak + right * 0.012, y, text, va="center", ha="left", fontsize=8, color=color, zorder=3,
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.2})
    labels = [f"rank {shown(r['label'])[:24]}" + ("" if r["stage"] is None else f" (PP {r['stage']})")
              + (" hot" if r["label"] == run.get("hot_label") else "") for r in rows]
    ax.set_yticks(ys, labels, fontsize=8)
    ax.set_xlim(0, right)
    ax.set_ylim(-0.6, n - 0.4)
    ax.set_xlabel("GiB per GPU, as the job's memory lines report it")
    ax.set_title(shown(title)[:180], fontsize=10)
    fig.legend(fontsize=8, loc="outside lower center", ncol=3, frameon=False)
    return fig


def render(run: dict[str, Any], title: str, suffix: str) -> bytes | None:
    """The picture as bytes in the format of ``suffix`` (.png, .pdf, .svg), drawn in memory so that nothing is
    written before the whole picture exists; None when no rank has figures."""
    from ..core.outfile import figure_bytes
    fig = draw_run(run, title)
    return None if fig is None else figure_bytes(fig, f"plot{suffix}")
