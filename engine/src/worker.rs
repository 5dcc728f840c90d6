//! The thread that owns MLX: it loads the model, then serves [`GenerateRequest`]s.
//!
//! Every active sequence advances one step (a prefill chunk or one token) per round, in turn,
//! so a long prompt does not stall the streams of others. A sequence whose event receiver was
//! dropped (client gone, stop string matched) is freed at its next turn. Requests beyond the
//! batch size or the KV budget wait in arrival order. MLX arrays never leave this thread.
use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::thread;

use tokio::sync::mpsc;

use crate::generate::{Decoder, HostSampler, StepError};
use crate::loader::LoadError;
use crate::models::{self, CausalLm, ModelInfo};
use crate::sampler::Sampler;
use crate::work::{FinishReason, GenerateRequest, TokenEvent, WorkSender};

/// Limits the supervisor may impose (smaller after an out-of-memory restart).
#[derive(Debug, Clone, Default)]
pub struct WorkerLimits {
    /// Sequences generating at once; more wait in line. `None`: no limit.
    pub max_batch_size: Option<usize>,
    /// KV cache bytes that admitted sequences may reserve (prompt + max_tokens each).
    pub kv_budget_bytes: Option<u64>,
    /// Caps the model's context length.
    pub context_length: Option<usize>,
}

/// Counters the worker publishes for `Stats` messages and `/health`.
#[derive(Debug, Default)]
pub struct WorkerStats {
    pub active: AtomicU64,
    pub queued: AtomicU64,
    pub kv_bytes: AtomicU64,
}

/// Called once, on the MLX thread, when MLX runs out of memory: the process cannot trust its
/// allocator any more and should report and exit (the supervisor restarts it smaller).
pub type OomHook = Box<dyn FnOnce(String) + Send>;

/// A running model thread.
pub struct Worker {
    pub work: WorkSender,
    pub info: ModelInfo,
    pub stats: Arc<WorkerStats>,
    thread: thread::JoinHandle<()>,
}

impl Worker {
    /// Loads the model in `dir` on a new thread; returns once it is ready to serve.
    pub fn start(
        dir: PathBuf,
        limits: WorkerLimits,
        on_oom: Option<OomHook>,
    ) -> Result<Worker, LoadError> {
        let (ready_tx, ready_rx) = std_mpsc::channel();
        let (work, rx) = mpsc::unbounded_channel();
        let stats = Arc::new(WorkerStats::default());
        let thread_stats = stats.clone();
        let thread = thread::Builder::new()
            .name("mlx".into())
            .spawn(move || match models::load(&dir) {
                Ok(model) => {
                    let mut info = model.info().clone();
                    if let Some(cap) = limits.context_length {
                        info.context_length = info.context_length.min(cap);
                    }
                    let _ = ready_tx.send(Ok(info.clone()));
                    let mut scheduler = Scheduler {
                        model: model.as_ref(),
                        info,
                        limits,
                        stats: thread_stats,
                        on_oom,
                    };
                    scheduler.run(rx);
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            })
            .map_err(|e| LoadError::Io {
                path: "<mlx thread>".into(),
                source: e,
            })?;
        match ready_rx.recv() {
            Ok(Ok(info)) => Ok(Worker {
                work,
                info,
                stats,
                thread,
            }),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(LoadError::Config(
                "the MLX thread died while loading the model".into(),
            )),
        }
    }

    /// Stops accepting work and waits for the thread to finish what it holds.
    pub fn join(self) {
        drop(self.work);
        let _ = self.thread.join();
    }
}

/// True for MLX's allocation-failure messages (CPU malloc, Metal and CUDA allocators).
pub fn is_out_of_memory(message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    m.contains("unable to allocate")
        || m.contains("out of memory")
        || m.contains("outofmemory")
        || m.contains("bad_alloc")
        || m.contains("insufficient memory")
}

impl HostSampler for Sampler {
    fn sample(
        &mut self,
        logprobs: &mut [f32],
        tokens: &[u32],
        prompt_len: usize,
    ) -> Result<u32, String> {
        Sampler::sample(self, logprobs, tokens, prompt_len).map_err(|e| e.to_string())
    }
}

struct Active {
    decoder: Decoder<Sampler>,
    max_tokens: usize,
    stop_ids: Vec<u32>,
    events: mpsc::UnboundedSender<TokenEvent>,
    prompt_reported: bool,
    /// KV bytes reserved against the budget: (prompt + max_tokens) × bytes per token.
    reserved: u64,
}

enum Outcome {
    Continue,
    Done,
    OutOfMemory(String),
}

impl Active {
    fn advance(&mut self, model: &dyn CausalLm, context: usize) -> Outcome {
        match self.try_advance(model, context) {
            Ok(true) => Outcome::Continue,
            Ok(false) => Outcome::Done,
            Err(e) => {
                let message = format!("generation failed: {e}");
                let _ = self.events.send(TokenEvent::Failed(message.clone()));
                if is_out_of_memory(&message) {
                    Outcome::OutOfMemory(message)
                } else {
                    Outcome::Done
                }
            }
        }
    }

