//! The queue transitions, without tokio: simulated engine handles (channels only), a fixed
//! clock; the slot helpers are the lifecycle tests'.

use std::time::Duration;

use tokio::time::Instant;

use super::*;
use crate::pool::lifecycle::tests::{
    cannot_load, crash, exit_calmly, load_failed, names, ready_report, slot, start_engine,
    starting, timing, waiter,
};
use crate::pool::lifecycle::{ready, Effect};

const RULES: AdmitRules = AdmitRules {
    failed_cooldown: Duration::from_secs(300),
    queue_capacity: 2,
    max_in_flight: 1,
};

#[test]
fn admission_grants_a_ready_engine_up_to_its_in_flight_limit() {
    let t0 = Instant::now();
    let mut s = starting(t0);
    assert!(matches!(
        admit(&mut s, WaitKind::Request, t0, &RULES),
        Admission::Wait
    ));
    ready(&mut s, ready_report(), t0, &timing());
    assert!(matches!(
        admit(&mut s, WaitKind::Request, t0, &RULES),
        Admission::Grant
    ));
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    let _lease = s.grant(&tx, &timing().policy, t0).unwrap();
    assert!(matches!(
        admit(&mut s, WaitKind::Request, t0, &RULES),
        Admission::Refuse(ProxyError::TooManyInFlight { limit: 1, .. })
    ));
    // An engine the caller found dead: wait for its successor instead.
    assert!(matches!(
        admit(&mut s, WaitKind::Retry { dead: 1 }, t0, &RULES),
        Admission::Wait
    ));
    // A request whose earlier engine died was in flight before: the limit does not refuse it.
    assert!(matches!(
        admit(&mut s, WaitKind::Retry { dead: 0 }, t0, &RULES),
        Admission::Grant
    ));
}

#[test]
fn admission_answers_from_the_failed_state_until_the_cool_down_ends() {
    let t0 = Instant::now();
    let mut s = starting(t0);
    exit_calmly(&mut s, cannot_load("no such model"), t0);
    match admit(
        &mut s,
        WaitKind::Request,
        t0 + Duration::from_secs(100),
        &RULES,
    ) {
        Admission::Refuse(ProxyError::CannotLoad { retry_after, .. }) => {
            assert_eq!(retry_after, Duration::from_secs(200))
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        admit(
            &mut s,
            WaitKind::Request,
            t0 + Duration::from_secs(300),
            &RULES
        ),
        Admission::Wait
    ));
    assert!(s.state.is_cold(), "tried again: {:?}", s.state);
}

#[test]
fn admission_refuses_a_full_queue_with_the_restart_delay() {
    let t0 = Instant::now();
    let mut s = starting(t0);
    exit_calmly(&mut s, crash(Some(9), None), t0);
    let mut keep = Vec::new();
    for id in 0..2 {
        let (reply, rx) = tokio::sync::oneshot::channel();
        keep.push(rx);
        s.waiters.push_back(Waiter {
            id,
            kind: WaitKind::Request,
            reply,
        });
    }
    match admit(&mut s, WaitKind::Request, t0, &RULES) {
        Admission::Refuse(ProxyError::QueueFull {
            capacity: 2,
            retry_after,
            ..
        }) => assert_eq!(retry_after, Duration::from_millis(1250)),
        other => panic!("{other:?}"),
    }
    // Waiters that gave up free their places.
    keep.clear();
    assert!(matches!(
        admit(&mut s, WaitKind::Request, t0, &RULES),
        Admission::Wait
    ));
}

const CALM: PoolMood = PoolMood {
    shutting_down: false,
};

#[test]
fn a_waiter_on_a_cold_model_queues_it_for_room_with_a_deadline() {
    let mut s = slot(false);
    let (w, _rx) = waiter(7);
    let fx = wait(&mut s, w, Duration::from_secs(10));
    assert!(matches!(fx[..],
        [Effect::After(d, Timer::WaiterDeadline { waiter: 7, .. }), Effect::Enqueue] if d == Duration::from_secs(10)));
    assert_eq!(s.waiters.len(), 1);
    let fx = queue(&mut s, 3, Duration::from_secs(30));
    assert_eq!(s.state.name(), "queued");
    assert!(matches!(fx[..],
        [Effect::JoinQueue, Effect::After(d, Timer::CapacityDeadline { ticket: 3, .. }), Effect::Place] if d == Duration::from_secs(30)));
    assert!(
        queue(&mut s, 4, Duration::from_secs(30)).is_empty(),
        "queued once"
    );
    // A second waiter on a model already queued (or loading) only waits.
    let (w, _rx2) = waiter(8);
    assert_eq!(names(&wait(&mut s, w, Duration::from_secs(10))), ["after"]);
    assert!(still_queued(&mut s));
}

