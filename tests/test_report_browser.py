"""The report as a reader sees it: rendered by headless Chromium (tests/browser_support.py),
measured in the page, not in the HTML text.

The charts are SVG whose layout autoloop computes itself (legend widths from a
characters-times-pixels estimate, labels placed beside points), so only a browser with
real fonts says whether a legend entry runs into the next, a label leaves the frame, or a
card's colour contradicts what its note says. What is checked:

* the headline cards: "discarded" is the number of grey points in the chart and of rows
  in the table of discarded trials, and the legend says the same number;
* every discarded point carries its trial number, inside the plot's frame, and the table
  has a row for it saying what was tried and why it was discarded;
* the legend's entries do not overlap and stay inside the chart;
* the relative gain is green only when the ablation confirms it: the same run with an
  ablation that finds the kept change indistinguishable from zero shows it in red;
* nothing is wider than the window (1440 px and a narrow 820 px), and the page throws no
  script error.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from browser_support import Browser, chromium
from review_support import build_noisy_db, noisy_report

# Slow as the live page's browser test is: a Chromium start takes seconds on a busy machine.
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(chromium() is None, reason="no chromium installed (.ci/run installs Debian's chromium)")]

# Everything the tests read from the rendered page, in one evaluation.
FACTS = r"""
(() => {
  const box = (el) => { const r = el.getBoundingClientRect(); return {l: r.left, t: r.top, r: r.right, b: r.bottom}; };
  const colour = (css) => { const d = document.createElement('span'); d.style.color = css; document.body.append(d);
                            const c = getComputedStyle(d).color; d.remove(); return c; };
  const cards = {};
  for (const el of document.querySelectorAll('#headline .stat')) {
    const value = el.querySelector('.value');
    cards[el.dataset.key] = {value: value.innerText.trim(), note: el.innerText.trim(), colour: getComputedStyle(value).color,
                             state: el.dataset.state || null};
  }
  const chart = document.querySelector('svg.chart');
  const frame = chart.querySelector('rect.frame');
  return {
    cards,
    good: colour('var(--good)'), bad: colour('var(--bad)'),
    chart: box(chart), frame: box(frame),
    legend: [...chart.querySelectorAll('g.legend')].map((g) => ({text: g.textContent.trim(), box: box(g)})),
    points: [...chart.querySelectorAll('.point.discard')].map((p) => ({trial: +p.dataset.trial, box: box(p)})),
    labels: [...chart.querySelectorAll('text.discard-label')].map((t) => ({text: t.textContent, box: box(t)})),
    rows: [...document.querySelectorAll('#discarded tbody tr')].map((tr) => ({
      trial: +tr.dataset.trial, visible: tr.offsetHeight > 0, cells: [...tr.cells].map((c) => c.innerText.trim())})),
    ablation: [...document.querySelectorAll('#ablation tbody tr')].map((tr) => tr.innerText),
    overflow: document.documentElement.scrollWidth - window.innerWidth, width: window.innerWidth,
  };
})()
"""


@pytest.fixture(scope="module")
def noisy(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("report-browser") / "noisy"
    build_noisy_db(repo)
    return repo


def report(repo: Path, out: Path, change=None) -> Path:
    """The noisy run's report, after `change(conn)` edited its db (a copy of it)."""
    return noisy_report(repo, out.with_name(out.name + "-repo"), out, change)


@pytest.fixture(scope="module")
def browser():
    """One Chromium for the module's pages (each start costs seconds)."""
    with Browser("about:blank", timeout=90) as b:
        yield b


def render(browser: Browser, page: Path, width: int, screenshot: Path | None = None) -> dict:
    browser.call("Emulation.setDeviceMetricsOverride", width=width, height=1000, deviceScaleFactor=1, mobile=False)
    browser.events.clear()
    browser.navigate(page.as_uri())
    browser.wait_for(f"location.href === {page.as_uri()!r} && document.readyState === 'complete' "
                     "&& document.querySelector('svg.chart') !== null", timeout=30)
    facts = browser.evaluate(FACTS)
    if screenshot is not None:
        browser.screenshot(screenshot)
    facts["errors"] = [e["params"] for e in browser.events if e.get("method") == "Runtime.exceptionThrown"]
    assert facts["width"] == width, facts["width"]
    return facts


