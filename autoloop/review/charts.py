"""The report's charts, drawn as inline SVG in plain Python (no matplotlib).

The report is part of the morning, so it must work with the README's install, which has
no plotting library; SVG text in the page also keeps it one self-contained file, with
text a browser can search and zoom. Two charts:

* `progress_svg`: every trial over its number. Kept trials green (labelled with what they
  changed, an error bar of ±1.96 standard errors where they are means of several runs),
  the running best as a step line, the baseline as a dashed line, discarded proposals
  grey and labelled with their trial number (the discard table below the chart says what
  each tried and why it went), drift checks and re-runs as hollow squares, ablations as
  hollow triangles, and trials without a verdict on the metric (crashed, timed out,
  invalid, interrupted, running) in a strip of their own below. Outliers above the
  chart's top (a diverged trial at 8.0 next to 1.0s) are triangles on its top edge.
  Every mark has a tooltip (`<title>`): trial, status, val_bpb, what was tried, the reason.
  The legend counts come from `point_groups`, the same function the headline's cards are
  checked against.
* `curves_svg`: the training loss over steps of the baseline and the best trial.

Only the geometry lives here; the numbers come from autoloop.review.report's data.
"""

from __future__ import annotations

import html
import math

from autoloop.store import Kind, Status

COLOURS = {
    "keep": "#1a9850", "discard": "#9e9e9e", "crash": "#d73027", "timeout": "#f46d43", "invalid": "#984ea3",
    "interrupted": "#e6ab02", "running": "#2c7fb8", "baseline": "#2c7fb8", "best": "#1a9850",
    "drift": "#8c6d31", "ablation": "#7b3294",
}
APART = (Status.CRASH.value, Status.TIMEOUT.value, Status.INVALID.value, Status.INTERRUPTED.value,
         Status.RUNNING.value)
REMEASURES = (Kind.DRIFT.value, Kind.RERUN.value)
Z95 = 1.96  # error bars: ±1.96 standard errors, a 95% interval of the mean
MAX_LABELLED_DISCARDS = 60  # beyond this, discard numbers would pile up: tooltips and the table say it
MAX_ANNOTATIONS = 12
FONT = "-apple-system, BlinkMacSystemFont, 'Segoe UI', Helvetica, Arial, sans-serif"


def _e(value) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def point_groups(points: list[dict]) -> dict[str, list[dict]]:
    """The trials of the progress chart by what they are, each in exactly one group:
    baseline, kept (changes), discarded (proposals and repairs, and old trials of no kind),
    remeasured (drift checks and re-runs of the incumbent), ablation, and apart (no
    verdict on the metric: crash, timeout, invalid, interrupted, running)."""
    groups: dict[str, list[dict]] = {k: [] for k in ("baseline", "kept", "discarded", "remeasured", "ablation", "apart")}
    for p in points:
        if p["status"] in APART or p.get("metric") is None:
            groups["apart"].append(p)
        elif p["kind"] == Kind.ABLATION.value:
            groups["ablation"].append(p)
        elif p["kind"] in REMEASURES:
            groups["remeasured"].append(p)
        elif p["status"] == Status.KEEP.value:
            groups["baseline" if p["kind"] == Kind.BASELINE.value else "kept"].append(p)
        else:
            groups["discarded"].append(p)
    return groups


# ---------------------------------------------------------------------------- axes


def nice_ticks(low: float, high: float, count: int = 6) -> list[float]:
    """About `count` round tick values covering [low, high]."""
    if not (math.isfinite(low) and math.isfinite(high)) or high <= low:
        return [low]
    raw = (high - low) / max(count - 1, 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.ceil(low / step - 1e-9) * step
    ticks = []
    value = first
    while value <= high + step * 1e-9:
        ticks.append(round(value, 12))
        value += step
    return ticks


def _tick_text(value: float, step: float) -> str:
    decimals = max(0, -math.floor(math.log10(step)) + (1 if step / 10 ** math.floor(math.log10(step)) == 2.5 else 0)) \
        if step > 0 else 0
    return f"{value:.{decimals}f}"


class _Frame:
    """A plot area inside an SVG: data coordinates -> pixels."""

    def __init__(self, left: float, top: float, width: float, height: float, x0: float, x1: float, y0: float,
                 y1: float):
        self.left, self.top, self.width, self.height = left, top, width, height
        self.x0, self.x1 = x0, x1 if x1 > x0 else x0 + 1
        self.y0, self.y1 = y0, y1 if y1 > y0 else y0 + 1

    def x(self, value: float) -> float:
        return self.left + (value - self.x0) / (self.x1 - self.x0) * self.width

    def y(self, value: float) -> float:
        return self.top + (self.y1 - value) / (self.y1 - self.y0) * self.height


def _text(x: float, y: float, text: str, *, size: int = 12, anchor: str = "start", fill: str = "#1f2328",
          extra: str = "") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" fill="{fill}"{extra}>'
            f"{_e(text)}</text>")


