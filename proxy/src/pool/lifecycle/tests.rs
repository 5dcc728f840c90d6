//! The lifecycle transitions, without tokio: simulated engine handles (channels only), a
//! fixed clock.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use mlxd_protocol::control::{
    Backend, Device, DeviceKind, Limits, LoadPhase, ParentMsg, Ready, Stats, PROTOCOL_VERSION,
};
use tokio::time::Instant;

use super::*;
use crate::catalog::Catalog;
use crate::config::{Config, ModelConfig};
use crate::engine::{EngineEvent, EngineHandle};
use crate::exit::{ExitCause, ExitReport};
use crate::logs::ModelLog;
use crate::policy::RestartPolicy;

pub(in crate::pool) fn timing() -> Timing {
    let config = Config::default();
    Timing {
        policy: RestartPolicy::from_config(&config),
        load_timeout: Duration::from_secs(60),
        hang_timeout: Duration::from_secs(30),
        failed_cooldown: Duration::from_secs(300),
    }
}

pub(in crate::pool) fn slot(pinned: bool) -> Slot {
    let config = Config {
        models: vec![ModelConfig {
            pinned,
            ..ModelConfig::new("m")
        }],
        ..Config::default()
    };
    let entry = Catalog::from_config(&config).unwrap().models[0].clone();
    Slot::new(
        entry,
        Arc::new(ModelLog::default()),
        (
            PathBuf::from("/tmp/m.sock"),
            PathBuf::from("/tmp/m-spare.sock"),
        ),
        Instant::now(),
    )
}

pub(in crate::pool) fn ready_report() -> Ready {
    Ready {
        version: PROTOCOL_VERSION,
        model_id: "m".into(),
        weight_bytes: 1000,
        kv_bytes_per_token: 10,
        state_bytes_per_sequence: 0,
        context_length: 64,
        capabilities: vec![],
        device: Device {
            kind: DeviceKind::Cpu,
            backend: Backend::Cpu,
        },
        limits: None,
    }
}

pub(in crate::pool) fn exit(cause: ExitCause) -> Arc<ExitReport> {
    Arc::new(ExitReport::new(cause, vec!["last words".into()]))
}

const CALM: PoolMood = PoolMood {
    shutting_down: false,
};

/// A slot whose engine (generation 1) was started at `t0`.
pub(in crate::pool) fn starting(t0: Instant) -> Slot {
    let mut s = slot(false);
    start_engine(&mut s, 42, 1, t0);
    s
}

/// Starts the slot's engine of `generation` (process `pid`) at `t0`, default limits.
pub(in crate::pool) fn start_engine(s: &mut Slot, pid: u32, generation: u64, t0: Instant) {
    s.generation = generation;
    let (handle, _ends) = EngineHandle::simulated(pid, generation);
    started(s, handle, Limits::default(), t0, &timing());
}

/// The engine exits with `cause`, seen at `t0` by a pool that is not shutting down.
pub(in crate::pool) fn exit_calmly(s: &mut Slot, cause: ExitCause, t0: Instant) -> Vec<Effect> {
    exited(s, exit(cause), t0, SystemTime::now(), &timing(), CALM)
}

pub(in crate::pool) fn crash(signal: Option<i32>, code: Option<i32>) -> ExitCause {
    ExitCause::Crash { signal, code }
}

pub(in crate::pool) fn load_failed(detail: &str) -> ExitCause {
    ExitCause::LoadFailed {
        detail: detail.into(),
    }
}

pub(in crate::pool) fn cannot_load(detail: &str) -> ExitCause {
    ExitCause::CannotLoad {
        detail: detail.into(),
    }
}

pub(in crate::pool) fn names(effects: &[Effect]) -> Vec<&'static str> {
    effects
        .iter()
        .map(|e| match e {
            Effect::After(..) => "after",
            Effect::Log(_) => "log",
            Effect::Control(_) => "control",
            Effect::Stop => "stop",
            Effect::Kill(_) => "kill",
            Effect::GrantWaiters => "grant",
            Effect::FailWaiters(_) => "fail",
            Effect::AnswerUnloads => "unloads",
            Effect::ArmIdleTimer => "idle",
            Effect::Enqueue => "enqueue",
            Effect::JoinQueue => "join_queue",
            Effect::StartStandby => "standby",
            Effect::StopStandby => "stop_standby",
            Effect::LeaveQueue => "leave_queue",
            Effect::FailWaiter(..) => "fail_one",
            Effect::Place => "place",
            Effect::Forget => "forget",
            Effect::CountRestart => "restart",
            Effect::ObserveLoad(_) => "load_time",
            Effect::CountEviction(_) => "eviction",
        })
        .collect()
}

