//! The pool actor as a state machine: simulated engines (no processes), paused time.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use mlxd_protocol::control::{Backend, Device, DeviceKind, Ready, PROTOCOL_VERSION};
use tokio::time::Instant;

use super::*;
use crate::catalog::Catalog;
use crate::config::{Config, ModelConfig};
use crate::engine::{EngineEvent, EngineHandle, EngineMsg, EngineSpec, RunnerCmd};
use crate::error::ProxyError;
use crate::exit::{ExitCause, ExitReport};
use crate::logs::Logs;
use crate::metrics::Metrics;

const GB: u64 = 1 << 30;

/// Simulated engines: each becomes ready after `load_delay` reporting its model's
/// `memory` as weights, logs control messages, and exits when stopped.
#[derive(Default)]
struct Sim {
    load_delay: Duration,
    memory: BTreeMap<String, u64>,
    spawns: Mutex<Vec<String>>,
    /// The limits each spawn was launched with, in spawn order.
    limits: Mutex<Vec<mlxd_protocol::control::Limits>>,
    /// Models whose next engine exits out of memory once ready (one-shot each).
    oom_next: Mutex<Vec<String>>,
    events: Mutex<Vec<String>>,
}

impl Sim {
    fn spawns(&self) -> Vec<String> {
        self.spawns.lock().unwrap().clone()
    }

    fn events(&self) -> Vec<String> {
        self.events.lock().unwrap().clone()
    }

    fn spawner(self: &Arc<Self>) -> Spawner {
        let sim = self.clone();
        Arc::new(move |spec: EngineSpec, generation, tx| {
            let n = {
                let mut s = sim.spawns.lock().unwrap();
                s.push(spec.model.clone());
                sim.limits.lock().unwrap().push(spec.limits.clone());
                s.len() as u32
            };
            let oom = {
                let mut o = sim.oom_next.lock().unwrap();
                let hit = o.contains(&spec.model);
                o.retain(|m| *m != spec.model);
                hit
            };
            let (handle, mut ends) = EngineHandle::simulated(1000 + n, generation);
            let sim = sim.clone();
            let model = spec.model.clone();
            tokio::spawn(async move {
                let emit = |event| {
                    let _ = tx.send(EngineMsg {
                        model: model.clone(),
                        generation,
                        event,
                    });
                };
                tokio::time::sleep(sim.load_delay).await;
                emit(EngineEvent::Ready(Ready {
                    version: PROTOCOL_VERSION,
                    model_id: model.clone(),
                    weight_bytes: sim.memory.get(&model).copied().unwrap_or(1),
                    kv_bytes_per_token: 0,
                    state_bytes_per_sequence: 0,
                    context_length: 0,
                    capabilities: vec![],
                    device: Device {
                        kind: DeviceKind::Gpu,
                        backend: Backend::Metal,
                    },
                    limits: None,
                }));
                if oom {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    let report = Arc::new(ExitReport::new(
                        ExitCause::OutOfMemory {
                            detail: "simulated".into(),
                        },
                        vec![],
                    ));
                    let _ = ends.death.send(Some(report.clone()));
                    emit(EngineEvent::Exited(report));
                    return;
                }
                loop {
                    tokio::select! {
                        biased;
                        Some(cmd) = ends.control.recv() => {
                            if let RunnerCmd::Control(m) = cmd {
                                sim.events.lock().unwrap().push(format!("{model} {m:?}"));
                            }
                        }
                        _ = &mut ends.stop => {
                            sim.events.lock().unwrap().push(format!("{model} stopped"));
                            let report = Arc::new(ExitReport::new(ExitCause::Requested, vec![]));
                            let _ = ends.death.send(Some(report.clone()));
                            emit(EngineEvent::Exited(report));
                            return;
                        }
                    }
                }
            });
            Ok(handle)
        })
    }
}

struct Setup {
    models: Vec<ModelConfig>,
    max_engines: usize,
    budget: u64,
    ttl: Duration,
    load_delay: Duration,
    queue_timeout: Duration,
}

