//! The MLX thread's loop: take requests, ask the scheduler what to do, run it.
//!
//! Each iteration admits what the [`scheduler`](super::scheduler) allows, runs one decode
//! step for every sequence past its prompt (one forward pass, [`DecodeBatch`]) and one prefill
//! unit (a chunk of one prompt or a padded group of short ones), then publishes its counters.
//! Sequences whose prompt is in their cache join the decode batch at the next step, the
//! prompt's last token their input, or with `first_token_from_prefill` the first token the
//! pass that completed the prompt sampled ([`super::first_token`]). MLX arrays never leave
//! this thread.
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;
use tokio::sync::mpsc;

use super::batch::{DecodeBatch, Departed, Prefilled};
use super::draft::Speculator;
use super::first_token::FirstTokens;
use super::request::{
    AdapterWork, AdapterWorkError, FinishReason, GenerateRequest, GenerationError, TokenEvent,
};
use super::scheduler::{self, Admission, PrefillView, PrefillWork, SchedulerLimits, WaitingView};
use super::sequence::Sequence;
use super::step_trace::PrefillTrace;
use super::{FatalHook, RuntimeStats};
use crate::adapters::{self, AdapterId, AdapterSummary};
use crate::cache::{CacheManager, KvLayout, KvQuant, KvSpace, LayerCache, LayerKind, SeqKv};
use crate::models::{CausalLm, ModelInfo};

/// A prefill pass of this step whose caches are still being computed: a chunk's prompt
/// (by its slot) or a group's unit (by its place in the ready list).
enum Queued {
    Slot(usize),
    Ready(usize),
}

/// An admitted sequence whose prompt is not all in its cache yet.
struct Prefilling {
    seq: Sequence,
    /// One-row caches, `None` until something is written (or a prefix-cache hit).
    layers: Option<Vec<LayerCache>>,
    /// Prompt positions in `layers`.
    written: usize,
    /// The prefill unit that last ran some of its prompt (0: none yet), for taking turns.
    last_unit: u64,
    /// Its prompt's last token runs here, and samples the first token
    /// ([`SchedulerLimits::first_token_from_prefill`]); otherwise in its first decode step.
    last_in_prefill: bool,
}

impl Prefilling {
    /// Positions of its cache a group pass may write again ([`PrefillView::rewind`]).
    fn rewind(&self) -> usize {
        match &self.layers {
            Some(layers) if layers.iter().all(LayerCache::rewindable) => self.written,
            _ => 0,
        }
    }

    /// Prompt tokens still to run here: all of them where the pass that runs the last one
    /// samples the first token, else all but the last.
    fn remaining(&self) -> usize {
        let end = if self.last_in_prefill {
            self.seq.prompt_len
        } else {
            self.seq.prompt_len.saturating_sub(1)
        };
        end.saturating_sub(self.written)
    }
}

pub(super) struct Executor<'m> {
    pub model: &'m dyn CausalLm,
    pub info: ModelInfo,
    pub limits: SchedulerLimits,
    pub caches: CacheManager,
    /// Each layer's kind: attention (its window bounding its caches) or recurrent state.
    kinds: Vec<LayerKind>,
    /// Whether some layers hold a recurrent state, which the prefix cache can only take
    /// whole: such sequences leave snapshots of their prompts as they prefill.
    stateful: bool,
    pub stats: Arc<RuntimeStats>,
    pub on_fatal: Option<FatalHook>,
    waiting: VecDeque<GenerateRequest>,
    prefilling: Vec<Prefilling>,
    ready: Vec<Prefilled>,
    batch: DecodeBatch,
    /// Waits for requests with a timeout while idle (SSD demotion is due even then).
    timer: Option<tokio::runtime::Runtime>,
    /// Prefill units run so far (numbers each one, for taking turns).
    units: u64,
    /// Prompt tokens per second of the last prefill unit, which sizes the next chunks.
    prefill_speed: Option<f64>,
    /// Pass shapes (rows, tokens) prefilled before: a step with a new one may spend most of
    /// its time compiling kernels (MLX's CUDA backend compiles at first use), so it does not
    /// measure the device's speed. Bounded by [`SEEN_SHAPES_MAX`]. `None` on the CPU, which
    /// compiles nothing per shape, so that its first chunk already sizes the next ones.
    prefill_shapes_seen: Option<HashSet<(usize, usize)>>,
    /// Whether the last iteration prefilled after a decode step with rows: that prefill's wait
    /// ran the decode pass the next decode step waits for, so the next step's time is not its
    /// own and is not counted (see [`RuntimeStats::decode_steps`]).
    prefill_ran_decode_pass: bool,
    /// The prefix-cache space of each loaded adapter (`KvSpace::of_adapter_dir`), so that an
    /// adapter's rows reuse their own earlier prompts' KV and never the base model's.
    adapter_spaces: HashMap<AdapterId, KvSpace>,
    /// Adapters to load and unload at run time (the admin routes), handled between
    /// iterations; `None`: no such work comes.
    adapter_work: Option<mpsc::UnboundedReceiver<AdapterWork>>,
}

/// What woke an idle executor.
enum Woken {
    Request(GenerateRequest),
    Adapter(AdapterWork),
    Closed,
}

/// Pass shapes remembered at most; past it every shape counts as seen (by then the kernels
/// a server uses are compiled).
const SEEN_SHAPES_MAX: usize = 4096;

