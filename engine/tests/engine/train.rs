//! LoRA training (`mlxd_engine::job::train`) against mlx-lm's trainer: the fixtures of
//! `scripts/gen_lora_adapter.py` hold mlx-lm's data, starting factors and loss log; mlxd
//! trains from the same factors on the same data with the same settings and must follow
//! mlx-lm's losses, and the adapter it writes must give the same greedy tokens in mlx-lm
//! (`generate` with `adapter_path`) as in mlxd's serving. A cancelled and resumed run ends
//! where an uninterrupted one does; a malformed line fails with its file and line number
//! and writes nothing.
use std::path::{Path, PathBuf};

use mlxd_engine::job::fuse::fuse_dir;
use mlxd_engine::job::train::{
    train, train_with, MemoryBound, Report, StepMode, TrainConfig, TrainSummary,
};
use mlxd_engine::job::JobError;
use mlxd_engine::runtime::request::GenerateRequest;
use mlxd_engine::runtime::{Runtime, RuntimeLimits};
use mlxd_protocol::jobs::TrainParams;
use serde_json::Value;

use crate::common::{collect, tiny_model, Output};

/// Largest difference allowed between mlxd's and mlx-lm's loss at any iteration of the
/// fixture's parity run (learning rate 1e-3, twelve full-batch steps). mlx-lm compiles its
/// step (fused kernels round differently); both sum in float32.
const LOSS_TOLERANCE: f64 = 1e-4;

fn fixture(name: &str) -> (PathBuf, Value) {
    let dir = mlxd_tests::test_models().join(name);
    let log = dir.join("train_log.json");
    let text = std::fs::read_to_string(&log).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (scripts/test.sh generates it with scripts/gen_lora_adapter.py)",
            log.display()
        )
    });
    (
        dir,
        serde_json::from_str(&text).expect("train_log.json is JSON"),
    )
}

/// The fixture's settings as a job's parameters.
fn params_of(log: &Value) -> TrainParams {
    let s = &log["settings"];
    let lora = &s["lora_parameters"];
    TrainParams {
        num_layers: s["num_layers"].as_i64().unwrap() as i32,
        rank: lora["rank"].as_u64().unwrap() as u32,
        scale: lora["scale"].as_f64().unwrap() as f32,
        dropout: lora["dropout"].as_f64().unwrap() as f32,
        learning_rate: s["learning_rate"].as_f64().unwrap() as f32,
        batch_size: s["batch_size"].as_u64().unwrap() as u32,
        iters: s["iters"].as_u64().unwrap(),
        val_batches: s["val_batches"].as_i64().unwrap() as i32,
        steps_per_eval: s["steps_per_eval"].as_u64().unwrap(),
        max_seq_length: s["max_seq_length"].as_u64().unwrap() as u32,
        seed: s["seed"].as_u64().unwrap(),
        fine_tune_type: s
            .get("fine_tune_type")
            .and_then(Value::as_str)
            .unwrap_or("lora")
            .into(),
        lr_schedule: s
            .get("lr_schedule")
            .map(|v| serde_json::from_value(v.clone()).expect("an lr_schedule")),
        ..TrainParams::default()
    }
}

/// Writes `data/<name>.jsonl` for each `(name, lines)` of `splits`: `text` lines of six words
/// in a fixed order, line `i` `words(i)` words long.
fn write_word_lines(data: &Path, splits: &[(&str, usize)], words: impl Fn(usize) -> usize) {
    const WORDS: [&str; 6] = ["harbour", "lantern", "tide", "granite", "beacon", "storm"];
    std::fs::create_dir_all(data).unwrap();
    for &(name, n) in splits {
        let lines: Vec<String> = (0..n)
            .map(|i| {
                let text: Vec<&str> = (0..words(i))
                    .map(|j| WORDS[(i + j * 5 + j / 3) % WORDS.len()])
                    .collect();
                serde_json::json!({"text": text.join(" ")}).to_string()
            })
            .collect();
        std::fs::write(data.join(format!("{name}.jsonl")), lines.join("\n")).unwrap();
    }
}

fn config(model: &Path, data: &Path, params: TrainParams, work: &Path) -> TrainConfig {
    TrainConfig {
        source: model.to_path_buf(),
        data: data.to_path_buf(),
        params,
        checkpoints: work.join("checkpoints"),
        resume: false,
        init_adapter: None,
        out: work.join("adapter"),
    }
}

/// [`train`] as a job runs it (its steps as `MLXD_TRAIN_COMPILE` says), MLX's memory limit
/// left as it is: the limit is the process's, and this binary's tests share theirs.
fn train_here(config: &TrainConfig, report: &mut Report<'_>) -> Result<TrainSummary, JobError> {
    train_with(config, StepMode::from_env()?, MemoryBound::Off, report)
}

fn run(config: &TrainConfig) -> TrainSummary {
    train_here(config, &mut |_| Ok(())).unwrap_or_else(|e| panic!("training failed: {e}"))
}

