//! The runtime on every rank of an engine group: rank 0's executor takes requests from the
//! HTTP side as a single engine does, and before each iteration broadcasts what that
//! iteration runs on ([`TurnMessage`]: new requests with their token ids and sampling
//! parameters, the requests whose clients left, the prefill speed that sizes chunks); every
//! other rank runs the same iteration on the same inputs, so the forward passes (and the
//! collectives inside them) pair up one for one and every rank samples the same tokens.
//!
//! Which clients are still listening must change at the same point on every rank. On rank 0
//! the executor therefore never holds a client's own event channel: it writes into a relay
//! channel, whose receiver the [`Leader`] holds and whose events a task forwards to the client
//! as they come; the relay closes only at the top of an iteration, after the departure has
//! been broadcast. The other ranks' events go to channels that they drain and drop.
use std::collections::HashMap;
use std::future::poll_fn;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use mlx_rs::error::Exception;
use tokio::sync::mpsc::{self, error::TryRecvError, UnboundedReceiver, UnboundedSender};

use super::watchdog::StepWatch;
use super::wire::{broadcast, broadcast_announced, Arrival, Sampling, TurnMessage};
use super::Group;
use crate::runtime::lockstep::{Lockstep, Turn};
use crate::runtime::request::{GenerateRequest, GenerationError, TokenEvent};

/// The exit status of a rank whose group broke (a peer died, a collective failed): the
/// supervisor restarts the whole group.
pub const EXIT_GROUP_BROKEN: i32 = 75;

/// Ends this rank: an engine group cannot continue once its ranks can no longer agree.
fn group_broken(rank: usize, why: &str) -> ! {
    tracing::error!(rank, reason = why, "engine group broken; exiting");
    std::process::exit(EXIT_GROUP_BROKEN)
}

/// Told why the group is given up as hung, before the rank exits.
pub type HungReport = Box<dyn Fn(&str) + Send + Sync>;

/// Who hears why the group hung before the rank exits (rank 0 under `mlxd`: the supervisor,
/// as a fatal report); set once per process.
static HUNG_REPORT: OnceLock<HungReport> = OnceLock::new();

/// Sends the reason a group is given up as hung to `report` before the rank exits.
pub fn report_hangs_to(report: HungReport) {
    let _ = HUNG_REPORT.set(report);
}

/// Ends this rank from its step watch: another thread is blocked inside an MLX collective
/// that will never return, so the process ends at once (`_exit`: no exit handlers, which
/// could wait on MLX's blocked threads). The parent-death signal ends the ranks it started.
fn group_hung(rank: usize, why: String) {
    tracing::error!(rank, reason = %why, "engine group hung; exiting");
    if let Some(report) = HUNG_REPORT.get() {
        report(&why);
    }
    // A rank 0 that is itself the one stopped can neither see this rank go nor end itself:
    // its parent-child link to this rank lets this rank end it, and the supervisor sees a
    // crash. (A rank on another machine cannot; see docs/architecture.md.)
    if let Some(leader) = leader_parent().filter(|_| rank != 0) {
        tracing::error!(rank, leader, "ending rank 0 with the group");
        // SAFETY: a plain signal to a pid checked to be this process's parent.
        unsafe {
            libc::kill(leader, libc::SIGKILL);
        }
    }
    // SAFETY: `_exit` ends the process without running anything else; it is always safe.
    unsafe { libc::_exit(EXIT_GROUP_BROKEN) }
}

/// Set by rank 0 in the environment of the ranks it starts as its children: its pid.
pub const LEADER_PID_ENV: &str = "MLXD_GROUP_LEADER_PID";

/// Rank 0's pid when it started this rank ([`LEADER_PID_ENV`]) and is still its parent.
fn leader_parent() -> Option<libc::pid_t> {
    let pid: libc::pid_t = std::env::var(LEADER_PID_ENV).ok()?.trim().parse().ok()?;
    // SAFETY: getppid has no preconditions.
    let parent = unsafe { libc::getppid() };
    (pid > 1 && parent == pid).then_some(pid)
}

/// A step watch for rank `rank` bounded by `bound`, ending the rank when a step outruns it.
fn watch_steps(rank: usize, bound: Duration) -> std::io::Result<StepWatch> {
    StepWatch::start(rank, bound, Box::new(move |why| group_hung(rank, why)))
}

type Slot = Arc<Mutex<Option<UnboundedReceiver<TokenEvent>>>>;

