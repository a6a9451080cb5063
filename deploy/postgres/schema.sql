-- Coordinator's read model in PostgreSQL.
--
-- Written only by the stats service, which projects the EVENTS stream into these tables; the
-- event log stays the source of truth, so every table here can be rebuilt by replaying it
-- (`coordinator stats rebuild` creates them afresh in the schema `stats_next`, replays, and
-- moves them into place in one transaction). The list of tables a rebuild swaps is
-- PROJECTION_TABLES in services/stats/rows.py: a table added here goes there too.
-- The file is idempotent (IF NOT EXISTS everywhere): the stats service applies it at every
-- start, and an operator may apply it by hand with `psql -f`. Names are unqualified: the
-- file is applied to whichever schema is first on the search_path.
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
    first_token_ms  double precision,
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

-- Added after the first release; a rebuild fills it for old tasks.
ALTER TABLE tasks ADD COLUMN IF NOT EXISTS first_token_ms double precision;
-- Who asked (the identity, and the gateway key): who may read the task. NULL in tasks asked
-- without identities, which anyone may read.
ALTER TABLE tasks ADD COLUMN IF NOT EXISTS asker text;
ALTER TABLE tasks ADD COLUMN IF NOT EXISTS client text;

-- Replaced by `outcomes` + `figures` (p50/p95 need the durations, not sums). Derived data:
-- `coordinator stats rebuild` recomputes everything from the event log.
DROP TABLE IF EXISTS model_stats;

-- One row per attempt that ended (done or failed): the facts the figures are computed from.
-- Written once, when the attempt first ends; `model` is re-keyed when an alias changes.
CREATE TABLE IF NOT EXISTS outcomes (
    task_id         text NOT NULL,
    attempt         integer NOT NULL,
    -- The canonical name (aliases applied); `raw_model` is the name the task asked for.
    model           text NOT NULL,
    raw_model       text NOT NULL,
    -- The requested domain, else the heuristic's (services/stats/domains.py).
    domain          text NOT NULL,
    -- '' when a failure named no worker.
    worker          text NOT NULL,
    ok              boolean NOT NULL,
    total_ms        double precision,
    load_ms         double precision,
    eval_ms         double precision,
    eval_tokens     integer,
    first_token_ms  double precision,
    ended_at        timestamptz NOT NULL,
    stream_seq      bigint NOT NULL,
    PRIMARY KEY (task_id, attempt)
);

CREATE INDEX IF NOT EXISTS outcomes_key_idx ON outcomes (model, domain, worker, ended_at);
CREATE INDEX IF NOT EXISTS outcomes_worker_idx ON outcomes (worker, ended_at);
CREATE INDEX IF NOT EXISTS outcomes_raw_model_idx ON outcomes (raw_model);

-- Operator decisions (events.stats.exclusion.*): outcomes of `worker` (of `model` only, when
-- set: the requested or the canonical name) that ended in [since, until) count in no figure
-- while the exclusion is not withdrawn. The outcomes themselves stay.
CREATE TABLE IF NOT EXISTS exclusions (
    exclusion_id     text PRIMARY KEY,
    worker           text NOT NULL,
    model            text,
    since            timestamptz NOT NULL,
    until            timestamptz,
    reason           text NOT NULL,
    added_at         timestamptz NOT NULL,
    withdrawn_at     timestamptz,
    withdraw_reason  text,
    stream_seq       bigint NOT NULL
);

-- events.stats.alias.*: `alias` names the model `canonical` (chains are followed).
CREATE TABLE IF NOT EXISTS aliases (
    alias       text PRIMARY KEY,
    canonical   text NOT NULL,
    set_at      timestamptz NOT NULL,
    stream_seq  bigint NOT NULL
);

-- The judge's verdicts (events.quality.<task_id>.scored): at most one per task, the first.
-- `score` is NULL when the verdict was malformed (recorded as such, never guessed).
CREATE TABLE IF NOT EXISTS quality (
    task_id      text PRIMARY KEY,
    attempt      integer NOT NULL,
    verdict      text NOT NULL CHECK (verdict IN ('scored', 'malformed')),
    score        double precision CHECK (score BETWEEN 0 AND 1),
    rubric       text NOT NULL,
    judge_model  text NOT NULL,
    judge_host   text NOT NULL,
    text         text NOT NULL DEFAULT '',
    reason       text NOT NULL DEFAULT '',
    scored_at    timestamptz NOT NULL,
    stream_seq   bigint NOT NULL
);

-- Figures per model (canonical), domain and worker, computed from `outcomes` (exclusions left
-- out) and `quality`: what `coordinator stats` shows and what goes to the KV bucket `stats`
-- for routing. Durations are milliseconds over done outcomes; `warm_p50_ms` leaves the model
-- load time out (lesson 10); `recent_*` cover the key's last 20 outcomes. Recomputed for the
-- keys each batch of events touches, so it is never out of step with `outcomes`.
CREATE TABLE IF NOT EXISTS figures (
    model               text NOT NULL,
    domain              text NOT NULL,
    worker              text NOT NULL,
    count               bigint NOT NULL,
    failures            bigint NOT NULL,
    mean_ms             double precision,
    p50_ms              double precision,
    p95_ms              double precision,
    load_ms_mean        double precision,
    load_ms_p50         double precision,
    cold_load_ms_p50    double precision,
    warm_p50_ms         double precision,
    tokens_per_s        double precision,
    first_token_ms_p50  double precision,
    quality_mean        double precision,
    quality_count       bigint NOT NULL DEFAULT 0,
    recent_count        bigint NOT NULL DEFAULT 0,
    recent_failures     bigint NOT NULL DEFAULT 0,
    last_at             timestamptz NOT NULL,
    PRIMARY KEY (model, domain, worker)
);