/// Asserts that two runs' train and validation losses agree within 1e-5, update by update;
/// `what` names the two runs in the message.
fn assert_same_losses(a: &TrainSummary, b: &TrainSummary, what: &str) {
    let pairs = a
        .train_losses
        .iter()
        .zip(&b.train_losses)
        .chain(a.val_losses.iter().zip(&b.val_losses));
    for ((i, x), (j, y)) in pairs {
        assert_eq!(i, j);
        assert!(
            (x - y).abs() <= 1e-5,
            "{what}: loss after {i} updates: {x} against {y}"
        );
    }
}

fn pairs(v: &Value) -> Vec<(u64, f64)> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|p| (p[0].as_u64().unwrap(), p[1].as_f64().unwrap()))
        .collect()
}

/// mlxd's greedy tokens for `prompt` on `model`, with `adapter` applied when given.
fn greedy_on(model: &Path, adapter: Option<&Path>, prompt: &[u32], n: usize) -> Vec<u32> {
    let limits = RuntimeLimits {
        prompt_cache_bytes: 0,
        adapters: adapter
            .map(|a| vec![("trained".to_string(), a.to_path_buf())])
            .unwrap_or_default(),
        ..Default::default()
    };
    let runtime = Runtime::start(model.to_path_buf(), limits, None).expect("load with adapter");
    let id = runtime.adapters.as_ref().and_then(|t| t.id_of("trained"));
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    runtime
        .work
        .send(GenerateRequest {
            prompt: prompt.to_vec(),
            sampling: Default::default(),
            max_tokens: n,
            stop_token_ids: vec![],
            sample_offset: 0,
            events: tx,
            constraint: None,
            logprobs: None,
            adapter: id,
        })
        .expect("runtime is running");
    let Output { tokens, .. } = collect(rx);
    runtime.join();
    tokens
}

fn greedy(model: &Path, adapter: &Path, prompt: &[u32], n: usize) -> Vec<u32> {
    greedy_on(model, Some(adapter), prompt, n)
}

#[test]
fn training_follows_mlx_lm_losses_and_its_adapter_gives_the_same_tokens_in_mlx_lm() {
    follows_mlx_lm("tiny-llama", "tiny-llama-lora-a", "parity");
}

/// A warmup then cosine-decay learning rate (mlx-lm's `lr_schedule`) gives mlx-lm's losses.
#[test]
fn a_learning_rate_schedule_follows_mlx_lm_losses() {
    follows_mlx_lm("tiny-llama", "tiny-llama-lora-a", "schedule");
}

/// QLoRA: the 4-bit base stays quantized and frozen; the factors train as mlx-lm's do.
#[test]
fn qlora_on_a_4_bit_base_follows_mlx_lm_losses_and_gives_its_tokens() {
    follows_mlx_lm("tiny-llama-q4", "tiny-llama-q4-lora", "parity");
}

/// DoRA: the magnitudes start from the base weight's row norms (the starting file has the
/// factors only) and train with them, as mlx-lm's `DoRALinear` does.
#[test]
fn dora_training_follows_mlx_lm_losses_and_gives_its_tokens() {
    follows_mlx_lm("tiny-llama", "tiny-llama-dora", "parity");
}

/// LoRA on a mixture-of-experts base: the expert stacks train one factor pair per expert
/// (mlx-lm's `LoRASwitchLinear`), the router and the other linears as usual, with mlx-lm's
/// losses; mlx-lm loads the adapter mlxd writes.
#[test]
fn lora_on_expert_stacks_follows_mlx_lm_losses_and_gives_its_tokens() {
    follows_mlx_lm("family-qwen3_moe", "family-qwen3_moe-lora-a", "parity");
}

/// DoRA has no form for expert stacks (mlx-lm refuses it): a DoRA run on a MoE base fails
/// with the reason, before anything is written.
#[test]
fn dora_on_a_mixture_of_experts_base_is_refused() {
    let model = tiny_model("family-qwen3_moe");
    let (fixture, log) = fixture("family-qwen3_moe-lora-a");
    let params = TrainParams {
        fine_tune_type: "dora".into(),
        ..params_of(&log["parity"])
    };
    let work = tempfile::tempdir().unwrap();
    let config = config(&model, &fixture.join("data"), params, work.path());
    let err = train_here(&config, &mut |_| Ok(())).unwrap_err();
    assert!(
        matches!(&err, JobError::Input(m) if m.contains("DoRA") && m.contains("expert stack")),
        "{err}"
    );
    assert!(!config.out.exists(), "no adapter written");
}

/// `grad_checkpoint` recomputes each layer in the backward pass: the losses of a LoRA and of
/// a DoRA run (with dropout, whose masks the recomputation must draw again) are those of the
/// same run without it. (Its lower peak memory is measured per job process, in
/// `tests/tests/jobs.rs`: this binary's tests share one MLX allocator.)
#[test]
fn gradient_checkpointing_gives_the_same_losses() {
    let model = tiny_model("tiny-llama");
    for name in ["tiny-llama-lora-a", "tiny-llama-dora"] {
        let (fixture, log) = fixture(name);
        let mut params = params_of(&log["parity"]);
        params.iters = 5;
        params.dropout = 0.1;
        let run_with = |grad_checkpoint: bool| {
            let work = tempfile::tempdir().unwrap();
            let params = TrainParams {
                grad_checkpoint,
                ..params.clone()
            };
            let mut config = config(&model, &fixture.join("data"), params, work.path());
            config.init_adapter = Some(fixture.join("init_adapters.safetensors"));
            run(&config)
        };
        let (plain, checkpointed) = (run_with(false), run_with(true));
        assert_eq!(plain.train_losses.len(), 5);
        assert_same_losses(
            &plain,
            &checkpointed,
            &format!("{name}, without checkpointing and with"),
        );
        assert!(
            plain.train_losses[4].1 < plain.train_losses[0].1 - 0.05,
            "{name}: it trains"
        );
    }
}