/// A request in flight on rank 0: its client's channel and the relay the executor writes to.
struct Relay {
    id: u64,
    client: UnboundedSender<TokenEvent>,
    /// The relay's receiving end, shared with the forwarding task; taken (closing the relay)
    /// only at the top of an iteration.
    slot: Slot,
}

/// Rank 0: decides each turn and broadcasts it.
pub struct Leader {
    group: Group,
    rx: UnboundedReceiver<GenerateRequest>,
    open: bool,
    next_id: u64,
    relays: Vec<Relay>,
    /// Runs the forwarding tasks (the model thread never awaits).
    forwarders: tokio::runtime::Runtime,
    /// Bounds each step: stepping from the broadcast to the next turn, waiting while idle.
    watch: StepWatch,
}

impl Leader {
    /// Rank 0 of `group`, taking requests from `rx`; a step that runs past `step_timeout`
    /// ends the rank ([`super::watchdog`]).
    pub fn new(
        group: Group,
        rx: UnboundedReceiver<GenerateRequest>,
        step_timeout: Duration,
    ) -> std::io::Result<Self> {
        let watch = watch_steps(group.rank(), step_timeout)?;
        let forwarders = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("mlx-relay")
            .enable_all()
            .build()?;
        Ok(Self {
            group,
            rx,
            open: true,
            next_id: 0,
            relays: Vec::new(),
            forwarders,
            watch,
        })
    }

    /// New requests: waits for one while the executor is idle, then takes what has come.
    fn incoming(&mut self, idle: bool) -> Vec<GenerateRequest> {
        let mut incoming = Vec::new();
        if idle && self.open {
            // An idle group waits for a request as long as it takes.
            self.watch.waiting();
            match self.rx.blocking_recv() {
                Some(req) => incoming.push(req),
                None => self.open = false,
            }
        }
        while self.open {
            match self.rx.try_recv() {
                Ok(req) => incoming.push(req),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => self.open = false,
            }
        }
        incoming
    }

    /// The request the executor runs for `req` (writing to a relay), and its wire form; a
    /// request the group cannot serve is answered here and not run.
    fn admit(&mut self, req: GenerateRequest) -> Option<(GenerateRequest, Arrival)> {
        if req.constraint.is_some() {
            let _ = req
                .events
                .send(TokenEvent::Failed(GenerationError::Unsupported {
                    // `response_format` or a forced `tool_choice`: the message names both.
                    param: None,
                    reason: "constrained decoding (response_format, forced tool calls) is not \
                             supported by an engine group yet"
                        .into(),
                }));
            return None;
        }
        let seed = req.sampling.seed.unwrap_or_else(rand::random);
        let arrival = Arrival {
            prompt: req.prompt.clone(),
            sampling: Sampling::new(&req.sampling, seed),
            max_tokens: req.max_tokens,
            stop_token_ids: req.stop_token_ids.clone(),
            sample_offset: req.sample_offset,
            logprobs: req.logprobs,
        };
        let (relay_tx, relay_rx) = mpsc::unbounded_channel();
        let slot: Slot = Arc::new(Mutex::new(Some(relay_rx)));
        self.forwarders
            .spawn(forward(slot.clone(), req.events.clone()));
        self.relays.push(Relay {
            id: self.next_id,
            client: req.events,
            slot,
        });
        self.next_id += 1;
        let run = GenerateRequest {
            prompt: req.prompt,
            sampling: arrival.sampling.params(),
            max_tokens: req.max_tokens,
            stop_token_ids: req.stop_token_ids,
            sample_offset: req.sample_offset,
            events: relay_tx,
            constraint: None,
            logprobs: req.logprobs,
            adapter: req.adapter,
        };
        Some((run, arrival))
    }

    /// Requests whose clients left, with their relays (to close once the broadcast is out);
    /// relays whose requests ended are forgotten.
    fn departures(&mut self) -> Vec<(u64, Slot)> {
        let mut left = Vec::new();
        self.relays.retain(|r| {
            if r.client.is_closed() {
                left.push((r.id, r.slot.clone()));
                false
            } else {
                // The forwarding task holds the other reference until the relay ends.
                Arc::strong_count(&r.slot) > 1
            }
        });
        left
    }
}

