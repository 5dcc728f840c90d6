//! The thread that owns MLX: it loads the model, then serves [`GenerateRequest`]s.
//!
//! Every active sequence advances one step (a prefill chunk or one token) per round, in turn,
//! so a long prompt does not stall the streams of others. A sequence whose event receiver was
//! dropped (client gone, stop string matched) is freed at its next turn. MLX arrays never leave
//! this thread.
use std::path::PathBuf;
use std::sync::mpsc as std_mpsc;
use std::thread;

use tokio::sync::mpsc;

use crate::generate::{Decoder, HostSampler, StepError};
use crate::loader::LoadError;
use crate::models::{self, CausalLm, ModelInfo};
use crate::sampler::Sampler;
use crate::work::{FinishReason, GenerateRequest, TokenEvent, WorkSender};

/// A running model thread.
pub struct Worker {
    pub work: WorkSender,
    pub info: ModelInfo,
    thread: thread::JoinHandle<()>,
}

impl Worker {
    /// Loads the model in `dir` on a new thread; returns once it is ready to serve.
    pub fn start(dir: PathBuf) -> Result<Worker, LoadError> {
        let (ready_tx, ready_rx) = std_mpsc::channel();
        let (work, rx) = mpsc::unbounded_channel();
        let thread = thread::Builder::new()
            .name("mlx".into())
            .spawn(move || match models::load(&dir) {
                Ok(model) => {
                    let _ = ready_tx.send(Ok(model.info().clone()));
                    serve(model.as_ref(), rx);
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            })
            .map_err(|e| LoadError::Io { path: "<mlx thread>".into(), source: e })?;
        match ready_rx.recv() {
            Ok(Ok(info)) => Ok(Worker { work, info, thread }),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(LoadError::Config("the MLX thread died while loading the model".into())),
        }
    }

    /// Stops accepting work and waits for the thread to finish what it holds.
    pub fn join(self) {
        drop(self.work);
        let _ = self.thread.join();
    }
}

struct Active {
    decoder: Decoder<Sampler>,
    max_tokens: usize,
    stop_ids: Vec<u32>,
    events: mpsc::UnboundedSender<TokenEvent>,
    prompt_reported: bool,
}

impl HostSampler for Sampler {
    fn sample(&mut self, logprobs: &mut [f32], tokens: &[u32], prompt_len: usize) -> Result<u32, String> {
        Sampler::sample(self, logprobs, tokens, prompt_len).map_err(|e| e.to_string())
    }
}

impl Active {
    /// Admits a request; an invalid one is answered with `Failed` at once.
    fn new(model: &dyn CausalLm, req: GenerateRequest) -> Option<Self> {
        let sampler = if req.sampling.is_plain_greedy() {
            None
        } else {
            match Sampler::new(&req.sampling) {
                Ok(s) => Some(s),
                Err(e) => {
                    let _ = req.events.send(TokenEvent::Failed(format!("invalid sampling parameters: {e}")));
                    return None;
                }
            }
        };
        Some(Active {
            decoder: Decoder::new(model, req.prompt, sampler),
            max_tokens: req.max_tokens,
            stop_ids: req.stop_token_ids,
            events: req.events,
            prompt_reported: false,
        })
    }

    /// Runs one step. Returns false when the sequence is finished and must be dropped.
    fn advance(&mut self, model: &dyn CausalLm) -> bool {
        match self.try_advance(model) {
            Ok(keep) => keep,
            Err(e) => {
                let _ = self.events.send(TokenEvent::Failed(format!("generation failed: {e}")));
                false
            }
        }
    }

    fn try_advance(&mut self, model: &dyn CausalLm) -> Result<bool, StepError> {
        let seq = &self.decoder.seq;
        let context = model.info().context_length;
        // Another token will be wanted after this one unless this one reaches a limit.
        let lookahead = seq.generated().len() + 1 < self.max_tokens && seq.tokens().len() + 1 < context;
        let Some(token) = self.decoder.advance(model, lookahead)? else {
            return Ok(true);
        };
        if !self.prompt_reported {
            self.prompt_reported = true;
            let prompt_tokens = self.decoder.seq.prompt_len();
            let _ = self.events.send(TokenEvent::PromptDone { prompt_tokens, cached: 0 });
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

fn serve(model: &dyn CausalLm, mut rx: mpsc::UnboundedReceiver<GenerateRequest>) {
    let mut active: Vec<Active> = Vec::new();
    loop {
        if active.is_empty() {
            match rx.blocking_recv() {
                Some(req) => active.extend(Active::new(model, req)),
                None => return,
            }
        }
        while let Ok(req) = rx.try_recv() {
            active.extend(Active::new(model, req));
        }
        active.retain_mut(|a| !a.events.is_closed() && a.advance(model));
    }
}