def inside(inner: dict, outer: dict, slack: float = 0.5) -> bool:
    return (inner["l"] >= outer["l"] - slack and inner["r"] <= outer["r"] + slack
            and inner["t"] >= outer["t"] - slack and inner["b"] <= outer["b"] + slack)


def overlap(a: dict, b: dict) -> bool:
    return a["l"] < b["r"] and b["l"] < a["r"] and a["t"] < b["b"] and b["t"] < a["b"]


def test_the_report_as_rendered_tells_the_whole_story(browser, noisy, tmp_path):
    page = report(noisy, tmp_path / "report")
    facts = render(browser, page, 1440, tmp_path / "report.png")
    assert facts["errors"] == []
    assert facts["overflow"] <= 0, f"the page is {facts['overflow']} px wider than the window"

    # The card, the chart's points, its legend and the table count the same discards.
    discarded = facts["cards"]["discarded"]["value"]
    trials = sorted(p["trial"] for p in facts["points"])
    assert discarded == str(len(trials)) == "3" and trials == [3, 4, 6]
    assert any(e["text"] == f"discarded ({discarded})" for e in facts["legend"]), facts["legend"]
    rows = {r["trial"]: r for r in facts["rows"]}
    assert sorted(rows) == trials and all(r["visible"] for r in rows.values())
    # trial, what was tried, change, delta, runs, why: the description and the reason are there.
    assert rows[4]["cells"][1] == "depth 12" and rows[4]["cells"][5] == "clearly worse: +0.1569"
    assert all(r["cells"][5] for r in rows.values()), "a discarded trial without its reason"

    # Every discard point is labelled with its number, inside the plot's frame.
    assert sorted(label["text"] for label in facts["labels"]) == [f"#{n}" for n in trials]
    for label in facts["labels"]:
        assert inside(label["box"], facts["frame"]), (label, facts["frame"])
    for point in facts["points"]:
        assert inside(point["box"], facts["frame"]), (point, facts["frame"])

    # The legend's entries neither overlap nor leave the chart.
    legend = facts["legend"]
    for i, a in enumerate(legend):
        assert inside(a["box"], facts["chart"]), a
        for b in legend[i + 1:]:
            assert not overlap(a["box"], b["box"]), (a, b)

    # The ablation finds the kept change helps: the gain is green, and says why.
    gain = facts["cards"]["relative_gain"]
    assert gain["state"] == "confirmed" and gain["colour"] == facts["good"]
    assert "every kept change helps in the ablation" in gain["note"]
    assert facts["cards"]["compute_hours"]["note"].startswith("CPU hours")


def test_a_gain_the_ablation_does_not_find_is_not_green(browser, noisy, tmp_path):
    null = '{"effect": -0.001, "low": -0.02, "high": 0.018, "n": 3, "null": true, "drop": true, "level": 0.95}'
    page = report(noisy, tmp_path / "null", lambda c: c.execute(
        "UPDATE trials SET decision = ? WHERE kind = 'ablation'", (null,)))
    facts = render(browser, page, 1440)
    gain = facts["cards"]["relative_gain"]
    assert gain["state"] == "not confirmed" and gain["colour"] == facts["bad"] != facts["good"]
    assert "the ablation finds no kept change distinguishable from zero" in gain["note"]
    assert any("candidate to drop" in row for row in facts["ablation"]), facts["ablation"]


def test_the_report_fits_a_narrow_window(browser, noisy, tmp_path):
    facts = render(browser, report(noisy, tmp_path / "narrow"), 820)
    assert facts["errors"] == []
    assert facts["overflow"] <= 0, f"the page is {facts['overflow']} px wider than an 820 px window"
    for label in facts["labels"]:
        assert inside(label["box"], facts["frame"]), label
    for i, a in enumerate(facts["legend"]):
        for b in facts["legend"][i + 1:]:
            assert not overlap(a["box"], b["box"]), (a, b)
