"""The morning review: reading a run back out of the db and git.

`queries.py` reads the db (trials, measurements, headlines, ideas); `text.py` formats those
rows for the terminal; `report.py` writes the HTML report, with its charts drawn as inline
SVG by `charts.py` (no plotting library); `export.py` the CSV, JSON and notebook exports
(and `load_trials`); `finalize.py` makes a clean branch from the kept changes; `ablate.py`
measures what each kept change is worth. Import from the modules: the export pulls in
pandas.
"""
