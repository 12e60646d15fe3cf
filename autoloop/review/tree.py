"""The experiment tree: every trial under the commit it was proposed from.

A trial records `parent_commit` (the incumbent it was proposed from) and `trial_commit`
(its own commit). The kept trials are the tree's commits: the baseline is the root (the
base commit, unchanged), and a keep's children are the trials whose parent is its
commit. So:

* **keeps continue the trunk**: a kept trial is a node on its lane, joined to the keep
  it was proposed from; the nodes left to right are the incumbents in the order they
  were kept (one column per keep, so a column is a moment of the night);
* **everything else is a leaf** of the commit it was proposed from: discards, crashes,
  timeouts, invalid proposals, running trials, and the measurements of that commit itself
  (drift checks and re-runs train it unchanged; ablations revert one of its changes), in
  a small grid under the node, newest first;
* **islands are lanes**: each lineage (`autoloop/<tag>-w<k>`) has a horizontal band of
  its own. A trial of one lane proposed from another lane's commit (the first trials of
  each island start from the baseline; a migration adopts another island's incumbent)
  hangs under a hollow "ghost" of that commit in its own lane, joined to the real node.

A trial whose parent is no kept commit (a commit of an earlier run of the tag, an
interrupted keep) hangs under the latest earlier keep of its lane, else the root.

At 10,000 trials most are leaves: each commit shows at most `LEAF_CAP` of them (fewer
when the whole tree would pass `MAX_NODES`), and a "+N" marker says how many more there
are (the page links it to the trial table filtered by that parent). At most `MAX_KEEPS`
kept commits are drawn (the latest).

`layout()` gives positions as plain data: the live page draws it with DOM calls
(`autoloop serve`), and `svg()` writes the same picture as inline SVG for `autoloop
report`, every text escaped.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field

LEAF_CAP = 30
MAX_NODES = 3000
MAX_KEEPS = 1000
COL = 50  # px per kept commit
LEAF_COLS = 3
LEAF_PITCH = 11
KEEP_R = 7
LEAF_R = 4
LEFT = 70  # room for the lane's name
TOP = 118  # room for the rotated labels of the keeps
LANE_GAP = 26
LABEL_CHARS = 22

FILL = {
    "baseline": "#2c7fb8", "keep": "#1a9850", "discard": "#9e9e9e", "crash": "#d73027", "timeout": "#f46d43",
    "invalid": "#984ea3", "interrupted": "#e6ab02", "running": "#2c7fb8", "drift": "#8c6d31", "rerun": "#8c6d31",
    "ablation": "#7b3294",
}
MEASURING_KINDS = ("drift", "rerun", "ablation")  # leaves that measure their commit rather than change it

TREE_COLUMNS = ("number", "kind", "status", "lineage", "parent_commit", "trial_commit", "metric", "metric_sd",
                "n_runs", "delta")


def tree_rows(store, run: dict) -> list[dict]:
    """The columns the tree needs, every trial of the run, oldest first (descriptions cut
    to 120 characters in the query, so 10,000 long ones cost little)."""
    from autoloop.review.queries import select

    return select(store, f"SELECT {', '.join(TREE_COLUMNS)}, substr(description, 1, 120) AS description "
                         "FROM trials WHERE run_id = ? ORDER BY number", (run["id"],))


@dataclass
class _Anchor:
    """Where leaves hang: a kept commit's node, or its ghost in another lane."""

    key: tuple
    column: int
    lane: str
    commit: str | None
    trial: int | None
    leaves: list = field(default_factory=list)


def _lane_order(rows: list[dict]) -> list[str]:
    seen: list[str] = []
    for r in rows:
        lane = r.get("lineage") or "main"
        if lane not in seen:
            seen.append(lane)
    return sorted(seen, key=lambda lane: (lane != "main", seen.index(lane)))


