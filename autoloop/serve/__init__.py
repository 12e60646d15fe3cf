"""`autoloop serve`: a live web page over a project's experiments.db.

The package holds the page and what it reads; nothing here writes the db but the two
steering actions, which go through the CLI's own code (`autoloop.seeding.seed_idea`,
`Store.request_stop`).

* `files`: reading what trial code could have written (no links, no FIFOs, capped).
* `readonly`: experiments.db opened read-only as a WAL reader (never blocks the controller).
* `queries`: the page's data, built on `autoloop.review` and capped for 10,000 trials.
* `tree`: the experiment tree's layout, as data for the page and as SVG for the report.
* `notify`: `autoloop run --notify CMD`, the user's command run on events.
* `app`: the Starlette application and its security rules; `command`: the CLI command.

Only `app` and `command` need the `[serve]` extra (starlette, uvicorn, sse-starlette);
`files`, `tree` and `notify` use the standard library, so `autoloop report`,
`autoloop status` and `autoloop run` import them on a bare install.
"""