impl Lockstep for Leader {
    fn next_turn(&mut self, idle: bool, prefill_speed: Option<f64>) -> Option<Turn> {
        let incoming = self.incoming(idle);
        // The step begins with its broadcast and lasts until the next turn is asked for.
        self.watch.stepping();
        let (cancelled, closing): (Vec<u64>, Vec<Slot>) = self.departures().into_iter().unzip();
        let mut arrived = Vec::new();
        let mut wire = Vec::new();
        for req in incoming {
            if let Some((run, arrival)) = self.admit(req) {
                arrived.push(run);
                wire.push(arrival);
            }
        }
        let message = if idle && arrived.is_empty() && !self.open {
            TurnMessage::Stop
        } else {
            TurnMessage::Turn {
                arrived: wire,
                cancelled,
                prefill_speed,
            }
        };
        if let Err(e) = broadcast(&self.group, Some(&message.encode())) {
            group_broken(0, &e.to_string());
        }
        for slot in closing {
            if let Ok(mut held) = slot.lock() {
                held.take();
            }
        }
        match message {
            TurnMessage::Stop => None,
            TurnMessage::Turn { .. } => Some(Turn {
                arrived,
                prefill_speed,
            }),
        }
    }

    fn failed(&mut self, error: Exception) {
        group_broken(0, &error.to_string())
    }
}

/// Forwards a relay's events to the client until the relay ends or the client leaves.
async fn forward(slot: Slot, client: UnboundedSender<TokenEvent>) {
    loop {
        let next = poll_fn(|cx| match slot.lock() {
            Ok(mut held) => match held.as_mut() {
                Some(rx) => rx.poll_recv(cx),
                None => std::task::Poll::Ready(None),
            },
            Err(_) => std::task::Poll::Ready(None),
        });
        tokio::select! {
            event = next => match event {
                Some(event) => {
                    if client.send(event).is_err() {
                        return;
                    }
                }
                None => return,
            },
            _ = client.closed() => return,
        }
    }
}

/// Every other rank: runs the turns rank 0 broadcasts.
pub struct Follower {
    group: Group,
    /// Bounds each step: waiting until rank 0 announces a turn, stepping from then on.
    watch: StepWatch,
    next_id: u64,
    /// The event receivers of the requests in flight, by number.
    streams: HashMap<u64, UnboundedReceiver<TokenEvent>>,
}

impl Follower {
    /// A rank other than 0 of `group`; a step that runs past `step_timeout` ends the rank.
    pub fn new(group: Group, step_timeout: Duration) -> std::io::Result<Self> {
        Ok(Self {
            watch: watch_steps(group.rank(), step_timeout)?,
            group,
            next_id: 0,
            streams: HashMap::new(),
        })
    }
}

impl Lockstep for Follower {
    fn next_turn(&mut self, idle: bool, _prefill_speed: Option<f64>) -> Option<Turn> {
        let rank = self.group.rank();
        // Every rank's executor holds the same work: while it holds some, rank 0 broadcasts
        // the next turn at once, so the wait for it is part of the step. While it holds none,
        // rank 0 waits for a request, and this rank waits as long (until the turn's length
        // arrives).
        let watch = &self.watch;
        if idle {
            watch.waiting();
        } else {
            watch.stepping();
        }
        let bytes = broadcast_announced(&self.group, None, || {
            if idle {
                watch.stepping()
            }
        })
        .unwrap_or_else(|e| group_broken(rank, &e.to_string()));
        let message = TurnMessage::decode(&bytes).unwrap_or_else(|e| group_broken(rank, &e));
        let TurnMessage::Turn {
            arrived,
            cancelled,
            prefill_speed,
        } = message
        else {
            return None;
        };
        for id in cancelled {
            self.streams.remove(&id);
        }
        // Events are not needed here; a stream whose request ended is dropped.
        self.streams.retain(|_, rx| loop {
            match rx.try_recv() {
                Ok(_) => continue,
                Err(TryRecvError::Empty) => break true,
                Err(TryRecvError::Disconnected) => break false,
            }
        });
        let arrived = arrived
            .into_iter()
            .map(|a| {
                let (tx, rx) = mpsc::unbounded_channel();
                self.streams.insert(self.next_id, rx);
                self.next_id += 1;
                GenerateRequest {
                    prompt: a.prompt,
                    sampling: a.sampling.params(),
                    max_tokens: a.max_tokens,
                    stop_token_ids: a.stop_token_ids,
                    sample_offset: a.sample_offset,
                    events: tx,
                    constraint: None,
                    logprobs: a.logprobs,
                    adapter: None,
                }
            })
            .collect();
        Some(Turn {
            arrived,
            prefill_speed,
        })
    }

    fn failed(&mut self, error: Exception) {
        group_broken(self.group.rank(), &error.to_string())
    }
}
