"""The ground floor: what every other package needs and nothing of theirs needs.

Process supervision and the one `kill_group` (processes), copying a folder a trial may
have written without following its links (files), the allow-listed environment
of every child (environment, openmp), the status vocabulary of a run (status), the
redactor and the rule that a trial's text is data (redact, text, secret_names), and the
fault points tests kill the controller at (faults). It imports nothing of autoloop but
`autoloop.errors`; tests/test_layout.py holds every package to the table of allowed
arrows, with this floor at the bottom.
"""
