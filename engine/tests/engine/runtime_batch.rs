//! The batched runtime on real MLX arrays with tiny random-weight models: a request gives the
//! same tokens alone and in a batch, seeded sampling is reproducible across batches, the prefix
//! cache changes nothing but the work done, and limits are honoured.
use crate::common;

use common::{generate_alone, generate_together, start_runtime, submit, Gen, Output};
use mlxd_engine::runtime::request::{FinishReason, GenerateRequest, GenerationError, TokenEvent};
use mlxd_engine::runtime::sampling_params::SamplingParams;
use mlxd_engine::runtime::{Runtime, RuntimeLimits};

/// Prompts of different lengths, so the batch is left-padded and rows join at different steps.
fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![5, 17, 42, 99, 7, 8, 9, 100, 101, 200],
        vec![1],
        vec![300, 2, 250, 250, 250, 13, 14],
        (0..40).map(|i| (i * 7 + 3) % 390).collect(),
        vec![11, 12],
        (0..23).map(|i| (i * 13 + 1) % 390).collect(),
    ]
}

fn tokens(outputs: &[Output]) -> Vec<Vec<u32>> {
    outputs.iter().map(|o| o.tokens.clone()).collect()
}

fn batch_equals_alone(shape: &str) {
    let dir = common::tiny_model(shape);
    assert_batched_equals_alone(start_runtime(&dir, 0), shape);
}

/// [`prompts`] give `runtime` the same greedy tokens batched as alone, each row its own
/// `max_tokens` (so rows also leave at different steps); `what` names the case.
fn assert_batched_equals_alone(runtime: Runtime, what: &str) {
    let gens: Vec<Gen> = prompts()
        .iter()
        .enumerate()
        .map(|(i, p)| Gen::greedy(p, 12 + 3 * i))
        .collect();
    let alone = tokens(&generate_alone(&runtime, &gens));
    let together = tokens(&generate_together(&runtime, &gens));
    assert_eq!(together, alone, "{what}: batched greedy tokens differ");
    for (g, t) in gens.iter().zip(&together) {
        assert_eq!(t.len(), g.max_tokens);
    }
    runtime.join();
}

#[test]
fn greedy_in_a_batch_equals_greedy_alone_f32() {
    batch_equals_alone("tiny-llama");
}

#[test]
fn greedy_in_a_batch_equals_greedy_alone_qwen3_bf16() {
    batch_equals_alone("tiny-qwen3-bf16");
}

#[test]
fn greedy_in_a_batch_equals_greedy_alone_4bit() {
    batch_equals_alone("tiny-llama-q4");
}

fn sampled(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        top_k: 40,
        seed: Some(seed),
        ..Default::default()
    }
}

#[test]
fn seeded_sampling_is_the_same_alone_and_in_any_batch() {
    let dir = common::tiny_model("tiny-llama");
    let runtime = start_runtime(&dir, 0);
    let p = prompts();
    let target = Gen {
        prompt: p[0].clone(),
        sampling: sampled(42),
        max_tokens: 20,
        logprobs: None,
    };
    let alone = generate_alone(&runtime, std::slice::from_ref(&target));
    let mut mixed: Vec<Gen> = p
        .iter()
        .skip(1)
        .enumerate()
        .map(|(i, prompt)| Gen {
            prompt: prompt.clone(),
            sampling: sampled(i as u64),
            max_tokens: 10,
            logprobs: None,
        })
        .collect();
    mixed.insert(2, target.clone());
    let together = generate_together(&runtime, &mixed);
    assert_eq!(together[2].tokens, alone[0].tokens);
    // A different seed draws differently (20 tokens from a 512-token vocabulary).
    let other = generate_alone(
        &runtime,
        &[Gen {
            sampling: sampled(43),
            ..target
        }],
    );
    assert_ne!(other[0].tokens, alone[0].tokens);
    runtime.join();
}

#[test]
fn every_sampling_option_runs_in_one_batch_without_changing_greedy_rows() {
    let dir = common::tiny_model("tiny-llama");
    let runtime = start_runtime(&dir, 0);
    let p = prompts();
    let greedy = Gen::greedy(&p[0], 16);
    let mut bias = SamplingParams::default();
    bias.logit_bias.insert(77, 100.0);
    let options = [
        sampled(1),
        SamplingParams {
            temperature: 0.7,
            min_p: 0.2,
            seed: Some(2),
            ..Default::default()
        },
        SamplingParams {
            repetition_penalty: 1.5,
            presence_penalty: 0.5,
            frequency_penalty: 0.5,
            ..Default::default()
        },
        bias,
    ];
    let mut gens = vec![greedy];
    gens.extend(options.iter().map(|s| Gen {
        prompt: p[3].clone(),
        sampling: s.clone(),
        max_tokens: 16,
        logprobs: None,
    }));
    let alone = generate_alone(&runtime, &gens[..1]);
    let together = generate_together(&runtime, &gens);
    assert_eq!(together[0].tokens, alone[0].tokens);
    assert!(together.iter().all(|o| o.tokens.len() == 16));
    // A +100 bias wins every step.
    assert!(together[4].tokens.iter().all(|&t| t == 77));
    // Penalties on every seen token: no token repeats in 16 greedy steps with a 512 vocabulary.
    let mut seen = together[3].tokens.clone();
    seen.sort();
    seen.dedup();
    assert!(
        seen.len() > 8,
        "penalties did not spread the choice: {:?}",
        together[3].tokens
    );
    runtime.join();
}

