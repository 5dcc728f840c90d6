//! Quantizes a model through `mlxd`'s managed jobs, printing progress, and cancels it on Ctrl-C.
//!
//!     mlxd serve &
//!     cargo run -p mlxd-client --example quantize_job -- /path/to/model-dir [bits] [group size]
//!
//! The quantized model lands in mlxd's store (`$MLXD_HOME/models/<name>-<bits>bit-g<group>`);
//! `MLXD_URL` (default `http://127.0.0.1:8080`) and `MLXD_API_KEY` choose the server.
use mlxd_client::{Client, JobRequest, TaskClient};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let model = args
        .next()
        .ok_or("usage: quantize_job MODEL [BITS] [GROUP_SIZE]")?;
    let bits = args.next().map(|b| b.parse()).transpose()?;
    let group_size = args.next().map(|g| g.parse()).transpose()?;
    let url = std::env::var("MLXD_URL").unwrap_or_else(|_| "http://127.0.0.1:8080".into());
    let mut builder = Client::builder();
    if let Ok(key) = std::env::var("MLXD_API_KEY") {
        builder = builder.api_key(key);
    }
    let tasks = TaskClient::new(builder.http(&url)?);
    let job = tasks
        .submit(&JobRequest::Quantize {
            model,
            bits,
            group_size,
            out: None,
        })
        .await?;
    eprintln!("{} {}", job.id, job.state.as_str());
    let wait = tasks.wait(&job.id, |p| {
        eprintln!(
            "{} {}/{} {}",
            p.phase,
            p.done,
            p.total,
            p.detail.as_deref().unwrap_or("")
        )
    });
    tokio::select! {
        done = wait => {
            let done = done?;
            let result = done.result.ok_or("a succeeded job reports its result")?;
            println!("{} ({} bytes, {:.1} s)", result.dir.display(), result.bytes, result.seconds);
        }
        _ = tokio::signal::ctrl_c() => {
            let job = tasks.cancel(&job.id).await?;
            eprintln!("{} {}", job.id, job.state.as_str());
        }
    }
    Ok(())
}
