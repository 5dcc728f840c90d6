//! Recent log lines per model — its engines' stderr and the supervisor's lifecycle
//! notes — for `GET /logs/{model}`, with live followers (`?follow=1`).

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, RwLock};

use tokio::sync::broadcast;

/// Lines kept per model.
pub const LOG_LINES: usize = 1000;

/// One model's log: a ring of recent lines plus a broadcast for followers.
#[derive(Debug)]
pub struct ModelLog {
    lines: Mutex<VecDeque<String>>,
    live: broadcast::Sender<String>,
}

impl Default for ModelLog {
    fn default() -> Self {
        Self {
            lines: Mutex::new(VecDeque::with_capacity(64)),
            live: broadcast::channel(256).0,
        }
    }
}

impl ModelLog {
    pub fn push(&self, line: impl Into<String>) {
        let line = line.into();
        {
            // A poisoned lock only means a panic mid-push; the ring is still usable.
            let mut l = self.lines.lock().unwrap_or_else(|p| p.into_inner());
            if l.len() == LOG_LINES {
                l.pop_front();
            }
            l.push_back(line.clone());
        }
        // No followers is fine.
        let _ = self.live.send(line);
    }

    /// The last `n` lines, oldest first.
    pub fn recent(&self, n: usize) -> Vec<String> {
        let l = self.lines.lock().unwrap_or_else(|p| p.into_inner());
        l.iter().skip(l.len().saturating_sub(n)).cloned().collect()
    }

    /// The last `n` lines and a receiver for every line after them (none lost between).
    pub fn follow(&self, n: usize) -> (Vec<String>, broadcast::Receiver<String>) {
        let l = self.lines.lock().unwrap_or_else(|p| p.into_inner());
        let rx = self.live.subscribe();
        let backlog = l.iter().skip(l.len().saturating_sub(n)).cloned().collect();
        (backlog, rx)
    }
}

/// Every configured model's log: those configured at start, and those a configuration
/// reload adds.
#[derive(Debug, Default, Clone)]
pub struct Logs(Arc<RwLock<BTreeMap<String, Arc<ModelLog>>>>);

impl Logs {
    pub fn new<'a>(ids: impl IntoIterator<Item = &'a str>) -> Self {
        Self(Arc::new(RwLock::new(
            ids.into_iter()
                .map(|id| (id.to_string(), Arc::default()))
                .collect(),
        )))
    }

    pub fn get(&self, id: &str) -> Option<Arc<ModelLog>> {
        // A poisoned lock only means a panic mid-insert; the map is still usable.
        let map = self.0.read().unwrap_or_else(|p| p.into_inner());
        map.get(id).cloned()
    }

    /// The log of `id`, made empty if it has none yet.
    pub fn get_or_create(&self, id: &str) -> Arc<ModelLog> {
        let mut map = self.0.write().unwrap_or_else(|p| p.into_inner());
        map.entry(id.to_string()).or_default().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn ring_and_follow() {
        let log = ModelLog::default();
        for i in 0..LOG_LINES + 5 {
            log.push(format!("l{i}"));
        }
        let r = log.recent(3);
        assert_eq!(r, ["l1002", "l1003", "l1004"]);
        assert_eq!(log.recent(usize::MAX).len(), LOG_LINES);
        let (backlog, mut rx) = log.follow(1);
        assert_eq!(backlog, ["l1004"]);
        log.push("next");
        assert_eq!(rx.recv().await.unwrap(), "next");
    }
}