#[test]
fn a_queued_model_whose_requests_gave_up_is_not_started() {
    let mut s = slot(false);
    let (w, rx) = waiter(1);
    wait(&mut s, w, Duration::from_secs(10));
    queue(&mut s, 0, Duration::from_secs(30));
    drop(rx);
    assert!(!still_queued(&mut s));
    assert_eq!(s.state.name(), "idle");
    // A pinned model is wanted with nobody waiting.
    let mut p = slot(true);
    queue(&mut p, 0, Duration::from_secs(30));
    assert!(still_queued(&mut p));
}

#[test]
fn the_capacity_deadline_refuses_with_what_was_missing_unless_room_is_being_made() {
    let short = Plan::Wait(Shortfall::Memory {
        needed: 10,
        available: 4,
    });
    let mut s = slot(false);
    let (w, mut rx) = waiter(1);
    wait(&mut s, w, Duration::from_secs(10));
    queue(&mut s, 5, Duration::from_secs(30));
    assert!(
        capacity_deadline(&mut s, 4, false, short.clone(), 100).is_empty(),
        "an older wait"
    );
    assert!(
        capacity_deadline(&mut s, 5, true, short.clone(), 100).is_empty(),
        "engines drain"
    );
    assert!(
        capacity_deadline(&mut s, 5, false, Plan::Start, 100).is_empty(),
        "it fits now"
    );
    assert_eq!(s.state.name(), "queued");
    let fx = capacity_deadline(&mut s, 5, false, short, 100);
    assert_eq!(names(&fx), ["leave_queue", "log", "fail"]);
    assert_eq!(s.state.name(), "idle");
    let Some(Effect::FailWaiters(e)) = fx.into_iter().nth(2) else {
        unreachable!()
    };
    assert!(matches!(
        e,
        ProxyError::InsufficientMemory {
            needed: 10,
            available: 4,
            budget: 100,
            ..
        }
    ));
    assert!(
        rx.try_recv().is_err(),
        "the actor answers, not the transition"
    );
}

#[test]
fn a_waiter_deadline_answers_503_except_during_a_load() {
    let t0 = Instant::now();
    let mut s = starting(t0);
    let (w, _rx) = waiter(1);
    wait(&mut s, w, Duration::from_secs(10));
    assert!(
        waiter_deadline(&mut s, 1).is_empty(),
        "the load timeout bounds it"
    );
    assert_eq!(s.waiters.len(), 1);
    exit_calmly(&mut s, crash(Some(9), None), t0);
    assert_eq!(s.state.name(), "restarting");
    let fx = waiter_deadline(&mut s, 1);
    assert!(matches!(&fx[..],
        [Effect::FailWaiter(w, ProxyError::Unavailable { state: "restarting", .. })] if w.id == 1));
    assert!(s.waiters.is_empty());
    assert!(waiter_deadline(&mut s, 1).is_empty(), "answered once");
}

#[test]
fn an_admin_unload_of_a_queued_model_ends_its_wait() {
    let mut s = slot(false);
    assert!(unqueue(&mut s).is_none(), "not queued");
    let (w, _rx) = waiter(1);
    wait(&mut s, w, Duration::from_secs(10));
    queue(&mut s, 0, Duration::from_secs(30));
    let fx = unqueue(&mut s).unwrap();
    assert_eq!(names(&fx), ["leave_queue", "fail"]);
    assert_eq!(s.state.name(), "idle");
}

/// An engine of `bytes` as placement sees it: ready and idle since `age` seconds before
/// `now`, unless `busy`.
fn resident(id: &str, bytes: u64, pinned: bool, busy: bool, age: u64, now: Instant) -> Resident {
    Resident {
        id: id.into(),
        pinned,
        in_flight: u32::from(busy),
        last_used: now - Duration::from_secs(age),
        bytes,
        ready: true,
        leaving: false,
    }
}

fn room(max_engines: usize, memory_bytes: u64, job_bytes: u64) -> Room {
    Room {
        budget: Budget {
            max_engines,
            memory_bytes,
        },
        job_bytes,
    }
}

