//! Speculative decoding inside the batch, on real MLX arrays with tiny random-weight models:
//! drafting (n-gram lookup or a draft model) never changes greedy output, alone or in a batch;
//! seeded sampling draws the same tokens with and without drafts; rows with penalties take no
//! drafts; a draft model with another tokenizer is refused with the reason.
use crate::common;

use std::path::Path;

use common::{generate_alone, generate_together, start_runtime, Gen, Output};
use mlxd_engine::runtime::draft::{DraftSource, NgramSizes, Speculation};
use mlxd_engine::runtime::sampling_params::SamplingParams;
use mlxd_engine::runtime::{Runtime, RuntimeLimits};

/// Prompts with repeated runs (so prompt lookup finds drafts) and without, of different
/// lengths, so rows draft different numbers of tokens in one pass.
fn prompts() -> Vec<Vec<u32>> {
    let run: Vec<u32> = vec![31, 32, 33, 34, 35, 36, 37, 38];
    let mut repeated = run.clone();
    repeated.extend([5, 6]);
    repeated.extend(&run);
    repeated.extend(&run[..3]);
    vec![
        repeated,
        vec![1],
        vec![300, 2, 250, 250, 250, 13, 14],
        (0..40).map(|i| (i * 7 + 3) % 390).collect(),
        vec![11, 12, 11, 12, 11, 12],
    ]
}

fn tokens(outputs: &[Output]) -> Vec<Vec<u32>> {
    outputs.iter().map(|o| o.tokens.clone()).collect()
}

fn speculative(dir: &Path, source: DraftSource, num_draft: usize) -> Runtime {
    Runtime::start(
        dir.to_path_buf(),
        RuntimeLimits {
            prompt_cache_bytes: 0,
            speculation: Some(Speculation { source, num_draft }),
            ..Default::default()
        },
        None,
    )
    .expect("load with speculation")
}

fn ngram() -> DraftSource {
    DraftSource::Ngram(NgramSizes::new(1, 3).unwrap())
}

/// Greedy tokens with drafting equal those without, alone and in a batch; returns the
/// (drafted, accepted) totals.
fn unchanged_greedy(shape: &str, source: DraftSource) -> (usize, usize) {
    let dir = common::tiny_model(shape);
    let plain = start_runtime(&dir, 0);
    let spec = speculative(&dir, source, 3);
    let gens: Vec<Gen> = prompts()
        .iter()
        .enumerate()
        .map(|(i, p)| Gen::greedy(p, 14 + 3 * i))
        .collect();
    let reference = tokens(&generate_alone(&plain, &gens));
    let alone = generate_alone(&spec, &gens);
    assert_eq!(
        tokens(&alone),
        reference,
        "{shape}: drafting changed greedy tokens"
    );
    let together = generate_together(&spec, &gens);
    assert_eq!(
        tokens(&together),
        reference,
        "{shape}: drafting in a batch changed greedy tokens"
    );
    for (g, o) in gens.iter().zip(&together) {
        assert_eq!(
            o.tokens.len(),
            g.max_tokens,
            "{shape}: max_tokens not honoured"
        );
    }
    plain.join();
    spec.join();
    draft_totals(alone.iter().chain(&together))
}

/// The (drafted, accepted) totals of `outputs`.
fn draft_totals<'a>(outputs: impl IntoIterator<Item = &'a Output>) -> (usize, usize) {
    outputs
        .into_iter()
        .filter_map(|o| o.drafts)
        .fold((0, 0), |(d, a), (dd, aa)| (d + dd, a + aa))
}

#[test]
fn ngram_drafting_leaves_greedy_output_unchanged_f32() {
    let (drafted, accepted) = unchanged_greedy("tiny-llama", ngram());
    eprintln!("tiny-llama n-gram: {accepted} of {drafted} drafts accepted");
    assert!(drafted > 0 && accepted > 0, "no drafts were verified");
}

#[test]
fn ngram_drafting_leaves_greedy_output_unchanged_bf16_and_4bit() {
    for shape in ["tiny-qwen3-bf16", "tiny-llama-q4"] {
        let (drafted, _) = unchanged_greedy(shape, ngram());
        assert!(drafted > 0, "{shape}: no drafts were verified");
    }
}

#[test]
fn a_draft_model_leaves_greedy_output_unchanged_and_rolls_back_rejections() {
    // The 4-bit copy of tiny-llama drafts for it: same tokenizer, close but not equal logits,
    // so most drafts are accepted and some are rejected (rollback in the main and draft caches).
    let draft = common::tiny_model("tiny-llama-q4");
    let (drafted, accepted) = unchanged_greedy("tiny-llama", DraftSource::Model(draft));
    eprintln!("tiny-llama drafted by its 4-bit copy: {accepted} of {drafted} accepted");
    assert!(accepted > 0, "no draft was accepted");
    assert!(
        accepted < drafted,
        "no draft was rejected: rollback untested"
    );
}