impl<'m> Executor<'m> {
    pub fn new(
        model: &'m dyn CausalLm,
        info: ModelInfo,
        limits: SchedulerLimits,
        caches: CacheManager,
        stats: Arc<RuntimeStats>,
        on_fatal: Option<FatalHook>,
        spec: Option<Speculator>,
    ) -> Self {
        let kinds = model.layer_kinds();
        let stateful = kinds.iter().any(|k| k.is_state());
        let mut limits = limits;
        if stateful {
            // Chunks no longer than the snapshot interval, so that a long prompt leaves a
            // snapshot every `state_snapshot_every` tokens (a state is only copied between
            // forward passes).
            limits.prefill_chunk = limits.prefill_chunk.min(limits.state_snapshot_every);
            limits.snapshot_boundaries = true;
        }
        let caches = caches.with_layers(kinds.clone(), info.state_bytes_per_sequence);
        let batch = DecodeBatch::new(
            kinds.clone(),
            info.vocab_size,
            caches.prefix_enabled(),
            caches.layout(),
            spec,
        );
        Self {
            model,
            info,
            limits,
            caches,
            kinds,
            stateful,
            stats,
            on_fatal,
            waiting: VecDeque::new(),
            prefilling: Vec::new(),
            ready: Vec::new(),
            batch,
            timer: None,
            units: 0,
            prefill_speed: None,
            prefill_shapes_seen: super::on_gpu().then(HashSet::new),
            prefill_ran_decode_pass: false,
            adapter_spaces: HashMap::new(),
            adapter_work: None,
        }
    }

    /// This executor taking adapter work from `rx` ([`AdapterWork`]).
    pub fn with_adapter_work(mut self, rx: mpsc::UnboundedReceiver<AdapterWork>) -> Self {
        self.adapter_work = Some(rx);
        self
    }

    /// Moves the requests that have arrived into the waiting line; false once the channel is
    /// closed.
    fn take_requests(&mut self, rx: &mut mpsc::UnboundedReceiver<GenerateRequest>) -> bool {
        loop {
            match rx.try_recv() {
                Ok(req) => self.waiting.push_back(req),
                Err(mpsc::error::TryRecvError::Empty) => return true,
                Err(mpsc::error::TryRecvError::Disconnected) => return false,
            }
        }
    }

    /// Does one piece of adapter work and answers it. Runs between iterations, so no forward
    /// pass holds a selection; the requests that arrived before it are already waiting, so an
    /// unload counts them.
    fn adapter_work(&mut self, work: AdapterWork) {
        match work {
            AdapterWork::Load { name, dir, reply } => {
                let result = self.load_adapter(&name, &dir);
                match &result {
                    Ok(s) => {
                        tracing::info!(adapter = %name, dir = %dir.display(), id = ?s.id, "adapter loaded")
                    }
                    Err(e) => {
                        tracing::warn!(adapter = %name, dir = %dir.display(), error = %e, "adapter not loaded")
                    }
                }
                let _ = reply.send(result);
            }
            AdapterWork::Unload { name, reply } => {
                let result = self.unload_adapter(&name);
                match &result {
                    Ok(s) => tracing::info!(adapter = %name, id = ?s.id, "adapter unloaded"),
                    Err(e) => tracing::warn!(adapter = %name, error = %e, "adapter not unloaded"),
                }
                let _ = reply.send(result);
            }
        }
    }

    fn load_adapter(
        &mut self,
        name: &str,
        dir: &std::path::Path,
    ) -> Result<AdapterSummary, AdapterWorkError> {
        let table = self
            .model
            .adapters()
            .ok_or(AdapterWorkError::NotAdaptable)?;
        if table.id_of(name).is_some() {
            return Err(adapters::AdapterError::Duplicate(name.to_owned()).into());
        }
        // The space first: an adapter is never loaded without one.
        let space = KvSpace::of_adapter_dir(dir).map_err(|e| AdapterWorkError::Space {
            path: dir.to_owned(),
            message: e.to_string(),
        })?;
        let id = table.load(name, dir)?;
        self.adapter_spaces.insert(id, space);
        table
            .list()
            .into_iter()
            .find(|a| a.id == id)
            .ok_or_else(|| AdapterWorkError::Unknown {
                name: name.to_owned(),
                loaded: Vec::new(),
            })
    }

    fn unload_adapter(&mut self, name: &str) -> Result<AdapterSummary, AdapterWorkError> {
        let table = self
            .model
            .adapters()
            .ok_or(AdapterWorkError::NotAdaptable)?;
        let unknown = || AdapterWorkError::Unknown {
            name: name.to_owned(),
            loaded: table.list().into_iter().map(|a| a.name).collect(),
        };
        let id = table.id_of(name).ok_or_else(unknown)?;
        let requests = self.requests_with(id);
        if requests > 0 {
            return Err(AdapterWorkError::InUse {
                name: name.to_owned(),
                requests,
            });
        }
        let summary = table.unload(id).ok_or_else(unknown)?;
        // Its prefix-cache entries stay, keyed by its content: the shared LRU evicts them,
        // and the same adapter loaded again finds them.
        self.adapter_spaces.remove(&id);
        Ok(summary)
    }

    /// Requests in flight (waiting, prefilling, prefilled or decoding) that run with `id`.
    fn requests_with(&self, id: AdapterId) -> usize {
        let waiting = self
            .waiting
            .iter()
            .filter(|r| r.adapter == Some(id) && !r.events.is_closed())
            .count();
        let prefilling = self
            .prefilling
            .iter()
            .filter(|p| p.seq.adapter == Some(id))
            .count();
        let ready = self
            .ready
            .iter()
            .flat_map(|r| &r.seqs)
            .filter(|s| s.adapter == Some(id))
            .count();
        let decoding = self.batch.adapters().filter(|a| *a == Some(id)).count();
        waiting + prefilling + ready + decoding
    }