impl Default for Setup {
    fn default() -> Self {
        Self {
            models: ["a", "b", "c"].into_iter().map(ModelConfig::new).collect(),
            max_engines: 8,
            budget: 100 * GB,
            ttl: Duration::ZERO,
            load_delay: Duration::from_millis(100),
            queue_timeout: Duration::from_secs(60),
        }
    }
}

fn model(id: &str, memory: u64, pinned: bool) -> ModelConfig {
    ModelConfig {
        memory: Some(memory),
        pinned,
        ..ModelConfig::new(id)
    }
}

fn pool(setup: Setup) -> (PoolHandle, Arc<Sim>) {
    let mut config = Config {
        models: setup.models,
        ..Config::default()
    };
    config.pool.max_engines = setup.max_engines;
    config.pool.ttl = setup.ttl;
    config.pool.capacity_wait = Duration::from_secs(10);
    config.server.queue_timeout_ms = setup.queue_timeout.as_millis() as u64;
    let catalog = Arc::new(Catalog::from_config(&config).unwrap());
    let sim = Arc::new(Sim {
        load_delay: setup.load_delay,
        memory: catalog
            .models
            .iter()
            .map(|m| (m.id.clone(), m.planned_bytes))
            .collect(),
        ..Sim::default()
    });
    let parts = PoolParts {
        logs: Logs::new(catalog.models.iter().map(|m| m.id.as_str())),
        catalog,
        runtime_dir: PathBuf::from("/tmp/mlxd-pool-test"),
        metrics: Arc::new(Metrics::new()),
        memory_budget: setup.budget,
    };
    let handle = start_with(Arc::new(config), parts, sim.spawner()).unwrap();
    (handle, sim)
}

async fn states(pool: &PoolHandle) -> BTreeMap<String, &'static str> {
    pool.status()
        .await
        .into_iter()
        .map(|s| (s.model, s.state))
        .collect()
}

/// One complete request: acquire, then release at once.
async fn use_model(pool: &PoolHandle, id: &str) {
    drop(pool.acquire(id).await.unwrap());
}

async fn settle() {
    tokio::time::sleep(Duration::from_millis(10)).await;
}

#[tokio::test(start_paused = true)]
async fn evicts_the_least_recently_used_idle_engine() {
    let (pool, sim) = pool(Setup {
        max_engines: 2,
        ..Setup::default()
    });
    use_model(&pool, "a").await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    use_model(&pool, "b").await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    use_model(&pool, "a").await; // a is now the most recent
    use_model(&pool, "c").await; // evicts b
    settle().await;
    assert_eq!(sim.spawns(), ["a", "b", "c"]);
    assert_eq!(sim.events(), ["b Spill", "b Drain", "b stopped"]);
    let st = states(&pool).await;
    assert_eq!((st["a"], st["b"], st["c"]), ("ready", "stopped", "ready"));
    use_model(&pool, "b").await; // evicts a (least recent now)
    settle().await;
    assert_eq!(sim.events()[3..], ["a Spill", "a Drain", "a stopped"]);
}

#[tokio::test(start_paused = true)]
async fn evicts_for_memory_and_refuses_what_cannot_fit_with_numbers() {
    let (pool, sim) = pool(Setup {
        models: vec![
            model("a", 3 * GB, false),
            model("b", 2 * GB, false),
            model("huge", 5 * GB, false),
        ],
        budget: 4 * GB,
        ..Setup::default()
    });
    use_model(&pool, "a").await;
    use_model(&pool, "b").await;
    settle().await;
    assert_eq!(sim.events(), ["a Spill", "a Drain", "a stopped"]);
    match pool.acquire("huge").await {
        Err(ProxyError::InsufficientMemory {
            needed,
            available,
            budget,
            retry_after: None,
            ..
        }) => assert_eq!((needed, available, budget), (5 * GB, 4 * GB, 4 * GB)),
        other => panic!("{other:?}"),
    }
    // Refused without evicting anything.
    assert_eq!(sim.spawns(), ["a", "b"]);
    assert_eq!(states(&pool).await["b"], "ready");
}

