//! Streams a chat answer from `mlxd` over HTTP.
//!
//!     mlxd serve &        # the default model, on 127.0.0.1:8080
//!     cargo run -p mlxd-client --example http_chat -- "What is the capital of France?"
//!
//! `MLXD_URL` (default `http://127.0.0.1:8080`) and `MLXD_API_KEY` (when mlxd has keys)
//! choose the server.
use std::io::Write;

use futures::StreamExt;
use mlxd_client::{ChatCompletionRequest, ChatMessage, Client, CompletionClient, Role};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let question = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "What is the capital of France?".into());
    let url = std::env::var("MLXD_URL").unwrap_or_else(|_| "http://127.0.0.1:8080".into());
    let mut builder = Client::builder();
    if let Ok(key) = std::env::var("MLXD_API_KEY") {
        builder = builder.api_key(key);
    }
    let client = builder.http(&url)?;
    let request = ChatCompletionRequest {
        messages: vec![ChatMessage::new(Role::User, question)],
        ..Default::default()
    };
    let mut chunks = client.stream(request).await?;
    while let Some(chunk) = chunks.next().await {
        for choice in chunk?.choices {
            print!("{}", choice.delta.content.unwrap_or_default());
            std::io::stdout().flush()?;
        }
    }
    println!();
    Ok(())
}