    /// A request whose adapter was unloaded after the server resolved its name is refused
    /// at admission (it would fail its batch's passes).
    fn check_adapter(&self, req: &GenerateRequest) -> Result<(), GenerationError> {
        match req.adapter {
            Some(id) if !self.adapter_spaces.contains_key(&id) => {
                Err(GenerationError::AdapterUnloaded(id))
            }
            _ => Ok(()),
        }
    }

    /// This executor with the prefix-cache spaces of the model's loaded adapters.
    pub fn with_adapter_spaces(mut self, spaces: HashMap<AdapterId, KvSpace>) -> Self {
        self.adapter_spaces = spaces;
        self
    }

    /// The space of a row running with `adapter`: the base model's without one; `None` for
    /// an adapter loaded without a space (none is today: every adapter loaded at start gets
    /// one), whose rows then bypass the cache.
    fn space_of(&self, adapter: Option<AdapterId>) -> Option<KvSpace> {
        let Some(id) = adapter else {
            return Some(KvSpace::BASE);
        };
        let space = self.adapter_spaces.get(&id).copied();
        if space.is_none() {
            tracing::warn!(
                ?id,
                "an adapter without a prefix-cache space: its rows bypass the cache"
            );
        }
        space
    }

    fn idle(&self) -> bool {
        self.waiting.is_empty()
            && self.prefilling.is_empty()
            && self.ready.is_empty()
            && self.batch.is_empty()
    }

    /// Serves requests until the channel closes and all work is done.
    pub fn run(&mut self, mut rx: mpsc::UnboundedReceiver<GenerateRequest>) {
        let mut open = true;
        loop {
            if self.idle() {
                if !open {
                    return;
                }
                match self.wait_for_work(&mut rx) {
                    Woken::Request(req) => {
                        self.waiting.push_back(req);
                        open = super::arrivals::gather(
                            &mut rx,
                            &mut self.waiting,
                            super::arrivals::GAP,
                            super::arrivals::MAX,
                        );
                    }
                    Woken::Adapter(work) => {
                        open = self.take_requests(&mut rx) && open;
                        self.adapter_work(work);
                        continue;
                    }
                    Woken::Closed => return,
                }
            }
            open = self.take_requests(&mut rx) && open;
            while let Some(work) = self.adapter_work.as_mut().and_then(|r| r.try_recv().ok()) {
                self.adapter_work(work);
            }
            if let Err(e) = self.iteration() {
                self.fail_all(GenerationError::from_mlx(e.to_string()));
            }
            self.stats.steps.fetch_add(1, Ordering::Relaxed);
            self.publish();
        }
    }

    /// Serves the request channel alone ([`Self::run`]), or, in an engine group, through the
    /// lockstep made of it ([`Self::run_lockstep`]).
    pub fn serve(
        &mut self,
        rx: mpsc::UnboundedReceiver<GenerateRequest>,
        lockstep: Option<super::MakeLockstep>,
    ) {
        match lockstep {
            None => self.run(rx),
            Some(make) => self.run_lockstep(make(rx).as_mut()),
        }
    }

    /// Serves an engine group's rank: each iteration's inputs come from `sync`, the same on
    /// every rank ([`super::lockstep`]), instead of this rank's own request channel.
    pub fn run_lockstep(&mut self, sync: &mut dyn super::lockstep::Lockstep) {
        while let Some(turn) = sync.next_turn(self.idle(), self.prefill_speed) {
            self.waiting.extend(turn.arrived);
            self.prefill_speed = turn.prefill_speed;
            if let Err(e) = self.iteration() {
                self.fail_all(GenerationError::from_mlx(e.to_string()));
                sync.failed(e);
                return;
            }
            self.publish();
        }
    }

    fn iteration(&mut self) -> Result<(), Exception> {
        self.waiting.retain(|r| !r.events.is_closed());
        self.drop_cancelled_prefills();
        // Before the lookups: a request may continue a row that just finished.
        let finished = self.batch.release_finished()?;
        self.settle(finished)?;
        self.admit()?;
        // Published before the step too: a step that prefills a long chunk may take seconds
        // on a slow device, and the counters must show the work it is doing meanwhile.
        self.publish();
        let joining = std::mem::take(&mut self.ready);
        // The decode step alone is timed (the memory-pressure watch's measure): the prefill
        // that follows makes an iteration longer by its prompts, and is timed on its own where
        // no decode pass runs under it (`RuntimeStats::prefill_steps`).
        let rows = self.batch.len() + joining.iter().map(|r| r.seqs.len()).sum::<usize>();
        if let Some(injected) = crate::fault::step_error() {
            // The requests of `joining` go back to be failed (or resumed) with the rest.
            self.ready = joining;
            return Err(Exception::custom(injected));
        }
        let started = std::time::Instant::now();
        let departed = self.batch.step(self.model, joining)?;
        if rows > 0 {
            crate::fault::on_step();
            if !self.prefill_ran_decode_pass {
                self.stats.record_decode_step(started.elapsed(), rows);
            }
        }
        self.settle(departed)?;
        self.checkpoint()?;
        let prefilled = self.prefill(rows > 0)?;
        self.prefill_ran_decode_pass = prefilled && rows > 0;
        self.caches.demote_idle()
    }

