"""The comparability guard: a run's trials are compared only under the same conditions.

A run records the machine and software it started on (autoloop.envinfo: GPU, driver,
torch, CUDA, Python) with the fingerprints of its data and of the harness. Resuming it
elsewhere, on other data or with another harness would compare numbers that measure
different things, so `check_comparability` refuses it with the changes named, unless
`--allow-env-change`, which records each accepted change on the run (`env_changes`) and
as an event. The decision rule and the isolation of every invocation are recorded too
(`record_rules`): a run resumed under another rule says so once.
"""

from __future__ import annotations

import time
from pathlib import Path

from autoloop.errors import AutoloopError
from autoloop.loop.host import TrialHost

# What must match for two trials of one run to be compared.
COMPARED = ("gpu", "torch_version", "cuda_version", "data_fingerprint", "harness_fingerprint")


def data_dir(config) -> Path:
    """The prepared dataset the run trains on (`--dataset`, else the embedded default)."""
    from autoloop.harness import default_data_dir

    if config.dataset:
        try:
            from autoloop.prepare import resolve_data_dir
        except ImportError:  # pragma: no cover - prepare module absent
            return Path(config.dataset).expanduser()
        return resolve_data_dir(config.dataset)
    return default_data_dir()


def collect(config) -> dict:
    """This machine and software, with the fingerprints of the run's data and the harness."""
    from autoloop import harness
    from autoloop.envinfo import collect_environment

    env = collect_environment()
    env["data_fingerprint"] = harness.load_dataset(data_dir(config)).fingerprint
    env["harness_fingerprint"] = harness.compute_harness_fingerprint()
    return env


def check_comparability(c: TrialHost, env: dict) -> None:
    """Refuse to resume run `c.run_row` under `env` if anything in COMPARED changed, unless
    the config allows it (then the change is recorded)."""
    changes = {
        key: (c.run_row.get(key), env.get(key))
        for key in COMPARED
        if c.run_row.get(key) != env.get(key)
    }
    if not changes:
        return
    described = "; ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changes.items())
    if not c.config.allow_env_change:
        raise AutoloopError(
            f"run '{c.tag}' was started with a different environment ({described}): its trials would not be "
            "comparable; use another --tag, or pass --allow-env-change to continue anyway (it is recorded)"
        )
    history = list(c.run_row.get("env_changes") or [])
    history.append({"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "changes": {k: list(v) for k, v in changes.items()}})
    c.store.update_run(c.run_row["id"], env_changes=history, **{k: env.get(k) for k in changes})
    c.event("env_change", f"environment changed and accepted: {described}")
    c.say(f"environment changed (accepted with --allow-env-change): {described}", "yellow")


def record_rules(c: TrialHost, existing: dict | None) -> None:
    """The decision rule and the isolation of this invocation, on the run and said once."""
    fields = {}
    rule = c.config.decision_rule
    if existing is not None and (existing.get("decision_rule") or "strict") != rule:
        before = existing.get("decision_rule") or "strict (one run, lower wins: before autoloop decided with noise)"
        message = f"run '{c.tag}' was decided by the {before} rule; it resumes with the {rule} rule (docs/decisions.md)"
        c.event("rule_change", message)
        c.say(message, "yellow")
    fields["decision_rule"] = rule
    if c.verifier is not None:
        sandbox = c.measurer.describe_sandbox()
        fields["sandbox"] = sandbox
        if not sandbox.startswith("bwrap"):
            c.event("unsandboxed", f"trials run unsandboxed: {sandbox}")
            c.say(f"trials run unsandboxed: {sandbox} (docs/verification.md)", "yellow")

    c.store.update_run(c.run_row["id"], **fields)
    c.run_row = c.store.get_run(c.tag)