#[test]
fn logprobs_change_no_token_and_report_the_models_distribution() {
    let dir = common::tiny_model("tiny-llama");
    let runtime = start_runtime(&dir, 0);
    let p = prompts();
    let plain = vec![
        Gen::greedy(&p[0], 10),
        Gen::greedy(&p[1], 10),
        Gen {
            prompt: p[2].clone(),
            sampling: sampled(4),
            max_tokens: 10,
            logprobs: None,
        },
    ];
    let mut asking = plain.clone();
    asking[0].logprobs = Some(5);
    asking[2].logprobs = Some(0);
    let reference = generate_together(&runtime, &plain);
    let out = generate_together(&runtime, &asking);
    assert_eq!(tokens(&out), tokens(&reference));
    assert!(
        out[1].logprobs.is_empty(),
        "a row that did not ask got logprobs"
    );
    assert_eq!(out[0].logprobs.len(), 10);
    for (lp, &token) in out[0].logprobs.iter().zip(&out[0].tokens) {
        // Greedy without bias or penalties: the chosen token is the likeliest.
        assert_eq!(lp.top.len(), 5);
        assert_eq!(lp.top[0].0, token);
        assert!((lp.top[0].1 - lp.logprob).abs() < 1e-6);
        assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1), "{lp:?}");
        let mass: f32 = lp.top.iter().map(|t| t.1.exp()).sum();
        assert!(lp.logprob <= 0.0 && mass <= 1.0 + 1e-4, "{lp:?}");
    }
    assert_eq!(out[2].logprobs.len(), 10);
    assert!(out[2]
        .logprobs
        .iter()
        .all(|lp| lp.top.is_empty() && lp.logprob <= 0.0 && lp.logprob.is_finite()));
    runtime.join();
}

#[test]
fn a_prefix_cache_hit_gives_the_same_tokens() {
    let dir = common::tiny_model("tiny-llama");
    let cold = start_runtime(&dir, 0);
    let warm = start_runtime(&dir, 64 << 20);
    let turn1: Vec<u32> = (0..60).map(|i| (i * 11 + 5) % 390).collect();
    let first = generate_alone(&warm, &[Gen::greedy(&turn1, 8)]);
    assert_eq!(first[0].cached, 0);
    // The second turn repeats the first and its answer, then adds more.
    let mut turn2 = turn1.clone();
    turn2.extend(&first[0].tokens);
    turn2.extend([9, 8, 7, 6]);
    let hit = generate_alone(&warm, &[Gen::greedy(&turn2, 12)]);
    let miss = generate_alone(&cold, &[Gen::greedy(&turn2, 12)]);
    assert!(
        hit[0].cached >= turn1.len(),
        "cached {} of a {}-token shared prefix",
        hit[0].cached,
        turn1.len()
    );
    assert_eq!(miss[0].cached, 0);
    assert_eq!(hit[0].tokens, miss[0].tokens);
    // The same prompt again hits for all but its last token.
    let again = generate_alone(&warm, &[Gen::greedy(&turn2, 12)]);
    assert_eq!(again[0].cached, turn2.len() - 1);
    assert_eq!(again[0].tokens, miss[0].tokens);
    cold.join();
    warm.join();
}

#[test]
fn a_long_prompt_is_prefilled_in_chunks_beside_running_streams() {
    let dir = common::tiny_model("tiny-llama");
    // Chunks of 16 tokens: the 150-token prompt takes ten steps while the others decode.
    let runtime = Runtime::start(
        dir.clone(),
        RuntimeLimits {
            prefill_chunk: 16,
            prompt_cache_bytes: 0,
            ..Default::default()
        },
        None,
    )
    .expect("load");
    let long: Vec<u32> = (0..150).map(|i| (i * 31 + 7) % 390).collect();
    let gens = vec![
        Gen::greedy(&prompts()[0], 30),
        Gen::greedy(&long, 6),
        Gen::greedy(&prompts()[2], 30),
    ];
    let alone = tokens(&generate_alone(&runtime, &gens));
    let together = tokens(&generate_together(&runtime, &gens));
    assert_eq!(together, alone);
    let reference = common::mlx_lm_greedy(&dir, 6, &long);
    assert_eq!(
        alone[1], reference,
        "a prompt of many chunks differs from mlx-lm"
    );
    runtime.join();
}

fn start_limited(limits: RuntimeLimits) -> Runtime {
    Runtime::start(common::tiny_model("tiny-llama"), limits, None).expect("load")
}