/// The compiled training step (the default) and the same step run op by op give the same
/// losses, for LoRA and DoRA, with and without gradient checkpointing, with dropout (whose key
/// is a step input: a key baked into the compiled graph would draw the first step's masks
/// again), AdamW and a learning-rate schedule (the rate is an input too). The compiled run
/// traces its step once per batch shape and the uncompiled one once per iteration, so a
/// compiled path that silently stopped compiling fails here.
#[test]
fn compiled_and_uncompiled_steps_give_the_same_losses() {
    use mlxd_engine::job::train::data;
    use mlxd_protocol::jobs::Optimizer;
    let model = tiny_model("tiny-llama");
    for (name, grad_checkpoint) in [
        ("tiny-llama-lora-a", false),
        ("tiny-llama-lora-a", true),
        ("tiny-llama-dora", true),
    ] {
        let (fixture, log) = fixture(name);
        let schedule = params_of(&fixture_log_schedule(&log));
        let params = TrainParams {
            iters: 8,
            batch_size: 2,
            // Long enough that the batches' widths (one plus a multiple of 32) differ.
            max_seq_length: 2048,
            dropout: 0.1,
            optimizer: Optimizer::Adamw,
            lr_schedule: schedule.lr_schedule,
            grad_checkpoint,
            ..params_of(&log["parity"])
        };
        assert!(
            params.lr_schedule.is_some(),
            "{name}: the fixture has a schedule"
        );
        let data_dir = fixture.join("data");
        let run_as = |mode: StepMode| {
            let work = tempfile::tempdir().unwrap();
            let mut config = config(&model, &data_dir, params.clone(), work.path());
            config.init_adapter = Some(fixture.join("init_adapters.safetensors"));
            train_with(&config, mode, MemoryBound::Off, &mut |_| Ok(()))
                .unwrap_or_else(|e| panic!("{name}: training ({mode:?}) failed: {e}"))
        };
        let (compiled, uncompiled) = (run_as(StepMode::Compiled), run_as(StepMode::Uncompiled));
        assert_eq!(compiled.train_losses.len(), 8);
        assert_same_losses(
            &compiled,
            &uncompiled,
            &format!("{name} (checkpointing {grad_checkpoint}), compiled and uncompiled"),
        );
        assert!(
            compiled.train_losses[7].1 < compiled.train_losses[0].1 - 0.05,
            "{name}: it trains"
        );

        // The shapes the run's batches have: its step is compiled once per shape.
        let tokenizer = mlxd_engine::tokenizer::Tokenizer::from_dir(&model).unwrap();
        let set = data::load(&data_dir, &tokenizer, params.mask_prompt).unwrap();
        let mut widths: Vec<usize> = data::batch_indices(&set.train, 2)
            .iter()
            .map(|b| {
                let rows: Vec<&data::Example> = b.iter().map(|&i| &set.train[i]).collect();
                data::batch(&rows, 2048).width
            })
            .collect();
        widths.sort();
        widths.dedup();
        assert!(widths.len() > 1, "the test's batches have several shapes");
        assert_eq!(
            compiled.step_traces,
            widths.len() as u64,
            "{name}: compiled once per batch shape ({widths:?})"
        );
        assert_eq!(uncompiled.step_traces, 8, "{name}: traced every iteration");
    }
}

/// The fixture's scheduled run's log (the LoRA fixture has one; the DoRA fixture takes the
/// LoRA fixture's schedule).
fn fixture_log_schedule(log: &Value) -> Value {
    if log["schedule"].is_object() {
        return log["schedule"].clone();
    }
    fixture("tiny-llama-lora-a").1["schedule"].clone()
}