#[test]
fn a_start_sets_a_load_deadline_and_the_ready_report_serves() {
    let t0 = Instant::now();
    let mut s = slot(false);
    s.generation = 1;
    let (handle, _ends) = EngineHandle::simulated(42, 1);
    let fx = started(&mut s, handle, Limits::default(), t0, &timing());
    assert_eq!(s.state.name(), "starting");
    assert!(fx.iter().any(|e| matches!(e,
        Effect::After(d, Timer::LoadDeadline { generation: 1, .. }) if *d == Duration::from_secs(60))));

    loading(&mut s, LoadPhase::Weights, 0.5);
    let st = s.status(t0, &timing().policy);
    assert_eq!(
        (st.loading_phase, st.loading_progress),
        (Some("weights"), Some(0.5))
    );

    let t1 = t0 + Duration::from_millis(1500);
    let fx = ready(&mut s, ready_report(), t1, &timing());
    assert_eq!(s.state.name(), "ready");
    assert!(fx
        .iter()
        .any(|e| matches!(e, Effect::ObserveLoad(d) if *d == Duration::from_millis(1500))));
    assert!(
        fx.iter().any(|e| matches!(e,
        Effect::After(d, Timer::HangCheck { generation: 1, .. }) if *d == Duration::from_secs(30)))
    );
    assert_eq!(&names(&fx)[3..], ["grant", "idle", "place"]);
    assert_eq!(s.last_used, t1);
    assert_eq!(s.observed_bytes, 1000);
    let st = s.status(t1, &timing().policy);
    assert_eq!(st.loading_progress, Some(1.0));
    assert_eq!(st.pid, Some(42));
    // A second Ready (or one for an engine no longer starting) changes nothing.
    assert!(ready(&mut s, ready_report(), t1, &timing()).is_empty());
}

#[test]
fn the_load_deadline_kills_only_a_load_still_in_progress() {
    let t0 = Instant::now();
    let mut s = starting(t0);
    assert!(matches!(
        load_deadline(&s, 1, &timing())[..],
        [Effect::Kill(ref r)] if r.contains("load timeout of 60000 ms")
    ));
    assert!(
        load_deadline(&s, 0, &timing()).is_empty(),
        "an older engine's"
    );
    ready(&mut s, ready_report(), t0, &timing());
    assert!(load_deadline(&s, 1, &timing()).is_empty());
}

#[test]
fn stats_are_heartbeats_and_a_silent_engine_is_killed() {
    let t0 = Instant::now();
    let mut s = starting(t0);
    ready(&mut s, ready_report(), t0, &timing());
    let t1 = t0 + Duration::from_secs(20);
    let previous = stats(
        &mut s,
        Stats {
            memory_bytes: 5000,
            ..Stats::default()
        },
        t1,
    );
    assert!(previous.is_none());
    assert_eq!(s.observed_bytes, 5000);
    // 25 s after the last heartbeat: alive, look again in 5 s.
    let fx = hang_check(&s, 1, t1 + Duration::from_secs(25), &timing());
    assert!(matches!(fx[..],
        [Effect::After(d, Timer::HangCheck { .. })] if d == Duration::from_secs(5)));
    let fx = hang_check(&s, 1, t1 + Duration::from_secs(30), &timing());
    assert_eq!(names(&fx), ["log", "kill"]);
    assert!(hang_check(&s, 2, t1 + Duration::from_secs(99), &timing()).is_empty());
}

#[test]
fn a_release_of_the_last_request_arms_the_idle_clock_or_stops_a_drain() {
    let t0 = Instant::now();
    let mut s = starting(t0);
    ready(&mut s, ready_report(), t0, &timing());
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    let a = s.grant(&tx, &timing().policy, t0).unwrap();
    let b = s.grant(&tx, &timing().policy, t0).unwrap();
    assert_eq!(s.in_flight(), 2);
    assert!(release(&mut s, 1, t0).is_empty());
    assert_eq!(names(&release(&mut s, 1, t0)), ["idle", "place"]);
    assert!(release(&mut s, 0, t0).is_empty(), "an older engine's lease");

    let c = s.grant(&tx, &timing().policy, t0).unwrap();
    let fx = drain(&mut s, "admin");
    assert_eq!(s.state.name(), "draining");
    assert!(matches!(
        fx[..2],
        [
            Effect::Control(ParentMsg::Spill),
            Effect::Control(ParentMsg::Drain)
        ]
    ));
    assert!(!names(&fx).contains(&"stop"), "a request is in flight");
    assert!(s.grant(&tx, &timing().policy, t0).is_none(), "draining");
    assert!(drain(&mut s, "admin").is_empty(), "drains once");
    assert_eq!(names(&release(&mut s, 1, t0)), ["stop"]);
    drop((a, b, c));
}

