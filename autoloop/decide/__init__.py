"""Deciding from measurements: pure statistics, no db, no git, no processes.

`rule.py` is the decision rule (pooled noise, the paired sequential test, the strict rule);
`heldout.py` the held-out guard on keeps; `effects.py` a result with its uncertainty;
`diagnosis.py` reads a training curve; `overfit.py` compares held-out with val over a run;
`simulate.py` runs whole simulated nights through the same rule (docs/decisions.md).
"""

from autoloop.decide.rule import DecisionConfig, Verdict, decide, pool_noise

__all__ = ["DecisionConfig", "Verdict", "decide", "pool_noise"]
