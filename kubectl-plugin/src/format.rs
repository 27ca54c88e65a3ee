//! Small formatting helpers shared by the tables and the `why` text.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

/// A duration the way kubectl prints ages: `45s`, `3m10s`, `42m`, `5h3m`, `30h`, `3d4h`, `12d`.
pub fn human_duration(seconds: i64) -> String {
    let s = seconds.max(0);
    let (m, h, d) = (s / 60, s / 3600, s / 86_400);
    if s < 120 {
        format!("{s}s")
    } else if m < 10 {
        format!("{m}m{}s", s % 60)
    } else if m < 180 {
        format!("{m}m")
    } else if h < 8 {
        format!("{h}h{}m", m % 60)
    } else if h < 48 {
        format!("{h}h")
    } else if h < 24 * 8 {
        format!("{d}d{}h", h % 24)
    } else {
        format!("{d}d")
    }
}

/// A label selector as `kubectl get -l` writes one: `app=llm,tier in (gold,silver),gpu,!legacy`; the
/// empty selector is `{} (every pod in the namespace)`.
pub fn selector_text(selector: &LabelSelector) -> String {
    let mut parts: Vec<String> = selector.match_labels.iter().flatten().map(|(k, v)| format!("{k}={v}")).collect();
    for e in selector.match_expressions.iter().flatten() {
        let values = e.values.clone().unwrap_or_default().join(",");
        parts.push(match e.operator.as_str() {
            "In" => format!("{} in ({values})", e.key),
            "NotIn" => format!("{} notin ({values})", e.key),
            "Exists" => e.key.clone(),
            "DoesNotExist" => format!("!{}", e.key),
            other => format!("{} {other} ({values})", e.key),
        });
    }
    if parts.is_empty() { "{} (every pod in the namespace)".to_owned() } else { parts.join(",") }
}

/// `usage` as a percentage of `limit`, one decimal; `None` without a limit.
pub fn percent(usage: u64, limit: u64) -> Option<f64> {
    (limit > 0).then(|| (u128::from(usage) * 1000 / u128::from(limit)) as f64 / 10.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_like_kubectl() {
        let cases = [(0, "0s"), (45, "45s"), (119, "119s"), (190, "3m10s"), (2520, "42m"), (18_180, "5h3m")];
        for (s, want) in cases {
            assert_eq!(human_duration(s), want);
        }
        assert_eq!(human_duration(30 * 3600), "30h");
        assert_eq!(human_duration(76 * 3600), "3d4h");
        assert_eq!(human_duration(12 * 86_400), "12d");
        assert_eq!(human_duration(-5), "0s", "a clock skew never prints a negative age");
    }

    #[test]
    fn selectors_read_like_kubectl() {
        let s: LabelSelector = serde_yaml::from_str(
            "matchLabels: {app: llm}\nmatchExpressions:\n- {key: tier, operator: In, values: [gold, silver]}\n\
             - {key: gpu, operator: Exists}\n- {key: legacy, operator: DoesNotExist}\n",
        )
        .unwrap();
        assert_eq!(selector_text(&s), "app=llm,tier in (gold,silver),gpu,!legacy");
        assert_eq!(selector_text(&LabelSelector::default()), "{} (every pod in the namespace)");
        assert_eq!(percent(9 << 30, 8 << 30), Some(112.5));
        assert_eq!(percent(1, 0), None);
    }
}