#[test]
fn a_recycled_engine_drains_on_its_last_release() {
    let t0 = Instant::now();
    let mut s = starting(t0);
    ready(&mut s, ready_report(), t0, &timing());
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    let _lease = s.grant(&tx, &timing().policy, t0).unwrap();
    s.state.engine_mut().unwrap().recycle = true;
    let fx = release(&mut s, 1, t0);
    assert_eq!(s.state.name(), "draining");
    assert!(fx
        .iter()
        .any(|e| matches!(e, Effect::CountEviction("limits_restored"))));
    assert!(names(&fx).contains(&"stop"));
}

#[test]
fn a_crash_restarts_after_backoff_and_a_load_failure_answers_the_waiters() {
    let t0 = Instant::now();
    let mut s = starting(t0);
    ready(&mut s, ready_report(), t0, &timing());
    let fx = exit_calmly(&mut s, crash(Some(9), None), t0);
    assert!(matches!(s.state, State::Restarting { at } if at == t0 + Duration::from_millis(250)));
    assert_eq!(s.restarts, 1);
    assert_eq!(
        names(&fx),
        ["log", "unloads", "restart", "after", "place"],
        "a crash after ready: no waiter is failed"
    );
    assert!(s.state.engine().is_none());
    assert_eq!(s.last_ready.as_ref().map(|r| r.weight_bytes), Some(1000));

    // The next engine fails its load: those waiting get the load's error.
    start_engine(&mut s, 43, 2, t0);
    let fx = exit_calmly(&mut s, load_failed("exit code 2 before ready"), t0);
    assert!(fx.iter().any(|e| matches!(e,
        Effect::FailWaiters(ProxyError::LoadFailed { retry_after, .. }) if *retry_after == Duration::from_secs(1))));
    assert_eq!(s.restarts, 2);
}

#[test]
fn too_many_crashes_fail_the_model() {
    let t0 = Instant::now();
    let mut s = slot(false);
    let mut fx = Vec::new();
    for i in 0..5 {
        start_engine(&mut s, 40, i + 1, t0);
        fx = exit_calmly(&mut s, load_failed("exit code 1 before ready"), t0);
    }
    assert!(matches!(
        s.state,
        State::Failed {
            cannot_load: false,
            ..
        }
    ));
    assert!(fx.iter().any(|e| matches!(e,
        Effect::FailWaiters(ProxyError::Failed { retry_after, .. }) if *retry_after == Duration::from_secs(300))));
    assert_eq!(s.restarts, 4);
}

/// An exit reported before the process was reaped: once reaped, the slot's record and the
/// failure it caused name the exit status.
#[test]
fn a_reaped_report_gives_the_exit_and_the_failure_their_status() {
    let t0 = Instant::now();
    let mut s = slot(false);
    let mut early = Arc::new(ExitReport::before_reaping(crash(None, None), vec![]));
    for i in 0..5 {
        start_engine(&mut s, 40, i + 1, t0);
        ready(&mut s, ready_report(), t0, &timing());
        early = Arc::new(ExitReport::before_reaping(crash(None, None), vec![]));
        exited(
            &mut s,
            early.clone(),
            t0,
            SystemTime::now(),
            &timing(),
            CALM,
        );
    }
    let failed = |s: &Slot| match &s.state {
        State::Failed { cause, .. } => cause.clone(),
        other => panic!("{other:?}"),
    };
    assert_eq!(failed(&s), "crashed");
    // Another exit's report changes nothing.
    let other = Arc::new(ExitReport::before_reaping(crash(None, None), vec![]));
    reaped(
        &mut s,
        &other,
        Arc::new(ExitReport::new(crash(Some(9), None), vec![])),
    );
    assert_eq!(failed(&s), "crashed");
    let status = Arc::new(ExitReport::new(crash(Some(6), None), vec![]));
    reaped(&mut s, &early, status.clone());
    assert_eq!(failed(&s), "crashed (killed by signal 6, SIGABRT)");
    assert!(Arc::ptr_eq(&s.last_exit.as_ref().unwrap().0, &status));
}