    fn try_advance(&mut self, model: &dyn CausalLm, context: usize) -> Result<bool, StepError> {
        let seq = &self.decoder.seq;
        // Another token will be wanted after this one unless this one reaches a limit.
        let lookahead =
            seq.generated().len() + 1 < self.max_tokens && seq.tokens().len() + 1 < context;
        let Some(token) = self.decoder.advance(model, lookahead)? else {
            return Ok(true);
        };
        if !self.prompt_reported {
            self.prompt_reported = true;
            let prompt_tokens = self.decoder.seq.prompt_len();
            let _ = self.events.send(TokenEvent::PromptDone {
                prompt_tokens,
                cached: 0,
            });
        }
        if self.stop_ids.contains(&token) {
            let _ = self.events.send(TokenEvent::Finished(FinishReason::Stop));
            return Ok(false);
        }
        if self.events.send(TokenEvent::Token(token)).is_err() {
            return Ok(false);
        }
        if !lookahead {
            let _ = self.events.send(TokenEvent::Finished(FinishReason::Length));
            return Ok(false);
        }
        Ok(true)
    }
}

struct Scheduler<'m> {
    model: &'m dyn CausalLm,
    info: ModelInfo,
    limits: WorkerLimits,
    stats: Arc<WorkerStats>,
    on_oom: Option<OomHook>,
}

impl Scheduler<'_> {
    fn reservation(&self, req: &GenerateRequest) -> u64 {
        let tokens = (req.prompt.len() + req.max_tokens).min(self.info.context_length);
        tokens as u64 * self.info.kv_bytes_per_token as u64
    }

    /// Turns a request into an active sequence, or answers it with `Failed` at once.
    fn admit(&self, req: GenerateRequest) -> Option<Active> {
        let reserved = self.reservation(&req);
        if let Some(budget) = self.limits.kv_budget_bytes {
            if reserved > budget {
                let _ = req.events.send(TokenEvent::Failed(format!(
                    "the request needs {reserved} bytes of KV cache (prompt {} + max_tokens {} tokens), \
                     more than the engine's KV budget of {budget} bytes",
                    req.prompt.len(),
                    req.max_tokens
                )));
                return None;
            }
        }
        let sampler = if req.sampling.is_plain_greedy() {
            None
        } else {
            match Sampler::new(&req.sampling) {
                Ok(s) => Some(s),
                Err(e) => {
                    let _ = req.events.send(TokenEvent::Failed(format!(
                        "invalid sampling parameters: {e}"
                    )));
                    return None;
                }
            }
        };
        Some(Active {
            decoder: Decoder::new(self.model, req.prompt, sampler),
            max_tokens: req.max_tokens,
            stop_ids: req.stop_token_ids,
            events: req.events,
            prompt_reported: false,
            reserved,
        })
    }

    fn has_room(&self, active: &[Active], next: &GenerateRequest) -> bool {
        if self
            .limits
            .max_batch_size
            .is_some_and(|max| active.len() >= max)
        {
            return false;
        }
        match self.limits.kv_budget_bytes {
            // A request larger than the whole budget is admitted alone, to be refused by admit.
            Some(budget) => {
                let used: u64 = active.iter().map(|a| a.reserved).sum();
                active.is_empty() || used + self.reservation(next) <= budget
            }
            None => true,
        }
    }

    fn run(&mut self, mut rx: mpsc::UnboundedReceiver<GenerateRequest>) {
        let mut active: Vec<Active> = Vec::new();
        let mut waiting: VecDeque<GenerateRequest> = VecDeque::new();
        let mut open = true;
        loop {
            if active.is_empty() && waiting.is_empty() {
                if !open {
                    return;
                }
                match rx.blocking_recv() {
                    Some(req) => waiting.push_back(req),
                    None => return,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(req) => waiting.push_back(req),
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            }
            waiting.retain(|r| !r.events.is_closed());
            while let Some(next) = waiting.front() {
                if !self.has_room(&active, next) {
                    break;
                }
                let req = waiting.pop_front().expect("front exists");
                active.extend(self.admit(req));
            }
            let context = self.info.context_length;
            let mut oom = None;
            active.retain_mut(|a| {
                if a.events.is_closed() {
                    return false;
                }
                match a.advance(self.model, context) {
                    Outcome::Continue => true,
                    Outcome::Done => false,
                    Outcome::OutOfMemory(message) => {
                        oom = Some(message);
                        false
                    }
                }
            });
            self.publish(&active, &waiting);
            if let Some(message) = oom {
                for a in active.drain(..) {
                    let _ = a.events.send(TokenEvent::Failed(format!(
                        "the engine ran out of memory: {message}"
                    )));
                }
                for r in waiting.drain(..) {
                    let _ = r.events.send(TokenEvent::Failed(format!(
                        "the engine ran out of memory: {message}"
                    )));
                }
                if let Some(hook) = self.on_oom.take() {
                    hook(message);
                }
                let _ = mlx_rs::memory::clear_cache();
            }
        }
    }

    fn publish(&self, active: &[Active], waiting: &VecDeque<GenerateRequest>) {
        self.stats
            .active
            .store(active.len() as u64, Ordering::Relaxed);
        self.stats
            .queued
            .store(waiting.len() as u64, Ordering::Relaxed);
        let kv: usize = active.iter().map(|a| a.decoder.seq.kv_bytes()).sum();
        self.stats.kv_bytes.store(kv as u64, Ordering::Relaxed);
    }
}
