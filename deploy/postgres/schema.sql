-- Coordinator's read model in PostgreSQL.
--
-- Written only by the stats service, which projects the EVENTS stream into these tables; the
-- event log stays the source of truth, so every table here can be rebuilt by replaying it.
-- The file is idempotent (IF NOT EXISTS everywhere): the stats service applies it at every
-- start, and an operator may apply it by hand with `psql -f`.
--
-- Timestamps are timestamptz (UTC). Durations are milliseconds as the backends reported them.

-- One row per task: its current state, as the pure `evolve` in services/stats/projection.py
-- computes it from the task's events.
CREATE TABLE IF NOT EXISTS tasks (
    task_id         text PRIMARY KEY,
    status          text NOT NULL CHECK (status IN ('queued', 'running', 'done', 'failed')),
    -- '' only while the task's `submitted` event has not been seen (see projection.py).
    model           text NOT NULL,
    domain          text,
    task_type       text NOT NULL DEFAULT 'inference',
    prompt          text NOT NULL DEFAULT '',
    -- The worker, queue and host of the current attempt.
    worker          text,
    queue           text,
    host            text,
    -- `attempt` is the current attempt (0 before the first `routed`); events of a lower
    -- attempt are stale and change nothing. `attempts` is the highest attempt number seen.
    attempt         integer NOT NULL DEFAULT 0,
    attempts        integer NOT NULL DEFAULT 0,
    response        text,
    thinking        text,
    total_ms        double precision,
    load_ms         double precision,
    prompt_eval_ms  double precision,
    eval_ms         double precision,
    prompt_tokens   integer,
    eval_tokens     integer,
    error_code      text,
    error           text,
    created_at      timestamptz NOT NULL,
    started_at      timestamptz,
    ended_at        timestamptz,
    -- EVENTS stream sequence of the last event that changed this row.
    updated_seq     bigint NOT NULL
);

CREATE INDEX IF NOT EXISTS tasks_status_created_idx ON tasks (status, created_at);
CREATE INDEX IF NOT EXISTS tasks_model_created_idx ON tasks (model, created_at);

-- Figures per model, domain and worker: what routing uses to expect a task's duration and
-- what `coordinator stats` shows. Each attempt's outcome is added once, when it is first
-- seen (done: count + 1 and its durations and tokens; failed: count + 1 and failures + 1).
-- The sums cover done attempts only, so a mean is `sum / (count - failures)`; a duration or
-- token count the backend did not report adds 0.
CREATE TABLE IF NOT EXISTS model_stats (
    model            text NOT NULL,
    -- The domain of the task's `submitted` event; '' when it had none.
    domain           text NOT NULL DEFAULT '',
    -- '' when a failure named no worker.
    worker           text NOT NULL,
    count            bigint NOT NULL DEFAULT 0,
    failures         bigint NOT NULL DEFAULT 0,
    total_ms_sum     double precision NOT NULL DEFAULT 0,
    load_ms_sum      double precision NOT NULL DEFAULT 0,
    eval_ms_sum      double precision NOT NULL DEFAULT 0,
    eval_tokens_sum  bigint NOT NULL DEFAULT 0,
    -- When the latest outcome counted here ended.
    last_at          timestamptz NOT NULL,
    PRIMARY KEY (model, domain, worker)
);

-- Which events each projection has applied. The row is written in the same transaction as
-- the projection's changes and the pair is the primary key, so a redelivered event (same
-- stream sequence) is recognised and changes nothing.
CREATE TABLE IF NOT EXISTS projection_tracking (
    projection  text NOT NULL,
    stream_seq  bigint NOT NULL,
    PRIMARY KEY (projection, stream_seq)
);

-- Every worker instance the event log has announced, latest registration per worker id.
-- History for operators; routing reads the live registry (KV `workers`), not this table.
CREATE TABLE IF NOT EXISTS workers_seen (
    worker_id      text PRIMARY KEY,
    host           text NOT NULL,
    instance_id    text NOT NULL,
    models         text[] NOT NULL DEFAULT '{}',
    supports       text[] NOT NULL DEFAULT '{}',
    version        text NOT NULL DEFAULT '',
    registered_at  timestamptz NOT NULL,
    -- Set by the `stopped` event of the same instance; cleared by a new registration.
    stopped_at     timestamptz,
    stop_reason    text,
    updated_seq    bigint NOT NULL
);
