//! What `/health` and `/health/ready` answer: a pure verdict over a snapshot of the
//! pool, so a load balancer only sends traffic to an mlxd that can serve it.
//!
//! A model *can serve* when its engine is ready and answers its own `/health`, and *could
//! serve* when it is not running but may be started (idle, stopped, loading, restarting,
//! unloading). The server is healthy (200) while at least one model can or could serve,
//! and unavailable (503) while it drains for shutdown or when every model has failed or
//! has a ready engine that does not answer. `/health/live` only says the process is up.

use serde::Serialize;

/// One model as the verdict sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelHealth<'a> {
    pub model: &'a str,
    /// The pool's fine-grained state name (`ready`, `failed`, ...).
    pub state: &'a str,
    /// For a ready engine: whether it answered its own `/health`.
    pub responding: Option<bool>,
    /// Why it failed, when it did.
    pub failure: Option<&'a str>,
    /// When it is not running and its planned memory exceeds the budget: (needed, budget).
    /// It could not start, so it does not count as loadable.
    pub too_large: Option<(u64, u64)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Every model can or could serve.
    Ok,
    /// Some models cannot serve, at least one can or could.
    Degraded,
    /// Nothing can serve: draining, or every model failed or is unresponsive.
    Unavailable,
}

/// The verdict: status, and why (one line per model that cannot serve, or "draining").
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Verdict {
    pub status: Status,
    pub reasons: Vec<String>,
    /// Models that can serve now (ready and responding).
    pub serving: usize,
    /// Models that could be started on demand.
    pub loadable: usize,
}

impl Verdict {
    pub fn http_status(&self) -> http::StatusCode {
        match self.status {
            Status::Ok | Status::Degraded => http::StatusCode::OK,
            Status::Unavailable => http::StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}

/// Judges the snapshot. `draining` is set once shutdown has begun.
pub fn assess(draining: bool, models: &[ModelHealth<'_>]) -> Verdict {
    let mut reasons = Vec::new();
    let (mut serving, mut loadable) = (0, 0);
    if draining {
        reasons.push("the server is shutting down (draining)".to_string());
    }
    for m in models {
        match (m.state, m.responding) {
            ("ready", Some(false)) => reasons.push(format!(
                "model {}: engine is ready but does not answer its health check",
                m.model
            )),
            ("ready", _) => serving += 1,
            ("failed", _) => reasons.push(format!(
                "model {}: failed: {}",
                m.model,
                m.failure.unwrap_or("repeated crashes")
            )),
            _ => match m.too_large {
                Some((needed, budget)) => reasons.push(format!(
                    "model {}: needs {needed} bytes, more than the memory budget of {budget} bytes; it cannot be loaded",
                    m.model
                )),
                None => loadable += 1,
            },
        }
    }
    if models.is_empty() {
        reasons.push("no models are configured".to_string());
    }
    let status = if draining || serving + loadable == 0 {
        Status::Unavailable
    } else if reasons.is_empty() {
        Status::Ok
    } else {
        Status::Degraded
    };
    Verdict {
        status,
        reasons,
        serving,
        loadable,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m<'a>(model: &'a str, state: &'a str, responding: Option<bool>) -> ModelHealth<'a> {
        ModelHealth {
            model,
            state,
            responding,
            failure: (state == "failed").then_some("exit code 2 before ready"),
            too_large: None,
        }
    }

    /// Issue 23, finding 4: `/health` said 200 `ok, models_loadable: 1` while the only model
    /// could never fit the memory budget.
    #[test]
    fn a_model_that_cannot_fit_is_not_loadable() {
        let big = ModelHealth {
            too_large: Some((2048, 1024)),
            ..m("big", "stopped", None)
        };
        let v = assess(false, std::slice::from_ref(&big));
        assert_eq!(
            (v.status, v.http_status().as_u16(), v.loadable),
            (Status::Unavailable, 503, 0)
        );
        assert!(v.reasons[0].contains("needs 2048 bytes"), "{:?}", v.reasons);
        let v = assess(false, &[big, m("small", "idle", None)]);
        assert_eq!((v.status, v.loadable), (Status::Degraded, 1));
    }

    #[test]
    fn idle_models_could_serve() {
        let v = assess(false, &[m("a", "idle", None)]);
        assert_eq!((v.status, v.http_status().as_u16()), (Status::Ok, 200));
        assert_eq!((v.serving, v.loadable), (0, 1));
    }

    #[test]
    fn every_model_failed_is_503_with_the_reason() {
        let v = assess(false, &[m("a", "failed", None)]);
        assert_eq!(
            (v.status, v.http_status().as_u16()),
            (Status::Unavailable, 503)
        );
        assert_eq!(v.reasons, ["model a: failed: exit code 2 before ready"]);
    }

    #[test]
    fn one_failed_one_ready_is_degraded_but_200() {
        let v = assess(
            false,
            &[m("a", "failed", None), m("b", "ready", Some(true))],
        );
        assert_eq!(
            (v.status, v.http_status().as_u16()),
            (Status::Degraded, 200)
        );
        assert_eq!(v.serving, 1);
    }

    #[test]
    fn an_unresponsive_ready_engine_cannot_serve() {
        let v = assess(false, &[m("a", "ready", Some(false))]);
        assert_eq!(v.status, Status::Unavailable);
        assert!(v.reasons[0].contains("does not answer"), "{:?}", v.reasons);
    }

    #[test]
    fn draining_is_503_whatever_the_models() {
        let v = assess(true, &[m("a", "ready", Some(true))]);
        assert_eq!(
            (v.status, v.http_status().as_u16()),
            (Status::Unavailable, 503)
        );
        assert!(v.reasons[0].contains("draining"));
        assert_eq!(assess(false, &[]).status, Status::Unavailable);
    }
}
