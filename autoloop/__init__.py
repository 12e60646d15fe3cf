"""autoloop: an autonomous, verified research loop for small-language-model pretraining.

This module imports nothing heavy on purpose: `import autoloop.harness` (which train.py
does) must work on a bare GPU image that has torch but not GitPython, sqlite-utils or
pandas.
"""

__version__ = "0.1.0"
