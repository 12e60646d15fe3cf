"""Redaction (autoloop.base.redact): which values are secrets, and that they never reach the db."""

from __future__ import annotations

from autoloop.base.redact import REDACTED, Redactor, environment_secrets, file_secrets, redact, register_project


def never_allowed(name: str) -> bool:
    return False


def test_environment_secrets_take_keys_and_leave_words_paths_and_numbers():
    environ = {
        "OPENAI_API_KEY": "abcd1234",           # named: a secret from 4 characters on
        "DB_PASSWORD": "hunter2!",
        "MY_SERVICE": "q8Zr2-77xk-pp0Q",      # unnamed, key-shaped enough: long, mixed
        "FAKE_AGENT_MODE": "protected",        # one plain word: a mode, not a secret
        "LOG_LEVEL": "debug",
        "WORKERS": "16",
        "ENABLED": "true",
        "DATA": "/srv/data:/srv/more",
        "SHORT": "ab12",                        # unnamed and short
        "PWD": "/home/someone/project-x1",
    }
    assert environment_secrets(environ, never_allowed) == {"abcd1234", "hunter2!", "q8Zr2-77xk-pp0Q"}


def test_the_users_git_identity_is_not_a_secret_but_keys_and_auth_are():
    """GIT_AUTHOR_NAME once counted as a secret ("AUTH" in it): the user's name, which is
    in their paths and tags, became [redacted] in the db, and a run could not find itself."""
    environ = {
        "GIT_AUTHOR_NAME": "beside", "GIT_AUTHOR_EMAIL": "b@example.com", "GIT_COMMITTER_NAME": "beside",
        "XDG_SESSION_TYPE": "wayland", "KEYMAP": "dvorak-uk", "MONKEY_MODE": "calm",
        "OPENAI_API_KEY": "abcd1234", "APIKEY": "zz-zz-zz", "BASIC_AUTH": "user:pw12", "PGPASSWORD": "hunter2",
        "HTTP_AUTHORIZATION": "Basic Zm9vOmJhcg==", "DB_PASS": "swordfish", "AWS_SESSION_TOKEN": "tok-abcdef",
    }
    assert environment_secrets(environ, never_allowed) == {
        "abcd1234", "zz-zz-zz", "user:pw12", "hunter2", "Basic Zm9vOmJhcg==", "swordfish", "tok-abcdef"}


def test_an_allowed_variable_is_a_secret_only_when_its_name_says_so():
    environ = {"OMP_NUM_THREADS_X": "zz9-zz9-zz9", "HF_TOKEN": "tok-12345"}
    assert environment_secrets(environ, lambda name: True) == {"tok-12345"}


def test_key_shapes_are_redacted_wherever_they_come_from():
    r = Redactor()
    text = "key sk-proj-ABCDEFGHIJKLMNOPQRSTUV and ghp_abcdefghijklmnopqrstuvwxyz012345 end"
    assert r(text) == f"key {REDACTED} and {REDACTED} end"
    assert r("edits protected file program.md") == "edits protected file program.md"


def test_longest_value_first_so_no_fragment_survives():
    r = Redactor(["abc12345", "abc12345-and-more"])
    assert r("x abc12345-and-more y abc12345 z") == f"x {REDACTED} y {REDACTED} z"


def test_dotenv_values_are_secrets_and_comments_are_not(tmp_path):
    env = tmp_path / ".env"
    env.write_text("# TOKEN=commented-out-value\nexport API_KEY='sk-canary-0000'\nDEBUG=true\nNAME = value-of-name\n")
    assert file_secrets([env]) == {"sk-canary-0000", "value-of-name"}
    link = tmp_path / "link.env"
    link.symlink_to(env)
    assert file_secrets([link]) == set()  # a link is never followed


def test_a_registered_project_and_the_environment_are_redacted_in_the_store(tmp_path, monkeypatch):
    from autoloop.store import Store

    monkeypatch.setenv("CANARY_SERVICE_TOKEN", "canary-env-7731")
    (tmp_path / ".env").write_text("OPENAI_API_KEY=canary-dotenv-4419\n")
    register_project(tmp_path)
    assert redact("a canary-env-7731 b canary-dotenv-4419") == f"a {REDACTED} b {REDACTED}"
    store = Store(tmp_path / "experiments.db")
    store.add_idea("try canary-dotenv-4419 and canary-env-7731", sets={}, source="human")
    store.close()
    raw = (tmp_path / "experiments.db").read_bytes()
    assert b"canary-dotenv-4419" not in raw and b"canary-env-7731" not in raw
