//! Property tests of the two weight-file header parsers (issue 12, fuzzing): a GGUF header
//! (our parser) and a safetensors header (MLX's, through the loader) built from arbitrary
//! bytes give an error, never a panic, an abort or an allocation the file cannot back.
//! `MLXD_FUZZ_CASES` sets the number of cases (default 64; `scripts/fuzz.sh` runs more).
use std::io::Write;

use mlxd_engine::loader::Weights;
use mlxd_store::convert::gguf::GgufFile;
use proptest::prelude::*;

fn cases() -> u32 {
    std::env::var("MLXD_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

fn write(dir: &std::path::Path, name: &str, bytes: &[u8]) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::File::create(&path)
        .and_then(|mut f| f.write_all(bytes))
        .expect("write the test file");
    path
}

/// A GGUF prefix: magic, a version (mostly a supported one), tensor and metadata counts.
fn gguf_prefix() -> impl Strategy<Value = Vec<u8>> {
    (
        prop_oneof![Just(3u32), Just(2u32), any::<u32>()],
        prop_oneof![0u64..4, any::<u64>()],
        prop_oneof![0u64..4, any::<u64>()],
    )
        .prop_map(|(version, n_tensors, n_kv)| {
            let mut b = b"GGUF".to_vec();
            b.extend_from_slice(&version.to_le_bytes());
            b.extend_from_slice(&n_tensors.to_le_bytes());
            b.extend_from_slice(&n_kv.to_le_bytes());
            b
        })
}

/// A metadata entry with an arbitrary type tag and length fields.
fn gguf_entry() -> impl Strategy<Value = Vec<u8>> {
    (
        prop_oneof![0u64..12, any::<u64>()],
        "[a-z.]{0,8}",
        prop_oneof![0u32..14, any::<u32>()],
        proptest::collection::vec(any::<u8>(), 0..24),
    )
        .prop_map(|(key_len, key, ty, value)| {
            let mut b = key_len.to_le_bytes().to_vec();
            b.extend_from_slice(key.as_bytes());
            b.extend_from_slice(&ty.to_le_bytes());
            b.extend_from_slice(&value);
            b
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn gguf_headers_from_arbitrary_bytes_are_errors(
        prefix in gguf_prefix(),
        entries in proptest::collection::vec(gguf_entry(), 0..4),
        tail in proptest::collection::vec(any::<u8>(), 0..256),
    ) {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut bytes = prefix;
        bytes.extend(entries.concat());
        bytes.extend(tail);
        let path = write(dir.path(), "m.gguf", &bytes);
        // Ok is possible for a well-formed tiny file; what matters is no panic or abort.
        let _ = GgufFile::open(&path);
    }

    #[test]
    fn safetensors_headers_from_arbitrary_bytes_are_errors(
        declared in prop_oneof![0u64..64, any::<u64>()],
        header in prop_oneof![
            "\\{\"w\":\\{\"dtype\":\"(F32|F16|BF16|I8|XX)\",\"shape\":\\[[0-9,]{0,12}\\],\"data_offsets\":\\[[0-9,]{0,16}\\]\\}\\}",
            ".{0,48}",
        ],
        tail in proptest::collection::vec(any::<u8>(), 0..64),
    ) {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut bytes = declared.to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend(tail);
        write(dir.path(), "model.safetensors", &bytes);
        let _ = Weights::open(dir.path(), &serde_json::json!({}));
    }
}