#[test]
fn a_request_larger_than_the_kv_budget_is_refused_and_others_still_run() {
    let probe = start_limited(RuntimeLimits::default());
    let per_token = probe.info.kv_bytes_per_token as u64;
    probe.join();
    let runtime = start_limited(RuntimeLimits {
        kv_budget_bytes: Some(per_token * 64),
        ..Default::default()
    });
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    runtime
        .work
        .send(GenerateRequest {
            prompt: vec![1, 2, 3],
            sampling: Default::default(),
            max_tokens: 100,
            stop_token_ids: vec![],
            sample_offset: 0,
            events: tx,
            constraint: None,
            logprobs: None,
            adapter: None,
        })
        .unwrap();
    match rx.blocking_recv() {
        Some(TokenEvent::Failed(GenerationError::KvBudget {
            needed,
            budget,
            prompt_tokens: 3,
            max_tokens: 100,
        })) => {
            assert_eq!(needed, 103 * per_token);
            assert_eq!(budget, 64 * per_token);
        }
        other => panic!("expected a KV budget refusal, got {other:?}"),
    }
    // Four requests of 3 + 20 tokens: only two fit at once; all complete.
    let gens: Vec<Gen> = (0..4).map(|i| Gen::greedy(&[1, 2, i + 3], 20)).collect();
    let out = generate_together(&runtime, &gens);
    assert!(out.iter().all(|o| o.tokens.len() == 20));
    runtime.join();
}

#[test]
fn max_batch_size_bounds_the_batch_and_everyone_finishes() {
    let runtime = start_limited(RuntimeLimits {
        max_batch_size: Some(2),
        ..Default::default()
    });
    let gens: Vec<Gen> = prompts().iter().map(|p| Gen::greedy(p, 10)).collect();
    let alone = tokens(&generate_alone(&runtime, &gens));
    let together = generate_together(&runtime, &gens);
    assert_eq!(tokens(&together), alone);
    assert!(together
        .iter()
        .all(|o| o.finish == Some(FinishReason::Length)));
    runtime.join();
}

#[test]
fn stop_tokens_and_cancellation_free_the_row() {
    let runtime = start_limited(RuntimeLimits::default());
    let base = generate_alone(&runtime, &[Gen::greedy(&prompts()[0], 10)]);
    let stop = base[0].tokens[3];
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    runtime
        .work
        .send(GenerateRequest {
            prompt: prompts()[0].clone(),
            sampling: Default::default(),
            max_tokens: 10,
            stop_token_ids: vec![stop],
            sample_offset: 0,
            events: tx,
            constraint: None,
            logprobs: None,
            adapter: None,
        })
        .unwrap();
    let mut got = vec![];
    let finish = loop {
        match rx.blocking_recv().expect("events until the end") {
            TokenEvent::Token(t) => got.push(t),
            TokenEvent::Finished(r) => break r,
            TokenEvent::PromptDone { .. } | TokenEvent::Drafts { .. } | TokenEvent::Logprobs(_) => {
            }
            TokenEvent::Failed(e) => panic!("{e}"),
        }
    };
    assert_eq!(finish, FinishReason::Stop);
    let first_stop = base[0].tokens.iter().position(|&t| t == stop).unwrap();
    assert_eq!(got, base[0].tokens[..first_stop]);
    // A dropped receiver cancels; the runtime goes on serving.
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    runtime
        .work
        .send(GenerateRequest {
            prompt: prompts()[3].clone(),
            sampling: Default::default(),
            max_tokens: 100_000,
            stop_token_ids: vec![],
            sample_offset: 0,
            events: tx,
            constraint: None,
            logprobs: None,
            adapter: None,
        })
        .unwrap();
    drop(rx);
    let after = generate_alone(&runtime, &[Gen::greedy(&prompts()[0], 10)]);
    assert_eq!(after[0].tokens, base[0].tokens);
    runtime.join();
}

fn quantized(bits: i32, cache_bytes: u64) -> Runtime {
    Runtime::start(
        common::tiny_model("tiny-qwen3"),
        RuntimeLimits {
            kv_quant: Some(mlxd_engine::cache::KvQuant {
                bits,
                group_size: 32,
            }),
            prompt_cache_bytes: cache_bytes,
            ..Default::default()
        },
        None,
    )
    .expect("load")
}

#[test]
fn a_quantized_kv_cache_batches_caches_and_stays_close_to_the_plain_one() {
    let plain = start_runtime(&common::tiny_model("tiny-qwen3"), 0);
    let q8 = quantized(8, 64 << 20);
    // The budget counts quantized bytes: 8 bits plus an f32 scale and bias per 32 elements,
    // against 4 bytes per element.
    let ratio = q8.info.kv_bytes_per_token as f64 / plain.info.kv_bytes_per_token as f64;
    assert!(
        (ratio - 1.25 / 4.0).abs() < 0.01,
        "bytes per token ratio {ratio}"
    );
    let gens: Vec<Gen> = prompts().iter().map(|p| Gen::greedy(p, 16)).collect();
    let alone = tokens(&generate_alone(&q8, &gens));
    let together = tokens(&generate_together(&q8, &gens));
    assert_eq!(together, alone, "quantized: batched greedy tokens differ");
    // Reported, not asserted equal: agreement of greedy tokens with the unquantized cache.
    let reference = tokens(&generate_alone(&plain, &gens));
    let same: usize = reference
        .iter()
        .zip(&alone)
        .map(|(a, b)| a.iter().zip(b).take_while(|(x, y)| x == y).count())
        .sum();
    let total: usize = reference.iter().map(Vec::len).sum();
    eprintln!("8-bit KV: {same} of {total} greedy tokens agree with the plain cache before the first difference");
    assert!(
        same * 2 >= total,
        "8-bit KV diverged early: {same} of {total}"
    );
    // Prefix-cache hits on the quantized layout give the same tokens.
    let again = generate_alone(&q8, &gens);
    assert!(again.iter().any(|o| o.cached > 0));
    assert_eq!(tokens(&again), alone);
    let q4 = quantized(4, 0);
    let four = generate_together(&q4, &gens);
    assert!(four.iter().all(|o| o.tokens.len() == 16));
    plain.join();
    q8.join();
    q4.join();
}