def _fmt(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _title(r: dict) -> str:
    """A node's tooltip: number, status, description, metric and delta."""
    metric = r.get("metric")
    if metric is not None and (r.get("n_runs") or 0) > 1 and r.get("metric_sd") is not None:
        value = f"{metric:.4f} ± {r['metric_sd']:.4f} ({r['n_runs']})"
    else:
        value = _fmt(metric, ".6f")
    parts = [f"#{r['number']} {r['status']}", r["kind"] if r["kind"] != "proposal" else None,
             (r.get("description") or "").strip() or None, f"val_bpb {value}" if metric is not None else None,
             f"Δ {_fmt(r.get('delta'), '+.4f')}" if r.get("delta") is not None else None,
             f"lane {r['lineage']}" if r.get("lineage") not in (None, "main") else None]
    return " · ".join(p for p in parts if p)


def _label(r: dict) -> str:
    desc = "baseline" if r["kind"] == "baseline" else (r.get("description") or "").strip().replace("\n", " ")
    text = f"#{r['number']} {desc}".strip()
    return text if len(text) <= LABEL_CHARS else text[:LABEL_CHARS - 1] + "…"


def layout(rows: list[dict], *, leaf_cap: int = LEAF_CAP, max_nodes: int = MAX_NODES,
           max_keeps: int = MAX_KEEPS) -> dict:
    """Positions of the tree's nodes, edges, lanes and "+N" markers (module docstring):
    {width, height, lanes: [{name, y}], nodes: [{number, x, y, r, fill, status, kind,
    lane, keep, ghost, label, title}], edges: [{x1, y1, x2, y2, kind: trunk|stem|lane}],
    more: [{x, y, count, parent, lane}], keeps, trials, hidden_keeps}."""
    keeps = [r for r in rows if r["status"] == "keep"]
    # The root: the kept baseline (the base commit), else a ghost of the base commit.
    root = keeps[0] if keeps and keeps[0]["kind"] == "baseline" else None
    root_commit = root["trial_commit"] if root else None
    later = keeps[1:] if root else keeps
    hidden_keeps = max(0, len(later) - max_keeps)
    drawn_keeps = ([root] if root else []) + later[hidden_keeps:]
    lanes = _lane_order(rows) or ["main"]
    node_of: dict[str, dict] = {}
    for k in keeps:
        if k.get("trial_commit"):
            node_of.setdefault(k["trial_commit"], k)
    column_of = {k["number"]: i + (0 if root else 1) for i, k in enumerate(drawn_keeps)}

    anchors: dict[tuple, _Anchor] = {}

    def anchor(parent: dict | None, lane: str) -> _Anchor:
        """The anchor of `parent`'s commit in `lane` (None: the root)."""
        if parent is None or parent["number"] not in column_of:
            key = ("root", lane)
            if key not in anchors:
                anchors[key] = _Anchor(key, 0, lane, root_commit, root["number"] if root else None)
            return anchors[key]
        key = (parent["number"], lane)
        if key not in anchors:
            anchors[key] = _Anchor(key, column_of[parent["number"]], lane, parent.get("trial_commit"), parent["number"])
        return anchors[key]

    def parent_of(r: dict) -> dict | None:
        parent = node_of.get(r.get("parent_commit") or "")
        if parent is not None and parent["number"] != r["number"]:
            return parent
        # The incumbent measured by a drift check or a re-run: the keep of its own commit.
        own = node_of.get(r.get("trial_commit") or "")
        if r["kind"] in MEASURING_KINDS and own is not None and own["number"] != r["number"]:
            return own
        lane = r.get("lineage") or "main"
        earlier = [k for k in keeps if k["number"] < r["number"] and (k.get("lineage") or "main") == lane]
        if earlier:
            return earlier[-1]
        earlier = [k for k in keeps if k["number"] < r["number"]]
        return earlier[0] if earlier else None

    keep_parent: dict[int, dict | None] = {}
    for r in rows:
        if r["status"] == "keep":
            # A kept trial is a node; one older than the drawn ones is counted in hidden_keeps.
            if r["number"] in column_of:
                keep_parent[r["number"]] = None if r is root else parent_of(r)
            continue
        anchor(parent_of(r), r.get("lineage") or "main").leaves.append(r)

    # How many leaves each anchor shows: LEAF_CAP, fewer when the tree would be too big.
    with_leaves = [a for a in anchors.values() if a.leaves]
    room = max_nodes - len(drawn_keeps)
    cap = leaf_cap
    if with_leaves and sum(min(len(a.leaves), cap) for a in with_leaves) > room:
        cap = max(3, min(leaf_cap, room // len(with_leaves)))

    # Lane heights: the node row plus the tallest leaf grid of the lane.
    def grid_rows(a: _Anchor) -> int:
        shown = min(len(a.leaves), cap)
        return (shown + LEAF_COLS - 1) // LEAF_COLS

    lane_y: dict[str, float] = {}
    y = TOP
    lane_info = []
    for lane in lanes:
        lane_y[lane] = y
        tallest = max([grid_rows(a) for a in anchors.values() if a.lane == lane] or [0])
        more = any(len(a.leaves) > cap for a in anchors.values() if a.lane == lane)
        height = KEEP_R + 18 + tallest * LEAF_PITCH + (16 if more else 0)
        lane_info.append({"name": lane, "y": y, "height": height})
        y += height + LANE_GAP
    columns = max([0, *column_of.values(), *(a.column for a in anchors.values())]) + 1
    width = LEFT + columns * COL + 160
    height = y

    def xy(column: int, lane: str) -> tuple[float, float]:
        return LEFT + column * COL + COL / 2, lane_y.get(lane, TOP)

    nodes: list[dict] = []
    edges: list[dict] = []
    more: list[dict] = []
    placed: dict[tuple, tuple[float, float]] = {}
    for k in drawn_keeps:
        lane = k.get("lineage") or "main"
        x, ky = xy(column_of[k["number"]], lane)
        placed[(k["number"], lane)] = (x, ky)
        nodes.append({"number": k["number"], "x": x, "y": ky, "r": KEEP_R,
                      "fill": FILL["baseline"] if k["kind"] == "baseline" else FILL["keep"], "status": k["status"],
                      "kind": k["kind"], "lane": lane, "keep": True, "ghost": False, "label": _label(k),
                      "title": _title(k)})
    for k in drawn_keeps:
        parent = keep_parent.get(k["number"])
        if parent is None:
            continue
        lane = k.get("lineage") or "main"
        start = placed.get((parent["number"], parent.get("lineage") or "main"))
        if start is None:
            continue
        x, ky = placed[(k["number"], lane)]
        edges.append({"x1": start[0], "y1": start[1], "x2": x, "y2": ky,
                      "kind": "trunk" if start[1] == ky else "lane"})
    for a in anchors.values():
        x, ay = xy(a.column, a.lane)
        real = placed.get((a.trial, a.lane)) if a.trial is not None else None
        if real is None:
            # A ghost: the commit lives in another lane (or is the base commit, not yet kept).
            nodes.append({"number": a.trial, "x": x, "y": ay, "r": KEEP_R - 2, "fill": "none", "status": "ghost",
                          "kind": "ghost", "lane": a.lane, "keep": False, "ghost": True,
                          "label": "" if a.trial is not None else "base", "title":
                          (f"commit of trial #{a.trial} (in another lane)" if a.trial is not None
                           else "the base commit")})
            home = next((placed[key] for key in placed if key[0] == a.trial), None) if a.trial is not None else None
            if home is not None:
                edges.append({"x1": home[0], "y1": home[1], "x2": x, "y2": ay, "kind": "lane"})
        if not a.leaves:
            continue
        shown = sorted(a.leaves, key=lambda r: (r["status"] != "running", -r["number"]))[:cap]
        rows_needed = (len(shown) + LEAF_COLS - 1) // LEAF_COLS
        top = ay + KEEP_R + 12
        edges.append({"x1": x, "y1": ay + KEEP_R, "x2": x, "y2": top + (rows_needed - 1) * LEAF_PITCH,
                      "kind": "stem"})
        for i, r in enumerate(shown):
            row, col = divmod(i, LEAF_COLS)
            lx = x + (col - (LEAF_COLS - 1) / 2) * LEAF_PITCH
            fill = FILL.get(r["kind"]) if r["kind"] in MEASURING_KINDS and r["status"] != "running" else None
            nodes.append({"number": r["number"], "x": lx, "y": top + row * LEAF_PITCH, "r": LEAF_R,
                          "fill": fill or FILL.get(r["status"], "#9e9e9e"), "status": r["status"], "kind": r["kind"],
                          "lane": a.lane, "keep": False, "ghost": False, "label": "", "title": _title(r)})
        if len(a.leaves) > cap:
            more.append({"x": x, "y": top + rows_needed * LEAF_PITCH + 4, "count": len(a.leaves) - cap,
                         "parent": a.commit, "trial": a.trial, "lane": a.lane})
    return {"width": width, "height": height, "lanes": lane_info, "nodes": nodes, "edges": edges, "more": more,
            "keeps": sum(1 for k in keeps if k["kind"] != "baseline"), "trials": len(rows), "hidden_keeps": hidden_keeps, "leaf_cap": cap}


# ---------------------------------------------------------------------------- static SVG (the report)


def _e(value) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def svg(tree: dict) -> str:
    """The tree as an inline <svg> element for an HTML page (no namespace URL needed there,
    so the report stays free of any http:// reference; no scripts, no links; every text
    escaped)."""
    w, h = tree["width"], tree["height"]
    out = [f'<svg class="tree" width="{w:.0f}" height="{h:.0f}" '
           f'viewBox="0 0 {w:.0f} {h:.0f}" role="img" aria-label="experiment tree">']
    for lane in tree["lanes"]:
        out.append(f'<text x="6" y="{lane["y"] + 4:.1f}" font-size="12" fill="#656d76">{_e(lane["name"])}</text>')
    for e in tree["edges"]:
        colour = {"trunk": "#1a9850", "lane": "#2c7fb8", "stem": "#c8ccd1"}[e["kind"]]
        width = 2.5 if e["kind"] == "trunk" else 1.2
        dash = ' stroke-dasharray="4 3"' if e["kind"] == "lane" else ""
        out.append(f'<line x1="{e["x1"]:.1f}" y1="{e["y1"]:.1f}" x2="{e["x2"]:.1f}" y2="{e["y2"]:.1f}" '
                   f'stroke="{colour}" stroke-width="{width}"{dash}/>')
    for n in tree["nodes"]:
        stroke = ' stroke="#1f2328" stroke-width="0.8"' if n["keep"] else ""
        if n["ghost"]:
            stroke = ' stroke="#2c7fb8" stroke-width="1.2"'
        out.append(f'<circle cx="{n["x"]:.1f}" cy="{n["y"]:.1f}" r="{n["r"]}" fill="{_e(n["fill"])}"{stroke} '
                   f'data-trial="{_e(n["number"])}" data-status="{_e(n["status"])}"><title>{_e(n["title"])}</title>'
                   f'</circle>')
        if n["label"]:
            out.append(f'<text x="{n["x"] + 4:.1f}" y="{n["y"] - 11:.1f}" font-size="11" fill="#1f2328" '
                       f'transform="rotate(-40 {n["x"] + 4:.1f} {n["y"] - 11:.1f})">{_e(n["label"])}</text>')
    for m in tree["more"]:
        out.append(f'<text x="{m["x"]:.1f}" y="{m["y"] + 8:.1f}" font-size="10" fill="#656d76" '
                   f'text-anchor="middle">+{m["count"]}</text>')
    out.append("</svg>")
    return "".join(out)