/// Trains from the fixture's starting factors with its parity run's settings and compares
/// losses and the written adapter's tokens with mlx-lm's.
fn follows_mlx_lm(base: &str, adapter_fixture: &str, which: &str) {
    let model = tiny_model(base);
    let (fixture, log) = fixture(adapter_fixture);
    let log = &log[which];
    assert!(
        log.is_object(),
        "train_log.json has no {which} run: regenerate the fixture (scripts/gen_lora_adapter.py)"
    );
    let work = tempfile::tempdir().unwrap();
    let mut config = config(&model, &fixture.join("data"), params_of(log), work.path());
    config.init_adapter = Some(fixture.join("init_adapters.safetensors"));
    let summary = run(&config);

    // mlx-lm reports iteration `it` (1-based) for the loss of its it-th step; mlxd counts
    // updates done before the step, from 0.
    let theirs = pairs(&log["train"]);
    assert_eq!(summary.train_losses.len(), theirs.len());
    for ((i, ours), (it, want)) in summary.train_losses.iter().zip(&theirs) {
        assert_eq!(i + 1, *it);
        assert!(
            (ours - want).abs() <= LOSS_TOLERANCE,
            "train loss of iteration {it}: mlxd {ours}, mlx-lm {want}"
        );
    }
    let theirs = pairs(&log["valid"]);
    assert_eq!(
        summary.val_losses.iter().map(|v| v.0).collect::<Vec<_>>(),
        theirs.iter().map(|v| v.0).collect::<Vec<_>>(),
        "validation after the same numbers of updates"
    );
    for ((i, ours), (_, want)) in summary.val_losses.iter().zip(&theirs) {
        assert!(
            (ours - want).abs() <= LOSS_TOLERANCE,
            "validation loss after {i} updates: mlxd {ours}, mlx-lm {want}"
        );
    }
    let first = summary.train_losses[0].1;
    let last = summary.train_losses.last().unwrap().1;
    assert!(last < first - 0.5, "the loss falls: {first} -> {last}");
    eprintln!(
        "parity: train {:?}\n        mlx-lm {:?}\n        valid {:?} mlx-lm {:?}",
        summary.train_losses,
        pairs(&log["train"]),
        summary.val_losses,
        theirs
    );

    // The adapter mlxd wrote: mlx-lm loads it, and gives mlxd's serving tokens.
    let adapter = &config.out;
    const PROMPT: &[u32] = &[1, 20, 31, 42, 53, 64, 75];
    let in_mlx_lm = crate::common::mlx_lm_greedy_with_adapter(&model, adapter, 8, PROMPT);
    assert_eq!(greedy(&model, adapter, PROMPT, 8), in_mlx_lm);
    assert_ne!(
        in_mlx_lm,
        crate::common::mlx_lm_greedy(&model, 8, PROMPT),
        "the trained adapter changes the greedy tokens, or the comparison shows nothing"
    );
}

#[test]
fn a_run_stopped_after_a_checkpoint_and_resumed_ends_where_an_uninterrupted_one_does() {
    let model = tiny_model("tiny-llama");
    let (fixture, log) = fixture("tiny-llama-lora-b");
    let params = TrainParams {
        iters: 6,
        save_every: 2,
        ..params_of(&log)
    };
    let whole_dir = tempfile::tempdir().unwrap();
    let whole = run(&config(
        &model,
        &fixture.join("data"),
        params.clone(),
        whole_dir.path(),
    ));

    let work = tempfile::tempdir().unwrap();
    let mut cfg = config(&model, &fixture.join("data"), params, work.path());
    // Stop (as a cancel does) once iteration 5 is done: the checkpoint of iteration 4 stays.
    let stopped = train_here(&cfg, &mut |p| match p.training {
        Some(t) if t.iteration == 5 && p.phase == "training" => {
            Err(JobError::Input("stopped by the test".into()))
        }
        _ => Ok(()),
    });
    assert!(stopped.is_err());
    assert!(!cfg.out.exists(), "a stopped run writes no adapter");
    assert!(cfg.checkpoints.join("checkpoint.safetensors").is_file());
    cfg.resume = true;
    let resumed = run(&cfg);
    assert_eq!(
        resumed.train_losses.first().map(|l| l.0),
        Some(4),
        "the resumed run starts after the checkpoint of iteration 4"
    );
    let (a, b) = (
        whole.train_losses.last().unwrap(),
        resumed.train_losses.last().unwrap(),
    );
    assert_eq!(a.0, b.0);
    assert!(
        (a.1 - b.1).abs() < 1e-6,
        "last loss: uninterrupted {}, resumed {}",
        a.1,
        b.1
    );
    assert_eq!(whole.val_losses.last(), resumed.val_losses.last());
    let read = |dir: &Path| std::fs::read(dir.join("adapters.safetensors")).unwrap();
    assert_eq!(
        read(&whole_dir.path().join("adapter")),
        read(&cfg.out),
        "the same adapter, byte for byte"
    );
}

#[test]
fn a_malformed_line_fails_with_its_file_and_line_and_nothing_is_written() {
    let model = tiny_model("tiny-llama");
    let data = tempfile::tempdir().unwrap();
    std::fs::write(
        data.path().join("train.jsonl"),
        "{\"text\": \"red cat\"}\n{\"text\": \"blue dog\"}\n{\"text\": \"green\n",
    )
    .unwrap();
    std::fs::write(data.path().join("valid.jsonl"), "{\"text\": \"sky\"}\n").unwrap();
    let work = tempfile::tempdir().unwrap();
    let cfg = config(&model, data.path(), TrainParams::default(), work.path());
    let err = train_here(&cfg, &mut |_| Ok(())).unwrap_err().to_string();
    assert!(err.contains("train.jsonl:3: not JSON"), "{err}");
    assert!(!cfg.out.exists() && !cfg.checkpoints.exists());

    std::fs::write(
        data.path().join("train.jsonl"),
        "{\"text\": \"red cat\"}\n{\"prompt\": \"a\", \"completion\": \"b\"}\n",
    )
    .unwrap();
    let err = train_here(&cfg, &mut |_| Ok(())).unwrap_err().to_string();
    assert!(err.contains("train.jsonl:2: has \"prompt\""), "{err}");
}

const FUSE_PROMPT: &[u32] = &[1, 20, 31, 42, 53, 64, 75];