    /// The next request or adapter work, blocking while idle; with SSD demotion configured,
    /// the wait wakes every housekeeping interval to demote idle prefix-cache entries.
    fn wait_for_work(&mut self, rx: &mut mpsc::UnboundedReceiver<GenerateRequest>) -> Woken {
        let every = self.caches.housekeeping_interval();
        if every.is_none() && self.adapter_work.is_none() {
            return rx.blocking_recv().map_or(Woken::Closed, Woken::Request);
        }
        if self.timer.is_none() {
            match tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
            {
                Ok(rt) => self.timer = Some(rt),
                Err(e) => {
                    tracing::warn!(
                        error = %e,
                        "no runtime to wait on: no SSD demotion nor adapter work while idle"
                    );
                    return rx.blocking_recv().map_or(Woken::Closed, Woken::Request);
                }
            }
        }
        loop {
            let timer = self.timer.as_ref().expect("built above");
            let work = self.adapter_work.as_mut();
            let woken = timer.block_on(async {
                let adapter = async {
                    match work {
                        Some(rx) => rx.recv().await,
                        None => std::future::pending().await,
                    }
                };
                let tick = async {
                    match every {
                        Some(every) => tokio::time::sleep(every).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    req = rx.recv() => Some(req.map_or(Woken::Closed, Woken::Request)),
                    Some(work) = adapter => Some(Woken::Adapter(work)),
                    () = tick => None,
                }
            });
            match woken {
                Some(woken) => return woken,
                None => {
                    if let Err(e) = self.caches.demote_idle() {
                        tracing::warn!(error = %e, "demoting idle prefixes failed");
                    }
                }
            }
        }
    }

    /// Queues generation checkpoints of the running rows that are due
    /// (`--generation-checkpoint`).
    fn checkpoint(&mut self) -> Result<(), Exception> {
        let Some(every) = self.caches.checkpoint_every() else {
            return Ok(());
        };
        for (space, (tokens, kv), generated) in self.batch.checkpoints(every)? {
            self.caches.checkpoint(space, &tokens, &kv, generated)?;
        }
        Ok(())
    }

    fn drop_cancelled_prefills(&mut self) {
        let mut kept = Vec::with_capacity(self.prefilling.len());
        for mut p in std::mem::take(&mut self.prefilling) {
            if p.seq.is_open() {
                kept.push(p);
            } else if let Some(r) = p.seq.reservation.take() {
                self.caches.release(r);
            }
        }
        self.prefilling = kept;
    }

    fn reservation(&self, req: &GenerateRequest) -> u64 {
        // The formula the proxy's KV pre-check uses too.
        let tokens = mlxd_protocol::request::kv_reservation_tokens(
            req.prompt.len() as u64,
            Some(req.max_tokens as u64),
            self.info.context_length as u64,
        );
        self.caches.bytes_for(tokens as usize)
    }

    fn admit(&mut self) -> Result<(), Exception> {
        let views: Vec<WaitingView> = self
            .waiting
            .iter()
            .map(|r| WaitingView {
                reservation: self.reservation(r),
            })
            .collect();
        let running = self.prefilling.len()
            + self.batch.len()
            + self.ready.iter().map(|r| r.seqs.len()).sum::<usize>();
        let decisions = scheduler::admit(&self.limits, self.caches.budget(), &views, running);
        for decision in decisions {
            let req = self
                .waiting
                .pop_front()
                .expect("a decision per waiting request");
            let needed = self.reservation(&req);
            match decision {
                Admission::Refuse => {
                    let error = GenerationError::KvBudget {
                        needed,
                        budget: self.caches.budget().limit().unwrap_or(u64::MAX),
                        prompt_tokens: req.prompt.len(),
                        max_tokens: req.max_tokens,
                    };
                    let _ = req.events.send(TokenEvent::Failed(error));
                }
                Admission::Admit => {
                    if let Err(e) = self
                        .check_vocabulary(&req)
                        .and_then(|()| self.check_adapter(&req))
                    {
                        let _ = req.events.send(TokenEvent::Failed(e));
                        continue;
                    }
                    let mut seq = Sequence::new(req, self.info.context_length);
                    seq.reservation = Some(self.caches.reserve(needed));
                    let looking = Instant::now();
                    seq.space = self.space_of(seq.adapter);
                    let hit = match seq.space {
                        Some(space) => self.caches.lookup(space, seq.prompt())?,
                        None => None,
                    };
                    tracing::debug!(
                        target: "mlxd_engine::prefix",
                        prompt = seq.prompt_len,
                        cached = hit.as_ref().map_or(0, |h| h.tokens),
                        lookup_us = looking.elapsed().as_micros() as u64,
                        "prefix lookup"
                    );
                    let (layers, written) = match hit {
                        Some(hit) => {
                            seq.cached_tokens = hit.tokens;
                            (Some(hit.layers), hit.tokens)
                        }
                        None => (None, 0),
                    };
                    self.prefilling.push(Prefilling {
                        seq,
                        layers,
                        written,
                        last_unit: 0,
                        last_in_prefill: self.limits.first_token_from_prefill,
                    });
                }
            }
        }
        self.promote_prefilled();
        Ok(())
    }

    /// Token ids the model cannot embed or bias are refused before they reach MLX, and so is
    /// a prompt of no tokens (its first token has no position to be sampled from).
    fn check_vocabulary(&self, req: &GenerateRequest) -> Result<(), GenerationError> {
        if req.prompt.is_empty() {
            return Err(GenerationError::Unsupported {
                param: Some("prompt"),
                reason: "the prompt has no tokens: a generation needs at least one".into(),
            });
        }
        let vocab = self.info.vocab_size;
        if let Some(&token) = req.prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(GenerationError::TokenOutOfRange {
                what: "the prompt",
                token,
                vocab,
            });
        }
        if let Some(&token) = req
            .sampling
            .logit_bias
            .keys()
            .find(|&&t| t as usize >= vocab)
        {
            return Err(GenerationError::TokenOutOfRange {
                what: "logit_bias",
                token,
                vocab,
            });
        }
        req.sampling.validate().map_err(GenerationError::from)
    }

