"""The stats service: projects the ``EVENTS`` stream into PostgreSQL and answers queries.

Pure, no I/O: ``projection`` (a task's state from its events, attempt outcomes), ``rows`` (the
read model's tables: names, locks, row shapes), ``tracking`` (which events were applied, by
position and digest; which failures park an event), ``figures`` (KV keys and values), ``requests``
(the endpoints' request bodies checked), ``verdict`` (the judge's rubrics and its verdicts
read), ``baseline`` (the bench's slow-worker judgement), ``bench_prompts`` and
``bench_report`` (the bench's prompts and its report). The domain heuristic and the alias
rules, which the router and the workers apply too, are in `services.fleet`.

I/O: ``projector`` (events applied to the tables, shared by the live projection and the
rebuild; the events that are not a task's in ``other_events``, the figures recomputed in
``figure_rows``), ``store`` (the asyncpg read model), ``rebuild`` (replay into fresh tables and
swap), ``consumer`` (the durable consumer: fetch, apply, ack), ``publisher`` (routing figures
to the KV bucket), ``endpoints`` (the query and operator endpoints), ``service`` (the three
wired together), and the two jobs ``judge`` and ``bench``.
"""
