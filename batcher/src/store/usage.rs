//! Usage per account: requests and tokens by lane, model, adapter, day and batch.

use chrono::NaiveDate;
use serde::Serialize;
use sqlx::Row;

use super::{Result, Store};
use crate::ids::AccountId;

/// What usage is grouped by, besides the lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UsageGroup {
    /// The model.
    Model,
    /// The adapter's id (none: `null`).
    Adapter,
    /// The UTC day the request finished.
    Day,
    /// The batch (`null` on the real-time lane).
    Batch,
}

impl UsageGroup {
    /// `model`, `adapter`, `day` or `batch`.
    pub fn parse(raw: &str) -> Option<Self> {
        match raw {
            "model" => Some(UsageGroup::Model),
            "adapter" => Some(UsageGroup::Adapter),
            "day" => Some(UsageGroup::Day),
            "batch" => Some(UsageGroup::Batch),
            _ => None,
        }
    }
}

/// One group's usage.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct UsageRow {
    /// `batch` or `realtime`.
    pub lane: String,
    /// With `group_by=model`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// With `group_by=adapter`: the adapter's id, `""` for none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub adapter: Option<String>,
    /// With `group_by=day`: `YYYY-MM-DD`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub day: Option<String>,
    /// With `group_by=batch`: the batch id, `""` on the real-time lane.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch_id: Option<String>,
    /// Requests that succeeded.
    pub requests: i64,
    /// Prompt tokens.
    pub input_tokens: i64,
    /// Generated tokens.
    pub output_tokens: i64,
}

impl Store {
    /// Count one real-time request served for `account` today (UTC).
    pub async fn record_realtime_usage(
        &self,
        account: &AccountId,
        model: &str,
        adapter: Option<&str>,
        input_tokens: u32,
        output_tokens: u32,
    ) -> Result<()> {
        sqlx::query(
            "INSERT INTO realtime_usage (account_id, day, model, adapter, requests, input_tokens, output_tokens)
             VALUES ($1, (now() AT TIME ZONE 'UTC')::date, $2, $3, 1, $4, $5)
             ON CONFLICT (account_id, day, model, adapter) DO UPDATE SET
                 requests = realtime_usage.requests + 1,
                 input_tokens = realtime_usage.input_tokens + EXCLUDED.input_tokens,
                 output_tokens = realtime_usage.output_tokens + EXCLUDED.output_tokens",
        )
        .bind(&account.0)
        .bind(model)
        .bind(adapter.unwrap_or(""))
        .bind(i64::from(input_tokens))
        .bind(i64::from(output_tokens))
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// The account's usage on the UTC days from `start` to before `end`, by
    /// lane and `groups`: the batch lane's succeeded requests by the day they
    /// finished, the real-time lane's from its daily counts.
    pub async fn usage(
        &self,
        account: &AccountId,
        start: NaiveDate,
        end: NaiveDate,
        groups: &[UsageGroup],
    ) -> Result<Vec<UsageRow>> {
        let has = |g| groups.contains(&g);
        // Every group's column is selected; those not asked for are constant.
        let pick = |g, expr: &str| {
            if has(g) {
                expr.to_string()
            } else {
                "NULL::text".to_string()
            }
        };
        let batch_select = format!(
            "SELECT 'batch' AS lane, {} AS model, {} AS adapter, {} AS day, {} AS batch_id,
                    count(*) AS requests, coalesce(sum(r.prompt_tokens), 0)::bigint AS input_tokens,
                    coalesce(sum(r.completion_tokens), 0)::bigint AS output_tokens
             FROM batches b JOIN requests r ON r.batch_id = b.id
             WHERE b.account_id = $1 AND b.created_at < ($3::date)::timestamp AT TIME ZONE 'UTC'
               AND r.status = 'succeeded'
               AND r.finished_at >= ($2::date)::timestamp AT TIME ZONE 'UTC'
               AND r.finished_at < ($3::date)::timestamp AT TIME ZONE 'UTC'
             GROUP BY 2, 3, 4, 5",
            pick(UsageGroup::Model, "b.model"),
            pick(UsageGroup::Adapter, "coalesce(r.body->>'lora', '')"),
            pick(
                UsageGroup::Day,
                "to_char(r.finished_at AT TIME ZONE 'UTC', 'YYYY-MM-DD')"
            ),
            pick(UsageGroup::Batch, "b.id"),
        );
        let realtime_select = format!(
            "SELECT 'realtime' AS lane, {} AS model, {} AS adapter, {} AS day, {} AS batch_id,
                    coalesce(sum(requests), 0)::bigint AS requests,
                    coalesce(sum(input_tokens), 0)::bigint AS input_tokens,
                    coalesce(sum(output_tokens), 0)::bigint AS output_tokens
             FROM realtime_usage
             WHERE account_id = $1 AND day >= $2 AND day < $3
             GROUP BY 2, 3, 4, 5",
            pick(UsageGroup::Model, "model"),
            pick(UsageGroup::Adapter, "adapter"),
            pick(UsageGroup::Day, "to_char(day, 'YYYY-MM-DD')"),
            pick(UsageGroup::Batch, "''"),
        );
        let rows = sqlx::query(&format!(
            "{batch_select} UNION ALL {realtime_select} ORDER BY lane, model, adapter, day, batch_id"
        ))
        .bind(&account.0)
        .bind(start)
        .bind(end)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .iter()
            .map(|r| UsageRow {
                lane: r.get("lane"),
                model: r.get("model"),
                adapter: r.get("adapter"),
                day: r.get("day"),
                batch_id: r.get("batch_id"),
                requests: r.get("requests"),
                input_tokens: r.get("input_tokens"),
                output_tokens: r.get("output_tokens"),
            })
            .collect())
    }
}
