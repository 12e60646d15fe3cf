"""autoloop: an autonomous, verified research loop for small-language-model pretraining.

This module imports nothing heavy on purpose: `import autoloop.harness` (which train.py
does) must work on a bare GPU image that has torch but not GitPython, sqlite-utils or
pandas. Public helpers that need those (`load_trials`) are imported on first use,
through the module-level `__getattr__` below.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy: `autoloop.load_trials` imports pandas and sqlite-utils only when used.
    if name == "load_trials":
        from autoloop.review.export import load_trials

        return load_trials
    raise AttributeError(f"module 'autoloop' has no attribute {name!r}")
