//! The loader refuses incomplete or padded checkpoints and names the tensors involved.
use crate::common;

use std::fs;

use mlxd_engine::loader::LoadError;
use mlxd_engine::models;

fn copy_model(shape: &str) -> tempfile::TempDir {
    let src = common::tiny_model(shape);
    let dir = tempfile::tempdir().expect("tempdir");
    for entry in fs::read_dir(&src).expect("read model dir") {
        let entry = entry.expect("entry");
        fs::copy(entry.path(), dir.path().join(entry.file_name())).expect("copy");
    }
    dir
}

fn rewrite_weights(
    dir: &std::path::Path,
    edit: impl FnOnce(&mut std::collections::HashMap<String, mlx_rs::Array>),
) {
    let path = dir.join("model.safetensors");
    let mut tensors = mlx_rs::Array::load_safetensors(&path).expect("load");
    edit(&mut tensors);
    // The loaded arrays read from `path` lazily: write elsewhere, then replace.
    let scratch = tempfile::tempdir().expect("tempdir");
    let tmp = scratch.path().join("model.safetensors");
    mlx_rs::Array::save_safetensors(tensors.iter().map(|(k, v)| (k.as_str(), v)), None, &tmp)
        .expect("save");
    fs::copy(&tmp, &path).expect("replace");
}

#[test]
fn a_missing_tensor_is_named() {
    let dir = copy_model("tiny-llama");
    rewrite_weights(dir.path(), |t| {
        t.remove("model.layers.1.mlp.up_proj.weight");
    });
    match models::load(dir.path()) {
        Err(LoadError::MissingTensors(names)) => {
            assert_eq!(names, vec!["model.layers.1.mlp.up_proj.weight".to_string()])
        }
        other => panic!("expected MissingTensors, got {:?}", other.err()),
    }
}

#[test]
fn an_unused_tensor_is_named() {
    let dir = copy_model("tiny-llama");
    rewrite_weights(dir.path(), |t| {
        t.insert(
            "model.layers.0.extra.weight".into(),
            mlx_rs::Array::from_f32(1.0),
        );
    });
    match models::load(dir.path()) {
        Err(LoadError::UnusedTensors(names)) => {
            assert_eq!(names, vec!["model.layers.0.extra.weight".to_string()])
        }
        other => panic!("expected UnusedTensors, got {:?}", other.err()),
    }
}

#[test]
fn a_truncated_weight_file_fails_the_load() {
    let dir = copy_model("tiny-llama");
    let path = dir.path().join("model.safetensors");
    let bytes = fs::read(&path).expect("read");
    fs::write(&path, &bytes[..bytes.len() / 2]).expect("truncate");
    assert!(
        models::load(dir.path()).is_err(),
        "a truncated checkpoint must not load"
    );
}

#[test]
fn an_unknown_architecture_is_refused_with_the_supported_list() {
    let dir = copy_model("tiny-llama");
    let path = dir.path().join("config.json");
    let text = fs::read_to_string(&path)
        .expect("read")
        .replace("LlamaForCausalLM", "MambaForCausalLM");
    fs::write(&path, text).expect("write");
    let err = models::load(dir.path())
        .err()
        .expect("must fail")
        .to_string();
    assert!(
        err.contains("MambaForCausalLM") && err.contains("Qwen3ForCausalLM"),
        "{err}"
    );
}

#[test]
fn sharded_checkpoints_load() {
    let dir = copy_model("tiny-llama");
    let path = dir.path().join("model.safetensors");
    let tensors = mlx_rs::Array::load_safetensors(&path).expect("load");
    fs::remove_file(&path).expect("rm");
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let (a, b) = names.split_at(names.len() / 2);
    let mut map = serde_json::Map::new();
    for (file, part) in [
        ("model-00001-of-00002.safetensors", a),
        ("model-00002-of-00002.safetensors", b),
    ] {
        mlx_rs::Array::save_safetensors(
            part.iter().map(|k| (k.as_str(), &tensors[*k])),
            None,
            dir.path().join(file),
        )
        .expect("save");
        for k in part {
            map.insert((*k).clone(), file.into());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    fs::write(
        dir.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .expect("index");
    let model = models::load(dir.path()).expect("sharded load");
    assert_eq!(model.info().num_layers, 2);
}

/// A quantization mode this build cannot read is refused at load with its name and the
/// supported ones, never read as affine.
#[test]
fn an_unknown_quantization_mode_is_refused_with_the_reason() {
    let dir = copy_model("tiny-llama-q4");
    let path = dir.path().join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&path).expect("read")).expect("json");
    for key in ["quantization", "quantization_config"] {
        if let Some(q) = config.get_mut(key) {
            q["mode"] = "nvfp4".into();
        }
    }
    fs::write(&path, config.to_string()).expect("write");
    let err = models::load(dir.path())
        .err()
        .expect("must fail")
        .to_string();
    assert!(
        err.contains("nvfp4") && err.contains("mxfp4") && err.contains("affine"),
        "{err}"
    );
}
