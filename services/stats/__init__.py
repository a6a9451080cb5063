"""The stats service: projects the ``EVENTS`` stream into PostgreSQL and answers queries.

``projection`` is the pure state logic, ``store`` the asyncpg read model, ``service`` the
durable consumer and the ``coordinator.task`` endpoint.
"""
