"""The stats service: projects the ``EVENTS`` stream into PostgreSQL and answers queries.

Pure, no I/O: ``projection`` (a task's state from its events, attempt outcomes), ``figures``
(KV keys and values), ``verdict`` (the judge's rubrics and its verdicts read), ``baseline``
(the bench's slow-worker judgement). The domain heuristic and the alias rules, which the
router and the workers apply too, are in `services.fleet`.

I/O: ``projector`` (events applied to the tables, shared by the live projection and the
rebuild), ``store`` (the asyncpg read model), ``rebuild`` (replay into fresh tables and swap),
``service`` (the durable consumer, the KV publisher and the endpoints), and the two jobs
``judge`` and ``bench``.
"""
