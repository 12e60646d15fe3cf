"""What makes a trial's number trustworthy: the rules a proposal cannot get around.

`integrity.py` fingerprints the harness, data, bytecode and import hooks around every run;
`watch.py` holds those fingerprints for a run (`Verifier.check_run`); `seal.py` seals what
decides in experiments.db; `budget.py` judges time and tokens on the trusted feed's
figures; `evaluation.py` launches the harness's evaluator in its own process;
`bytecode.py` keeps the harness's bytecode in prefixes no trial can write. Import from the
modules: each is small and some pull in the sandbox and the process runner.
"""