#[tokio::test(start_paused = true)]
async fn pinned_models_load_at_start_and_are_never_evicted() {
    let (pool, sim) = pool(Setup {
        models: vec![
            model("pinned", 6 * GB, true),
            model("a", GB, false),
            model("b", 3 * GB, false),
        ],
        max_engines: 2,
        budget: 8 * GB,
        ttl: Duration::from_secs(60),
        ..Setup::default()
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(sim.spawns(), ["pinned"]);
    assert_eq!(states(&pool).await["pinned"], "ready");
    use_model(&pool, "a").await;
    // b (3 GiB) cannot fit beside the pinned 6 GiB in 8: refused, pinned untouched.
    match pool.acquire("b").await {
        Err(ProxyError::InsufficientMemory {
            needed, available, ..
        }) => assert_eq!((needed, available), (3 * GB, 2 * GB)),
        other => panic!("{other:?}"),
    }
    // Long past the TTL: a is unloaded, the pinned model stays.
    tokio::time::sleep(Duration::from_secs(600)).await;
    let st = states(&pool).await;
    assert_eq!((st["pinned"], st["a"]), ("ready", "stopped"));
    assert!(!sim.events().iter().any(|e| e.starts_with("pinned")));
}

#[tokio::test(start_paused = true)]
async fn all_slots_pinned_is_refused() {
    let (pool, _sim) = pool(Setup {
        models: vec![model("p", GB, true), model("a", GB, false)],
        max_engines: 1,
        ..Setup::default()
    });
    match pool.acquire("a").await {
        Err(ProxyError::NoEngineAvailable {
            max_engines: 1,
            why,
            ..
        }) => assert_eq!(why, "held by pinned models"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn idle_engines_unload_after_their_ttl() {
    let (pool, sim) = pool(Setup {
        ttl: Duration::from_secs(300),
        ..Setup::default()
    });
    use_model(&pool, "a").await;
    tokio::time::sleep(Duration::from_secs(200)).await;
    use_model(&pool, "a").await; // the idle clock starts again
    tokio::time::sleep(Duration::from_secs(200)).await;
    assert_eq!(states(&pool).await["a"], "ready");
    tokio::time::sleep(Duration::from_secs(101)).await;
    assert_eq!(states(&pool).await["a"], "stopped");
    assert_eq!(sim.events(), ["a Spill", "a Drain", "a stopped"]);
    // The next request loads it again.
    use_model(&pool, "a").await;
    assert_eq!(sim.spawns(), ["a", "a"]);
}

#[tokio::test(start_paused = true)]
async fn ttl_zero_never_unloads() {
    let (pool, sim) = pool(Setup::default());
    use_model(&pool, "a").await;
    tokio::time::sleep(Duration::from_secs(100_000)).await;
    assert_eq!(states(&pool).await["a"], "ready");
    assert!(sim.events().is_empty());
}

#[tokio::test(start_paused = true)]
async fn concurrent_requests_for_a_cold_model_share_one_load() {
    let (pool, sim) = pool(Setup {
        load_delay: Duration::from_secs(5),
        ..Setup::default()
    });
    let tasks: Vec<_> = (0..10)
        .map(|_| {
            let pool = pool.clone();
            tokio::spawn(async move { pool.acquire("a").await.map(|l| l.generation) })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let st = pool.status().await;
    let a = st.iter().find(|s| s.model == "a").unwrap();
    assert_eq!((a.state, a.queued_requests), ("starting", 10));
    for t in tasks {
        assert_eq!(t.await.unwrap().unwrap(), 1);
    }
    assert_eq!(sim.spawns(), ["a"]);
}

#[tokio::test(start_paused = true)]
async fn a_busy_engine_is_never_evicted_the_request_waits_then_gets_503() {
    let (pool, sim) = pool(Setup {
        max_engines: 1,
        ..Setup::default()
    });
    let busy = pool.acquire("a").await.unwrap();
    let waiting = tokio::spawn({
        let pool = pool.clone();
        async move { pool.acquire("b").await.map(drop) }
    });
    tokio::time::sleep(Duration::from_secs(5)).await;
    let st = states(&pool).await;
    assert_eq!((st["a"], st["b"]), ("ready", "queued"));
    assert!(
        sim.events().is_empty(),
        "busy engine drained: {:?}",
        sim.events()
    );
    // Still busy at the capacity wait (10 s): 503 with a Retry-After.
    match waiting.await.unwrap() {
        Err(ProxyError::NoEngineAvailable {
            max_engines: 1,
            retry_after: Some(_),
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(sim.spawns(), ["a"]);

    // Once the request finishes, the next one for b evicts a.
    let waiting = tokio::spawn({
        let pool = pool.clone();
        async move { pool.acquire("b").await.map(drop) }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    drop(busy);
    waiting.await.unwrap().unwrap();
    assert_eq!(sim.spawns(), ["a", "b"]);
    assert_eq!(sim.events(), ["a Spill", "a Drain", "a stopped"]);
}

#[tokio::test(start_paused = true)]
async fn admin_unload_drains_after_in_flight_requests() {
    let (pool, sim) = pool(Setup::default());
    let lease = pool.acquire("a").await.unwrap();
    let unload = tokio::spawn({
        let pool = pool.clone();
        async move { pool.unload("a").await }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(sim.events(), ["a Spill", "a Drain"]);
    assert_eq!(states(&pool).await["a"], "draining");
    drop(lease);
    unload.await.unwrap().unwrap();
    assert_eq!(sim.events(), ["a Spill", "a Drain", "a stopped"]);
    let st = pool.status().await;
    assert_eq!(st[0].availability, "unloaded");
    // A request after the unload loads it again.
    use_model(&pool, "a").await;
    assert_eq!(sim.spawns(), ["a", "a"]);
}

#[tokio::test(start_paused = true)]
async fn a_request_arriving_while_its_engine_drains_gets_a_fresh_engine() {
    let (pool, sim) = pool(Setup::default());
    let lease = pool.acquire("a").await.unwrap();
    let unload = tokio::spawn({
        let pool = pool.clone();
        async move { pool.unload("a").await }
    });
    settle().await;
    let again = tokio::spawn({
        let pool = pool.clone();
        async move { pool.acquire("a").await.map(|l| l.generation) }
    });
    settle().await;
    drop(lease);
    unload.await.unwrap().unwrap();
    assert_eq!(again.await.unwrap().unwrap(), 2);
    assert_eq!(sim.spawns(), ["a", "a"]);
}

fn pool_with_missing_engine() -> PoolHandle {
    let mut config = Config::single("m");
    config.server.engine_bin = Some("/nonexistent/mlxd-engine".into());
    config.server.queue_timeout_ms = 60_000;
    let catalog = Arc::new(Catalog::from_config(&config).unwrap());
    let parts = PoolParts {
        logs: Logs::new(["m"]),
        catalog,
        runtime_dir: PathBuf::from("/tmp/mlxd-pool-test"),
        metrics: Arc::new(Metrics::new()),
        memory_budget: u64::MAX,
    };
    start(Arc::new(config), parts).unwrap()
}

#[tokio::test(start_paused = true)]
async fn failures_back_off_then_mark_the_model_failed() {
    let pool = pool_with_missing_engine();
    let t = Instant::now();
    // The request waiting for the load gets the load's error at once, not a wait through
    // the retries.
    match pool.acquire("m").await.unwrap_err() {
        ProxyError::LoadFailed {
            cause, retry_after, ..
        } => {
            assert!(cause.contains("cannot start"), "{cause}");
            assert_eq!(retry_after, Duration::from_secs(1));
        }
        other => panic!("{other:?}"),
    }
    assert!(t.elapsed() < Duration::from_millis(50), "{:?}", t.elapsed());
    // The pool retries: five failures, with 250 + 500 + 1000 + 2000 ms of backoff between.
    tokio::time::sleep(Duration::from_millis(3760)).await;
    let st = pool.status().await;
    assert_eq!(st[0].state, "failed");
    assert_eq!(st[0].availability, "failed");
    assert!(st[0].failure.as_ref().unwrap().contains("cannot start"));
    assert_eq!(st[0].restarts, 4);
    assert_eq!(st[0].last_exit.as_ref().unwrap().code, "load_failed");

    // Failed: answered at once, no new attempt.
    let again = pool.acquire("m").await.unwrap_err();
    assert!(matches!(again, ProxyError::Failed { .. }));
    assert_eq!(pool.status().await[0].generation, 5);

    assert_eq!(pool.reset(None).await, vec!["m".to_string()]);
    assert_eq!(pool.status().await[0].state, "idle");
    pool.shutdown().await;
    assert!(matches!(
        pool.acquire("m").await,
        Err(ProxyError::ShuttingDown)
    ));
}

#[tokio::test(start_paused = true)]
async fn failed_model_cools_down() {
    let pool = pool_with_missing_engine();
    let _ = pool.acquire("m").await.unwrap_err();
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(pool.status().await[0].state, "failed");
    tokio::time::advance(Duration::from_millis(
        crate::config::ServerConfig::default().failed_cooldown_ms,
    ))
    .await;
    // The cool-down is over: a new round of attempts, failing again.
    let _ = pool.acquire("m").await.unwrap_err();
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(pool.status().await[0].generation, 10);
    assert_eq!(pool.status().await[0].state, "failed");
}

#[tokio::test(start_paused = true)]
async fn oom_halves_the_limits_and_a_stable_period_restores_them() {
    let mut m = ModelConfig::new("a");
    m.kv_budget_bytes = Some(1 << 20);
    m.max_batch_size = Some(8);
    let (pool, sim) = pool(Setup {
        models: vec![m],
        ..Setup::default()
    });
    sim.oom_next.lock().unwrap().push("a".into());
    use_model(&pool, "a").await;
    // The first engine died out of memory; the second runs with halved limits.
    tokio::time::sleep(Duration::from_secs(2)).await;
    use_model(&pool, "a").await;
    let kv: Vec<Option<u64>> = sim
        .limits
        .lock()
        .unwrap()
        .iter()
        .map(|l| l.kv_budget_bytes)
        .collect();
    assert_eq!(kv, [Some(1 << 20), Some(1 << 19)]);
    let st = &pool.status().await[0];
    assert!(st.limits.reduced);
    assert_eq!(st.limits.kv_budget_bytes, Some(1 << 19));
    assert_eq!(st.limits.configured_kv_budget_bytes, Some(1 << 20));
    assert!(st.limits.recovers_in_s.unwrap() > 590.0);

    // Ten minutes without another OOM: configured limits back; the idle engine that
    // runs with the small ones is recycled, and the next one gets the full budget.
    tokio::time::sleep(Duration::from_secs(600)).await;
    settle().await;
    let st = &pool.status().await[0];
    assert!(!st.limits.reduced, "{:?}", st.limits);
    assert_eq!(st.limits.kv_budget_bytes, Some(1 << 20));
    assert_eq!(st.state, "stopped");
    use_model(&pool, "a").await;
    let last = sim.limits.lock().unwrap().last().cloned().unwrap();
    assert_eq!(last.kv_budget_bytes, Some(1 << 20));
    assert_eq!(last.max_batch_size, Some(8));
}

#[tokio::test(start_paused = true)]
async fn an_admin_reset_restores_reduced_limits_at_once() {
    let mut m = ModelConfig::new("a");
    m.kv_budget_bytes = Some(1 << 20);
    let (pool, sim) = pool(Setup {
        models: vec![m],
        ..Setup::default()
    });
    sim.oom_next.lock().unwrap().push("a".into());
    use_model(&pool, "a").await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    use_model(&pool, "a").await;
    assert!(pool.status().await[0].limits.reduced);
    assert_eq!(pool.reset(Some("a".into())).await, vec!["a".to_string()]);
    settle().await;
    assert!(!pool.status().await[0].limits.reduced);
    use_model(&pool, "a").await;
    let kv: Vec<Option<u64>> = sim
        .limits
        .lock()
        .unwrap()
        .iter()
        .map(|l| l.kv_budget_bytes)
        .collect();
    assert_eq!(kv, [Some(1 << 20), Some(1 << 19), Some(1 << 20)]);
}

#[tokio::test(start_paused = true)]
async fn a_request_waits_for_a_load_longer_than_the_queue_timeout() {
    let (pool, sim) = pool(Setup {
        load_delay: Duration::from_secs(45),
        queue_timeout: Duration::from_secs(30),
        ..Setup::default()
    });
    let t = Instant::now();
    let waiting = tokio::spawn({
        let pool = pool.clone();
        async move { pool.acquire("a").await.map(|l| l.generation) }
    });
    tokio::time::sleep(Duration::from_secs(35)).await;
    assert_eq!(states(&pool).await["a"], "starting");
    assert_eq!(waiting.await.unwrap().unwrap(), 1);
    assert!(t.elapsed() >= Duration::from_secs(45));
    assert_eq!(sim.spawns(), ["a"]);
}

#[tokio::test(start_paused = true)]
async fn waiting_for_room_still_ends_at_the_queue_timeout() {
    let (pool, _sim) = pool(Setup {
        max_engines: 1,
        queue_timeout: Duration::from_secs(5),
        ..Setup::default()
    });
    let _busy = pool.acquire("a").await.unwrap();
    // b cannot start while a is busy; the capacity wait (10 s) is longer than the queue
    // timeout, so the queue timeout answers.
    match pool.acquire("b").await {
        Err(ProxyError::Unavailable { state, .. }) => {
            assert_eq!(state, "waiting for room (engine slots or memory)")
        }
        other => panic!("{other:?}"),
    }
}

fn reloaded(models: Vec<ModelConfig>) -> (Arc<Catalog>, Arc<Config>) {
    let mut config = Config {
        models,
        ..Config::default()
    };
    config.pool.ttl = Duration::ZERO;
    (
        Arc::new(Catalog::from_config(&config).unwrap()),
        Arc::new(config),
    )
}

#[tokio::test(start_paused = true)]
async fn a_reload_adds_removes_and_changes_models() {
    let (pool, sim) = pool(Setup::default());
    let lease = pool.acquire("a").await.unwrap();
    use_model(&pool, "b").await;
    // a (busy) and c are removed, d is added pinned, b gets a context length.
    let (catalog, config) = reloaded(vec![
        ModelConfig {
            context_length: Some(512),
            ..ModelConfig::new("b")
        },
        model("d", GB, true),
    ]);
    let plan = pool.reload(catalog, config, 100 * GB).await.unwrap();
    assert_eq!(plan.added, ["d"]);
    assert_eq!(plan.removed, ["a", "c"]);
    assert_eq!(plan.changed.len(), 1);
    assert_eq!(plan.changed[0].fields, ["limits"]);
    settle().await;
    let rows = pool.status().await;
    let ids: Vec<(&str, bool, &str)> = rows
        .iter()
        .map(|r| (r.model.as_str(), r.configured, r.state))
        .collect();
    // a drains while its request runs; c (never started) is gone; d (pinned) is starting.
    assert_eq!(
        ids,
        [
            ("a", false, "draining"),
            ("b", true, "ready"),
            ("d", true, "starting")
        ]
    );
    match pool.acquire("a").await {
        Err(ProxyError::NotFound(m)) => assert!(m.contains("removed"), "{m}"),
        other => panic!("{other:?}"),
    }
    drop(lease);
    settle().await;
    let ids: Vec<String> = pool.status().await.into_iter().map(|r| r.model).collect();
    assert_eq!(ids, ["b", "d"]);
    assert_eq!(sim.events(), ["a Spill", "a Drain", "a stopped"]);
    // b runs on; its next engine gets the new limit.
    pool.unload("b").await.unwrap();
    use_model(&pool, "b").await;
    let limits = sim.limits.lock().unwrap().clone();
    assert_eq!(limits.last().unwrap().context_length, Some(512));
    // a comes back under its old generation count (no stale timer or lease matches).
    let (catalog, config) = reloaded(vec![ModelConfig::new("a"), ModelConfig::new("b")]);
    let plan = pool.reload(catalog, config, 100 * GB).await.unwrap();
    assert_eq!(
        (plan.added.as_slice(), plan.removed.as_slice()),
        (&["a".to_string()][..], &["d".to_string()][..])
    );
    assert_eq!(pool.acquire("a").await.unwrap().generation, 2);
}