fn fuse(model: &Path, adapter: &Path, work: &Path) -> PathBuf {
    let out = work.join("fused");
    fuse_dir(model, adapter, &work.join("staging"), &out, &mut |_| Ok(()))
        .unwrap_or_else(|e| panic!("fuse failed: {e}"));
    assert!(
        !work.join("staging").exists(),
        "the staging directory is gone"
    );
    out
}

#[test]
fn a_fused_model_gives_the_tokens_of_its_base_with_the_adapter() {
    let model = tiny_model("tiny-llama");
    let (adapter, _) = fixture("tiny-llama-lora-a");
    let work = tempfile::tempdir().unwrap();
    let fused = fuse(&model, &adapter, work.path());
    let with_adapter = crate::common::mlx_lm_greedy_with_adapter(&model, &adapter, 8, FUSE_PROMPT);
    assert_eq!(greedy_on(&fused, None, FUSE_PROMPT, 8), with_adapter);
    assert_ne!(
        with_adapter,
        crate::common::mlx_lm_greedy(&model, 8, FUSE_PROMPT),
        "the adapter changes the tokens, or the comparison shows nothing"
    );
}

#[test]
fn a_quantized_base_is_fused_as_mlx_lm_fuses_it() {
    let model = tiny_model("tiny-llama-q4");
    let (adapter, _) = fixture("tiny-llama-q4-lora");
    let work = tempfile::tempdir().unwrap();
    let fused = fuse(&model, &adapter, work.path());
    // mlx-lm's own fuse of the same adapter (dequantize, merge, quantize with the base's
    // settings): the same tensors, bit for bit.
    let theirs = mlx_lm_fuse(&model, &adapter, work.path());
    let load = |dir: &Path| {
        mlx_rs::Array::load_safetensors(dir.join("model.safetensors")).expect("fused weights")
    };
    let (ours, want) = (load(&fused), load(&theirs));
    let mut names: Vec<&String> = want.keys().collect();
    names.sort();
    assert_eq!(ours.len(), want.len(), "tensor count");
    for name in names {
        let (a, b) = (&ours[name], &want[name]);
        assert_eq!(a.shape(), b.shape(), "{name}");
        assert_eq!(a.dtype(), b.dtype(), "{name}");
        let same = a.eq_values(b).unwrap();
        assert!(same, "{name} differs from mlx-lm's fuse");
    }
    assert_eq!(
        greedy_on(&fused, None, FUSE_PROMPT, 8),
        crate::common::mlx_lm_greedy(&theirs, 8, FUSE_PROMPT)
    );
}

/// A DoRA adapter fused as mlx-lm's `DoRALinear.fuse` fuses it: each adapted weight within
/// float32 rounding of mlx-lm's, the others the same, and the same greedy tokens as the base
/// with the adapter.
#[test]
fn a_dora_adapter_is_fused_as_mlx_lm_fuses_it() {
    let model = tiny_model("tiny-llama");
    let (adapter, _) = fixture("tiny-llama-dora");
    let work = tempfile::tempdir().unwrap();
    let (fused, theirs, changed) = fuse_like_mlx_lm(&model, &adapter, work.path(), |name| {
        name.contains("layers") && name.ends_with("proj.weight")
    });
    assert!(changed > 0, "the adapted weights were compared");
    let with_adapter = crate::common::mlx_lm_greedy_with_adapter(&model, &adapter, 8, FUSE_PROMPT);
    assert_eq!(greedy_on(&fused, None, FUSE_PROMPT, 8), with_adapter);
    assert_eq!(
        crate::common::mlx_lm_greedy(&theirs, 8, FUSE_PROMPT),
        with_adapter
    );
}

/// An adapter with expert-stack factors fused as mlx-lm's `LoRASwitchLinear.fuse` fuses it:
/// every tensor within float32 rounding of mlx-lm's fuse, and the fused model gives the base's
/// tokens with the adapter.
#[test]
fn an_adapter_on_expert_stacks_is_fused_as_mlx_lm_fuses_it() {
    let model = tiny_model("family-qwen3_moe");
    let (adapter, _) = fixture("family-qwen3_moe-lora-a");
    let work = tempfile::tempdir().unwrap();
    let (fused, _, stacks) = fuse_like_mlx_lm(&model, &adapter, work.path(), |name| {
        name.contains("switch_mlp")
    });
    assert_eq!(stacks, 6, "the expert stacks were compared");
    let with_adapter = crate::common::mlx_lm_greedy_with_adapter(&model, &adapter, 8, FUSE_PROMPT);
    assert_ne!(
        with_adapter,
        crate::common::mlx_lm_greedy(&model, 8, FUSE_PROMPT),
        "the adapter changes the tokens, or the comparison shows nothing"
    );
    assert_eq!(greedy_on(&fused, None, FUSE_PROMPT, 8), with_adapter);
}