def _tip(point: dict) -> str:
    metric = f"{point['metric']:.6f}" if point.get("metric") is not None else "no val_bpb"
    parts = [f"trial {point['number']} ({point['kind']}, {point['status']}): {metric}"]
    if point.get("description"):
        parts.append(str(point["description"]))
    if point.get("reason"):
        parts.append(str(point["reason"]))
    return f"<title>{_e(' — '.join(parts))}</title>"


def _axes(frame: _Frame, xticks: list[float], yticks: list[float], xlabel: str, ylabel: str,
          ystep: float) -> list[str]:
    out = [f'<rect class="frame" x="{frame.left}" y="{frame.top}" width="{frame.width}" height="{frame.height}" '
           'fill="none" stroke="#444" stroke-width="1"/>']
    for v in yticks:
        y = frame.y(v)
        out.append(f'<line x1="{frame.left}" x2="{frame.left + frame.width}" y1="{y:.1f}" y2="{y:.1f}" '
                   'stroke="#000" stroke-opacity="0.08"/>')
        out.append(_text(frame.left - 6, y + 4, _tick_text(v, ystep), size=11, anchor="end"))
    for v in xticks:
        x = frame.x(v)
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{frame.top}" y2="{frame.top + frame.height}" '
                   'stroke="#000" stroke-opacity="0.06"/>')
    out.append(_text(frame.left - 52, frame.top + frame.height / 2, ylabel, size=12, anchor="middle",
                     extra=f' transform="rotate(-90 {frame.left - 52:.1f} {frame.top + frame.height / 2:.1f})"'))
    return out


def _xticks(points: list[dict]) -> list[float]:
    numbers = [p["number"] for p in points] or [1]
    ticks = [t for t in nice_ticks(min(numbers), max(numbers), 10) if float(t).is_integer()]
    return ticks or [min(numbers)]


def _svg(width: int, height: int, body: list[str], label: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" viewBox="0 0 {width} {height}" '
            f'width="100%" role="img" aria-label="{_e(label)}" font-family="{_e(FONT)}">'
            + "".join(body) + "</svg>")


def _legend(entries: list[tuple[str, str]], x: float, y: float) -> list[str]:
    """One row of (swatch svg at (0, 0), label) from the right edge `x` leftwards."""
    out, cursor = [], x
    for swatch, label in reversed(entries):
        width = 7.0 * len(label) + 26
        cursor -= width
        out.append(f'<g class="legend" transform="translate({cursor:.1f},{y:.1f})">{swatch}'
                   f'{_text(14, 4, label, size=12)}</g>')
    return out


# ---------------------------------------------------------------------------- progress