#[test]
fn a_request_to_a_pool_shutting_down_or_for_an_unknown_or_removed_model_is_refused() {
    let t0 = Instant::now();
    let mut s = slot(false);
    let shutting = PoolMood {
        shutting_down: true,
    };
    assert!(matches!(
        request(Some(&mut s), "m", shutting, WaitKind::Request, t0, &RULES),
        Admission::Refuse(ProxyError::ShuttingDown)
    ));
    match request(None, "x", CALM, WaitKind::Request, t0, &RULES) {
        Admission::Refuse(ProxyError::NotFound(why)) => {
            assert_eq!(why, "model x is not configured")
        }
        other => panic!("{other:?}"),
    }
    s.removed = true;
    match request(Some(&mut s), "m", CALM, WaitKind::Request, t0, &RULES) {
        Admission::Refuse(ProxyError::NotFound(why)) => {
            assert_eq!(why, "model m was removed from the configuration")
        }
        other => panic!("{other:?}"),
    }
    s.removed = false;
    assert!(matches!(
        request(Some(&mut s), "m", CALM, WaitKind::Request, t0, &RULES),
        Admission::Wait
    ));
}

/// The end of a waiter's answer.
type Answer = tokio::sync::oneshot::Receiver<Result<crate::pool::Lease, ProxyError>>;

/// A restarting slot whose queue of two ([`RULES`]) waiters 1 and 2 fill, with their answers'
/// ends (dropping one frees its place).
fn full_queue(t0: Instant) -> (Slot, Answer, Answer) {
    let mut s = starting(t0);
    exit_calmly(&mut s, crash(Some(9), None), t0);
    let (w1, rx1) = waiter(1);
    let (w2, rx2) = waiter(2);
    wait(&mut s, w1, Duration::from_secs(10));
    wait(&mut s, w2, Duration::from_secs(10));
    assert!(matches!(
        admit(&mut s, WaitKind::Request, t0, &RULES),
        Admission::Refuse(ProxyError::QueueFull { .. })
    ));
    (s, rx1, rx2)
}

#[test]
fn a_waiter_whose_client_left_frees_its_place_and_its_deadline_answers_nobody() {
    let t0 = Instant::now();
    let (mut s, rx1, _rx2) = full_queue(t0);
    drop(rx1);
    assert!(matches!(
        admit(&mut s, WaitKind::Request, t0, &RULES),
        Admission::Wait
    ));
    assert_eq!(s.waiters.len(), 1, "the one that left is gone");
    assert!(waiter_deadline(&mut s, 1).is_empty(), "nobody to answer");
    assert_eq!(names(&waiter_deadline(&mut s, 2)), ["fail_one"]);
}

#[test]
fn placement_starts_what_fits_and_evicts_only_for_the_first_that_does_not() {
    let now = Instant::now();
    let residents = [
        resident("old", 60, false, false, 100, now),
        resident("busy", 20, false, true, 200, now),
    ];
    let room = room(3, 100, 0);
    let mut pass = Pass::default();
    // 80 + 40 > 100: the idle "old" engine goes (the busy one, used longer ago, stays).
    let plan = plan_beside_jobs(40, &residents, room);
    match place("b", plan, &mut pass, 100) {
        Placement::Evict(victims) => assert_eq!(victims, ["old"]),
        other => panic!("{other:?}"),
    }
    assert!(pass.blocked);
    // A model behind it that fits as things are starts at once...
    let plan = plan_beside_jobs(20, &residents, room);
    assert!(matches!(place("c", plan, &mut pass, 100), Placement::Start));
    // ...but one that needs evictions too waits for the room being made for "b".
    let plan = plan_beside_jobs(30, &residents, room);
    assert!(matches!(plan, Plan::Evict(_)));
    assert!(matches!(place("d", plan, &mut pass, 100), Placement::Wait));
    // Room held by a busy engine: wait.
    let mut pass = Pass::default();
    let plan = plan_beside_jobs(90, &residents[1..], room);
    assert!(matches!(place("e", plan, &mut pass, 100), Placement::Wait));
    assert!(pass.blocked);
}

#[test]
fn placement_refuses_what_pinned_engines_leave_no_room_for_with_the_numbers() {
    let now = Instant::now();
    let pinned = [resident("p", 70, true, false, 1, now)];
    let mut pass = Pass::default();
    let plan = plan_beside_jobs(40, &pinned, room(2, 100, 0));
    match place("big", plan, &mut pass, 100) {
        Placement::Refuse(ProxyError::InsufficientMemory {
            model,
            needed: 40,
            available: 30,
            budget: 100,
            retry_after: None,
        }) => assert_eq!(model, "big"),
        other => panic!("{other:?}"),
    }
    assert!(!pass.blocked, "a refusal blocks nobody behind it");
    let plan = plan_beside_jobs(10, &pinned, room(1, 100, 0));
    assert!(matches!(
        place("small", plan, &mut pass, 100),
        Placement::Refuse(ProxyError::NoEngineAvailable {
            max_engines: 1,
            why: "held by pinned models",
            ..
        })
    ));
}

