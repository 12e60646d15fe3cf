"""What the live page's tests (and bench/serve_scale.py) share: a writer that adds trials
to a real experiments.db through the real Store, the way the controller does; the real
`autoloop serve` in a subprocess on a free port; a plain HTTP client.

The writer mirrors what the controller writes for a trial: a `running` row with the
path of its run's log (`.autoloop/<tag>/trials/<n>/runs/<k>/train.log`) and a
progress file beside it that grows while it "trains"; then the final status, the
measurement rows (seed, metric, log path), the curve, and for a keep the run's new best
commit. With `git_repo` the kept commits are real commits (same tree, made with
`git commit-tree`), so ideas seeded against the best commit validate as they would in a
real run; without it (the 10,000-trial bench) they are made-up hashes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIT_ENV = {"GIT_AUTHOR_NAME": "test", "GIT_AUTHOR_EMAIL": "t@example.com",
           "GIT_COMMITTER_NAME": "test", "GIT_COMMITTER_EMAIL": "t@example.com"}


def fake_sha(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


class NightWriter:
    """Adds trials to `repo/experiments.db` through the real Store (module docstring)."""

    def __init__(self, repo: Path, tag: str = "live", *, git_repo: bool = True, seed: int = 1337,
                 time_budget: float = 30.0, config: dict | None = None, noise: bool = True,
                 progress_files: bool = True):
        from autoloop.store import Store

        self.repo = Path(repo)
        self.tag = tag
        self.git_repo = git_repo
        self.seed = seed
        self.time_budget = time_budget
        self.progress_files = progress_files  # each finished run leaves its progress.jsonl, as train.py does
        self.store = Store(self.repo / "experiments.db")
        self.rng = random.Random(7)
        base = self._git("rev-parse", "HEAD").strip() if git_repo else fake_sha(f"{tag}-base")
        run_config = {"seed": seed, "time_budget": time_budget, "max_steps": None, "keep_margin": 0.0,
                      "proposers": ["ideas", "search"], "decision_rule": "two-tier", **(config or {})}
        fields = dict(noise_sd=0.006, noise_pair_sd=0.004, noise_df=8, decision_rule="two-tier") if noise else {}
        self.run = self.store.create_run(tag, branch=f"autoloop/{tag}", base_commit=base, best_commit=None,
                                         config=run_config, status="active", host="testhost", gpu="pretend GPU", **fields)
        self.best: dict | None = None  # the incumbent trial row

    # -- git ------------------------------------------------------------------------------

    def _git(self, *args: str) -> str:
        return subprocess.run(["git", *args], cwd=self.repo, check=True, capture_output=True, text=True,
                              env={**os.environ, **GIT_ENV}).stdout

    def _commit(self, parent: str, message: str) -> str:
        if not self.git_repo:
            return fake_sha(f"{self.tag}-{message}-{parent}")
        tree = self._git("rev-parse", f"{parent}^{{tree}}").strip()
        return self._git("commit-tree", tree, "-p", parent, "-m", message).strip()

    # -- trials ---------------------------------------------------------------------------

    def run_dir(self, number: int, k: int = 1) -> Path:
        path = self.repo / ".autoloop" / self.tag / "trials" / str(number) / "runs" / str(k)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def start(self, description: str, *, kind: str = "proposal", worker: str | None = None,
              lineage: str = "main", steps: int = 0, k: int = 1) -> dict:
        """A running trial (its row, its run folder, `steps` progress lines)."""
        parent = self.best["trial_commit"] if self.best else self.run["base_commit"]
        trial = self.store.new_trial(self.run["id"], kind, description=description, parent_commit=parent,
                                     lineage=lineage, worker=worker, proposer="search", seed=self.seed,
                                     started_at=_now(), best_before=self.best["metric"] if self.best else None)
        if kind == "baseline":
            commit = parent
        else:
            commit = self._commit(parent, f"trial {trial['number']}: {description[:40]}")
        log = self.run_dir(trial["number"], k) / "train.log"
        log.write_text(f"# autoloop: trial {trial['number']}\n")
        self.store.update_trial(trial["id"], trial_commit=commit, log_path=str(log), heartbeat_at=_now())
        trial = self.store.trial_by_id(trial["id"])
        if steps:
            self.progress(trial, steps)
        return trial

    def loss(self, step: int, offset: float = 0.0) -> float:
        return 1.0 + offset + 3.0 * math.exp(-step / 40.0)

    def progress(self, trial: dict, steps: int, *, offset: float = 0.0, every: int = 10) -> None:
        """Append progress lines up to `steps` (train.py's ProgressWriter records)."""
        path = Path(trial["log_path"]).with_name("progress.jsonl")
        done = 0
        if path.exists():
            lines = path.read_text().splitlines()
            done = json.loads(lines[-1])["step"] if lines else 0
        with open(path, "a") as handle:
            for step in range(done + every, steps + 1, every):
                seconds = self.time_budget * step / 200
                handle.write(json.dumps({"step": step, "progress": round(step / 200, 4),
                                         "loss": round(self.loss(step, offset), 5), "lr": 1.0, "grad_norm": 0.5,
                                         "tokens_per_second": 5000.0, "training_seconds": seconds}) + "\n")

    def finish(self, trial: dict, status: str, metric: float | None = None, *, reason: str | None = None,
               runs: int = 1, confirmed: bool = False, curve: bool = True) -> dict:
        """End a trial as the controller records it: measurements, curve, decision, best."""
        store = self.store
        fields: dict = {"status": status, "reason": reason or f"{status} (test writer)",
                        "finished_at": _now(), "wall_seconds": self.time_budget + 5.0}
        if metric is not None:
            seeds = [self.seed + i for i in range(runs)]
            values = [metric + 0.002 * (i - (runs - 1) / 2) for i in range(runs)]
            for i, (s, value) in enumerate(zip(seeds, values)):
                log = self.run_dir(trial["number"], i + 1) / "train.log"
                if self.progress_files and not log.with_name("progress.jsonl").exists():
                    self.progress({"log_path": str(log)}, 200, offset=value - 1.0 + 0.01 * i)
                store.add_measurement(trial["id"], value, seed=s, role="baseline" if trial["kind"] == "baseline"
                                      else "candidate", status="ok", log_path=str(log), num_steps=200,
                                      training_seconds=self.time_budget, wall_seconds=self.time_budget + 5.0)
            before = self.best["metric"] if self.best else None
            fields.update(metric=metric, metric_source="verified", n_runs=runs, num_steps=200,
                          metric_sd=0.0012 if runs > 1 else None, training_seconds=self.time_budget,
                          delta=(metric - before) if before is not None else None)
            if before is not None:
                diff = metric - before
                fields["decision"] = {"action": status, "rule": "two-tier", "n": runs, "mean_diff": diff, "se": 0.002,
                                      "low": diff - 0.005, "high": diff + 0.005, "confirmed": confirmed}
        if status == "keep":
            fields["tier"] = "baseline" if trial["kind"] == "baseline" else "confirmed" if confirmed else "adopted"
        if trial["kind"] != "baseline":
            fields["diff"] = (f"diff --git a/train.py b/train.py\n--- a/train.py\n+++ b/train.py\n@@ -1 +1 @@\n"
                              f"-LR = 0.02\n+LR = {0.02 + trial['number'] * 1e-4:.4f}  # {trial['description'][:40]}\n")
        with store.transaction():
            store.update_trial(trial["id"], **fields)
            if status == "keep":
                store.update_run(self.run["id"], best_commit=trial["trial_commit"])
        if curve and metric is not None:
            store.add_curve(trial["id"], [{"step": s, "seconds": s * 0.1, "loss": self.loss(s, metric - 1.0)}
                                          for s in range(10, 201, 10)])
        final = store.trial_by_id(trial["id"])
        if status == "keep":
            self.best = final
        return final

    def trial(self, description: str, status: str, metric: float | None = None, **kwargs) -> dict:
        """A whole trial at once (for building a night quickly)."""
        kind = kwargs.pop("kind", "proposal")
        return self.finish(self.start(description, kind=kind, worker=kwargs.pop("worker", None),
                                      lineage=kwargs.pop("lineage", "main")), status, metric, **kwargs)

    def baseline(self, metric: float = 1.60) -> dict:
        return self.trial("baseline: the unmodified training script", "keep", metric, kind="baseline", runs=3)

    def event(self, kind: str, message: str, trial: dict | None = None) -> None:
        self.store.add_event(self.run["id"], kind, message, trial_id=trial["id"] if trial else None)

    def night(self, trials: int, *, keep_every: int = 7, start_metric: float = 1.60) -> None:
        """A plausible night: a baseline, then keeps every ~`keep_every` trials, discards
        around the incumbent, a few crashes and invalid proposals."""
        if self.best is None:
            self.baseline(start_metric)
        for i in range(trials):
            n = i + 2
            incumbent = self.best["metric"]
            roll = self.rng.random()
            description = f"{self.rng.choice(['raise', 'lower', 'halve', 'double'])} " \
                          f"{self.rng.choice(['MATRIX_LR', 'EMBED_LR', 'WARMUP_RATIO', 'DEPTH', 'WEIGHT_DECAY'])} (#{n})"
            if n % keep_every == 0:
                self.trial(description, "keep", incumbent - 0.004 - 0.01 * self.rng.random(), runs=3)
            elif roll < 0.08:
                self.trial(description, "crash", None, reason="RuntimeError: CUDA out of memory (pretend)")
            elif roll < 0.12:
                self.trial(description, "invalid", None, reason="the edit does not compile: line 12")
            else:
                self.trial(description, "discard", incumbent + abs(self.rng.gauss(0.004, 0.01)), runs=2)

    def close(self) -> None:
        self.store.close()


def _now() -> str:
    from autoloop.store import utcnow

    return utcnow()


# ---------------------------------------------------------------------------- the server


class Server:
    """`python -m autoloop serve` in a subprocess on a free port (`--port 0`)."""

    def __init__(self, repo: Path, *args: str, env: dict | None = None, timeout: float = 30.0):
        environment = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        self.process = subprocess.Popen([sys.executable, "-m", "autoloop", "serve", "--repo", str(repo), "--port", "0",
                                         *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env=environment)
        self.output: list[str] = []
        deadline = time.monotonic() + timeout
        link = None
        while link is None:
            line = self.process.stdout.readline()
            if not line:
                raise RuntimeError("autoloop serve ended: " + "".join(self.output))
            self.output.append(line)
            link = re.search(r"(http://\S+)/\?token=(\S+)", line)
            if time.monotonic() > deadline:
                raise RuntimeError("autoloop serve printed no link: " + "".join(self.output))
        self.token = link.group(2)
        port = int(link.group(1).rsplit(":", 1)[1])
        self.base = f"http://127.0.0.1:{port}"
        self.port = port
        self.link = f"{self.base}/?token={self.token}"
        while True:
            try:
                status, _, _ = request(self.base + "/api/session", headers={"X-Autoloop-Token": self.token})
                if status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("autoloop serve does not answer")
            time.sleep(0.1)

    def get(self, path: str, **kwargs):
        return request(self.base + path, **kwargs)

    def post(self, path: str, data, *, token: bool = True, headers: dict | None = None):
        head = {"Content-Type": "application/json", **({"X-Autoloop-Token": self.token} if token else {}),
                **(headers or {})}
        return request(self.base + path, method="POST", body=json.dumps(data).encode(), headers=head)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        if self.process.stdout:
            self.process.stdout.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


_OPENER = urllib.request.build_opener(NoRedirect)


def request(url: str, *, method: str = "GET", body: bytes | None = None, headers: dict | None = None,
            timeout: float = 10.0):
    """(status, headers, parsed JSON or text) of one real HTTP request; redirects are not followed."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with _OPENER.open(req, timeout=timeout) as reply:
            status, head, data = reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as error:
        status, head, data = error.code, dict(error.headers), error.read()
    text = data.decode("utf-8", errors="replace")
    if head.get("content-type", head.get("Content-Type", "")).startswith("application/json"):
        return status, head, json.loads(text)
    return status, head, text