#[test]
fn rows_whose_drafts_are_rejected_stop_drafting_and_keep_their_tokens() {
    // Other random weights with the same tokenizer: drafts are nearly always wrong.
    let dir = common::tiny_model("tiny-llama");
    let draft = common::tiny_model("tiny-llama-other");
    let spec = speculative(&dir, DraftSource::Model(draft), 3);
    let plain = start_runtime(&dir, 0);
    let p = prompts();
    let gens: Vec<Gen> = [&p[0], &p[3]].iter().map(|p| Gen::greedy(p, 48)).collect();
    let out = generate_together(&spec, &gens);
    assert_eq!(tokens(&out), tokens(&generate_alone(&plain, &gens)));
    for o in &out {
        let (drafted, accepted) = o.drafts.unwrap_or((0, 0));
        // Without the pause every pass would draft 3 (about 140 in all); with it, a trial of
        // about 8 drafts, then one retry after the pause.
        assert!(
            drafted <= 40 && accepted * 3 < drafted.max(1) * 2,
            "a mostly rejected row kept drafting: {accepted} of {drafted} accepted"
        );
    }
    plain.join();
    spec.join();
}

#[test]
fn a_draft_model_that_is_the_model_itself_accepts_every_draft() {
    let dir = common::tiny_model("tiny-llama");
    let spec = speculative(&dir, DraftSource::Model(dir.clone()), 4);
    let plain = start_runtime(&dir, 0);
    let gens: Vec<Gen> = prompts().iter().map(|p| Gen::greedy(p, 13)).collect();
    let out = generate_together(&spec, &gens);
    assert_eq!(tokens(&out), tokens(&generate_alone(&plain, &gens)));
    for o in &out {
        let (drafted, accepted) = o.drafts.expect("drafts reported");
        assert_eq!(drafted, accepted, "a draft equal to the model was rejected");
    }
    plain.join();
    spec.join();
}

fn sampled(temperature: f32, seed: u64) -> SamplingParams {
    SamplingParams {
        temperature,
        top_p: 0.95,
        seed: Some(seed),
        ..Default::default()
    }
}

/// Seeded sampling at `temperature` draws the same tokens with drafts from `source` as
/// without; returns the (drafted, accepted) totals.
fn seeded_tokens_unchanged(source: DraftSource, temperature: f32) -> (usize, usize) {
    let dir = common::tiny_model("tiny-llama");
    let plain = start_runtime(&dir, 0);
    let spec = speculative(&dir, source, 3);
    let gens: Vec<Gen> = prompts()
        .iter()
        .enumerate()
        .map(|(i, p)| Gen {
            prompt: p.clone(),
            sampling: sampled(temperature, i as u64 + 7),
            max_tokens: 24,
            logprobs: None,
        })
        .collect();
    let reference = tokens(&generate_alone(&plain, &gens));
    let drafted = generate_together(&spec, &gens);
    assert_eq!(
        tokens(&drafted),
        reference,
        "drafting changed seeded tokens at temperature {temperature}"
    );
    plain.join();
    spec.join();
    draft_totals(&drafted)
}

#[test]
fn seeded_sampling_draws_the_same_tokens_with_and_without_drafts() {
    // A draft model near the main one (its 4-bit copy) at 0.8: drafts accepted and rejected
    // (sampled hot, few are accepted), each judged against the token the same noise draws.
    let draft = common::tiny_model("tiny-llama-q4");
    let (drafted, accepted) = seeded_tokens_unchanged(DraftSource::Model(draft), 0.8);
    eprintln!("seeded, drafted by the 4-bit copy: {accepted} of {drafted} accepted");
    assert!(
        accepted > 0 && accepted < drafted,
        "{accepted} of {drafted} accepted"
    );
    // Prompt lookup drafts for a row once replayed lookups say it would be accepted: random
    // weights sampled hot rarely repeat themselves, nearly greedy they do.
    let (drafted, _) = seeded_tokens_unchanged(ngram(), 0.05);
    assert!(drafted > 0, "no n-gram drafts were verified");
}