    /// Moves sequences with nothing left to prefill to the ready list, in order.
    fn promote_prefilled(&mut self) {
        let mut still = Vec::with_capacity(self.prefilling.len());
        for p in std::mem::take(&mut self.prefilling) {
            if p.remaining() > 0 {
                still.push(p);
                continue;
            }
            tracing::debug!(
                target: "mlxd_engine::prefix",
                prompt = p.seq.prompt_len,
                cached = p.seq.cached_tokens,
                prefilled_us = p.seq.admitted.elapsed().as_micros() as u64,
                "prompt in its cache"
            );
            let layers = match p.layers {
                Some(layers) => layers,
                // A one-token prompt whose token runs in its first decode step.
                None if !p.last_in_prefill => {
                    fresh_layers(&self.kinds, vec![0], self.caches.layout().at(1))
                }
                None => {
                    // Not reached: admission refuses empty prompts, and any other runs a pass.
                    let mut seq = p.seq;
                    if let Some(r) = seq.reservation.take() {
                        self.caches.release(r);
                    }
                    seq.fail(GenerationError::Mlx(
                        "a prompt finished its prefill without a cache".into(),
                    ));
                    continue;
                }
            };
            self.ready.push(Prefilled {
                seqs: vec![p.seq],
                layers,
            });
        }
        self.prefilling = still;
    }

    /// Takes the prefilled rows whose first token was also their last (a stop token,
    /// `max_tokens` of 1, a finished constraint, a client gone) out of the ready units, their
    /// prompts' KV to the prefix cache, rather than joining them to the batch for nothing: a
    /// request sent the moment they finish finds their prompt cached.
    fn depart_finished_ready(&mut self) -> Result<(), Exception> {
        let keep_kv = self.caches.prefix_enabled();
        let mut departed = Vec::new();
        // Only rows that were handed a token: one whose first token is still to come (its
        // prompt's last token runs in its first decode step) joins whatever its limits.
        let done = |s: &Sequence| s.sampled > 0 && !s.wants_more();
        for unit in &mut self.ready {
            if !unit.seqs.iter().any(done) {
                continue;
            }
            let mut keep = Vec::with_capacity(unit.seqs.len());
            let mut kept = Vec::with_capacity(unit.seqs.len());
            for (r, mut seq) in std::mem::take(&mut unit.seqs).into_iter().enumerate() {
                if !done(&seq) {
                    keep.push(r);
                    kept.push(seq);
                    continue;
                }
                let kv = match (keep_kv, seq.space) {
                    (true, Some(_)) => row_snapshot(&unit.layers, r, seq.prompt_len)?
                        .map(|kv| (seq.prompt().to_vec(), kv)),
                    _ => None,
                };
                if !seq.finished {
                    seq.finish(FinishReason::Length);
                }
                departed.push(Departed { seq, kv });
            }
            if !keep.is_empty() {
                for layer in &mut unit.layers {
                    layer.filter(&keep)?;
                }
            }
            unit.seqs = kept;
        }
        self.ready.retain(|u| !u.seqs.is_empty());
        self.settle(departed)
    }

    /// Releases the reservations of sequences that left the batch and keeps their KV.
    fn settle(&mut self, departed: Vec<Departed>) -> Result<(), Exception> {
        for Departed { mut seq, kv } in departed {
            if let Some(r) = seq.reservation.take() {
                self.caches.release(r);
            }
            if let (Some(space), Some((tokens, layers))) = (seq.space, kv) {
                let storing = Instant::now();
                let n = tokens.len();
                self.caches.store(space, tokens, layers)?;
                // Queued, not waited for, unless an SSD tier writes it (`CacheManager::store`).
                tracing::debug!(
                    target: "mlxd_engine::prefix",
                    tokens = n,
                    store_us = storing.elapsed().as_micros() as u64,
                    "prefix stored"
                );
            }
        }
        Ok(())
    }

