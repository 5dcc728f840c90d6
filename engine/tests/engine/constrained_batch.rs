//! Constrained rows inside the batch, on real MLX arrays with a tiny random-weight model: a
//! constrained row emits exactly what its constraint allows, rows beside it generate what they
//! generate alone (their mask rows are zeros, and the synchronous steps change nothing for
//! them), and rows join and leave across the switch between the pipelined and synchronous
//! paths.
use crate::common;

use common::{generate_alone, start_runtime, Gen};
use mlxd_engine::constraint::ForcedTokens;
use mlxd_engine::runtime::request::{FinishReason, GenerateRequest, TokenEvent};
use mlxd_engine::runtime::sampling_params::SamplingParams;
use tokio::sync::mpsc;

fn send(
    runtime: &mlxd_engine::runtime::Runtime,
    prompt: &[u32],
    max_tokens: usize,
    sampling: SamplingParams,
    forced: Option<Vec<u32>>,
) -> mpsc::UnboundedReceiver<TokenEvent> {
    let (tx, rx) = mpsc::unbounded_channel();
    runtime
        .work
        .send(GenerateRequest {
            prompt: prompt.to_vec(),
            sampling,
            max_tokens,
            stop_token_ids: vec![],
            sample_offset: 0,
            events: tx,
            constraint: forced.map(|t| {
                Box::new(ForcedTokens::new(t)) as Box<dyn mlxd_engine::constraint::TokenConstraint>
            }),
            logprobs: None,
            adapter: None,
        })
        .expect("runtime is running");
    rx
}

fn collect(mut rx: mpsc::UnboundedReceiver<TokenEvent>) -> (Vec<u32>, Option<FinishReason>) {
    let mut tokens = Vec::new();
    while let Some(event) = rx.blocking_recv() {
        match event {
            TokenEvent::PromptDone { .. } | TokenEvent::Drafts { .. } | TokenEvent::Logprobs(_) => {
            }
            TokenEvent::Token(t) => tokens.push(t),
            TokenEvent::Finished(reason) => return (tokens, Some(reason)),
            TokenEvent::Failed(e) => panic!("generation failed: {e}"),
        }
    }
    (tokens, None)
}

#[test]
fn constrained_rows_follow_their_mask_and_leave_the_others_unchanged() {
    let dir = common::tiny_model("tiny-llama");
    let runtime = start_runtime(&dir, 0);
    let free: Vec<Gen> = vec![
        Gen::greedy(&[5, 17, 42, 99, 7], 14),
        Gen::greedy(&[1], 9),
        Gen {
            prompt: vec![300, 2, 250, 13],
            sampling: SamplingParams {
                temperature: 0.9,
                top_k: 40,
                seed: Some(7),
                ..Default::default()
            },
            max_tokens: 12,
            logprobs: None,
        },
    ];
    let alone: Vec<Vec<u32>> = generate_alone(&runtime, &free)
        .into_iter()
        .map(|o| o.tokens)
        .collect();

    // Two constrained rows of different lengths among the free ones: the first ends before
    // the free rows do (the batch goes back to the pipelined path), the second is cut by
    // max_tokens before its constraint completes.
    let short = vec![3u32, 3, 200, 4];
    let long: Vec<u32> = (0..20).map(|i| (i * 37 + 11) % 390).collect();
    let mut receivers = vec![send(
        &runtime,
        &free[0].prompt,
        14,
        free[0].sampling.clone(),
        None,
    )];
    receivers.push(send(
        &runtime,
        &[9, 9, 9],
        30,
        Default::default(),
        Some(short.clone()),
    ));
    receivers.push(send(
        &runtime,
        &free[1].prompt,
        9,
        free[1].sampling.clone(),
        None,
    ));
    receivers.push(send(
        &runtime,
        &[44, 45],
        6,
        Default::default(),
        Some(long.clone()),
    ));
    receivers.push(send(
        &runtime,
        &free[2].prompt,
        12,
        free[2].sampling.clone(),
        None,
    ));
    let outs: Vec<_> = receivers.into_iter().map(collect).collect();

    assert_eq!(
        outs[0].0, alone[0],
        "free greedy row changed beside constrained rows"
    );
    assert_eq!(
        outs[2].0, alone[1],
        "free greedy row changed beside constrained rows"
    );
    assert_eq!(
        outs[4].0, alone[2],
        "seeded row changed beside constrained rows"
    );
    assert_eq!(
        outs[1],
        (short, Some(FinishReason::Stop)),
        "a complete constraint ends the row"
    );
    assert_eq!(
        outs[3],
        (long[..6].to_vec(), Some(FinishReason::Length)),
        "max_tokens cuts a constrained row"
    );
    runtime.join();
}
