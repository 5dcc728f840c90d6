//! The fingerprints an entry is written under: the model's (its config and weights) and the
//! tokenizer's, so a file from another model, another conversion of it or another tokenizer
//! is never restored.
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use sha2::{Digest, Sha256};

use super::format::Identity;
use crate::cache::KvSpace;

/// Bytes hashed from each end of a weight file: enough to tell fine-tunes of one shape apart
/// without reading gigabytes at every start.
const WEIGHT_SAMPLE: u64 = 1 << 20;

/// The identity of the model in `dir` with its KV stored as `kv_format` says (`plain`, or
/// the quantization's bits and group size): SHA-256 over that, `config.json`, then each
/// `*.safetensors` file (by name) with its size and its first and last MiB; and SHA-256 over
/// `tokenizer.json` and `tokenizer_config.json`. Engines of one model with different KV
/// quantization keep separate entries (a quantized entry would turn a plain engine's batch
/// quantized).
pub fn of_model_dir(dir: &Path, kv_format: &str) -> std::io::Result<Identity> {
    let mut model = Sha256::new();
    model.update(b"mlxd-kv-model\0");
    model.update(kv_format.as_bytes());
    model.update(b"\0");
    model.update(std::fs::read(dir.join("config.json"))?);
    let mut weights: Vec<_> = std::fs::read_dir(dir)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    weights.sort();
    for path in weights {
        model.update(
            path.file_name()
                .map(|n| n.as_encoded_bytes())
                .unwrap_or(b""),
        );
        hash_weight_file(&mut model, &path)?;
    }
    let mut tokenizer = Sha256::new();
    tokenizer.update(b"mlxd-kv-tokenizer\0");
    for name in ["tokenizer.json", "tokenizer_config.json"] {
        match std::fs::read(dir.join(name)) {
            Ok(bytes) => {
                tokenizer.update(name.as_bytes());
                tokenizer.update((bytes.len() as u64).to_le_bytes());
                tokenizer.update(bytes);
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(Identity {
        model: model.finalize().into(),
        tokenizer: tokenizer.finalize().into(),
    })
}

/// Feeds `h` a weight file's size and its first and last [`WEIGHT_SAMPLE`] bytes: enough to
/// tell two trainings of one shape apart without reading the whole file.
pub(crate) fn hash_weight_file(h: &mut Sha256, path: &Path) -> std::io::Result<()> {
    let mut f = File::open(path)?;
    let len = f.metadata()?.len();
    h.update(len.to_le_bytes());
    let mut buf = vec![0; WEIGHT_SAMPLE.min(len) as usize];
    f.read_exact(&mut buf)?;
    h.update(&buf);
    f.seek(SeekFrom::Start(len - buf.len() as u64))?;
    f.read_exact(&mut buf)?;
    h.update(&buf);
    Ok(())
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The file name of the entry holding `tokens` in `space` (a base entry's name does not
/// depend on the space, so it is the same as before spaces existed).
pub fn entry_name(space: KvSpace, tokens: &[u32]) -> String {
    let mut h = Sha256::new();
    if !space.is_base() {
        h.update(b"mlxd-kv-space\0");
        h.update(space.0);
    }
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    format!("{}.kv", hex(&h.finalize()[..16]))
}