def progress_svg(data: dict) -> str:
    """The progress chart (module docstring) as one <svg> element."""
    points = data["points"]
    head = data["headline"]
    groups = point_groups(points)
    rows = [s for s in APART if any(p["status"] == s for p in groups["apart"])]
    width, left, right = 1100, 80, 20
    top, plot_h = 62, 360
    strip_top = top + plot_h + 14
    strip_h = 22 * max(len(rows), 1) + 10
    height = strip_top + strip_h + 44
    scored = [p for g in ("baseline", "kept", "discarded", "remeasured", "ablation") for p in groups[g]]
    numbers = [p["number"] for p in points] or [1]
    pad = max(0.5, 0.02 * (max(numbers) - min(numbers)))
    x0, x1 = min(numbers) - pad, max(numbers) + pad
    body: list[str] = []
    baseline = head.get("baseline_metric")
    title = (f"run '{head['run']}': {head['trials']} trial{'s' if head['trials'] != 1 else ''}, "
             f"{head['kept']} kept change{'s' if head['kept'] != 1 else ''}")
    body.append(_text(left, 22, title, size=15, extra=' font-weight="600"'))
    legend: list[tuple[str, str]] = []
    if scored:
        metrics = sorted(p["metric"] for p in scored)
        low = metrics[0]
        # Outliers would flatten the chart: the top is the baseline or the 90th percentile,
        # whichever is higher; points above it are triangles on the top edge.
        high = max(baseline if baseline is not None else metrics[-1], metrics[int(0.9 * (len(metrics) - 1))])
        barred = [p for p in groups["kept"] + groups["baseline"] if _has_bar(p)]
        if barred:
            low = min(low, *(p["metric"] - Z95 * p["metric_sd"] for p in barred))
            high = max(high, *(p["metric"] + Z95 * p["metric_sd"] for p in barred))
        span = (high - low) or abs(high) * 0.01 or 0.01
        y0, y1 = low - 0.1 * span, high + 0.1 * span
        yticks = nice_ticks(y0, y1, 7)
        ystep = yticks[1] - yticks[0] if len(yticks) > 1 else span
        frame = _Frame(left, top, width - left - right, plot_h, x0, x1, y0, y1)
        body += _axes(frame, _xticks(points), yticks, "", "val_bpb (lower is better)", ystep)
        if baseline is not None:
            y = frame.y(baseline)
            body.append(f'<line class="baseline-line" x1="{frame.left}" x2="{frame.left + frame.width}" y1="{y:.1f}" '
                        f'y2="{y:.1f}" stroke="{COLOURS["baseline"]}" stroke-dasharray="6 4" stroke-width="1.2"/>')
            legend.append((f'<line x1="0" x2="10" y1="0" y2="0" stroke="{COLOURS["baseline"]}" stroke-dasharray="3 2"/>',
                           f"baseline {baseline:.4f}"))
        body += _running_best(frame, groups["baseline"] + groups["kept"], numbers[-1], legend)
        clipped = lambda p: p["metric"] > y1  # noqa: E731
        # Discarded proposals: grey, labelled with their number.
        discards = groups["discarded"]
        label_discards = len(discards) <= MAX_LABELLED_DISCARDS
        for p in discards:
            x = frame.x(p["number"])
            if clipped(p):
                body.append(f'<path class="point discard above" data-trial="{p["number"]}" d="M{x - 5:.1f},{top + 9:.1f} L{x + 5:.1f},{top + 9:.1f} '
                            f'L{x:.1f},{top + 1:.1f} Z" fill="{COLOURS["discard"]}">{_tip(p)}</path>')
                y = top + 24  # its label goes below the triangle, inside the frame
            else:
                y = frame.y(p["metric"])
                body.append(f'<circle class="point discard" data-trial="{p["number"]}" cx="{x:.1f}" cy="{y:.1f}" r="4.5" '
                            f'fill="{COLOURS["discard"]}" fill-opacity="0.75">{_tip(p)}</circle>')
            if label_discards:
                body.append(_text(x + 6, y - 5, f"#{p['number']}", size=10, fill="#6e7781",
                                  extra=' class="discard-label"'))
        if discards:
            legend.append((f'<circle cx="5" cy="0" r="4.5" fill="{COLOURS["discard"]}"/>', f"discarded ({len(discards)})"))
        for kind, shape, label in (("remeasured", "square", "drift check / re-run"), ("ablation", "triangle", "ablation")):
            colour = COLOURS["drift" if kind == "remeasured" else "ablation"]
            for p in groups[kind]:
                x, y = frame.x(p["number"]), frame.y(min(p["metric"], y1))
                body.append(_marker(shape, x, y, colour, f'class="point {kind}"', _tip(p)))
            if groups[kind]:
                legend.append((_marker(shape, 5, 0, colour, "", ""), f"{label} ({len(groups[kind])})"))
        for p in sorted(groups["kept"] + groups["baseline"], key=lambda p: p["number"]):
            if _has_bar(p):
                x, ya, yb = frame.x(p["number"]), frame.y(p["metric"] - Z95 * p["metric_sd"]), \
                    frame.y(p["metric"] + Z95 * p["metric_sd"])
                body.append(f'<g class="errorbar" stroke="#14532d" stroke-width="1.4"><line x1="{x:.1f}" x2="{x:.1f}" '
                            f'y1="{ya:.1f}" y2="{yb:.1f}"/><line x1="{x - 4:.1f}" x2="{x + 4:.1f}" y1="{ya:.1f}" '
                            f'y2="{ya:.1f}"/><line x1="{x - 4:.1f}" x2="{x + 4:.1f}" y1="{yb:.1f}" y2="{yb:.1f}"/></g>')
        if any(_has_bar(p) for p in groups["kept"] + groups["baseline"]):
            legend.append(('<line x1="5" x2="5" y1="-6" y2="6" stroke="#14532d" stroke-width="1.4"/>', "mean ± 1.96 se"))
        for p in groups["baseline"]:
            x, y = frame.x(p["number"]), frame.y(p["metric"])
            body.append(f'<path class="point baseline" d="M{x:.1f},{y - 7:.1f} L{x + 7:.1f},{y:.1f} L{x:.1f},{y + 7:.1f} '
                        f'L{x - 7:.1f},{y:.1f} Z" fill="{COLOURS["baseline"]}" stroke="#000" stroke-width="0.6">'
                        f"{_tip(p)}</path>")
        if groups["baseline"]:
            legend.append((f'<path d="M5,-5 L10,0 L5,5 L0,0 Z" fill="{COLOURS["baseline"]}"/>', "baseline trial"))
        for p in groups["kept"]:
            x, y = frame.x(p["number"]), frame.y(min(p["metric"], y1))
            body.append(f'<circle class="point keep" data-trial="{p["number"]}" cx="{x:.1f}" cy="{y:.1f}" r="6.5" '
                        f'fill="{COLOURS["keep"]}" stroke="#000" stroke-width="0.6">{_tip(p)}</circle>')
        if groups["kept"]:
            legend.append((f'<circle cx="5" cy="0" r="5" fill="{COLOURS["keep"]}" stroke="#000" stroke-width="0.6"/>',
                           f"kept ({len(groups['kept'])})"))
        body += _kept_labels(frame, groups["baseline"] + groups["kept"], numbers[-1])
    else:
        frame = _Frame(left, top, width - left - right, plot_h, x0, x1, 0, 1)
        body.append(f'<rect x="{left}" y="{top}" width="{frame.width}" height="{plot_h}" fill="none" stroke="#444"/>')
        body.append(_text(left + frame.width / 2, top + plot_h / 2, "no trial has a metric yet", size=13,
                          anchor="middle", fill="#666"))
    body += _legend(legend, width - right, 46)
    # The strip: trials without a verdict on the metric.
    body.append(f'<rect x="{left}" y="{strip_top}" width="{width - left - right}" height="{strip_h}" fill="none" '
                'stroke="#444"/>')
    strip = _Frame(left, strip_top, width - left - right, strip_h, x0, x1, 0, 1)
    if not rows:
        body.append(_text(left + strip.width / 2, strip_top + strip_h / 2 + 4,
                          "no crashed, timed-out, invalid or interrupted trials", size=11, anchor="middle", fill="#666"))
    for row, status in enumerate(rows):
        y = strip_top + 16 + 22 * row
        mine = [p for p in groups["apart"] if p["status"] == status]
        body.append(_text(left - 6, y + 4, f"{status} ({len(mine)})", size=11, anchor="end"))
        for p in mine:
            x = strip.x(p["number"])
            if status in (Status.CRASH.value, Status.TIMEOUT.value):
                body.append(f'<g class="point {status}" stroke="{COLOURS[status]}" stroke-width="2">'
                            f'<line x1="{x - 4:.1f}" x2="{x + 4:.1f}" y1="{y - 4:.1f}" y2="{y + 4:.1f}"/>'
                            f'<line x1="{x - 4:.1f}" x2="{x + 4:.1f}" y1="{y + 4:.1f}" y2="{y - 4:.1f}"/>{_tip(p)}</g>')
            else:
                body.append(f'<circle class="point {status}" cx="{x:.1f}" cy="{y:.1f}" r="4.5" '
                            f'fill="{COLOURS[status]}">{_tip(p)}</circle>')
    for v in _xticks(points):
        body.append(_text(strip.x(v), strip_top + strip_h + 16, f"{v:g}", size=11, anchor="middle"))
    body.append(_text(left + strip.width / 2, strip_top + strip_h + 36, "trial number", size=12, anchor="middle"))
    return _svg(width, height, body, "progress chart: val_bpb of every trial")


