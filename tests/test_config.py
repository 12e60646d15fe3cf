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
        ("time-budget = 'soon'\n", "time_budget = 'soon' is not a valid float"),
        ("max-trials = 1.5\n", "max_trials = 1.5 is not a valid int"),
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
    with pytest.raises(AutoloopError, match="environment AUTOLOOP_MAX_TRIALS: max_trials = 'many'"):
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