    /// Runs the step's prefill passes ([`scheduler::plan_prefill`]): each is queued as soon as
    /// it is built (`async_eval`), so the device works through one while the host builds the
    /// next, and the step waits once, at the end. `behind_decode`: this iteration's decode
    /// step had rows, so its pass may still run ahead of these (the step is then not timed for
    /// the memory-pressure watch, see [`RuntimeStats::prefill_steps`]). Returns whether it ran
    /// any pass.
    fn prefill(&mut self, behind_decode: bool) -> Result<bool, Exception> {
        let views: Vec<PrefillView> = self
            .prefilling
            .iter()
            .map(|p| PrefillView {
                remaining: p.remaining(),
                written: p.written,
                last_unit: p.last_unit,
                rewind: p.rewind(),
            })
            .collect();
        let chunk = scheduler::chunk_budget(&self.limits, self.prefill_speed);
        let step = scheduler::step_budget(&self.limits, self.prefill_speed);
        let work = scheduler::plan_prefill(&self.limits, &views, chunk, step);
        if work.is_empty() {
            return Ok(false);
        }
        self.units += 1;
        let mut trace = PrefillTrace::start();
        let started = Instant::now();
        let mut slots: Vec<Option<Prefilling>> = std::mem::take(&mut self.prefilling)
            .into_iter()
            .map(Some)
            .collect();
        let mut tokens = 0;
        // Without padding: what the `crawl_prefill` fault counts.
        let mut prompt_tokens = 0;
        let mut queued = Vec::with_capacity(work.len());
        let result = (|| -> Result<(), Exception> {
            for w in &work {
                let pass_tokens = w.tokens(&views, self.limits.prefill_pad_to);
                tokens += pass_tokens;
                match w {
                    PrefillWork::Chunk { index, tokens: n } => {
                        let p = slots[*index].as_mut().expect("each index once a step");
                        p.last_unit = self.units;
                        let first = self.prefill_chunk(p, *n, &mut trace)?;
                        prompt_tokens += *n;
                        trace.pass(1, *n, *n);
                        queued.push((Queued::Slot(*index), first));
                    }
                    PrefillWork::Group { indices } => {
                        let rows: Vec<Prefilling> = indices
                            .iter()
                            .map(|&i| slots[i].take().expect("each index once a step"))
                            .collect();
                        let real: usize = rows.iter().map(Prefilling::remaining).sum();
                        let (unit, first) = self.prefill_group(rows, &mut trace)?;
                        prompt_tokens += real;
                        trace.pass(indices.len(), real, pass_tokens);
                        queued.push((Queued::Ready(self.ready.len()), first));
                        self.ready.push(unit);
                    }
                }
                trace.built();
            }
            // One wait for every pass of the step.
            let mut state = Vec::new();
            for (q, first) in &queued {
                state.extend(first.iter().flat_map(FirstTokens::arrays));
                match q {
                    Queued::Slot(i) => state.extend(
                        slots[*i]
                            .iter()
                            .flat_map(|p| p.layers.iter().flatten())
                            .flat_map(LayerCache::state),
                    ),
                    Queued::Ready(r) => {
                        state.extend(self.ready[*r].layers.iter().flat_map(LayerCache::state))
                    }
                }
            }
            mlx_rs::transforms::eval(state)?;
            for (q, first) in &queued {
                let Some(first) = first else { continue };
                match q {
                    Queued::Slot(i) => {
                        let p = slots[*i].as_mut().expect("a queued slot stays");
                        first.hand_out(std::slice::from_mut(&mut p.seq))?;
                    }
                    Queued::Ready(r) => first.hand_out(&mut self.ready[*r].seqs)?,
                }
            }
            Ok(())
        })();
        self.prefilling = slots.into_iter().flatten().collect();
        result?;
        crate::fault::on_prefill(prompt_tokens);
        trace.finish(tokens);
        let took = started.elapsed();
        let seconds = took.as_secs_f64();
        let warm = self.saw_before(&work, &views);
        if warm && scheduler::measures_speed(&self.limits, chunk, step, tokens, seconds) {
            self.prefill_speed = Some(tokens as f64 / seconds);
        }
        if warm && !behind_decode {
            self.stats.record_prefill_step(took, tokens);
        }
        self.promote_prefilled();
        self.depart_finished_ready()?;
        Ok(true)
    }

    /// Whether every pass of this step has a shape prefilled before (and remembers them).
    fn saw_before(&mut self, work: &[PrefillWork], views: &[PrefillView]) -> bool {
        let Some(seen) = self.prefill_shapes_seen.as_mut() else {
            return true;
        };
        if seen.len() >= SEEN_SHAPES_MAX {
            return true;
        }
        let mut warm = true;
        for w in work {
            let rows = match w {
                PrefillWork::Chunk { .. } => 1,
                PrefillWork::Group { indices } => indices.len(),
            };
            warm &= !seen.insert((rows, w.tokens(views, self.limits.prefill_pad_to)));
        }
        warm
    }

    /// The next `n` prompt tokens of one sequence into its own cache (queued, not waited for).
    /// A chunk that ends the prompt (only with [`SchedulerLimits::first_token_from_prefill`])
    /// samples its first token too (returned, still on the device); with recurrent layers its
    /// last token runs in a pass of its own, so that the state before it is kept as a snapshot
    /// (see [`Self::final_pieces`]).
    fn prefill_chunk(
        &mut self,
        p: &mut Prefilling,
        n: usize,
        trace: &mut PrefillTrace,
    ) -> Result<Option<FirstTokens>, Exception> {
        let layout = self.caches.layout();
        let ends = p.written + n == p.seq.prompt_len;
        let mut layers = p
            .layers
            .take()
            .unwrap_or_else(|| fresh_layers(&self.kinds, vec![0], layout.at(0)));
        let mut last_logits = None;
        for piece in self.final_pieces(n, ends) {
            let chunk = &p.seq.tokens[p.written..p.written + piece];
            let input = Array::from_slice(chunk, &[1, piece as i32]);
            let sample = ends && p.written + piece == p.seq.prompt_len;
            let (queued, logits) = {
                let _adapters = adapters::select(self.model, [p.seq.adapter])?;
                queue_prefill(self.model, &input, layers, sample, trace)?
            };
            layers = queued;
            last_logits = logits;
            let before = p.written;
            p.written += piece;
            quantize_past_start(&mut layers, layout, p.written)?;
            let written = p.written;
            let every = self.limits.state_snapshot_every.max(1);
            let boundary = written == p.seq.prompt_len - 1 || written / every > before / every;
            if let (true, true, Some(space)) = (self.stateful, boundary, p.seq.space) {
                let tokens = p.seq.tokens[..written].to_vec();
                self.snapshot_row(space, tokens, &layers, 0)?;
            }
        }
        p.layers = Some(layers);
        last_logits
            .map(|logits| {
                FirstTokens::sample(std::slice::from_mut(&mut p.seq), &logits, self.vocab())
            })
            .transpose()
    }

    /// How the `n` tokens of a pass run: in one pass, but where they end a prompt of a model
    /// with recurrent layers, the last token in a pass of its own. A recurrent state cannot be
    /// cut back, so a later request with this very prompt (a regenerated answer) can only
    /// continue from a snapshot of the state before the prompt's last token; the extra pass is
    /// what every prompt paid before first tokens came from the prefill.
    fn final_pieces(&self, n: usize, ends: bool) -> Vec<usize> {
        if self.stateful && ends && n > 1 {
            vec![n - 1, 1]
        } else {
            vec![n]
        }
    }

