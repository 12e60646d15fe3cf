"""What a trial's constant costs the controller to read (issue 31, item 5).

For each reader of a trial's source (the constants of train.py, as the out-of-memory
repair, the search and `seed --set` read them; a search hint's number; a typed `--set`
value) and each bomb, times one read in a fresh process, killed at --timeout, and prints
its CPU seconds and what it read. Run it on another checkout (--root) to compare: the
bounded evaluator reads every bomb in milliseconds; `eval` took seconds to hours.
Usage: python bench/const_bombs.py [--root PATH] [--timeout 60]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BOMBS = ["3**3**15", "3**3**16", "9**9**9", "1<<10**9", "10**10**10"]
READERS = {
    # A skipped block on the reader's device, as tests/test_attacks_consts.py plants it.
    "read_constants": "from autoloop.pyconst import read_constants\n"
                      "source = 'DEVICE_TYPE = \"none\"\\nif DEVICE_TYPE == \"cpu\":\\n    DEVICE_BATCH_SIZE = 8 + 0*({bomb})\\n'\n"
                      "result = read_constants(source, 'cpu')['DEVICE_BATCH_SIZE'].value",
    "search hint": "from autoloop.proposers.search_space import parse_hints\n"
                   "result = parse_hints('range 1..{bomb} log', name='X').hi",
    "seed --set": "from autoloop.proposers.seeding import parse_sets\n"
                  "result = parse_sets(['DEPTH=4+0*({bomb})'], 'DEPTH = 2\\n', 'train.py')",
}
PROBE = "import time\nstarted = time.process_time()\ntry:\n{body}\nexcept Exception as exc:\n" \
        "    result = type(exc).__name__ + ': ' + str(exc)[:70]\n" \
        "print(f'{{time.process_time() - started:.3f}} s CPU: {{str(result)[:90]}}')\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="The checkout whose autoloop reads the bombs.")
    parser.add_argument("--timeout", type=float, default=60.0, help="Seconds before a read is killed.")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(args.root.resolve()), "AUTOLOOP_DEVICE_TYPE": "cpu"}
    import_check = subprocess.run([sys.executable, "-c", "import autoloop; print(autoloop.__file__)"], env=env,
                                  cwd=args.root, capture_output=True, text=True)
    print(f"autoloop from {import_check.stdout.strip()}")
    for reader, body in READERS.items():
        for bomb in BOMBS:
            code = PROBE.format(body="\n".join("    " + line for line in body.format(bomb=bomb).splitlines()))
            started = time.monotonic()
            try:
                # From the checkout itself: `python -c` puts the working folder first on the path.
                done = subprocess.run([sys.executable, "-c", code], env=env, cwd=args.root, capture_output=True,
                                      text=True, timeout=args.timeout)
                line = (done.stdout.strip() or done.stderr.strip().splitlines()[-1])
            except subprocess.TimeoutExpired:
                line = f"killed after {args.timeout:g} s"
            print(f"{reader:<15} {bomb:<11} {line}  ({time.monotonic() - started:.1f} s wall)")


if __name__ == "__main__":
    main()