-- Added after the first release: the p50 load time of the done outcomes that loaded the model
-- (a load of 100 ms or more, `schemas.stats.COLD_LOAD_MIN_MS`), what routing counts for a cold
-- start. Derived: every figure row is recomputed at the stats service's start.
ALTER TABLE figures ADD COLUMN IF NOT EXISTS cold_load_ms_p50 double precision;

-- The nightly benchmark (events.bench.<run_id>.*): runs, and one row per prompt and worker.
CREATE TABLE IF NOT EXISTS bench_runs (
    run_id       text PRIMARY KEY,
    started_at   timestamptz NOT NULL,
    models       text[] NOT NULL DEFAULT '{}',
    workers      text[] NOT NULL DEFAULT '{}',
    prompts      integer NOT NULL DEFAULT 0,
    finished_at  timestamptz,
    ok           integer,
    failed       integer,
    slow         text[],
    stream_seq   bigint NOT NULL
);

CREATE TABLE IF NOT EXISTS bench_results (
    run_id       text NOT NULL,
    result_index integer NOT NULL,
    -- Canonical (re-keyed when an alias changes), and as the benchmark asked for it.
    model        text NOT NULL,
    raw_model    text NOT NULL,
    worker       text NOT NULL,
    domain       text NOT NULL,
    prompt_key   text NOT NULL,
    prompt_name  text NOT NULL,
    ok           boolean NOT NULL,
    task_id      text,
    total_ms     double precision,
    load_ms      double precision,
    error        text,
    at           timestamptz NOT NULL,
    stream_seq   bigint NOT NULL,
    PRIMARY KEY (run_id, result_index)
);

CREATE INDEX IF NOT EXISTS bench_results_key_idx ON bench_results (model, worker, prompt_key);

-- Which events each projection has applied (or parked). The row is written in the same
-- transaction as the projection's changes and (projection, stream_seq) is the primary key, so
-- a redelivered event is recognised and changes nothing. `digest` identifies the event at its
-- position (a digest of its subject and bytes, services/stats/tracking.py): an EVENTS stream
-- recreated, or restored from an older copy, holds other events at positions already applied,
-- and they are told apart by it. The stream's `created` time would not do: a restored backup
-- (the same events) gets a new one, on a cluster a different one on each replica.
CREATE TABLE IF NOT EXISTS projection_tracking (
    projection  text NOT NULL,
    stream_seq  bigint NOT NULL,
    digest      bytea,
    PRIMARY KEY (projection, stream_seq)
);

-- Added after the first release. NULL on the rows written before it: the stats service fills
-- them in at start from the events the stream still holds at those positions. The index holds
-- only the rows still without one, so the service's look for them at every start is cheap.
ALTER TABLE projection_tracking ADD COLUMN IF NOT EXISTS digest bytea;
CREATE INDEX IF NOT EXISTS projection_tracking_undigested_idx
    ON projection_tracking (projection, stream_seq) WHERE digest IS NULL;

-- Tracking rows set aside because the log came to hold other events at their positions (from
-- `replaced_from` on, noticed at `replaced_at`): events of a log EVENTS no longer holds. What
-- they counted stays in the tables until `coordinator stats rebuild`; `coordinator doctor`
-- says so while any are here.
CREATE TABLE IF NOT EXISTS replaced_tracking (
    projection     text NOT NULL,
    stream_seq     bigint NOT NULL,
    digest         bytea,
    replaced_from  bigint NOT NULL,
    replaced_at    timestamptz NOT NULL,
    PRIMARY KEY (projection, replaced_at, stream_seq)
);

-- Events that decode but cannot be projected (a time no column holds, a value a check
-- refuses, or a failure nothing explains, tried three times): recorded here, with a tracking
-- row, instead of being tried for ever. A rebuild tries them again (`coordinator stats parked`
-- lists them, `coordinator doctor` counts them).
CREATE TABLE IF NOT EXISTS parked_events (
    stream      text NOT NULL,
    stream_seq  bigint NOT NULL,
    digest      bytea NOT NULL,
    subject     text NOT NULL,
    kind        text NOT NULL,
    error       text NOT NULL,
    parked_at   timestamptz NOT NULL,
    PRIMARY KEY (stream_seq, digest)
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

-- The digest of this file as last applied here (services/stats/store.py, `apply_schema`). A
-- start that finds it unchanged runs none of the above: an `ALTER TABLE` takes its table's
-- strongest lock even when it changes nothing, and a standby starting beside an instance that
-- is projecting would otherwise queue behind (or deadlock with) that instance's writes.
CREATE TABLE IF NOT EXISTS schema_applied (
    digest      text NOT NULL,
    applied_at  timestamptz NOT NULL
);
