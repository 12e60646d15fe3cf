"""The config resolver: defaults < pyproject [tool.autoloop] < AUTOLOOP_* env < flags."""

import pytest

from autoloop.config import Config, resolve
from autoloop.errors import AutoloopError


def write_pyproject(tmp_path, body: str):
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n\n[tool.autoloop]\n" + body)


def test_defaults(tmp_path):
    config = resolve(tmp_path, {}, environ={})
    assert config.time_budget == Config().time_budget == 300.0
    assert config.train_argv()[1:] == ["train.py"]
    assert config.tag  # today's date


def test_precedence_pyproject_env_flags(tmp_path):
    write_pyproject(tmp_path, "time-budget = 60\nmax-trials = 5\nkeep_margin = 0.001\nproposers = ['ideas']\n")
    config = resolve(tmp_path, {}, environ={})
    assert (config.time_budget, config.max_trials, config.keep_margin, config.proposers) == (60.0, 5, 0.001, ["ideas"])
    env = {"AUTOLOOP_TIME_BUDGET": "30", "AUTOLOOP_PROPOSERS": "ideas, other"}
    config = resolve(tmp_path, {}, environ=env)
    assert config.time_budget == 30.0 and config.max_trials == 5 and config.proposers == ["ideas", "other"]
    config = resolve(tmp_path, {"time_budget": 10, "max_trials": None}, environ=env)
    assert config.time_budget == 10.0 and config.max_trials == 5  # None = flag not given


def test_bool_and_optional_values(tmp_path):
    config = resolve(tmp_path, {}, environ={"AUTOLOOP_ALLOW_ENV_CHANGE": "yes", "AUTOLOOP_HOURS": "none"})
    assert config.allow_env_change is True and config.hours is None


@pytest.mark.parametrize(
    "body, message",
    [
        ("time-budget = 'soon'\n", "time-budget = 'soon' is not a valid float"),
        ("max-trials = 1.5\n", "max-trials = 1.5 is not a valid int"),
        ("budget = 3\n", "unknown setting [tool.autoloop] budget"),
        ("time-budget = \n", "does not parse"),
    ],
)
def test_bad_pyproject_values_are_one_clear_line(tmp_path, body, message):
    write_pyproject(tmp_path, body)
    with pytest.raises(AutoloopError) as err:
        resolve(tmp_path, {}, environ={})
    assert message in str(err.value)


def test_bad_env_value(tmp_path):
    with pytest.raises(AutoloopError, match="AUTOLOOP_MAX_TRIALS=many in the environment is not a valid int"):
        resolve(tmp_path, {}, environ={"AUTOLOOP_MAX_TRIALS": "many"})


def test_train_command_python_means_this_interpreter(tmp_path):
    import sys

    config = resolve(tmp_path, {"train_command": "python my_train.py --fast"}, environ={})
    assert config.train_argv() == [sys.executable, "my_train.py", "--fast"]


def test_sandbox_setting(tmp_path):
    assert resolve(tmp_path, {}, environ={}).sandbox == "auto"
    write_pyproject(tmp_path, "sandbox = 'on'\n")
    assert resolve(tmp_path, {}, environ={}).sandbox == "on"
    assert resolve(tmp_path, {}, environ={"AUTOLOOP_SANDBOX": "Off"}).sandbox == "off"
    assert resolve(tmp_path, {"sandbox": "auto"}, environ={"AUTOLOOP_SANDBOX": "off"}).sandbox == "auto"
    write_pyproject(tmp_path, "sandbox = false\n")  # TOML's booleans mean on/off
    assert resolve(tmp_path, {}, environ={}).sandbox == "off"
    write_pyproject(tmp_path, "sandbox = 'bwrap'\n")
    with pytest.raises(AutoloopError, match=r"sandbox = 'bwrap' is not one of auto, on, off: fix the value"):
        resolve(tmp_path, {}, environ={})


# ---------------------------------------------------------------------------- numbers in range (issue 22)

# Every numeric setting, a value out of its range, and the words of the one-line refusal.
BAD_NUMBERS = [
    ("time_budget", -5, "must be more than 0"),
    ("time_budget", 0, "must be more than 0"),
    ("max_trials", -1, "must be at least 0"),
    ("max_steps", 0, "must be at least 1"),
    ("hours", 0, "must be more than 0"),
    ("hours", "nan", "is not a finite number"),
    ("baseline_seeds", 0, "must be at least 1"),
    ("max_runs", 0, "must be at least 1"),
    ("workers", -1, "must be at least 0"),
    ("keep_margin", -0.01, "must be at least 0"),
    ("alpha", 0.5, "must be below 0.5"),
    ("alpha", 0, "must be more than 0"),
    ("grace_seconds", -1, "must be at least 0"),
    ("drift_every", -1, "must be at least 0"),
    ("max_consecutive_failures", 0, "must be at least 1"),
    ("seed", -1, "must be at least 0"),
    ("max_cost", -1, "must be at least 0"),
    ("migrate_every", -3, "must be at least 0"),
    ("llm_timeout", 0, "must be more than 0"),
    ("agent_timeout", -1, "must be more than 0"),
    ("notify_timeout", 0, "must be more than 0"),
    ("pair_speed_tolerance", 0, "must be more than 0"),
]


@pytest.mark.parametrize("name, value, problem", BAD_NUMBERS)
def test_a_number_out_of_range_is_refused_from_every_source(tmp_path, name, value, problem):
    flag, key, env = "--" + name.replace("_", "-"), name.replace("_", "-"), "AUTOLOOP_" + name.upper()
    number = float(value) if value == "nan" else value
    with pytest.raises(AutoloopError) as err:
        resolve(tmp_path, {name: number}, environ={})
    line = str(err.value)
    assert line.startswith(f"{flag} ") and problem in line and f"give e.g. {flag} " in line and "\n" not in line
    with pytest.raises(AutoloopError) as err:
        resolve(tmp_path, {}, environ={env: str(value)})
    assert str(err.value).startswith(f"{env}={value} in the environment {problem}"), str(err.value)
    if value != "nan":  # TOML has nan too, but spelled without quotes
        write_pyproject(tmp_path, f"{key} = {value}\n")
        with pytest.raises(AutoloopError) as err:
            resolve(tmp_path, {}, environ={})
        assert f"[tool.autoloop]: {key} = {value!r} {problem}" in str(err.value) and f"give e.g. {key} = " in str(err.value)


def test_numbers_in_range_pass_and_none_means_not_given(tmp_path):
    config = resolve(tmp_path, {"time_budget": 0.5, "max_trials": 1, "workers": 0, "alpha": 0.2, "max_steps": None},
                     environ={"AUTOLOOP_HOURS": "none"})
    assert (config.time_budget, config.max_trials, config.workers, config.alpha, config.max_steps, config.hours) == (
        0.5, 1, 0, 0.2, None, None)


def test_a_toml_boolean_is_not_a_number(tmp_path):
    write_pyproject(tmp_path, "time-budget = true\n")
    with pytest.raises(AutoloopError, match=r"time-budget = True is not a valid float"):
        resolve(tmp_path, {}, environ={})


def test_every_numeric_setting_has_a_range():
    from dataclasses import fields

    from autoloop.config import _HINTS, _RANGES

    numeric = [f.name for f in fields(Config)
               if any(t in (int, float) for t in (_HINTS[f.name], *getattr(_HINTS[f.name], "__args__", ())))]
    assert sorted(numeric) == sorted(_RANGES), "a numeric setting without a range (or a range without a setting)"
