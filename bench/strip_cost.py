"""What stripping a trial's text of control characters costs (autoloop.base.text).

    python bench/strip_cost.py                  # 20,000 lines, median of 5 rounds
    python bench/strip_cost.py --lines 100000 --rounds 7

Every line a trial prints passes through the worker's log pipe, which now strips it before
redacting it. This times, per line, the pipe's cleaning with and without the stripping on
lines like train.py's step line (clean: the usual case), the same line coloured (ANSI
styles to remove), and a hostile line (every class of control), and states the cost for a
300 s GPU trial that prints --lines-per-trial lines (train.py prints one every LOG_EVERY
steps; a chatty script one per step). The Store strips each text it writes once, a
handful per trial: the per-line figure bounds it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autoloop.base.redact import redact  # noqa: E402
from autoloop.base.text import strip_controls  # noqa: E402

STEP = ("step 01234 ( 41.1%) | loss 3.4567 | lr x1.000 | grad norm 0.512 | 312 ms | 1,234,567 tok/s"
        " | mfu 41.2%\n")
LINES = {
    "clean (train.py's step line)": STEP,
    "coloured (ANSI styles)": f"\x1b[1;32m{STEP[:40]}\x1b[0m{STEP[40:]}",
    "hostile (every class)": "\x1b]52;c;cm0gLXJmIH4K\x07\x1b]0;t\x07\x1b[2J\x1b[8mx\x1b[28m\x9b2J\ry\x08\x00\u202e"
                             + "\U000e0069" * 8 + STEP,
}


def per_line_us(clean, line: str, lines: int, rounds: int) -> float:
    """Median over `rounds` of the time per line to clean `lines` copies of `line`, in µs."""
    batch = [line] * lines
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        for text in batch:
            clean(text)
        times.append((time.perf_counter() - started) / lines * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=20_000, help="Lines per round.")
    parser.add_argument("--rounds", type=int, default=5, help="Rounds; the median is reported.")
    parser.add_argument("--lines-per-trial", type=int, default=10_000,
                        help="Lines a 300 s trial prints, for the per-trial figure.")
    args = parser.parse_args()
    if args.lines < 1 or args.rounds < 1 or args.lines_per_trial < 0:
        parser.error("--lines and --rounds must be at least 1, --lines-per-trial at least 0")
    redact("warm up")  # builds the redactor once, outside the timing
    print(f"{args.lines} lines x {args.rounds} rounds (median); a 300 s trial printing {args.lines_per_trial} lines")
    print(f"{'line':<30} {'redact':>10} {'strip+redact':>13} {'added':>9} {'per trial':>10} {'of 300 s':>9}")
    for name, line in LINES.items():
        before = per_line_us(redact, line, args.lines, args.rounds)
        after = per_line_us(lambda text: redact(strip_controls(text)), line, args.lines, args.rounds)
        added_s = max(after - before, 0.0) * args.lines_per_trial / 1e6
        print(f"{name:<30} {before:>8.2f}us {after:>11.2f}us {after - before:>7.2f}us {added_s * 1000:>8.1f}ms "
              f"{added_s / 300:>9.4%}")


if __name__ == "__main__":
    main()
