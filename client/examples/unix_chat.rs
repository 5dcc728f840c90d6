//! Asks one `mlxd-engine` on its unix socket, without `mlxd` in between.
//!
//!     mlxd-engine --model smollm2-135m --unix /tmp/engine.sock &
//!     cargo run -p mlxd-client --example unix_chat -- /tmp/engine.sock "Name three colors."
use mlxd_client::{
    ChatCompletionRequest, ChatMessage, Client, CompletionClient, GenerationParams, Role,
};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let socket = args.next().ok_or("usage: unix_chat SOCKET [QUESTION]")?;
    let question = args.next().unwrap_or_else(|| "Name three colors.".into());
    let client = Client::builder().unix(socket)?;
    let answer = client
        .complete(ChatCompletionRequest {
            messages: vec![ChatMessage::new(Role::User, question)],
            params: GenerationParams {
                max_tokens: Some(64),
                temperature: Some(0.0),
                ..Default::default()
            },
            ..Default::default()
        })
        .await?;
    let choice = &answer.choices[0];
    println!("{}", choice.message.content.as_deref().unwrap_or_default());
    println!(
        "({} prompt + {} generated tokens, finish: {})",
        answer.usage.prompt_tokens,
        answer.usage.completion_tokens,
        choice.finish_reason.as_deref().unwrap_or("none")
    );
    Ok(())
}