#[test]
fn unsupported_kv_quantization_is_refused_at_start_with_the_reason() {
    let start = |bits, group_size, shape| {
        Runtime::start(
            common::tiny_model(shape),
            RuntimeLimits {
                kv_quant: Some(mlxd_engine::cache::KvQuant { bits, group_size }),
                ..Default::default()
            },
            None,
        )
    };
    let e = start(5, 32, "tiny-qwen3").err().expect("5 bits is refused");
    assert!(e.to_string().contains("bits must be 4 or 8"), "{e}");
    // tiny-llama's heads are 16 wide: a group of 32 cannot divide them.
    let e = start(8, 32, "tiny-llama")
        .err()
        .expect("group 32 on 16-wide heads is refused");
    assert!(e.to_string().contains("does not divide"), "{e}");
}

#[test]
fn a_quantized_kv_start_keeps_short_sequences_unquantized_and_converts_long_ones() {
    let dir = common::tiny_model("tiny-qwen3");
    let plain = start_runtime(&dir, 0);
    let late = Runtime::start(
        dir.clone(),
        RuntimeLimits {
            kv_quant: Some(mlxd_engine::cache::KvQuant {
                bits: 4,
                group_size: 32,
            }),
            quantized_kv_start: 16,
            prompt_cache_bytes: 16 << 20,
            ..Default::default()
        },
        None,
    )
    .expect("load");
    let p = prompts();
    // 10 prompt tokens + 6 generated stay within the start: exactly the plain cache's tokens.
    let short = Gen::greedy(&p[0], 6);
    assert_eq!(
        tokens(&generate_alone(&late, std::slice::from_ref(&short))),
        tokens(&generate_alone(&plain, std::slice::from_ref(&short)))
    );
    // 40 prompt tokens pass it in the prefill, 7 + 20 during decoding; together with others,
    // and again from the prefix cache.
    let gens = vec![
        Gen::greedy(&p[3], 12),
        Gen::greedy(&p[2], 20),
        short.clone(),
    ];
    let together = generate_together(&late, &gens);
    for (g, o) in gens.iter().zip(&together) {
        assert_eq!(o.tokens.len(), g.max_tokens);
    }
    let again = generate_alone(&late, &gens[..1]);
    assert!(again[0].cached > 0, "the converted prefix was not reused");
    assert_eq!(again[0].tokens.len(), 12);
    // 4-bit storage past the start: the long run differs from the plain cache somewhere, or
    // the conversion did not happen (reported, since a tiny model may agree anyway).
    let reference = generate_alone(&plain, &gens[..1]);
    eprintln!(
        "quantized start: long row agrees with the plain cache: {}",
        reference[0].tokens == together[0].tokens
    );
    let refused = Runtime::start(
        dir,
        RuntimeLimits {
            quantized_kv_start: 16,
            ..Default::default()
        },
        None,
    );
    assert!(refused
        .err()
        .is_some_and(|e| e.to_string().contains("needs a quantized KV cache")));
    plain.join();
    late.join();
}

/// The tiny model, recording the shape `[rows, tokens]` of every forward pass and sleeping
/// `per_token` for each token of a prefill pass: a slow device, as far as the runtime's clock
/// can tell. A pass waits while its [`Hold`] is closed.
struct Paced {
    inner: Box<dyn mlxd_engine::models::CausalLm>,
    per_token: std::time::Duration,
    passes: std::sync::Arc<std::sync::Mutex<Vec<(i32, i32)>>>,
    hold: std::sync::Arc<Hold>,
}

/// Stops the runtime's thread inside its next forward pass until the test lets it go, so
/// that requests the test sends meanwhile all arrive before the runtime's next look at its
/// channel (without it, a busy machine can run a step between two sends).
#[derive(Default)]
struct Hold {
    state: std::sync::Mutex<HoldState>,
    changed: std::sync::Condvar,
}

#[derive(Default)]
struct HoldState {
    /// Passes wait.
    closed: bool,
    /// A pass is waiting.
    waiting: bool,
}

impl Hold {
    /// The next pass waits; returns once one is waiting (within a minute).
    fn stop_next_pass(&self) {
        let start = std::time::Instant::now();
        let mut state = self.state.lock().unwrap();
        state.closed = true;
        while !state.waiting {
            assert!(
                start.elapsed().as_secs() < 60,
                "no forward pass came to the hold"
            );
            state = self
                .changed
                .wait_timeout(state, std::time::Duration::from_secs(1))
                .unwrap()
                .0;
        }
    }