def _has_bar(p: dict) -> bool:
    return (p.get("n_runs") or 0) > 1 and p.get("metric_sd") is not None and p.get("metric") is not None


def _marker(shape: str, x: float, y: float, colour: str, attrs: str, tip: str) -> str:
    if shape == "square":
        return (f'<rect {attrs} x="{x - 5:.1f}" y="{y - 5:.1f}" width="10" height="10" fill="none" stroke="{colour}" '
                f'stroke-width="1.4">{tip}</rect>')
    return (f'<path {attrs} d="M{x - 6:.1f},{y - 4:.1f} L{x + 6:.1f},{y - 4:.1f} L{x:.1f},{y + 6:.1f} Z" fill="none" '
            f'stroke="{colour}" stroke-width="1.4">{tip}</path>')


def _running_best(frame: _Frame, kept: list[dict], last: int, legend: list) -> list[str]:
    kept = sorted(kept, key=lambda p: p["number"])
    if not kept:
        return []
    coords, best = [], None
    for p in kept:
        if best is None or p["metric"] < best:
            if best is not None:
                coords.append((frame.x(p["number"]), frame.y(best)))
            best = p["metric"]
            coords.append((frame.x(p["number"]), frame.y(best)))
    coords.append((frame.x(last), frame.y(best)))
    path = " ".join(f"{'M' if i == 0 else 'L'}{x:.1f},{y:.1f}" for i, (x, y) in enumerate(coords))
    legend.append((f'<line x1="0" x2="10" y1="0" y2="0" stroke="{COLOURS["best"]}" stroke-width="2"/>', "running best"))
    return [f'<path class="running-best" d="{path}" fill="none" stroke="{COLOURS["best"]}" stroke-width="2" '
            'stroke-opacity="0.85"/>']


