"""The headline when `best`, `report` or `finalize` asks for it: a run whose best has no
reserve runs yet is re-measured first, at fresh seeds no decision used
(autoloop.loop.reserve), where it can be.

`ensure_headline(repo, run)` does nothing when the run's reserve is off (`reserve-seeds
= 0` in its config), when its best has its reserve already, or while a controller holds
the working tree (the run is going: the command shows the selection mean, marked as
such, and says why). Otherwise it opens the run's own controller, as `autoloop ablate`
does (the run's stored config, its lock), measures the missing runs, and leaves the
run's status as it was. A controller that cannot be opened (the environment changed, the
training script is gone) is one line of explanation, and the command goes on with the
selection mean.
"""

from __future__ import annotations

from pathlib import Path

from autoloop.errors import AutoloopError


def reserve_setting(run: dict) -> int:
    """The run's reserve-seeds (its stored config; 4 for a run from before the reserve)."""
    value = (run.get("config") or {}).get("reserve_seeds")
    return 4 if value is None else int(value)


def ensure_headline(repo: Path | str, run: dict, *, db: str | None = None, display=None,
                    **controller_options) -> str | None:
    """Measure the run's missing reserve runs (see the module docstring). Returns None
    when the headline is there (or the reserve is off), else one line saying why it is not."""
    from autoloop.loop.lock import holder
    from autoloop.loop.reserve import missing
    from autoloop.store import Store

    from autoloop.review.ablate import run_config

    most = reserve_setting(run)
    if most <= 0:
        return None
    import dataclasses

    config = dataclasses.replace(run_config(Path(repo), run, db), reserve_seeds=most)  # the run's own setting
    path = Path(config.db) if Path(config.db).is_absolute() else Path(repo) / config.db
    store = Store(path)
    try:
        lacking = missing(store, run, most)
    finally:
        store.close()
    if not lacking:
        return None
    if holder(Path(repo)) is not None:
        return (f"run '{run['tag']}' is going, so its best is not re-measured now: the figure is the selection mean "
                "(it is re-measured when the night ends)")
    from autoloop.loop.controller import Controller

    try:
        controller = Controller(config, repo, display=display, **controller_options)
        controller.open()
    except AutoloopError as exc:
        return f"the best could not be re-measured ({exc}): the figure is the selection mean"
    try:
        previous = run.get("status")
        try:
            from autoloop.loop.reserve import measure

            measure(controller)
        finally:
            if previous is not None:  # re-measuring is not running: a finished run stays finished
                controller.store.update_run(controller.run_row["id"], status=previous)
    finally:
        controller.close()
    return None