/// Fuses `adapter` into `model` with mlxd's job and with `mlx_lm fuse`, and asserts every
/// tensor of the two equal in shape and dtype and within float32 rounding; returns mlxd's
/// fused directory, mlx-lm's, and how many tensors `counted` picks (so that a test can check
/// the adapted ones were among those compared).
fn fuse_like_mlx_lm(
    model: &Path,
    adapter: &Path,
    work: &Path,
    counted: impl Fn(&str) -> bool,
) -> (PathBuf, PathBuf, usize) {
    let fused = fuse(model, adapter, work);
    let theirs = mlx_lm_fuse(model, adapter, work);
    let load = |dir: &Path| {
        mlx_rs::Array::load_safetensors(dir.join("model.safetensors")).expect("fused weights")
    };
    let (ours, want) = (load(&fused), load(&theirs));
    assert_eq!(ours.len(), want.len(), "tensor count");
    let mut picked = 0;
    for (name, b) in &want {
        let a = &ours[name];
        assert_eq!(a.shape(), b.shape(), "{name}");
        assert_eq!(a.dtype(), b.dtype(), "{name}");
        let close = a.all_close(b, 1e-5, 1e-6, None).unwrap();
        assert!(close, "{name} differs from mlx-lm's fuse");
        picked += usize::from(counted(name));
    }
    (fused, theirs, picked)
}

/// `mlx_lm fuse` of `adapter` into `model`, in `work/mlx-lm-fused`.
fn mlx_lm_fuse(model: &Path, adapter: &Path, work: &Path) -> PathBuf {
    let theirs = work.join("mlx-lm-fused");
    let status = std::process::Command::new(mlxd_tests::python().expect("the test venv"))
        .args(["-m", "mlx_lm", "fuse", "--model"])
        .arg(model)
        .arg("--adapter-path")
        .arg(adapter)
        .arg("--save-path")
        .arg(&theirs)
        .stdout(std::process::Stdio::null())
        .status()
        .expect("running mlx_lm fuse");
    assert!(status.success());
    theirs
}

#[test]
fn data_lines_become_mlx_lm_s_tokens_and_prompt_offsets() {
    let model = tiny_model("tiny-llama");
    let dir = tempfile::tempdir().unwrap();
    let files = [
        (
            "comp.jsonl",
            "{\"prompt\": \"red cat\", \"completion\": \"blue dog\"}\n\
             {\"prompt\": \"sky\", \"completion\": \"tree over stone\"}\n",
        ),
        (
            "chat.jsonl",
            "{\"messages\": [{\"role\": \"system\", \"content\": \"be brief\"}, \
             {\"role\": \"user\", \"content\": \"hi\"}, \
             {\"role\": \"assistant\", \"content\": \"hello there\"}]}\n",
        ),
        ("text.jsonl", "{\"text\": \"the quick river\"}\n"),
    ];
    for (name, text) in files {
        std::fs::write(dir.path().join(name), text).unwrap();
    }
    let out = std::process::Command::new(mlxd_tests::python().expect("the test venv"))
        .arg(mlxd_tests::workspace_root().join("scripts/mlx_lm_dataset.py"))
        .arg(&model)
        .args(files.iter().map(|(n, _)| dir.path().join(n)))
        .output()
        .expect("running scripts/mlx_lm_dataset.py");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let want: Vec<Vec<(Vec<u32>, usize)>> = serde_json::from_slice(&out.stdout).unwrap();
    let tokenizer = mlxd_engine::tokenizer::Tokenizer::from_dir(&model).unwrap();
    for ((name, _), want) in files.iter().zip(want) {
        let mask = *name != "text.jsonl";
        let ours: Vec<(Vec<u32>, usize)> =
            mlxd_engine::job::train::data::load_file(&dir.path().join(name), &tokenizer, mask)
                .unwrap_or_else(|e| panic!("{name}: {e}"))
                .into_iter()
                .map(|e| (e.tokens, e.offset))
                .collect();
        assert_eq!(ours, want, "{name}");
    }
}