#[test]
fn a_load_that_cannot_succeed_fails_at_once_without_a_restart() {
    let t0 = Instant::now();
    let mut s = starting(t0);
    let fx = exit_calmly(&mut s, cannot_load("no such model; did you mean m2?"), t0);
    match &s.state {
        State::Failed {
            cause,
            cannot_load: true,
            ..
        } => assert_eq!(cause, "no such model; did you mean m2?"),
        other => panic!("{other:?}"),
    }
    assert_eq!(s.restarts, 0);
    assert_eq!(s.history.recent(), 0);
    assert!(!names(&fx).contains(&"restart"));
    assert!(fx.iter().any(|e| matches!(e,
        Effect::FailWaiters(ProxyError::CannotLoad { cause, .. }) if cause.ends_with("m2?"))));
}

#[test]
fn requested_stops_leave_the_model_stopped_unless_someone_waits() {
    let t0 = Instant::now();
    let mut s = starting(t0);
    ready(&mut s, ready_report(), t0, &timing());
    drain(&mut s, "ttl");
    let fx = exited(
        &mut s,
        exit(ExitCause::Requested),
        t0,
        SystemTime::now(),
        &timing(),
        CALM,
    );
    assert_eq!(s.state.name(), "stopped");
    assert_eq!(names(&fx), ["log", "unloads", "place"]);

    // A pinned model recycled for its restored limits comes straight back.
    let mut s = slot(true);
    start_engine(&mut s, 42, 1, t0);
    ready(&mut s, ready_report(), t0, &timing());
    s.state.engine_mut().unwrap().recycle = true;
    let fx = exited(
        &mut s,
        exit(ExitCause::Requested),
        t0,
        SystemTime::now(),
        &timing(),
        CALM,
    );
    assert_eq!(names(&fx), ["log", "unloads", "enqueue", "place"]);
}

#[test]
fn an_exit_during_shutdown_or_after_removal_ends_the_model() {
    let t0 = Instant::now();
    let mut s = starting(t0);
    assert_eq!(names(&shut_down(&mut s)), ["stop"]);
    assert_eq!(s.state.name(), "draining");
    let fx = exited(
        &mut s,
        exit(ExitCause::Requested),
        t0,
        SystemTime::now(),
        &timing(),
        PoolMood {
            shutting_down: true,
        },
    );
    assert_eq!(s.state.name(), "stopped");
    assert!(matches!(
        fx.last(),
        Some(Effect::FailWaiters(ProxyError::ShuttingDown))
    ));

    let mut s = starting(t0);
    s.removed = true;
    let fx = exit_calmly(&mut s, crash(None, Some(1)), t0);
    assert_eq!(names(&fx), ["log", "unloads", "forget", "place"]);
    assert_eq!(s.restarts, 0);
}

#[test]
fn an_out_of_memory_exit_halves_the_limits_and_schedules_their_recovery() {
    let t0 = Instant::now();
    let config = Config {
        models: vec![ModelConfig::new("m")],
        ..Config::default()
    };
    let mut entry = Catalog::from_config(&config).unwrap().models[0].clone();
    entry.limits = Limits {
        max_batch_size: Some(8),
        kv_budget_bytes: Some(1 << 20),
        context_length: None,
    };
    let mut s = Slot::new(
        entry,
        Arc::new(ModelLog::default()),
        (
            PathBuf::from("/tmp/m.sock"),
            PathBuf::from("/tmp/m-spare.sock"),
        ),
        t0,
    );
    s.generation = 1;
    let (handle, _ends) = EngineHandle::simulated(42, 1);
    let limits = s.limits.current().clone();
    started(&mut s, handle, limits, t0, &timing());
    ready(&mut s, ready_report(), t0, &timing());
    let fx = exit_calmly(
        &mut s,
        ExitCause::OutOfMemory {
            detail: "simulated".into(),
        },
        t0,
    );
    assert_eq!(s.limits.current().max_batch_size, Some(4));
    assert!(fx
        .iter()
        .any(|e| matches!(e, Effect::After(_, Timer::LimitsRecovery { .. }))));
    assert_eq!(s.state.name(), "restarting");
}

