//! `/api/pull`: the model store's `resolve_model` (as `mlxd pull`), its progress events as
//! Ollama's NDJSON status objects.

use std::collections::HashMap;

use mlxd_store::StoreEvent;
use serde_json::{json, Value};

/// Turns store events into status objects, at most one per percent of each download so a
/// slow client is not sent a line per network read.
#[derive(Debug, Default)]
pub struct PullStatus {
    /// The last percent reported of each download.
    percent: HashMap<String, u64>,
}

impl PullStatus {
    /// The status object for `e`, if it is worth a line.
    pub fn line(&mut self, e: &StoreEvent) -> Option<Value> {
        match e {
            StoreEvent::Download { what, done, total } => {
                let pct = if *total == 0 {
                    0
                } else {
                    (done * 100 / total).min(100)
                };
                let last = self.percent.get(what).copied();
                if last.is_some_and(|l| l >= pct) {
                    return None;
                }
                self.percent.insert(what.clone(), pct);
                let mut o =
                    json!({"status": format!("pulling {what}"), "digest": what, "completed": done});
                if *total > 0 {
                    o["total"] = json!(total);
                }
                Some(o)
            }
            StoreEvent::Downloaded { what } => {
                Some(json!({"status": format!("pulled {what}"), "digest": what}))
            }
            StoreEvent::Converting { source } => {
                Some(json!({"status": format!("converting {} to MLX", source.display())}))
            }
            StoreEvent::Converted { dir, seconds } => Some(json!({
                "status": format!("converted into {} in {seconds:.1} s", dir.display())
            })),
        }
    }
}

/// The HTTP status of a failed pull: the client's fault when the name is not a model or
/// the repo does not exist, the network's or the store's otherwise.
pub fn failure_status(e: &mlxd_store::StoreError) -> http::StatusCode {
    use mlxd_store::StoreError as E;
    match e {
        E::UnknownModel { .. } | E::MissingConfig(_) | E::NotAModel(_) => {
            http::StatusCode::BAD_REQUEST
        }
        E::HfNotFound { .. } | E::NotStored(_) | E::HfNotCached { .. } => {
            http::StatusCode::NOT_FOUND
        }
        E::HfUnauthorized { .. } => http::StatusCode::FORBIDDEN,
        E::Network { .. } | E::HttpStatus { .. } | E::Truncated { .. } => {
            http::StatusCode::BAD_GATEWAY
        }
        _ => http::StatusCode::INTERNAL_SERVER_ERROR,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn downloads_report_each_percent_once() {
        let mut s = PullStatus::default();
        let ev = |done| StoreEvent::Download {
            what: "model.gguf".into(),
            done,
            total: 1000,
        };
        let first = s.line(&ev(0)).unwrap();
        assert_eq!(first["status"], "pulling model.gguf");
        assert_eq!(first["total"], 1000);
        assert_eq!(first["completed"], 0);
        assert!(s.line(&ev(5)).is_none(), "same percent");
        assert_eq!(s.line(&ev(10)).unwrap()["completed"], 10);
        assert!(s.line(&ev(19)).is_none());
        assert_eq!(s.line(&ev(1000)).unwrap()["completed"], 1000);
        let unknown = StoreEvent::Download {
            what: "b".into(),
            done: 7,
            total: 0,
        };
        let l = s.line(&unknown).unwrap();
        assert!(l.get("total").is_none());
        assert!(s
            .line(&StoreEvent::Downloaded { what: "b".into() })
            .is_some());
    }

    #[test]
    fn failures_are_classified() {
        let e = mlxd_store::StoreError::UnknownModel {
            spec: "x".into(),
            known: "a".into(),
        };
        assert_eq!(failure_status(&e), http::StatusCode::BAD_REQUEST);
        let e = mlxd_store::StoreError::HfNotFound { url: "u".into() };
        assert_eq!(failure_status(&e), http::StatusCode::NOT_FOUND);
    }
}