#[test]
fn memory_held_by_jobs_makes_a_model_wait_rather_than_be_refused() {
    let none: [Resident; 0] = [];
    assert_eq!(
        plan_beside_jobs(80, &none, room(2, 100, 50)),
        Plan::Wait(Shortfall::Memory {
            needed: 80,
            available: 50
        })
    );
    assert_eq!(plan_beside_jobs(40, &none, room(2, 100, 50)), Plan::Start);
    assert!(matches!(
        plan_beside_jobs(120, &none, room(2, 100, 50)),
        Plan::RefuseMemory { needed: 120, .. }
    ));
}

#[test]
fn a_model_placement_refuses_leaves_the_queue_and_its_waiters_get_the_reason() {
    let mut s = slot(false);
    let (w, _rx) = waiter(1);
    wait(&mut s, w, Duration::from_secs(10));
    queue(&mut s, 0, Duration::from_secs(30));
    let Placement::Refuse(err) = place(
        "m",
        Plan::RefuseMemory {
            needed: 9,
            available: 1,
        },
        &mut Pass::default(),
        5,
    ) else {
        unreachable!()
    };
    let fx = refuse(&mut s, err);
    assert_eq!(names(&fx), ["leave_queue", "log", "fail"]);
    assert_eq!(s.state.name(), "idle");
    assert!(!still_queued(&mut s));
}

#[test]
fn an_engine_that_fails_while_requests_wait_answers_them_or_keeps_them_for_the_restart() {
    let t0 = Instant::now();
    // The load cannot succeed: every waiter gets the cause, no restart.
    let mut s = starting(t0);
    let (w, _rx) = waiter(1);
    wait(&mut s, w, Duration::from_secs(10));
    let fx = exit_calmly(&mut s, cannot_load("no weights"), t0);
    assert!(fx
        .iter()
        .any(|e| matches!(e, Effect::FailWaiters(ProxyError::CannotLoad { .. }))));
    assert_eq!(s.state.name(), "failed");
    // A crash of the ready engine: a request that found it dead waits for the restart,
    // and keeps waiting through the crash; a new request waits with it.
    let mut s = starting(t0);
    ready(&mut s, ready_report(), t0, &timing());
    assert!(matches!(
        admit(&mut s, WaitKind::Retry { dead: 1 }, t0, &RULES),
        Admission::Wait
    ));
    let (w, _rx) = waiter(1);
    assert_eq!(names(&wait(&mut s, w, Duration::from_secs(10))), ["after"]);
    let fx = exit_calmly(&mut s, crash(Some(9), None), t0);
    assert!(!fx.iter().any(|e| matches!(e, Effect::FailWaiters(_))));
    assert_eq!(s.state.name(), "restarting");
    assert_eq!(s.waiters.len(), 1);
    assert!(matches!(
        admit(&mut s, WaitKind::Request, t0, &RULES),
        Admission::Wait
    ));
    // The restarted engine's load fails: now they get its error.
    start_engine(&mut s, 43, 2, t0);
    let fx = exit_calmly(&mut s, load_failed("exit code 2 before ready"), t0);
    assert!(fx
        .iter()
        .any(|e| matches!(e, Effect::FailWaiters(ProxyError::LoadFailed { .. }))));
}

#[test]
fn an_admin_unload_ends_a_wait_drains_an_engine_or_has_nothing_to_do() {
    let t0 = Instant::now();
    let mut s = slot(false);
    assert!(matches!(unload(&mut s), Unload::Now(fx) if fx.is_empty()));
    let (w, _rx) = waiter(1);
    wait(&mut s, w, Duration::from_secs(10));
    queue(&mut s, 0, Duration::from_secs(30));
    let Unload::Now(fx) = unload(&mut s) else {
        panic!("a queued model has no engine to wait for")
    };
    assert_eq!(names(&fx), ["leave_queue", "fail"]);
    let mut s = starting(t0);
    ready(&mut s, ready_report(), t0, &timing());
    let Unload::WhenStopped(fx) = unload(&mut s) else {
        panic!("a running engine drains first")
    };
    assert_eq!(
        names(&fx),
        ["control", "control", "log", "eviction", "stop"]
    );
    assert_eq!(s.state.name(), "draining");
}