#[test]
fn an_admin_reset_clears_a_failure_and_the_crash_history() {
    let t0 = Instant::now();
    let mut s = starting(t0);
    exit_calmly(&mut s, cannot_load("no such model"), t0);
    s.restarts = 3;
    assert_eq!(
        reset(&mut s),
        ResetDone {
            failure_cleared: true,
            limits_restored: false
        }
    );
    assert_eq!(s.state.name(), "idle");
    assert_eq!(s.restarts, 0);
    // Nothing to do a second time.
    assert_eq!(
        reset(&mut s),
        ResetDone {
            failure_cleared: false,
            limits_restored: false
        }
    );
}

/// The idle check an effect list arms: its delay and number.
fn idle_armed(effects: &[Effect]) -> Option<(Duration, u64)> {
    effects.iter().find_map(|e| match e {
        Effect::After(d, Timer::IdleCheck { number, .. }) => Some((*d, *number)),
        _ => None,
    })
}

#[test]
fn the_idle_clock_unloads_after_the_ttl_and_rechecks_a_reused_engine() {
    let t0 = Instant::now();
    let mut s = starting(t0);
    ready(&mut s, ready_report(), t0, &timing());
    let (d, first) = idle_armed(&arm_idle(&mut s)).expect("armed");
    assert_eq!(d, Duration::from_secs(300), "the configured ttl");
    assert!(arm_idle(&mut s).is_empty(), "one pending check at a time");
    // Used 100 s in: the check at 300 s looks again 100 s later.
    s.last_used = t0 + Duration::from_secs(100);
    let fx = idle_check(&mut s, first, t0 + Duration::from_secs(300));
    let (d, second) = idle_armed(&fx).expect("re-armed");
    assert_eq!(d, Duration::from_secs(100));
    assert!(
        idle_check(&mut s, first, t0 + Duration::from_secs(400)).is_empty(),
        "a replaced check does nothing"
    );
    let fx = idle_check(&mut s, second, t0 + Duration::from_secs(400));
    assert!(names(&fx).contains(&"eviction") && names(&fx).contains(&"stop"));
    assert_eq!(s.state.name(), "draining");
}

#[test]
fn a_keep_alive_replaces_the_ttl_until_the_model_is_unloaded() {
    let t0 = Instant::now();
    let mut s = starting(t0);
    ready(&mut s, ready_report(), t0, &timing());
    let (_, configured) = idle_armed(&arm_idle(&mut s)).unwrap();

    // A shorter keep-alive takes over at once: the pending 300 s check is stale.
    let fx = keep_alive(&mut s, KeepAlive::For(Duration::from_secs(10)), t0);
    let (d, kept) = idle_armed(&fx).expect("armed for the keep-alive");
    assert_eq!(d, Duration::from_secs(10));
    assert!(idle_check(&mut s, configured, t0 + Duration::from_secs(10)).is_empty());
    let st = s.status(t0, &timing().policy);
    assert_eq!((st.ttl_s, st.ttl_from_request), (Some(10.0), true));

    // A request without keep_alive leaves it: its release arms for 10 s again.
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    let lease = s.grant(&tx, &timing().policy, t0).unwrap();
    assert!(
        idle_check(&mut s, kept, t0 + Duration::from_secs(10)).is_empty(),
        "busy"
    );
    drop(lease);
    let t1 = t0 + Duration::from_secs(12);
    assert_eq!(names(&release(&mut s, 1, t1)), ["idle", "place"]);
    let (d, again) = idle_armed(&arm_idle(&mut s)).unwrap();
    assert_eq!(d, Duration::from_secs(10));
    assert!(names(&idle_check(&mut s, again, t1 + d)).contains(&"stop"));

    // Unloaded: the next engine takes the configured ttl.
    exit_calmly(&mut s, ExitCause::Requested, t1 + d);
    assert_eq!(s.keep_alive, None);
    assert_eq!(s.ttl(), Some(Duration::from_secs(300)));
}