    fn vocab(&self) -> usize {
        self.info.vocab_size
    }

    /// The remainders of sequences (all but their last tokens; with
    /// [`SchedulerLimits::first_token_from_prefill`], all of them, the pass then sampling their
    /// first tokens, returned on the device) in one forward pass of the group's padded length
    /// (queued, not waited for); they then join the batch together. Fresh sequences are padded
    /// on the left; sequences that continue a cache each re-feed the cached tokens just before
    /// their remainder to reach that length, their caches cut back to match and joined into
    /// one (see [`PrefillWork::Group`]). With recurrent layers the last column runs in a pass
    /// of its own ([`Self::final_pieces`]).
    fn prefill_group(
        &mut self,
        mut rows: Vec<Prefilling>,
        trace: &mut PrefillTrace,
    ) -> Result<(Prefilled, Option<FirstTokens>), Exception> {
        let lens: Vec<usize> = rows.iter().map(Prefilling::remaining).collect();
        let longest = scheduler::padded_length(
            lens.iter().copied().max().unwrap_or(0),
            self.limits.prefill_pad_to,
        );
        let continued = rows.iter().any(|p| p.layers.is_some());
        let mut tokens = Vec::with_capacity(rows.len() * longest);
        let mut padding = Vec::with_capacity(rows.len());
        let mut parts = Vec::with_capacity(rows.len());
        for (p, &len) in rows.iter_mut().zip(&lens) {
            if continued {
                // The scheduler grouped it within what it can re-feed.
                let from = (p.written + len).checked_sub(longest).ok_or_else(|| {
                    Exception::custom("a continued prompt grouped past what it holds")
                })?;
                let mut layers = p.layers.take().ok_or_else(|| {
                    Exception::custom("a fresh prompt grouped with continued ones")
                })?;
                for layer in &mut layers {
                    layer.rewind(from)?;
                }
                parts.push(layers);
                tokens.extend_from_slice(&p.seq.tokens[from..from + longest]);
            } else {
                let pad = longest - len;
                tokens.extend(std::iter::repeat_n(0u32, pad));
                tokens.extend_from_slice(&p.seq.tokens[..len]);
                padding.push(pad as i32);
            }
        }
        let input = Array::from_slice(&tokens, &[rows.len() as i32, longest as i32]);
        let layout = self.caches.layout();
        let mut layers = if continued {
            LayerCache::join_sequences(parts)?
        } else {
            fresh_layers(&self.kinds, padding, layout.at(0))
        };
        let samples = self.limits.first_token_from_prefill;
        let mut logits = None;
        let mut done = 0;
        for piece in self.final_pieces(longest, samples) {
            let columns = if piece == longest {
                input.clone()
            } else {
                input.index((.., done as i32..(done + piece) as i32))
            };
            done += piece;
            let sample = samples && done == longest;
            let (queued, l) = {
                let _adapters = adapters::select(self.model, rows.iter().map(|p| p.seq.adapter))?;
                queue_prefill(self.model, &columns, layers, sample, trace)?
            };
            layers = queued;
            logits = l;
            if self.stateful && !sample {
                // Every row holds its prompt but the last token: the snapshot a repeat needs.
                for (row, p) in rows.iter().enumerate() {
                    if let Some(space) = p.seq.space {
                        let tokens = p.seq.tokens[..p.seq.prompt_len - 1].to_vec();
                        self.snapshot_row(space, tokens, &layers, row)?;
                    }
                }
            }
        }
        // Every row now holds its whole prompt, or all of it but the last token.
        let held = rows
            .iter()
            .map(|p| p.seq.prompt_len - usize::from(!samples))
            .max();
        quantize_past_start(&mut layers, layout, held.unwrap_or(0).max(longest))?;
        let mut seqs: Vec<Sequence> = rows.into_iter().map(|p| p.seq).collect();
        let first = logits
            .map(|logits| FirstTokens::sample(&mut seqs, &logits, self.vocab()))
            .transpose()?;
        Ok((Prefilled { seqs, layers }, first))
    }

    /// Keeps row `row` of a prompt's caches in the prefix cache as the cache of `tokens`: a
    /// recurrent state cannot be cut to a shorter prefix later, so a model with recurrent
    /// layers leaves snapshots at the end of each prompt and every `state_snapshot_every`
    /// tokens of a long one (see [`SeqKv`]).
    fn snapshot_row(
        &mut self,
        space: KvSpace,
        tokens: Vec<u32>,
        layers: &[LayerCache],
        row: usize,
    ) -> Result<(), Exception> {
        if !self.caches.prefix_enabled() || tokens.is_empty() {
            return Ok(());
        }
        if let Some(kv) = row_snapshot(layers, row, tokens.len())? {
            self.caches.store(space, tokens, kv)?;
        }
        Ok(())
    }