#[test]
fn a_removed_model_fails_its_waiters_and_goes_now_or_after_its_drain() {
    let t0 = Instant::now();
    let mut s = slot(false);
    let (w, _rx) = waiter(1);
    wait(&mut s, w, Duration::from_secs(10));
    queue(&mut s, 0, Duration::from_secs(30));
    let fx = remove(&mut s);
    assert!(s.removed);
    assert_eq!(names(&fx), ["fail", "leave_queue", "forget"]);
    assert!(
        matches!(&fx[0], Effect::FailWaiters(ProxyError::NotFound(why)) if why == "model m was removed from the configuration")
    );
    let mut s = starting(t0);
    ready(&mut s, ready_report(), t0, &timing());
    let fx = remove(&mut s);
    assert_eq!(
        names(&fx),
        [
            "fail",
            "leave_queue",
            "log",
            "control",
            "control",
            "log",
            "eviction",
            "stop"
        ]
    );
    assert_eq!(s.state.name(), "draining");
}

#[test]
fn shutdown_answers_the_waiters_before_the_engine_stops() {
    let t0 = Instant::now();
    let mut s = starting(t0);
    let (w, _rx) = waiter(1);
    wait(&mut s, w, Duration::from_secs(10));
    let fx = shut_down(&mut s);
    assert_eq!(names(&fx), ["fail", "stop"]);
    assert!(matches!(
        fx[0],
        Effect::FailWaiters(ProxyError::ShuttingDown)
    ));
}

#[test]
fn a_ready_engine_grants_the_waiters_still_there_in_order() {
    let t0 = Instant::now();
    let mut s = starting(t0);
    let mut kept = Vec::new();
    for id in 0..3 {
        let (w, rx) = waiter(id);
        wait(&mut s, w, Duration::from_secs(10));
        kept.push(rx);
    }
    drop(kept.remove(1));
    let fx = ready(&mut s, ready_report(), t0, &timing());
    assert!(names(&fx).contains(&"grant"));
    let granted: Vec<u64> = to_grant(&mut s).iter().map(|w| w.id).collect();
    assert_eq!(granted, [0, 2], "the one whose client left gets no lease");
    assert!(s.waiters.is_empty());
}

#[test]
fn the_start_up_load_takes_no_place_of_the_request_queue() {
    let t0 = Instant::now();
    let mut s = starting(t0);
    // `mlxd serve --model`'s own load waits first...
    let (reply, _load_rx) = tokio::sync::oneshot::channel();
    let load = Waiter {
        id: 0,
        kind: WaitKind::StartUp,
        reply,
    };
    assert!(matches!(
        admit(&mut s, WaitKind::StartUp, t0, &RULES),
        Admission::Wait
    ));
    wait(&mut s, load, Duration::from_secs(10));
    // ...and the queue's two places are still the clients'.
    let (w1, _rx1) = waiter(1);
    let (w2, _rx2) = waiter(2);
    for w in [w1, w2] {
        assert!(matches!(
            admit(&mut s, WaitKind::Request, t0, &RULES),
            Admission::Wait
        ));
        wait(&mut s, w, Duration::from_secs(10));
    }
    assert_eq!(s.waiters.len(), 3);
    assert!(matches!(
        admit(&mut s, WaitKind::Request, t0, &RULES),
        Admission::Refuse(ProxyError::QueueFull { capacity: 2, .. })
    ));
    // A full queue never refuses the start-up load.
    assert!(matches!(
        admit(&mut s, WaitKind::StartUp, t0, &RULES),
        Admission::Wait
    ));
}

#[test]
fn a_retried_request_waits_however_full_the_queue_is() {
    let t0 = Instant::now();
    let (mut s, _rx1, _rx2) = full_queue(t0);
    // A stream whose engine died resumes on the successor: it was admitted once.
    assert!(matches!(
        admit(&mut s, WaitKind::Retry { dead: 1 }, t0, &RULES),
        Admission::Wait
    ));
    let (reply, _rx3) = tokio::sync::oneshot::channel();
    wait(
        &mut s,
        Waiter {
            id: 3,
            kind: WaitKind::Retry { dead: 1 },
            reply,
        },
        Duration::from_secs(10),
    );
    assert_eq!(s.queued_requests(), 2, "the retry took no place");
    assert!(matches!(
        admit(&mut s, WaitKind::Retry { dead: 1 }, t0, &RULES),
        Admission::Wait
    ));
}