#[test]
fn keep_alive_forever_survives_a_crash_restart_and_a_pinned_model_ignores_it() {
    let t0 = Instant::now();
    let mut s = starting(t0);
    ready(&mut s, ready_report(), t0, &timing());
    assert!(
        keep_alive(&mut s, KeepAlive::Forever, t0).is_empty(),
        "no idle clock"
    );
    assert_eq!(s.ttl(), None);
    assert_eq!(s.status(t0, &timing().policy).ttl_s, None);
    let t1 = t0 + Duration::from_secs(60);
    exit_calmly(&mut s, crash(Some(9), None), t1);
    assert_eq!(s.state.name(), "restarting");
    assert_eq!(
        s.keep_alive,
        Some(KeepAlive::Forever),
        "the same model, restarted"
    );
    start_engine(&mut s, 43, 2, t1);
    ready(&mut s, ready_report(), t1, &timing());
    assert!(arm_idle(&mut s).is_empty());

    // Loading: the keep-alive waits for the engine to be ready to arm.
    let mut loading = starting(t0);
    assert!(keep_alive(&mut loading, KeepAlive::For(Duration::from_secs(5)), t0).is_empty());
    let fx = ready(&mut loading, ready_report(), t0, &timing());
    assert_eq!(&names(&fx)[3..], ["grant", "idle", "place"]);
    assert_eq!(
        idle_armed(&arm_idle(&mut loading)).map(|a| a.0),
        Some(Duration::from_secs(5))
    );

    let mut pinned = slot(true);
    keep_alive(&mut pinned, KeepAlive::For(Duration::from_secs(5)), t0);
    assert_eq!(pinned.ttl(), None);
    assert!(!pinned.status(t0, &timing().policy).ttl_from_request);
}

/// A waiter with number `id`, and the receiving end of its answer.
pub(in crate::pool) fn waiter(
    id: u64,
) -> (
    super::super::slot::Waiter,
    tokio::sync::oneshot::Receiver<Result<crate::pool::Lease, ProxyError>>,
) {
    let (reply, rx) = tokio::sync::oneshot::channel();
    (
        super::super::slot::Waiter {
            id,
            kind: super::super::slot::WaitKind::Request,
            reply,
        },
        rx,
    )
}

/// A ready engine (generation 1, pid 42) of a model that keeps a standby, and its ready
/// standby (generation 2, pid 43).
fn with_ready_standby(t0: Instant) -> Slot {
    let mut s = starting(t0);
    s.entry.standby = true;
    s.entry.planned_bytes = 1000;
    let fx = ready(&mut s, ready_report(), t0, &timing());
    assert_eq!(
        names(&fx).last(),
        Some(&"standby"),
        "a standby is asked for"
    );
    let g = s.next_generation();
    assert_eq!(g, 2);
    let (handle, _ends) = EngineHandle::simulated(43, g);
    standby_started(&mut s, handle, Limits::default(), t0);
    assert_eq!(
        s.status(t0, &timing().policy).standby.unwrap().state,
        "starting"
    );
    assert!(names(&standby_event(&mut s, EngineEvent::Ready(ready_report()))).contains(&"log"));
    s
}

#[test]
fn a_crash_promotes_the_ready_standby_at_once_and_a_new_one_starts() {
    let t0 = Instant::now();
    let mut s = with_ready_standby(t0);
    let st = s.status(t0, &timing().policy);
    assert_eq!(st.standby.as_ref().unwrap().state, "ready");
    assert_eq!(
        st.memory_bytes, 2000,
        "the standby counts against the budget"
    );
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    let (w, mut got) = waiter(1);
    s.waiters.push_back(w);

    let t1 = t0 + Duration::from_secs(5);
    let fx = exit_calmly(&mut s, crash(Some(9), None), t1);
    assert_eq!(s.state.name(), "ready", "no restart backoff");
    assert_eq!(s.generation, 2);
    assert_eq!(s.socket, PathBuf::from("/tmp/m-spare.sock"));
    assert_eq!(s.spare_socket, PathBuf::from("/tmp/m.sock"));
    assert_eq!(s.restarts, 1);
    assert!(s.standby.is_none());
    let n = names(&fx);
    assert!(fx
        .iter()
        .any(|e| matches!(e, Effect::After(_, Timer::StandbyDue { .. }))));
    for want in ["restart", "grant", "place"] {
        assert!(n.contains(&want), "{want} in {n:?}");
    }
    assert!(
        got.try_recv().is_err(),
        "the actor grants, not the transition"
    );
    let lease = s.grant(&tx, &timing().policy, t1).expect("serves at once");
    assert_eq!(
        (lease.generation, lease.socket.clone()),
        (2, PathBuf::from("/tmp/m-spare.sock"))
    );
    // The next spare takes a generation above both.
    assert_eq!(s.next_generation(), 3);
}