#[test]
fn rows_with_penalties_or_logprobs_take_no_drafts_and_keep_their_tokens() {
    let dir = common::tiny_model("tiny-llama");
    let plain = start_runtime(&dir, 0);
    let spec = speculative(&dir, ngram(), 3);
    let p = prompts();
    let penalised = Gen {
        prompt: p[0].clone(),
        sampling: SamplingParams {
            repetition_penalty: 1.3,
            presence_penalty: 0.5,
            ..Default::default()
        },
        max_tokens: 12,
        logprobs: None,
    };
    let reporting = Gen {
        logprobs: Some(2),
        ..Gen::greedy(&p[2], 12)
    };
    let gens = vec![
        penalised,
        Gen::greedy(&p[0], 12),
        Gen::greedy(&p[4], 12),
        reporting,
    ];
    let reference = generate_alone(&plain, &gens);
    let out = generate_together(&spec, &gens);
    assert_eq!(tokens(&out), tokens(&reference));
    assert_eq!(out[0].drafts, None, "a penalised row was given drafts");
    assert_eq!(
        out[3].drafts, None,
        "a row reporting logprobs was given drafts"
    );
    assert_eq!(out[3].logprobs.len(), 12);
    for ((lp, plain), &token) in out[3]
        .logprobs
        .iter()
        .zip(&reference[3].logprobs)
        .zip(&out[3].tokens)
    {
        assert_eq!(lp.top[0].0, token);
        assert!(
            (lp.logprob - plain.logprob).abs() < 1e-3,
            "{lp:?} against {plain:?}"
        );
    }
    plain.join();
    spec.join();
}

#[test]
fn a_draft_model_with_another_tokenizer_is_refused_with_the_reason() {
    let home = tempfile::tempdir().unwrap();
    let main = common::tiny_model("tiny-llama");
    // A copy of the model whose vocabulary swaps the ids of two tokens.
    let other = home.path().join("other");
    std::fs::create_dir(&other).unwrap();
    for entry in std::fs::read_dir(&main).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, other.join(path.file_name().unwrap())).unwrap();
    }
    let tokenizer = std::fs::read_to_string(other.join("tokenizer.json")).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&tokenizer).unwrap();
    let vocab = json["model"]["vocab"].as_object_mut().unwrap();
    let (a, b) = (vocab["!"].clone(), vocab["\""].clone());
    vocab.insert("!".into(), b);
    vocab.insert("\"".into(), a);
    std::fs::write(other.join("tokenizer.json"), json.to_string()).unwrap();
    let draft = mlxd_engine::app::DraftOptions {
        choice: mlxd_engine::app::DraftChoice::Model(other.display().to_string()),
        num_draft: 3,
    };
    let e = mlxd_engine::app::load(
        &main.display().to_string(),
        home.path(),
        RuntimeLimits::default(),
        Some(draft),
        None,
    )
    .err()
    .expect("a draft with another tokenizer is refused")
    .to_string();
    assert!(e.contains("tokenizer differs"), "{e}");
    assert!(
        e.contains("\"!\""),
        "the first differing token is named: {e}"
    );
}

/// The default model (real weights) on an input-grounded prompt: n-gram drafts are accepted
/// and greedy tokens are those of the model without drafts, alone and beside another stream.
#[test]
fn ngram_drafting_on_the_default_model_keeps_greedy_tokens() {
    let home = common::test_home();
    let model = mlxd_store::resolve_model("smollm2-135m", &home).expect("default model");
    let [grounded, other]: [Vec<u32>; 2] = common::hf_chat_tokens_many(
        &model.dir,
        &[
            "Copy the following text exactly.\n\nThe quick brown fox jumps over the lazy dog \
             near the river bank, and the dog does not wake up.",
            "List three prime numbers.",
        ],
    )
    .try_into()
    .expect("two prompts");
    let gens = vec![Gen::greedy(&grounded, 28), Gen::greedy(&other, 8)];
    let plain = start_runtime(&model.dir, 0);
    let reference = tokens(&generate_alone(&plain, &gens));
    plain.join();
    let spec = speculative(
        &model.dir,
        DraftSource::Ngram(NgramSizes::new(2, 4).unwrap()),
        3,
    );
    let together = generate_together(&spec, &gens);
    let alone = generate_alone(&spec, &gens[..1]);
    spec.join();
    // Ends at the end-of-sequence token like the reference: compare up to it.
    assert_eq!(
        tokens(&together),
        reference,
        "drafting changed the default model's tokens"
    );
    assert_eq!(alone[0].tokens, reference[0]);
    let (drafted, accepted) = alone[0].drafts.expect("drafts reported");
    eprintln!("smollm2 grounded prompt: {accepted} of {drafted} n-gram drafts accepted");
    assert!(
        accepted > 0,
        "no draft accepted on a copying task (of {drafted})"
    );
}