    /// Lets the waiting pass (and every later one) run.
    fn release(&self) {
        let mut state = self.state.lock().unwrap();
        *state = HoldState::default();
        self.changed.notify_all();
    }

    fn pass(&self) {
        let mut state = self.state.lock().unwrap();
        if state.closed {
            state.waiting = true;
            self.changed.notify_all();
            while state.closed {
                state = self.changed.wait(state).unwrap();
            }
        }
    }
}

impl Paced {
    /// A pass over `tokens` begins: it waits at the hold, takes its time and is recorded.
    fn begin(&self, tokens: &mlx_rs::Array) {
        let shape = tokens.shape();
        let (rows, len) = (shape[0], shape[1]);
        self.hold.pass();
        if len > 1 {
            std::thread::sleep(self.per_token * (rows * len) as u32);
        }
        self.passes.lock().unwrap().push((rows, len));
    }
}

impl mlxd_engine::models::CausalLm for Paced {
    fn hidden(
        &self,
        tokens: &mlx_rs::Array,
        caches: &mut [mlxd_engine::cache::LayerCache],
    ) -> Result<mlx_rs::Array, mlx_rs::error::Exception> {
        self.begin(tokens);
        self.inner.hidden(tokens, caches)
    }
    fn forward_last(
        &self,
        tokens: &mlx_rs::Array,
        caches: &mut [mlxd_engine::cache::LayerCache],
    ) -> Result<mlx_rs::Array, mlx_rs::error::Exception> {
        self.begin(tokens);
        self.inner.forward_last(tokens, caches)
    }
    fn head(&self, hidden: &mlx_rs::Array) -> Result<mlx_rs::Array, mlx_rs::error::Exception> {
        self.inner.head(hidden)
    }
    fn info(&self) -> &mlxd_engine::models::ModelInfo {
        self.inner.info()
    }
}

type Passes = std::sync::Arc<std::sync::Mutex<Vec<(i32, i32)>>>;

fn start_paced(limits: RuntimeLimits, per_token: std::time::Duration) -> (Runtime, Passes) {
    let (runtime, passes, _) = start_held(limits, per_token);
    (runtime, passes)
}

/// [`start_paced`], with the [`Hold`] on its passes.
fn start_held(
    limits: RuntimeLimits,
    per_token: std::time::Duration,
) -> (Runtime, Passes, std::sync::Arc<Hold>) {
    let passes = Passes::default();
    let hold = std::sync::Arc::new(Hold::default());
    let (recorded, held) = (passes.clone(), hold.clone());
    let load: mlxd_engine::runtime::ModelLoader = Box::new(move |dir: &std::path::Path| {
        let inner = mlxd_engine::models::load(dir)?;
        Ok(Box::new(Paced {
            inner,
            per_token,
            passes: recorded,
            hold: held,
        }) as Box<dyn mlxd_engine::models::CausalLm>)
    });
    let runtime = Runtime::start_with_loader(common::tiny_model("tiny-llama"), limits, None, load)
        .expect("load");
    (runtime, passes, hold)
}

fn send(
    runtime: &Runtime,
    prompt: Vec<u32>,
    max_tokens: usize,
) -> tokio::sync::mpsc::UnboundedReceiver<TokenEvent> {
    common::submit_greedy(runtime, &prompt, max_tokens, None)
}

