//! Time as Ollama's API writes and reads it: RFC 3339 timestamps (`created_at`,
//! `modified_at`, `expires_at`) and `keep_alive` durations (`"5m"`, `"1h30m"`, `300`, `-1`).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// `t` as `2026-12-02T12:50:32.123456Z` (UTC, microseconds: what Python's `datetime`
/// and pydantic read without loss).
pub fn rfc3339(t: SystemTime) -> String {
    let (secs, micros) = match t.duration_since(UNIX_EPOCH) {
        Ok(d) => (d.as_secs() as i64, d.subsec_micros()),
        // Before 1970: only from a broken clock; the epoch is as good as any.
        Err(_) => (0, 0),
    };
    rfc3339_parts(secs, micros)
}

/// [`rfc3339`] of `secs` seconds (and `micros`) after the Unix epoch.
pub fn rfc3339_parts(secs: i64, micros: u32) -> String {
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{micros:06}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Year, month, day of the day `z` days after 1970-01-01 (proleptic Gregorian), after
/// Howard Hinnant's `civil_from_days`.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// What a request's `keep_alive` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeepAlive {
    /// Absent: whatever holds (an earlier request's keep-alive while the model stays
    /// loaded, else the configured TTL).
    Default,
    /// `0`: unload the model once this request is answered.
    Unload,
    /// A positive duration.
    For(Duration),
    /// Negative: keep the model loaded.
    Forever,
}

/// Parses `keep_alive` as Ollama does: a number of seconds, or a Go duration string
/// (`"300ms"`, `"10s"`, `"5m"`, `"1h30m"`, a bare `"300"` as seconds); negative means
/// forever, zero unload now.
pub fn keep_alive(v: &serde_json::Value) -> Result<KeepAlive, String> {
    let secs: f64 = match v {
        serde_json::Value::Null => return Ok(KeepAlive::Default),
        serde_json::Value::Number(n) => n
            .as_f64()
            .ok_or_else(|| format!("keep_alive {n} is not a number of seconds"))?,
        serde_json::Value::String(s) => go_duration(s.trim()).ok_or_else(|| {
            format!(
                "keep_alive {s:?} is not a duration (such as \"5m\", \"1h30m\", \"300\" or \"-1\")"
            )
        })?,
        other => {
            return Err(format!(
                "keep_alive must be a duration string or a number of seconds, got {other}"
            ))
        }
    };
    Ok(if secs < 0.0 {
        KeepAlive::Forever
    } else if secs == 0.0 {
        KeepAlive::Unload
    } else {
        KeepAlive::For(Duration::from_secs_f64(secs.min(1e12)))
    })
}

/// Seconds in a Go duration string, or a bare number of seconds.
fn go_duration(s: &str) -> Option<f64> {
    if let Ok(n) = s.parse::<f64>() {
        return n.is_finite().then_some(n);
    }
    let (sign, mut rest) = match s.strip_prefix('-') {
        Some(r) => (-1.0, r),
        None => (1.0, s.strip_prefix('+').unwrap_or(s)),
    };
    if rest.is_empty() {
        return None;
    }
    let mut total = 0.0;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        if digits == 0 {
            return None;
        }
        let value: f64 = rest[..digits].parse().ok()?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return None,
        };
        rest = &rest[unit_len..];
        total += value * scale;
    }
    Some(sign * total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn formats_utc_timestamps() {
        assert_eq!(rfc3339_parts(0, 0), "1970-01-01T00:00:00.000000Z");
        assert_eq!(
            rfc3339_parts(1_796_215_832, 123_456),
            "2026-12-02T12:50:32.123456Z"
        );
        // A leap day, and the end of a century year that is a leap year.
        assert_eq!(rfc3339_parts(951_782_400, 0), "2000-02-29T00:00:00.000000Z");
        assert_eq!(
            rfc3339_parts(978_307_199, 999_999),
            "2000-12-31T23:59:59.999999Z"
        );
    }

    #[test]
    fn keep_alive_forms() {
        assert_eq!(keep_alive(&json!(null)), Ok(KeepAlive::Default));
        assert_eq!(keep_alive(&json!(0)), Ok(KeepAlive::Unload));
        assert_eq!(keep_alive(&json!("0")), Ok(KeepAlive::Unload));
        assert_eq!(keep_alive(&json!("0s")), Ok(KeepAlive::Unload));
        assert_eq!(keep_alive(&json!(-1)), Ok(KeepAlive::Forever));
        assert_eq!(keep_alive(&json!("-1m")), Ok(KeepAlive::Forever));
        assert_eq!(
            keep_alive(&json!("1h30m")),
            Ok(KeepAlive::For(Duration::from_secs(5400)))
        );
        assert_eq!(
            keep_alive(&json!("300ms")),
            Ok(KeepAlive::For(Duration::from_millis(300)))
        );
        assert_eq!(
            keep_alive(&json!(90)),
            Ok(KeepAlive::For(Duration::from_secs(90)))
        );
        assert_eq!(
            keep_alive(&json!("1.5h")),
            Ok(KeepAlive::For(Duration::from_secs(5400)))
        );
        for bad in [
            json!("5 minutes"),
            json!("m"),
            json!(""),
            json!("5x"),
            json!(true),
        ] {
            let e = keep_alive(&bad).unwrap_err();
            assert!(e.contains("keep_alive"), "{e}");
        }
    }
}