def _kept_labels(frame: _Frame, kept: list[dict], last: int) -> list[str]:
    """Every kept trial's label when there are few, else the biggest steps only."""
    chosen = kept
    if len(kept) > MAX_ANNOTATIONS:
        steps = sorted((p for p in kept if p.get("delta_step")), key=lambda p: p["delta_step"])
        chosen = sorted(steps[:MAX_ANNOTATIONS // 2], key=lambda p: p["number"])
    first = min((p["number"] for p in kept), default=0)
    out = []
    for p in chosen:
        label = p.get("label") or f"#{p['number']}"
        right = last > first and (p["number"] - first) / (last - first) > 0.75
        x, y = frame.x(p["number"]), frame.y(min(p["metric"], frame.y1))
        out.append(_text(x + (-9 if right else 9), y - 9, label, size=11, anchor="end" if right else "start",
                         fill="#14532d", extra=' class="keep-label"'))
    return out


# ---------------------------------------------------------------------------- loss curves


def curves_svg(data: dict) -> str | None:
    """Training loss over steps of the baseline and the best trial (None if neither recorded one)."""
    curves = {k: v for k, v in data["curves"].items() if v["points"]}
    if not curves:
        return None
    width, left, right, top, plot_h = 1100, 80, 20, 50, 300
    height = top + plot_h + 50
    steps = [p["step"] for c in curves.values() for p in c["points"]]
    losses = [p["loss"] for c in curves.values() for p in c["points"] if p["loss"] is not None
              and math.isfinite(p["loss"])]
    if not losses:
        return None
    x0, x1 = min(steps), max(steps)
    if x0 == x1:  # one logged step: give the axis integer room
        x0, x1 = x0 - 1, x1 + 1
    lo, hi = min(losses), max(losses)
    span = (hi - lo) or abs(hi) * 0.05 or 0.05
    yticks = nice_ticks(lo - 0.05 * span, hi + 0.05 * span, 6)
    ystep = yticks[1] - yticks[0] if len(yticks) > 1 else span
    frame = _Frame(left, top, width - left - right, plot_h, x0, x1, lo - 0.05 * span, hi + 0.05 * span)
    xticks = [t for t in nice_ticks(x0, x1, 10) if float(t).is_integer()] or [x0]
    body = [_text(left, 22, "loss curves", size=15, extra=' font-weight="600"')]
    body += _axes(frame, xticks, yticks, "step", "training loss", ystep)
    legend = []
    for label, curve in curves.items():
        pts = [(frame.x(p["step"]), frame.y(p["loss"])) for p in curve["points"]
               if p["loss"] is not None and math.isfinite(p["loss"])]
        colour = COLOURS[label]
        path = " ".join(f"{'M' if i == 0 else 'L'}{x:.1f},{y:.1f}" for i, (x, y) in enumerate(pts))
        body.append(f'<path class="curve {label}" d="{path}" fill="none" stroke="{colour}" stroke-width="1.8"/>')
        if len(pts) < 40:
            body += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colour}"/>' for x, y in pts]
        metric = f", val_bpb {curve['metric']:.4f}" if curve.get("metric") is not None else ""
        legend.append((f'<line x1="0" x2="10" y1="0" y2="0" stroke="{colour}" stroke-width="2"/>',
                       f"{label}: trial {curve['trial']}{metric}"))
    body += _legend(legend, width - right, 40)
    for v in xticks:
        body.append(_text(frame.x(v), top + plot_h + 16, f"{v:g}", size=11, anchor="middle"))
    body.append(_text(left + frame.width / 2, top + plot_h + 38, "step", size=12, anchor="middle"))
    return _svg(width, height, body, "loss curves of the baseline and the best trial")


# ---------------------------------------------------------------------------- the scale ladder

TAG_COLOURS = {"holds": "#1a9850", "fades": "#9e9e9e", "reverses": "#d73027"}


def ladder_svg(rung: dict) -> str | None:
    """One rung: each kept change's effect at the night's scale (x) against its effect at
    the rung (y), its interval as a bar, coloured by its tag; the diagonal is "the same at
    both scales", the horizontal zero line "no effect at the larger scale"."""
    rows = [t for t in rung.get("tags") or [] if t.get("small_effect") is not None and t.get("effect") is not None]
    if not rows:
        return None
    values = [0.0] + [t["small_effect"] for t in rows] + [t["effect"] for t in rows] \
        + [v for t in rows for v in (t.get("low"), t.get("high")) if v is not None]
    low, high = min(values), max(values)
    pad = (high - low) * 0.1 or 0.01
    ticks = nice_ticks(low - pad, high + pad, 6)
    step = ticks[1] - ticks[0] if len(ticks) > 1 else 0.01
    frame = _Frame(80, 20, 360, 260, ticks[0], ticks[-1], ticks[0], ticks[-1])
    body = _axes(frame, ticks, ticks, "", f"effect at {rung['spec']}", step)
    for v in ticks:
        body.append(_text(frame.x(v), frame.top + frame.height + 16, _tick_text(v, step), size=11, anchor="middle"))
    body.append(_text(frame.left + frame.width / 2, frame.top + frame.height + 34, "effect at the night's scale",
                      anchor="middle"))
    body.append(f'<line class="diagonal" x1="{frame.x(ticks[0]):.1f}" y1="{frame.y(ticks[0]):.1f}" '
                f'x2="{frame.x(ticks[-1]):.1f}" y2="{frame.y(ticks[-1]):.1f}" stroke="#444" stroke-dasharray="4 3"/>')
    body.append(f'<line class="zero" x1="{frame.left}" x2="{frame.left + frame.width}" y1="{frame.y(0.0):.1f}" '
                f'y2="{frame.y(0.0):.1f}" stroke="#444"/>')
    for t in rows:
        x, y, colour = frame.x(t["small_effect"]), frame.y(t["effect"]), TAG_COLOURS.get(t["tag"], "#444")
        tip = f"<title>{_e(_ladder_tip(t))}</title>"
        if t.get("low") is not None and t.get("high") is not None:
            body.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{frame.y(t["low"]):.1f}" y2="{frame.y(t["high"]):.1f}" '
                        f'stroke="{colour}" stroke-width="2"/>')
        body.append(f'<circle class="{_e(t["tag"])}" data-trial="{_e(t["trial"])}" cx="{x:.1f}" cy="{y:.1f}" r="5" '
                    f'fill="{colour}">{tip}</circle>')
        body.append(_text(x + 8, y - 6, str(t["trial"]), size=11))
    return _svg(480, 330, body, f"effect of each kept change at the night's scale and at {rung['spec']}")


def _ladder_tip(t: dict) -> str:
    return (f"trial {t['trial']}: {t['tag']} at the larger scale, effect {t['effect']:+.4f} "
            f"(at the night's scale {t['small_effect']:+.4f})" + (f" — {t['description']}" if t.get("description") else ""))