/// Waits (polling, bounded) until `done` holds.
fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let start = std::time::Instant::now();
    while !done() {
        assert!(
            start.elapsed().as_secs() < 60,
            "timed out waiting for {what}"
        );
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

/// The forward passes run until the request's first token.
fn passes_to_first_token(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<TokenEvent>,
    passes: &Passes,
) -> usize {
    let before = passes.lock().unwrap().len();
    loop {
        match rx.blocking_recv().expect("events until a token") {
            TokenEvent::Token(_) => return passes.lock().unwrap().len() - before,
            TokenEvent::Failed(e) => panic!("{e}"),
            _ => {}
        }
    }
}

#[test]
fn first_tokens_sampled_from_the_prefill_are_those_of_the_first_decode_step() {
    // Both orders on the float32 tiny Llama, a burst of greedy, seeded and penalized rows (a
    // one-token prompt among them), then the same burst again as prefix hits: the same tokens.
    let dir = common::tiny_model("tiny-llama");
    let start = |on: bool| {
        Runtime::start(
            dir.clone(),
            RuntimeLimits {
                prompt_cache_bytes: 64 << 20,
                first_token_from_prefill: on,
                ..Default::default()
            },
            None,
        )
        .expect("load")
    };
    let penalized = SamplingParams {
        repetition_penalty: 1.3,
        frequency_penalty: 0.4,
        ..sampled(7)
    };
    let gens: Vec<Gen> = prompts()
        .into_iter()
        .enumerate()
        .map(|(i, prompt)| Gen {
            prompt,
            sampling: match i % 3 {
                0 => SamplingParams::default(),
                1 => sampled(i as u64),
                _ => penalized.clone(),
            },
            max_tokens: 8,
            logprobs: (i == 0).then_some(2),
        })
        .collect();
    let (decode, prefill) = (start(false), start(true));
    for round in ["misses", "hits"] {
        let a = generate_together(&decode, &gens);
        let b = generate_together(&prefill, &gens);
        assert_eq!(tokens(&a), tokens(&b), "{round}");
        assert_eq!(
            b[0].logprobs.len(),
            8,
            "{round}: a log-probability per token"
        );
        if round == "hits" {
            assert!(b.iter().skip(2).all(|o| o.cached > 0), "{round}: {b:?}");
        }
    }
    decode.join();
    prefill.join();
}

#[test]
fn the_pass_that_ends_a_prompt_samples_its_first_token_and_a_one_token_answer_keeps_its_prompt() {
    // No chunking (the 40 tokens fit one pass) and the prefix cache on.
    let (runtime, passes) = start_paced(
        RuntimeLimits {
            prompt_cache_bytes: 16 << 20,
            first_token_from_prefill: true,
            ..Default::default()
        },
        std::time::Duration::ZERO,
    );
    let prompt: Vec<u32> = (0..40).map(|i| (i * 13 + 7) % 390).collect();
    // The first token comes out of the one pass over the whole prompt: three tokens take that
    // pass and two decode steps (mlx-lm's order, the prompt's last token in the first decode
    // step, ran 39 tokens and then three steps). The list is read once the answer has ended:
    // counted at the first token, a busy machine may already have run the next step.
    let mut rx = send(&runtime, prompt.clone(), 3);
    let mut answer = Vec::new();
    read_tokens(&mut rx, &mut answer, None);
    assert_eq!(answer.len(), 3);
    assert_eq!(passes.lock().unwrap()[..], [(1, 40), (1, 1), (1, 1)]);
    // A one-token answer never joins the batch: one pass, and its prompt is cached at once,
    // so the same prompt sent the moment it ends runs only its last token.
    let other: Vec<u32> = (0..24).map(|i| (i * 29 + 3) % 390).collect();
    let before = passes.lock().unwrap().len();
    let mut rx = send(&runtime, other.clone(), 1);
    let mut got = Vec::new();
    read_tokens(&mut rx, &mut got, None);
    assert_eq!(got.len(), 1);
    assert_eq!(passes.lock().unwrap()[before..], [(1, 24)]);
    let again = generate_alone(&runtime, &[Gen::greedy(&other, 1)]);
    assert_eq!(again[0].cached, other.len() - 1);
    assert_eq!(
        again[0].tokens, got,
        "the cached prompt gives the same token"
    );
    assert_eq!(passes.lock().unwrap()[before + 1..], [(1, 1)]);
    runtime.join();
}

#[test]
fn a_short_request_is_not_stuck_behind_a_long_prefill_and_a_cancelled_one_stops() {
    use std::sync::atomic::Ordering;
    // Chunks of 16 tokens, 16 ms each: the 480-token prompt needs 30 of them.
    let (runtime, passes) = start_paced(
        RuntimeLimits {
            prefill_chunk: 16,
            prompt_cache_bytes: 0,
            ..Default::default()
        },
        std::time::Duration::from_millis(1),
    );
    let long: Vec<u32> = (0..480).map(|i| (i * 31 + 7) % 390).collect();
    let mut long_rx = send(&runtime, long, 1);
    wait_until("the long prompt's second chunk", || {
        passes.lock().unwrap().len() >= 2
    });
    // /engines' figures: the prefill is counted while it runs.
    let stats = runtime.stats.clone();
    wait_until("the prefill in the stats", || {
        stats.prefilling.load(Ordering::Relaxed) == 1
    });
    let left = stats.prefill_tokens_left.load(Ordering::Relaxed);
    assert!(left > 0 && left < 480, "prefill tokens left: {left}");
    assert_eq!(stats.active.load(Ordering::Relaxed), 1);

    // A short request comes in: it is prefilled at the next chunk boundary and decodes while
    // the long prompt still has most of its chunks to go (first in, first out took 28 more).
    let mut short = send(&runtime, prompts()[0].clone(), 2);
    let n = passes_to_first_token(&mut short, &passes);
    assert!(
        n <= 4,
        "{n} forward passes before the short request's first token"
    );
    assert!(
        matches!(
            long_rx.try_recv(),
            Err(_) | Ok(TokenEvent::PromptDone { .. })
        ),
        "the long prompt is still prefilling"
    );
    assert!(!matches!(long_rx.try_recv(), Ok(TokenEvent::Token(_))));
    // The short request ends (its second token), so that the passes counted below are the
    // next request's and the cancelled prompt's alone.
    let mut rest = Vec::new();
    read_tokens(&mut short, &mut rest, None);
    assert_eq!(rest.len(), 1, "the short request's second token");

    // The long prompt's client leaves: it stops at the next chunk boundary, and the next
    // request starts at once.
    drop(long_rx);
    let mut next = send(&runtime, prompts()[2].clone(), 2);
    let n = passes_to_first_token(&mut next, &passes);
    assert!(
        n <= 4,
        "{n} forward passes before the next request's first token"
    );
    wait_until("no prefill left", || {
        stats.prefilling.load(Ordering::Relaxed) == 0 && stats.active.load(Ordering::Relaxed) == 0
    });
    assert_eq!(stats.prefill_tokens_left.load(Ordering::Relaxed), 0);
    let long_chunks = passes
        .lock()
        .unwrap()
        .iter()
        .filter(|&&p| p == (1, 16))
        .count();
    assert!(
        long_chunks < 20,
        "{long_chunks} chunks of the abandoned prompt ran (it needs 30)"
    );
    runtime.join();
}

#[test]
fn on_a_slow_device_prefill_chunks_shrink_to_the_unit_target() {
    // A fresh engine knows nothing of its device: its first chunk is a probe of
    // `PROBE_CHUNK` (256) tokens, not the configured 2 048 (the whole 600-token prompt here).
    // 3 ms a token: the probe takes 0.77 s, past the 0.5 s target, so the next chunks hold at
    // most 128 (333 tokens/s × 0.5 s, rounded down to a power of two).
    let limits = RuntimeLimits {
        prefill_chunk: 2048,
        prompt_cache_bytes: 0,
        ..Default::default()
    };
    // The prompt's last token is prefilled too when the first token is sampled there.
    let prefilled = if limits.first_token_from_prefill {
        600
    } else {
        599
    };
    let (runtime, passes) = start_paced(limits, std::time::Duration::from_millis(3));
    let long: Vec<u32> = (0..600).map(|i| (i * 17 + 3) % 390).collect();
    let mut rx = send(&runtime, long, 1);
    passes_to_first_token(&mut rx, &passes);
    let prefill: Vec<i32> = passes
        .lock()
        .unwrap()
        .iter()
        .filter(|p| p.1 > 1)
        .map(|p| p.1)
        .collect();
    assert_eq!(
        prefill[0],
        mlxd_engine::runtime::scheduler::PROBE_CHUNK as i32,
        "the first chunk is the probe: {prefill:?}"
    );
    assert!(
        prefill[1..].iter().all(|&c| (32..=128).contains(&c)) && prefill.len() >= 3,
        "later chunks shrink: {prefill:?}"
    );
    assert_eq!(prefill.iter().sum::<i32>(), prefilled);
    runtime.join();
}

/// Reads a request's tokens up to `until` of them (all when `None`).
fn read_tokens(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<TokenEvent>,
    got: &mut Vec<u32>,
    until: Option<usize>,
) {
    while until.is_none_or(|n| got.len() < n) {
        match rx.blocking_recv().expect("events until the end") {
            TokenEvent::Token(t) => got.push(t),
            TokenEvent::Finished(_) => return,
            TokenEvent::Failed(e) => panic!("generation failed: {e}"),
            TokenEvent::PromptDone { .. } | TokenEvent::Drafts { .. } | TokenEvent::Logprobs(_) => {
            }
        }
    }
}

/// `prefill_pad_to`: groups of prompts padded on the left to a multiple of 16 tokens (the six
/// prompts of 1 to 40 tokens become passes 16, 32 or 48 long) give each row its alone output.
#[test]
fn groups_padded_to_a_multiple_give_their_alone_output() {
    let runtime = start_limited(RuntimeLimits {
        prefill_pad_to: 16,
        prompt_cache_bytes: 0,
        ..Default::default()
    });
    assert_batched_equals_alone(runtime, "groups padded to a multiple of 16");
}

#[test]
fn prompts_of_very_different_lengths_joining_at_different_steps_get_their_alone_output() {
    // Small chunks and a small step budget, so that one step prefills several passes (chunks
    // of long prompts beside groups of short ones, padded or not), long prompts take several
    // steps, and rows join a batch that is already decoding.
    let runtime = start_limited(RuntimeLimits {
        prefill_chunk: 16,
        prefill_step_tokens: Some(48),
        prompt_cache_bytes: 0,
        ..Default::default()
    });
    let long = |n: usize, k: usize| -> Vec<u32> {
        (0..n).map(|i| ((i * k + 5) % 380) as u32 + 1).collect()
    };
    let gens = [
        Gen::greedy(&long(150, 7), 14),
        Gen::greedy(&[9], 12),
        Gen {
            prompt: long(70, 11),
            sampling: sampled(5),
            max_tokens: 16,
            logprobs: None,
        },
        Gen::greedy(&long(5, 3), 20),
        Gen::greedy(&long(5, 13), 9),
        Gen {
            prompt: long(12, 17),
            sampling: sampled(6),
            max_tokens: 18,
            logprobs: None,
        },
        Gen::greedy(&long(260, 19), 10),
        Gen::greedy(&long(33, 23), 15),
    ];
    let alone = tokens(&generate_alone(&runtime, &gens));
    // Three waves: each next one is sent once the first row of the last has a token, so it
    // joins a batch that is decoding (and, for the long prompts, still prefilling).
    let waves: [&[usize]; 3] = [&[0, 1, 2], &[3, 4, 5], &[6, 7]];
    let mut rxs: Vec<Option<tokio::sync::mpsc::UnboundedReceiver<TokenEvent>>> =
        (0..gens.len()).map(|_| None).collect();
    let mut got: Vec<Vec<u32>> = vec![Vec::new(); gens.len()];
    for wave in waves {
        for &i in wave {
            rxs[i] = Some(submit(&runtime, &gens[i]));
        }
        let first = wave[0];
        read_tokens(rxs[first].as_mut().expect("sent"), &mut got[first], Some(1));
    }
    for (i, rx) in rxs.iter_mut().enumerate() {
        read_tokens(rx.as_mut().expect("sent"), &mut got[i], None);
    }
    assert_eq!(
        got, alone,
        "rows joining at different steps differ from alone"
    );
    runtime.join();
}

/// `warm_up`: the generations run before the runtime reports ready leave nothing behind — no
/// KV, no prefix-cache entry (their own prompts miss afterwards) — and change no token.
#[test]
fn a_warmed_up_runtime_keeps_nothing_from_its_warm_up_and_gives_the_same_tokens() {
    let dir = common::tiny_model("tiny-llama");
    let start = |warm_up| {
        let limits = RuntimeLimits {
            warm_up: Some(warm_up),
            ..Default::default()
        };
        Runtime::start(dir.clone(), limits, None).expect("load")
    };
    let warm = start(true);
    assert_eq!(
        warm.stats
            .kv_bytes
            .load(std::sync::atomic::Ordering::SeqCst),
        0,
        "the warm-up left KV behind"
    );
    let vocab = warm.info.vocab_size;
    let warm_prompts: Vec<Vec<u32>> = mlxd_engine::runtime::warm_up::requests(vocab)
        .into_iter()
        .map(|(prompt, _)| prompt)
        .collect();
    let mut gens: Vec<Gen> = warm_prompts.iter().map(|p| Gen::greedy(p, 6)).collect();
    gens.extend(prompts().iter().map(|p| Gen::greedy(p, 6)));
    gens.push(Gen {
        sampling: sampled(5),
        ..Gen::greedy(&prompts()[0], 6)
    });
    let warmed = generate_alone(&warm, &gens);
    for (o, p) in warmed.iter().zip(&warm_prompts) {
        assert_eq!(
            o.cached,
            0,
            "a warm-up prompt ({} tokens) hit the prefix cache",
            p.len()
        );
    }
    warm.join();
    let cold = start(false);
    let plain = generate_alone(&cold, &gens);
    cold.join();
    assert_eq!(tokens(&warmed), tokens(&plain));
}

/// Prefix hits arriving together are prefilled in one pass: each re-feeds the cached tokens
/// just before its uncached remainder up to the group's length (here the longest remainder,
/// 7, padded to 8: 10 tokens re-fed in all, within any chunk), and each still gets the tokens
/// it gets alone with nothing cached.
#[test]
fn prefix_hits_arriving_together_share_one_pass_and_give_their_alone_output() {
    let (warm, passes, hold) = start_held(
        RuntimeLimits {
            prompt_cache_bytes: 64 << 20,
            prefill_pad_to: 8,
            ..Default::default()
        },
        std::time::Duration::ZERO,
    );
    let prefix = |n: usize, k: usize| -> Vec<u32> {
        (0..n).map(|i| ((i * k + 3) % 380) as u32 + 1).collect()
    };
    let firsts: Vec<Gen> = [(30, 7), (41, 11), (52, 13), (35, 17)]
        .iter()
        .map(|&(n, k)| Gen::greedy(&prefix(n, k), 6))
        .collect();
    let answers = generate_alone(&warm, &firsts);
    // Each second turn repeats its first turn and answer, then adds 4 to 7 tokens.
    let seconds: Vec<Gen> = firsts
        .iter()
        .zip(&answers)
        .zip([4usize, 6, 7, 5])
        .map(|((g, a), extra)| {
            let mut prompt = g.prompt.clone();
            prompt.extend(&a.tokens);
            prompt.extend((0..extra as u32).map(|i| 40 + i));
            Gen::greedy(&prompt, 10)
        })
        .collect();
    // A stream decoding meanwhile, held inside a pass while the four are sent, so that they
    // arrive while the runtime is busy and are admitted in one step.
    let mut busy = send(&warm, prefix(20, 3), 64);
    read_tokens(&mut busy, &mut Vec::new(), Some(1));
    hold.stop_next_pass();
    let before = passes.lock().unwrap().len();
    let receivers: Vec<_> = seconds.iter().map(|g| common::submit(&warm, g)).collect();
    hold.release();
    let together: Vec<_> = receivers.into_iter().map(common::collect).collect();
    let shapes: Vec<(i32, i32)> = passes.lock().unwrap()[before..].to_vec();
    read_tokens(&mut busy, &mut Vec::new(), None);
    for ((g, first), hit) in firsts.iter().zip(&answers).zip(&together) {
        // Everything but the answer's last token (never fed) was cached.
        assert_eq!(hit.cached, g.prompt.len() + first.tokens.len() - 1);
    }
    assert!(
        shapes.contains(&(4, 8)),
        "no pass of the four hits together: {shapes:?}"
    );
    assert!(
        shapes.iter().all(|&(_, len)| len == 1 || len == 8),
        "a hit ran a pass of its own: {shapes:?}"
    );
    warm.join();
    let cold = common::start_runtime(&common::tiny_model("tiny-llama"), 0);
    let alone = tokens(&generate_alone(&cold, &seconds));
    assert_eq!(tokens(&together), alone, "hits prefilled together");
    cold.join();
}