#[test]
fn a_constrained_row_takes_no_drafts_and_follows_its_mask_in_a_speculative_batch() {
    use mlxd_engine::constraint::{ForcedTokens, TokenConstraint};
    use mlxd_engine::runtime::request::{GenerateRequest, TokenEvent};
    let dir = common::tiny_model("tiny-llama");
    let plain = start_runtime(&dir, 0);
    let spec = speculative(&dir, ngram(), 3);
    let p = prompts();
    let free = Gen::greedy(&p[0], 12);
    let reference = tokens(&generate_alone(&plain, std::slice::from_ref(&free)));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let forced = vec![7, 8, 9, 10, 7, 8];
    spec.work
        .send(GenerateRequest {
            prompt: p[4].clone(),
            sampling: Default::default(),
            max_tokens: 12,
            stop_token_ids: vec![],
            sample_offset: 0,
            events: tx,
            constraint: Some(
                Box::new(ForcedTokens::new(forced.clone())) as Box<dyn TokenConstraint>
            ),
            logprobs: None,
            adapter: None,
        })
        .unwrap();
    let out = generate_together(&spec, std::slice::from_ref(&free));
    let mut constrained = Vec::new();
    let mut drafts = None;
    while let Some(event) = rx.blocking_recv() {
        match event {
            TokenEvent::Token(t) => constrained.push(t),
            TokenEvent::Drafts { drafted, accepted } => drafts = Some((drafted, accepted)),
            TokenEvent::Finished(_) => break,
            TokenEvent::Failed(e) => panic!("{e}"),
            TokenEvent::PromptDone { .. } | TokenEvent::Logprobs(_) => {}
        }
    }
    assert_eq!(constrained, forced);
    assert_eq!(drafts, None, "a constrained row was given drafts");
    assert_eq!(tokens(&out), reference);
    plain.join();
    spec.join();
}

#[test]
fn drafting_over_a_quantized_kv_cache_keeps_its_greedy_tokens() {
    let dir = common::tiny_model("tiny-qwen3");
    let limits = |speculation| RuntimeLimits {
        prompt_cache_bytes: 0,
        kv_quant: Some(mlxd_engine::cache::KvQuant {
            bits: 8,
            group_size: 32,
        }),
        speculation,
        ..Default::default()
    };
    let plain = Runtime::start(dir.clone(), limits(None), None).expect("load");
    let spec = Runtime::start(
        dir,
        limits(Some(Speculation {
            source: ngram(),
            num_draft: 3,
        })),
        None,
    )
    .expect("load");
    let gens: Vec<Gen> = prompts().iter().map(|p| Gen::greedy(p, 14)).collect();
    let reference = tokens(&generate_alone(&plain, &gens));
    let out = generate_together(&spec, &gens);
    assert_eq!(
        tokens(&out),
        reference,
        "drafting changed quantized-cache tokens"
    );
    assert!(out.iter().any(|o| o.drafts.is_some_and(|(d, _)| d > 0)));
    plain.join();
    spec.join();
}

/// Rows of one batch that reject different numbers of drafts leave holes in its cache (the
/// rejected positions stay, masked); a departing row's copy for the prefix cache holds its
/// valid positions only, so a follow-up prompt that hits it continues exactly as a runtime
/// without drafts or cache does. Drafted by tiny-llama's 4-bit copy: a draft model drafts
/// from a row's first step, and this one is accepted and rejected by turns.
#[test]
fn rows_with_rollback_holes_leave_prefix_entries_that_continue_exactly() {
    let dir = common::tiny_model("tiny-llama");
    let plain = start_runtime(&dir, 0);
    let spec = Runtime::start(
        dir.clone(),
        RuntimeLimits {
            prompt_cache_bytes: 64 << 20,
            speculation: Some(Speculation {
                source: DraftSource::Model(common::tiny_model("tiny-llama-q4")),
                num_draft: 3,
            }),
            ..Default::default()
        },
        None,
    )
    .expect("load with speculation and a prefix cache");
    let gens: Vec<Gen> = prompts().iter().map(|p| Gen::greedy(p, 20)).collect();
    let first = generate_together(&spec, &gens);
    assert_eq!(tokens(&first), tokens(&generate_alone(&plain, &gens)));
    let drafts: Vec<(usize, usize)> = first.iter().filter_map(|o| o.drafts).collect();
    assert!(
        drafts.iter().any(|&(d, a)| d > a) && drafts.iter().any(|&(_, a)| a > 0),
        "the batch needs rows that reject and rows that accept: {drafts:?}"
    );
    let follow: Vec<Gen> = prompts()
        .iter()
        .zip(&first)
        .map(|(p, o)| {
            let mut prompt = p.clone();
            prompt.extend(&o.tokens[..12]);
            Gen::greedy(&prompt, 6)
        })
        .collect();
    let again = generate_alone(&spec, &follow);
    for (g, o) in follow.iter().zip(&again) {
        assert!(
            o.cached > g.prompt.len() / 2,
            "{} of {} prompt tokens came from the cache",
            o.cached,
            g.prompt.len()
        );
    }
    assert_eq!(tokens(&again), tokens(&generate_alone(&plain, &follow)));
    plain.join();
    spec.join();
}