/// A measurement, run by hand, one process per mode (MLX's peak counter is the process's):
/// `MLXD_TRAIN_COMPILE=1|0 cargo test -p mlxd-engine --test engine -- --ignored
/// train_step_figures --nocapture`, on `MLXD_TRAIN_BENCH_MODEL` (default the tiny llama) with
/// generated text rows filling `MLXD_TRAIN_BENCH_SEQ` tokens (default 256), batch 4,
/// `MLXD_TRAIN_BENCH_ITERS` iterations (default 30) (`MLXD_TRAIN_BENCH_CHECKPOINT=1`: with gradient checkpointing). Prints the
/// median tokens/s of the iterations after the first third and MLX's
/// peak memory, as `scripts/bench/lora_train.py` takes them from a job's progress.
#[test]
#[ignore]
fn train_step_figures() {
    let var = |k: &str| std::env::var(k).ok();
    let model = var("MLXD_TRAIN_BENCH_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| tiny_model("tiny-llama"));
    let seq: u32 = var("MLXD_TRAIN_BENCH_SEQ").map_or(256, |s| s.parse().unwrap());
    let work = tempfile::tempdir().unwrap();
    let data = work.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let words = [
        "harbour", "lantern", "tide", "granite", "beacon", "storm", "river", "stone",
    ];
    for (name, n) in [("train", 32), ("valid", 4)] {
        let lines: Vec<String> = (0..n)
            .map(|i| {
                let text: Vec<&str> = (0..2 * seq as usize)
                    .map(|j| words[(i * 7 + j * 3 + j / 5) % words.len()])
                    .collect();
                serde_json::json!({"text": text.join(" ")}).to_string()
            })
            .collect();
        std::fs::write(data.join(format!("{name}.jsonl")), lines.join("\n")).unwrap();
    }
    let iters = var("MLXD_TRAIN_BENCH_ITERS").map_or(30, |s| s.parse().unwrap());
    let params = TrainParams {
        iters,
        batch_size: 4,
        num_layers: 16,
        rank: 8,
        max_seq_length: seq,
        steps_per_eval: 10 * iters,
        save_every: 10 * iters,
        val_batches: 1,
        grad_checkpoint: var("MLXD_TRAIN_BENCH_CHECKPOINT").as_deref() == Some("1"),
        ..TrainParams::default()
    };
    let grad_checkpoint = params.grad_checkpoint;
    let config = config(&model, &data, params, work.path());
    let mut rates = Vec::new();
    let mut peak = 0;
    let started = std::time::Instant::now();
    let summary = train(&config, &mut |p| {
        if let Some(t) = &p.training {
            if p.phase == "training" && t.iteration > iters / 3 {
                rates.push(t.tokens_per_second);
            }
            peak = peak.max(t.peak_memory_bytes);
        }
        Ok(())
    })
    .unwrap();
    rates.sort_by(f64::total_cmp);
    println!(
        "{}",
        serde_json::json!({
            "model": model.file_name().map(|n| n.to_string_lossy().into_owned()),
            "compile": std::env::var("MLXD_TRAIN_COMPILE").unwrap_or_else(|_| "1".into()),
            "seq": seq,
            "grad_checkpoint": grad_checkpoint,
            "tok_s_median": rates[rates.len() / 2],
            "peak_mb": peak as f64 / 1e6,
            "traces": summary.step_traces,
            "last_loss": summary.train_losses.last().map(|l| l.1),
            "wall_s": started.elapsed().as_secs_f64(),
        })
    );
}

/// Set in the child process of [`active_memory_stays_flat_across_iterations`]: the run's
/// settings (`compiled|uncompiled` and `plain|checkpointed`).
const MEMORY_CHILD: &str = "MLXD_TRAIN_MEMORY_CHILD";
/// The line on which the child prints its figures.
const MEMORY_MARK: &str = "active memory per iteration: ";

/// MLX's active memory after each training iteration stays where it was after the second
/// (weights, factors, Adam's moments: nothing of a step outlives it), compiled and not, with
/// and without gradient checkpointing, with dropout, validations and checkpoints between the
/// steps and batches of several widths (issue 25: on an H100 active memory grew by ~1.3 GB
/// over six iterations, and the peak with it). Each run is a process of its own, since MLX's
/// counters are the process's and this binary's tests run side by side.
#[test]
fn active_memory_stays_flat_across_iterations() {
    let exe = std::env::current_exe().unwrap();
    for settings in [
        "compiled plain",
        "uncompiled plain",
        "compiled checkpointed",
        "uncompiled checkpointed",
        "compiled checkpointed dora",
    ] {
        let out = std::process::Command::new(&exe)
            .args([
                "--exact",
                "train::active_memory_per_iteration",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(MEMORY_CHILD, settings)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{settings}: the child failed: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let line = stdout
            .lines()
            .find_map(|l| l.split_once(MEMORY_MARK).map(|(_, figures)| figures))
            .unwrap_or_else(|| panic!("{settings}: no figures in {stdout}"));
        let active: Vec<i64> = serde_json::from_str(line).unwrap();
        println!("{settings}: {active:?}");
        assert_eq!(active.len(), 12, "{settings}");
        for (i, a) in active.iter().enumerate().skip(2) {
            assert!(
                (a - active[1]).abs() <= MEMORY_TOLERANCE,
                "{settings}: active memory after iteration {} is {a} bytes, after iteration \
                 2 {} ({active:?})",
                i + 1,
                active[1]
            );
        }
    }
}

/// Bytes of active memory an iteration may differ by from the second: compiled runs on the
/// CPU vary by up to ~50 KB between iterations (the same widths included, not growing), and a
/// step's logits alone are 0.8 MB at the widest batch here, so a step's graph kept shows.
const MEMORY_TOLERANCE: i64 = 256 * 1024;

/// The child of [`active_memory_stays_flat_across_iterations`] (nothing without its
/// variable): trains the tiny llama 12 iterations on rows of several lengths and prints MLX's
/// active memory after each.
#[test]
#[ignore = "run by active_memory_stays_flat_across_iterations, in a process of its own"]
fn active_memory_per_iteration() {
    let Ok(settings) = std::env::var(MEMORY_CHILD) else {
        return;
    };
    let mode = if settings.contains("uncompiled") {
        StepMode::Uncompiled
    } else {
        StepMode::Compiled
    };
    let model = tiny_model("tiny-llama");
    let work = tempfile::tempdir().unwrap();
    let data = work.path().join("data");
    // 10 to 160 words: batches of several widths.
    write_word_lines(&data, &[("train", 16), ("valid", 4)], |i| 10 + 10 * i);
    let params = TrainParams {
        iters: 12,
        batch_size: 2,
        num_layers: -1,
        max_seq_length: 256,
        steps_per_eval: 4,
        save_every: 5,
        val_batches: 2,
        dropout: 0.1,
        learning_rate: 1e-3,
        grad_checkpoint: settings.contains("checkpointed"),
        fine_tune_type: if settings.contains("dora") {
            "dora"
        } else {
            "lora"
        }
        .into(),
        ..TrainParams::default()
    };
    let config = config(&model, &data, params, work.path());
    let mut active = Vec::new();
    train_with(&config, mode, MemoryBound::Off, &mut |p| {
        let done = p.training.as_ref().map_or(0, |t| t.iteration);
        if p.phase == "training" && done as usize == active.len() + 1 {
            active.push(mlx_rs::memory::active_memory().unwrap() as i64);
        }
        Ok(())
    })
    .unwrap();
    println!("{MEMORY_MARK}{}", serde_json::to_string(&active).unwrap());
}

/// Set in the child process of [`the_memory_limit_is_the_first_step_peak_with_the_margin`]:
/// `unset` or the value of `MLXD_TRAIN_MEMORY_LIMIT` the child's run is given.
const LIMIT_CHILD: &str = "MLXD_TRAIN_LIMIT_CHILD";
/// The line on which that child prints its figures.
const LIMIT_MARK: &str = "memory limit figures: ";

/// A run bounds MLX's memory limit by its batch width's first-step peak times the margin
/// (`MLXD_TRAIN_MEMORY_LIMIT` unset or `auto`), leaves it as it was with `off`, and refuses
/// any other value. Each run is a process of its own: the limit and the peak counter are the
/// process's.
#[test]
fn the_memory_limit_is_the_first_step_peak_with_the_margin() {
    use mlxd_engine::job::train::memory_bound::MARGIN;
    let exe = std::env::current_exe().unwrap();
    let child = |value: &str| {
        let mut command = std::process::Command::new(&exe);
        command
            .args([
                "--exact",
                "train::memory_limit_of_a_run",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(LIMIT_CHILD, value)
            .env_remove("MLXD_TRAIN_MEMORY_LIMIT");
        if value != "unset" {
            command.env("MLXD_TRAIN_MEMORY_LIMIT", value);
        }
        let out = command.output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{value}: the child failed: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let line = stdout
            .lines()
            .find_map(|l| {
                l.split_once(LIMIT_MARK)
                    .map(|(_, figures)| figures.to_string())
            })
            .unwrap_or_else(|| panic!("{value}: no figures in {stdout}"));
        serde_json::from_str::<Value>(&line).unwrap()
    };
    for value in ["unset", "auto"] {
        let figures = child(value);
        println!("{value}: {figures}");
        let [start, after, first_peak] =
            ["start", "after", "first_step_peak"].map(|k| figures[k].as_u64().unwrap() as f64);
        let want = first_peak * MARGIN;
        assert!(
            (after - want).abs() <= 1.0,
            "{value}: MLX's limit after the run is {after} bytes; the first step peaked at \
             {first_peak}, times {MARGIN} is {want} ({figures})"
        );
        assert!(after < start, "{value}: {figures}");
    }
    let off = child("off");
    println!("off: {off}");
    assert_eq!(off["after"], off["start"], "off: {off}");
    let refused = child("sometimes");
    let error = refused["error"].as_str().unwrap();
    assert!(error.contains("MLXD_TRAIN_MEMORY_LIMIT"), "{error}");
}

/// The child of [`the_memory_limit_is_the_first_step_peak_with_the_margin`] (nothing without
/// its variable): trains the tiny llama 6 iterations through [`train`], as a job does, on
/// rows that all fill `max_seq_length` (one batch width), and prints MLX's limit before and
/// after the run and the run's peak after its first step (the first step's own: the weights
/// load and the first validation, before it, hold less). A run that fails prints its error.
#[test]
#[ignore = "run by the_memory_limit_is_the_first_step_peak_with_the_margin, in a process of its own"]
fn memory_limit_of_a_run() {
    if std::env::var(LIMIT_CHILD).is_err() {
        return;
    }
    let model = tiny_model("tiny-llama");
    let work = tempfile::tempdir().unwrap();
    let data = work.path().join("data");
    write_word_lines(&data, &[("train", 8), ("valid", 2)], |_| 300);
    let params = TrainParams {
        iters: 6,
        batch_size: 2,
        num_layers: -1,
        max_seq_length: 128,
        steps_per_eval: 100,
        save_every: 100,
        val_batches: 1,
        learning_rate: 1e-3,
        ..TrainParams::default()
    };
    let config = config(&model, &data, params, work.path());
    let start = mlx_rs::memory::memory_limit().unwrap();
    let mut first_step_peak = None;
    let result = train(&config, &mut |p| {
        if let Some(t) = &p.training {
            if p.phase == "training" && t.iteration == 1 {
                first_step_peak = Some(t.peak_memory_bytes);
            }
        }
        Ok(())
    });
    let figures = match result {
        Ok(_) => serde_json::json!({
            "start": start,
            "after": mlx_rs::memory::memory_limit().unwrap(),
            "first_step_peak": first_step_peak.expect("a report after the first step"),
        }),
        Err(e) => serde_json::json!({"error": e.to_string()}),
    };
    println!("{LIMIT_MARK}{figures}");
}
