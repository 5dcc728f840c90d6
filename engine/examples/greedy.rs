//! Debugging aid: `cargo run --example greedy -- <model dir> <max tokens> <token id>...`
//! prints the greedy continuation's token ids, one line, space-separated.
fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dir = std::path::Path::new(&args[0]);
    let max: usize = args[1].parse()?;
    let prompt: Vec<u32> = args[2..]
        .iter()
        .map(|s| s.parse())
        .collect::<Result<_, _>>()?;
    let model = mlxd_engine::models::load(dir)?;
    let out = mlxd_engine::runtime::reference::greedy(model.as_ref(), &prompt, max, &[])?;
    println!(
        "{}",
        out.iter().map(u32::to_string).collect::<Vec<_>>().join(" ")
    );
    Ok(())
}
