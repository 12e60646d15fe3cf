"""`autoloop serve`: a live web page over a project's experiments.db.

The package holds the page and what it reads; nothing here writes the db but the two
steering actions, which go through the CLI's own code (`autoloop.proposers.seeding.seed_idea`,
`Store.request_stop`).

* `readonly`: experiments.db opened read-only as a WAL reader (never blocks the controller).
* `queries`: the page's data, built on `autoloop.review.queries` and capped for 10,000 trials.
* `app`: the Starlette application and its security rules.

Elsewhere, by concern: the command (`autoloop.cli.serve`), the experiment tree's layout
(`autoloop.review.tree`, also in the report), the notifications of `run --notify`
(`autoloop.loop.notify`). Only `app` and the command need the `[serve]` extra (starlette,
uvicorn, sse-starlette); the rest uses the standard library.
"""
