"""The ``figures`` table: each (model, domain, worker)'s figures recomputed from the facts.

The facts are ``outcomes`` (an attempt that ended), ``exclusions`` (an outcome counts unless an
active exclusion covers it) and ``quality`` (the judge's scores). The live projection
recomputes the keys its batches touched, at most once a second; a rebuild all of them at the
end; the store's figure queries reuse the exclusion rule and the column list.
"""

from __future__ import annotations

from typing import Final

from schemas.stats import COLD_LOAD_MIN_MS, RECENT_WINDOW
from services.stats.rows import Connection, FigureKey

# An outcome counts unless an active exclusion covers it.
NOT_EXCLUDED: Final = """NOT EXISTS (
    SELECT 1 FROM exclusions e
    WHERE e.withdrawn_at IS NULL AND e.worker = {row}.worker
      AND (e.model IS NULL OR e.model = {row}.model OR e.model = {row}.raw_model)
      AND {row}.{at} >= e.since AND (e.until IS NULL OR {row}.{at} < e.until))"""

FIGURE_COLUMNS: Final = (
    "model",
    "domain",
    "worker",
    "count",
    "failures",
    "mean_ms",
    "p50_ms",
    "p95_ms",
    "load_ms_mean",
    "load_ms_p50",
    "cold_load_ms_p50",
    "warm_p50_ms",
    "tokens_per_s",
    "first_token_ms_p50",
    "quality_mean",
    "quality_count",
    "recent_count",
    "recent_failures",
    "last_at",
)
# $1 is the recent window; with keys, $2-$4 are the models, domains and workers.
_FIGURES_INSERT: Final = f"""
WITH kept AS (
    SELECT o.* FROM outcomes o
    WHERE {{keys}} AND {NOT_EXCLUDED.format(row="o", at="ended_at")}
), ranked AS (
    SELECT kept.*, row_number() OVER (
        PARTITION BY model, domain, worker ORDER BY ended_at DESC, stream_seq DESC
    ) AS recency
    FROM kept
), judged AS (
    SELECT k.model, k.domain, k.worker, avg(q.score) AS quality_mean, count(*) AS quality_count
    FROM quality q JOIN kept k ON k.task_id = q.task_id AND k.attempt = q.attempt
    WHERE q.score IS NOT NULL
    GROUP BY k.model, k.domain, k.worker
)
INSERT INTO figures ({", ".join(FIGURE_COLUMNS)})
SELECT r.model, r.domain, r.worker,
    count(*),
    count(*) FILTER (WHERE NOT r.ok),
    avg(r.total_ms) FILTER (WHERE r.ok),
    percentile_cont(0.5) WITHIN GROUP (ORDER BY r.total_ms) FILTER (WHERE r.ok),
    percentile_cont(0.95) WITHIN GROUP (ORDER BY r.total_ms) FILTER (WHERE r.ok),
    avg(r.load_ms) FILTER (WHERE r.ok),
    percentile_cont(0.5) WITHIN GROUP (ORDER BY r.load_ms) FILTER (WHERE r.ok),
    percentile_cont(0.5) WITHIN GROUP (ORDER BY r.load_ms)
        FILTER (WHERE r.ok AND r.load_ms >= {COLD_LOAD_MIN_MS!r}),
    percentile_cont(0.5) WITHIN GROUP (ORDER BY r.total_ms - coalesce(r.load_ms, 0))
        FILTER (WHERE r.ok),
    sum(r.eval_tokens) FILTER (WHERE r.ok AND r.eval_ms > 0 AND r.eval_tokens IS NOT NULL)
        * 1000.0
        / nullif(sum(r.eval_ms)
                 FILTER (WHERE r.ok AND r.eval_ms > 0 AND r.eval_tokens IS NOT NULL), 0),
    percentile_cont(0.5) WITHIN GROUP (ORDER BY r.first_token_ms) FILTER (WHERE r.ok),
    max(j.quality_mean),
    coalesce(max(j.quality_count), 0),
    count(*) FILTER (WHERE r.recency <= $1),
    count(*) FILTER (WHERE r.recency <= $1 AND NOT r.ok),
    max(r.ended_at)
FROM ranked r LEFT JOIN judged j
    ON j.model = r.model AND j.domain = r.domain AND j.worker = r.worker
GROUP BY r.model, r.domain, r.worker
"""
_KEYS_MATCH: Final = (
    "({alias}.model, {alias}.domain, {alias}.worker) IN "
    "(SELECT * FROM unnest(${first}::text[], ${second}::text[], ${third}::text[]))"
)
_REFRESH_KEYS_DELETE: Final = "DELETE FROM figures f WHERE " + _KEYS_MATCH.format(
    alias="f", first=1, second=2, third=3
)
_REFRESH_KEYS_INSERT: Final = _FIGURES_INSERT.replace(
    "{keys}", _KEYS_MATCH.format(alias="o", first=2, second=3, third=4)
)
_REFRESH_ALL_INSERT: Final = _FIGURES_INSERT.replace("{keys}", "true")


async def refresh_figures(conn: Connection, keys: set[FigureKey] | None = None) -> None:
    """Recompute the figures of ``keys`` (every key when None) from the facts tables."""
    if keys is None:
        await conn.execute("DELETE FROM figures")
        await conn.execute(_REFRESH_ALL_INSERT, RECENT_WINDOW)
        return
    if not keys:
        return
    models, domains, workers = (list(column) for column in zip(*sorted(keys), strict=True))
    await conn.execute(_REFRESH_KEYS_DELETE, models, domains, workers)
    await conn.execute(_REFRESH_KEYS_INSERT, RECENT_WINDOW, models, domains, workers)