    /// Fails every request this thread holds and drops the prefix cache. An error that ends
    /// the engine (out of memory, a lost GPU) goes to the fatal hook first: under a supervisor
    /// the process reports it and exits right there, its requests unanswered, and the
    /// supervisor resumes them on the restarted engine. Answering them here would hand every
    /// client an error instead (an H100 driven out of memory on 2026-12-05: 64 streams failed
    /// with 503 where they should have resumed).
    fn fail_all(&mut self, error: GenerationError) {
        tracing::error!(%error, "generation step failed");
        if let Some(kind) = error.ends_engine() {
            if let Some(hook) = self.on_fatal.take() {
                hook(kind, error.to_string());
            }
        }
        for mut seq in self.batch.drain() {
            seq.fail(error.clone());
        }
        for p in std::mem::take(&mut self.prefilling) {
            let mut seq = p.seq;
            seq.fail(error.clone());
        }
        for unit in std::mem::take(&mut self.ready) {
            for mut seq in unit.seqs {
                seq.fail(error.clone());
            }
        }
        let (plain, stored) = self.caches.bytes_per_token();
        let ssd = self.caches.take_ssd();
        self.caches = CacheManager::new(
            self.caches.budget().limit(),
            self.caches.prefix_budget(),
            plain,
            stored,
            self.caches.layout(),
        )
        .with_layers(self.kinds.clone(), self.info.state_bytes_per_sequence)
        .with_ssd(ssd);
        if error.ends_engine().is_some() {
            for r in self.waiting.drain(..) {
                let _ = r.events.send(TokenEvent::Failed(error.clone()));
            }
        }
        let _ = mlx_rs::memory::clear_cache();
    }

    fn publish(&self) {
        let ready: usize = self.ready.iter().map(|r| r.seqs.len()).sum();
        let active = self.batch.len() + self.prefilling.len() + ready;
        self.stats.active.store(active as u64, Ordering::Relaxed);
        self.stats
            .queued
            .store(self.waiting.len() as u64, Ordering::Relaxed);
        self.stats
            .prefilling
            .store(self.prefilling.len() as u64, Ordering::Relaxed);
        let left: usize = self.prefilling.iter().map(Prefilling::remaining).sum();
        self.stats
            .prefill_tokens_left
            .store(left as u64, Ordering::Relaxed);
        let prefill_bytes: usize = self
            .prefilling
            .iter()
            .flat_map(|p| p.layers.iter().flatten())
            .map(LayerCache::nbytes)
            .sum();
        // A prompt still prefilling holds the positions written so far: they grow with each
        // step, which is how the memory-pressure watch sees an engine whose prompts crawl
        // press on the device.
        let held = self.batch.held_tokens()
            + self.prefilling.iter().map(|p| p.written).sum::<usize>()
            + self
                .ready
                .iter()
                .flat_map(|r| &r.seqs)
                .map(|s| s.tokens.len())
                .sum::<usize>();
        self.stats
            .running_tokens
            .store(held as u64, Ordering::Relaxed);
        let kv = self.batch.kv_bytes() + prefill_bytes + self.caches.prefix_bytes() as usize;
        self.stats.kv_bytes.store(kv as u64, Ordering::Relaxed);
        *self.stats.prefix.lock().unwrap_or_else(|p| p.into_inner()) = self.caches.prefix_stats();
        let drafts = self.batch.draft_counts;
        self.stats.drafted.store(drafts.drafted, Ordering::Relaxed);
        self.stats
            .accepted
            .store(drafts.accepted, Ordering::Relaxed);
    }
}

/// Empty caches, one per layer (an attention layer's bounded by its window), for rows with
/// `padding`.
fn fresh_layers(kinds: &[LayerKind], padding: Vec<i32>, quant: Option<KvQuant>) -> Vec<LayerCache> {
    kinds
        .iter()
        .map(|&kind| kind.fresh(padding.clone(), quant))
        .collect()
}

/// Converts prefill caches whose rows hold more than the layout's start to quantized storage
/// (keys and values; a recurrent state stays as it is).
fn quantize_past_start(
    layers: &mut [LayerCache],
    layout: KvLayout,
    written: usize,
) -> Result<(), Exception> {
    if let Some(q) = layout.at(written) {
        for layer in layers.iter_mut().filter_map(LayerCache::as_batched_mut) {
            layer.quantize(q)?;
        }
    }
    Ok(())
}

/// A copy of row `row` of `layers` as the cache of `tokens`, when every layer holds exactly
/// them (a padded group's rows hold their own prompt lengths).
fn row_snapshot(
    layers: &[LayerCache],
    row: usize,
    tokens: usize,
) -> Result<Option<SeqKv>, Exception> {
    let mut copies = Vec::with_capacity(layers.len());
    let mut starts = Vec::with_capacity(layers.len());
    for layer in layers {
        if layer.row_len(row) != tokens {
            return Ok(None);
        }
        match layer.row_copy(row)? {
            Some((copy, start)) => {
                copies.push(copy);
                starts.push(start);
            }
            None => return Ok(None),
        }
    }
    Ok(Some(SeqKv::new(copies, starts)))
}

/// Runs `input` `[B, L]` into `layers` and queues the caches' evaluation (`async_eval`);
/// windowed layers drop what their windows no longer reach, so that a prompt waiting to join
/// the batch holds a bounded cache. With `sample`, also returns the logits of the last
/// position `[B, vocab]` (lazy: the head runs on that position only), from which the pass's
/// first tokens are sampled. `trace` times the graph and the queueing apart.
fn queue_prefill(
    model: &dyn CausalLm,
    input: &Array,
    mut caches: Vec<LayerCache>,
    sample: bool,
    trace: &mut PrefillTrace,
) -> Result<(Vec<LayerCache>, Option<Array>), Exception> {
    let logits = trace.graph(|| -> Result<Option<Array>, Exception> {
        let logits = if sample {
            let last = model.forward_last(input, &mut caches)?;
            Some(last.index((.., -1, ..)))
        } else {
            let _ = model.hidden(input, &mut caches)?;
            None
        };
        for cache in &mut caches {
            cache.evict_outside_window()?;
        }
        Ok(logits)
    })?;
    trace.queue(|| mlx_rs::transforms::async_eval(caches.iter().flat_map(LayerCache::state)))?;
    Ok((caches, logits))
}