#[test]
fn no_promotion_after_out_of_memory_or_before_the_standby_is_ready() {
    let t0 = Instant::now();
    let mut s = with_ready_standby(t0);
    let fx = exit_calmly(
        &mut s,
        ExitCause::OutOfMemory {
            detail: "kv".into(),
        },
        t0,
    );
    assert_eq!(
        s.state.name(),
        "restarting",
        "smaller limits: a fresh engine"
    );
    assert!(names(&fx).contains(&"stop_standby"));

    let mut s = starting(t0);
    s.entry.standby = true;
    ready(&mut s, ready_report(), t0, &timing());
    let g = s.next_generation();
    let (handle, _ends) = EngineHandle::simulated(43, g);
    standby_started(&mut s, handle, Limits::default(), t0);
    exit_calmly(&mut s, crash(Some(9), None), t0);
    assert_eq!(
        s.state.name(),
        "restarting",
        "a loading standby cannot serve"
    );
}

#[test]
fn a_drain_stops_the_standby_and_its_exit_forgets_it() {
    let t0 = Instant::now();
    let mut s = with_ready_standby(t0);
    assert!(names(&drain(&mut s, "admin")).contains(&"stop_standby"));
    let fx = standby_event(&mut s, EngineEvent::Exited(exit(ExitCause::Requested)));
    assert_eq!(names(&fx), ["log", "place"]);
    assert!(s.standby.is_none());
    assert_eq!(s.status(t0, &timing().policy).standby.map(|s| s.pid), None);
}

#[test]
fn a_reload_that_changes_launch_settings_replaces_the_standby() {
    let t0 = Instant::now();
    let mut s = with_ready_standby(t0);
    let entry = s.entry.clone();
    // Aliases do not reach the engine: the spare stays.
    let fx = reconfigured(&mut s, entry.clone(), &["aliases"]);
    assert!(!names(&fx).contains(&"stop_standby"), "{:?}", names(&fx));
    assert!(!s.replace_standby);
    // New options: the spare was launched with the old ones; another starts once it exits.
    let fx = reconfigured(&mut s, entry.clone(), &["options"]);
    assert!(names(&fx).contains(&"stop_standby"), "{:?}", names(&fx));
    let fx = standby_event(&mut s, EngineEvent::Exited(exit(ExitCause::Requested)));
    assert_eq!(names(&fx), ["log", "place", "standby"]);
    // Standby turned off: the spare stops and none follows.
    let mut s = with_ready_standby(t0);
    let mut off = s.entry.clone();
    off.standby = false;
    let fx = reconfigured(&mut s, off, &["standby", "limits"]);
    assert!(names(&fx).contains(&"stop_standby"), "{:?}", names(&fx));
    let fx = standby_event(&mut s, EngineEvent::Exited(exit(ExitCause::Requested)));
    assert_eq!(names(&fx), ["log", "place"]);
}

#[test]
fn a_standby_starts_for_a_ready_engine_and_waits_while_requests_are_in_flight() {
    let t0 = Instant::now();
    let mut s = starting(t0);
    s.entry.standby = true;
    assert!(
        matches!(standby_start(&s, CALM, false), StandbyStart::No),
        "not ready yet"
    );
    ready(&mut s, ready_report(), t0, &timing());
    assert!(matches!(standby_start(&s, CALM, false), StandbyStart::Now));
    let stopping = PoolMood {
        shutting_down: true,
    };
    assert!(matches!(
        standby_start(&s, stopping, true),
        StandbyStart::No
    ));
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    let _lease = s.grant(&tx, &timing().policy, t0).unwrap();
    match standby_start(&s, CALM, false) {
        StandbyStart::Later(fx) => assert!(matches!(&fx[..],
            [Effect::After(d, Timer::StandbyDue { model })] if *d == STANDBY_WAIT && model == "m")),
        other => panic!("{other:?}"),
    }
    assert!(
        matches!(standby_start(&s, CALM, true), StandbyStart::Now),
        "its wait is over"
    );
    let mut plain = starting(t0);
    ready(&mut plain, ready_report(), t0, &timing());
    assert!(
        matches!(standby_start(&plain, CALM, true), StandbyStart::No),
        "the model keeps none"
    );
    let s = with_ready_standby(t0);
    assert!(
        matches!(standby_start(&s, CALM, true), StandbyStart::No),
        "it has one"
    );
}

