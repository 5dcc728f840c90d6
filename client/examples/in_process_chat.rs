//! Runs the engine inside this process and answers a batch of questions, in order.
//!
//!     cargo run -p mlxd-client --features in-process --example in_process_chat
//!
//! The model is `smollm2-135m` from the store (`$MLXD_HOME`, else `~/.cache/mlxd`), fetched
//! and converted on first use; a first argument names another model (id, directory or GGUF).
use mlxd_client::{
    BatchCompletionClient, ChatCompletionRequest, ChatMessage, Client, GenerationParams,
    InProcessOptions, Role,
};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let model = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "smollm2-135m".into());
    let client = Client::builder()
        .in_process(&model, InProcessOptions::default())
        .await?;
    let questions = [
        "What is the capital of France?",
        "Name a prime number.",
        "Say hello in Spanish.",
    ];
    let requests = questions
        .iter()
        .map(|q| ChatCompletionRequest {
            messages: vec![ChatMessage::new(Role::User, *q)],
            params: GenerationParams {
                max_tokens: Some(32),
                temperature: Some(0.0),
                ..Default::default()
            },
            ..Default::default()
        })
        .collect();
    for (question, answer) in questions.iter().zip(client.complete_batch(requests).await) {
        let answer = answer?;
        println!(
            "{question}\n  {}",
            answer.choices[0]
                .message
                .content
                .as_deref()
                .unwrap_or_default()
        );
    }
    // Waits for anything still in flight, then stops the engine's MLX thread.
    client.close().await;
    Ok(())
}