#[test]
fn a_restart_timer_starts_only_the_generation_still_restarting() {
    let t0 = Instant::now();
    let mut s = starting(t0);
    ready(&mut s, ready_report(), t0, &timing());
    assert!(!restart_due(&s, 1, CALM), "not restarting");
    exit_calmly(&mut s, crash(Some(9), None), t0);
    assert!(restart_due(&s, 1, CALM));
    assert!(!restart_due(&s, 0, CALM), "an older engine's timer");
    let stopping = PoolMood {
        shutting_down: true,
    };
    assert!(!restart_due(&s, 1, stopping));
}

#[test]
fn recovered_limits_recycle_an_engine_running_with_the_reduced_ones() {
    let t0 = Instant::now();
    let policy = timing().policy;
    let mut s = slot(false);
    s.entry.limits = Limits {
        max_batch_size: Some(8),
        ..Limits::default()
    };
    s.limits = crate::policy::ModelLimits::new(s.entry.limits.clone());
    start_engine(&mut s, 42, 1, t0);
    ready(&mut s, ready_report(), t0, &timing());
    exit_calmly(
        &mut s,
        ExitCause::OutOfMemory {
            detail: "simulated".into(),
        },
        t0,
    );
    assert_eq!(s.limits.current().max_batch_size, Some(4));
    // The next engine runs with the halved limits.
    s.generation = 2;
    let (handle, _ends) = EngineHandle::simulated(43, 2);
    let reduced = s.limits.current().clone();
    started(&mut s, handle, reduced, t0, &timing());
    ready(&mut s, ready_report(), t0, &timing());
    assert!(
        limits_recovery(&mut s, &policy, t0).is_empty(),
        "not stable long enough"
    );
    let later = t0 + policy.limits_recovery;
    // Busy: recycled on its last release, not now.
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    let lease = s.grant(&tx, &policy, later).unwrap();
    let fx = limits_recovery(&mut s, &policy, later);
    assert_eq!(names(&fx), ["log"]);
    assert_eq!(s.limits.current().max_batch_size, Some(8));
    assert!(s.state.engine().unwrap().recycle);
    assert_eq!(s.state.name(), "ready");
    drop(lease);
    assert!(
        limits_recovery(&mut s, &policy, later).is_empty(),
        "restored once"
    );
    // Idle: drained at once.
    s.state.engine_mut().unwrap().recycle = false;
    s.state.engine_mut().unwrap().in_flight = 0;
    let fx = limits_grew(&mut s);
    assert_eq!(
        names(&fx),
        ["control", "control", "log", "eviction", "stop"]
    );
    assert_eq!(s.state.name(), "draining");
    assert!(limits_grew(&mut s).is_empty(), "already draining");
}

#[test]
fn a_reload_retries_a_failed_model_queues_a_newly_pinned_one_and_restarts_the_idle_clock() {
    let t0 = Instant::now();
    // A failed model with new limits: idle again, history forgotten, new limits.
    let mut s = starting(t0);
    exit_calmly(&mut s, cannot_load("no weights"), t0);
    assert_eq!(s.state.name(), "failed");
    let mut entry = s.entry.clone();
    entry.limits.max_batch_size = Some(2);
    let fx = reconfigured(&mut s, entry, &["limits"]);
    assert_eq!(names(&fx), ["log", "idle"]);
    assert!(
        matches!(&fx[0], Effect::Log(l) if l == "[mlxd] configuration reloaded: limits changed (applies at the next load)")
    );
    assert_eq!(s.state.name(), "idle");
    assert_eq!(s.limits.current().max_batch_size, Some(2));
    // Pinned by the reload: queued for an engine.
    let mut entry = s.entry.clone();
    entry.pinned = true;
    assert_eq!(
        names(&reconfigured(&mut s, entry.clone(), &["pinned"])),
        ["log", "enqueue"]
    );
    // Pinned already and not failed: nothing to start; pinned models have no idle clock.
    assert_eq!(names(&reconfigured(&mut s, entry, &["aliases"])), ["log"]);
    // Another field than limits leaves the limits alone; the pending idle check is replaced.
    let mut s = starting(t0);
    ready(&mut s, ready_report(), t0, &timing());
    arm_idle(&mut s);
    assert!(s.idle_timer.is_some());
    let before = s.limits.current().clone();
    let mut entry = s.entry.clone();
    entry.limits.max_batch_size = Some(99);
    let fx = reconfigured(&mut s, entry, &["ttl"]);
    assert_eq!(names(&fx), ["log", "idle"]);
    assert_eq!(s.idle_timer, None);
    assert_eq!(s.limits.current(), &before);
    assert_eq!(
        s.state.name(),
        "ready",
        "the running engine keeps its settings"
    );
}
