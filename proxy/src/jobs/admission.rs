//! May a job start now? A pure function over a snapshot of the pool's memory, and the
//! estimate of what a job needs. The pool actor applies [`admit`] (so that counting a job and
//! starting an engine never race); the jobs actor keeps a job queued while it says `Wait`.

use std::path::Path;

use mlxd_protocol::jobs::QUANTIZE_SHARD_BYTES;

/// The pool's memory as a job sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemorySnapshot {
    /// The memory budget engines and jobs share.
    pub budget: u64,
    /// Counted for every engine that holds (or is about to hold) memory.
    pub engines: u64,
    /// Of `engines`, what pinned models hold: never given back.
    pub pinned: u64,
    /// Counted for the jobs already running.
    pub jobs: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Counted; the job may start.
    Start,
    /// Fits once engines unload or other jobs finish; `available` is free now.
    Wait {
        needed: u64,
        available: u64,
    },
    /// Cannot fit even with every unpinned engine and every other job gone.
    Refuse {
        needed: u64,
        available: u64,
        budget: u64,
    },
    ShuttingDown,
}

/// Whether a job needing `needed` bytes fits beside what `snapshot` counts.
pub fn admit(needed: u64, snapshot: &MemorySnapshot) -> Admission {
    let ever = snapshot.budget.saturating_sub(snapshot.pinned);
    if needed > ever {
        return Admission::Refuse {
            needed,
            available: ever,
            budget: snapshot.budget,
        };
    }
    let used = snapshot.engines.saturating_add(snapshot.jobs);
    if used.saturating_add(needed) <= snapshot.budget {
        Admission::Start
    } else {
        Admission::Wait {
            needed,
            available: snapshot.budget.saturating_sub(used),
        }
    }
}

/// MLX's own working memory beside the tensors (allocator pools, the graph).
const MLX_OVERHEAD_BYTES: u64 = 256 << 20;

/// What a checkpoint holds, from its safetensors headers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CheckpointSize {
    /// Bytes of all tensors.
    pub total: u64,
    /// Bytes of the largest tensor.
    pub largest: u64,
}

/// The estimated peak of quantizing a checkpoint of `size` to `bits`: the output shard being
/// filled (at most [`QUANTIZE_SHARD_BYTES`], and never more than the whole output, which is
/// at most the source's size) plus the largest tensor three times over (its source, a
/// dequantized copy when the source is quantized, and the quantization's intermediates), plus
/// MLX's overhead.
pub fn quantize_peak_bytes(size: CheckpointSize, bits: u32) -> u64 {
    // A 16-bit source shrinks to bits/16 plus scales and biases; count half the source for
    // 8-bit and a third for 4-bit, which bounds both (f32 sources shrink more).
    let output = match bits {
        8 => size.total / 2 + size.total / 16,
        _ => size.total / 3,
    };
    output.min(QUANTIZE_SHARD_BYTES) + size.largest.saturating_mul(3) + MLX_OVERHEAD_BYTES
}

/// Memory counted for a GGUF conversion: the converter streams tensor by tensor from the mapped
/// file, so its own peak is small; the mapped pages count as the largest tensor would.
pub fn convert_peak_bytes(gguf_bytes: u64) -> u64 {
    (gguf_bytes / 8).min(1 << 30) + MLX_OVERHEAD_BYTES / 4
}

/// What a LoRA job's estimate needs of a model's config.json (0 where it is silent).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ModelShape {
    pub hidden: u64,
    pub intermediate: u64,
    pub layers: u64,
    pub vocab: u64,
}

impl ModelShape {
    /// Reads `dir/config.json` (a multimodal model's `text_config` when there is one).
    pub fn read(dir: &Path) -> Self {
        let Some(config) = std::fs::read(dir.join("config.json"))
            .ok()
            .and_then(|t| serde_json::from_slice::<serde_json::Value>(&t).ok())
        else {
            return Self::default();
        };
        let c = config.get("text_config").unwrap_or(&config);
        let n = |k: &str| c.get(k).and_then(serde_json::Value::as_u64).unwrap_or(0);
        Self {
            hidden: n("hidden_size"),
            intermediate: n("intermediate_size"),
            layers: n("num_hidden_layers"),
            vocab: n("vocab_size"),
        }
    }
}

/// The estimated peak of a LoRA job: the base's weights, plus the activations a backward pass
/// keeps for a batch of `batch_size` rows of `row_tokens` tokens (per layer and token about
/// twelve hidden-size and four intermediate-size float32 vectors) and the logits with their
/// gradient (three float32 vocabulary rows per token), plus MLX's overhead.
pub fn lora_peak_bytes(
    size: CheckpointSize,
    shape: ModelShape,
    params: &mlxd_protocol::jobs::TrainParams,
    row_tokens: u64,
) -> u64 {
    let tokens = u64::from(params.batch_size) * row_tokens;
    let per_token =
        shape.layers * (12 * shape.hidden + 4 * shape.intermediate) * 4 + 3 * shape.vocab * 4;
    size.total + tokens.saturating_mul(per_token) + MLX_OVERHEAD_BYTES
}

/// Tokens a chat template may add to a line beyond its own bytes (role markers, a system
/// prompt, tool descriptions' framing).
pub const TEMPLATE_TOKENS: u64 = 1024;

/// The most tokens a row of the data in `files` can take: `max_seq_length`, or fewer when the
/// longest line is short (a token is at least one byte of the line's text, and the template
/// adds at most [`TEMPLATE_TOKENS`]).
pub fn lora_row_tokens(files: &[&Path], max_seq_length: u32) -> std::io::Result<u64> {
    use std::io::BufRead;
    let mut longest = 0u64;
    for f in files {
        let mut reader = std::io::BufReader::new(std::fs::File::open(f)?);
        let mut line = Vec::new();
        loop {
            line.clear();
            let n = reader.read_until(b'\n', &mut line)?;
            if n == 0 {
                break;
            }
            longest = longest.max(n as u64);
        }
    }
    Ok((longest + TEMPLATE_TOKENS).min(u64::from(max_seq_length)))
}

/// The estimated peak of fusing an adapter into a checkpoint of `size`: like a quantize job,
/// one output shard being filled plus the largest tensor three times over (its source, a
/// dequantized copy and the merged one) plus MLX's overhead.
pub fn fuse_peak_bytes(size: CheckpointSize) -> u64 {
    size.total.min(QUANTIZE_SHARD_BYTES) + size.largest.saturating_mul(3) + MLX_OVERHEAD_BYTES
}

/// Memory counted for a fetch: downloads stream to disk.
pub const FETCH_PEAK_BYTES: u64 = 64 << 20;

/// Reads the safetensors headers of the `*.safetensors` files in `dir` (without their data).
pub fn checkpoint_size(dir: &Path) -> std::io::Result<CheckpointSize> {
    use std::io::Read;
    let mut size = CheckpointSize::default();
    let mut found = false;
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.extension().is_none_or(|e| e != "safetensors") {
            continue;
        }
        found = true;
        let mut file = std::fs::File::open(&path)?;
        let mut len = [0u8; 8];
        file.read_exact(&mut len)?;
        let len = u64::from_le_bytes(len);
        if len > 100 << 20 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{}: a safetensors header of {len} bytes", path.display()),
            ));
        }
        let mut header = vec![0u8; len as usize];
        file.read_exact(&mut header)?;
        let header: serde_json::Value = serde_json::from_slice(&header).map_err(|e| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{}: safetensors header: {e}", path.display()),
            )
        })?;
        for (name, info) in header.as_object().into_iter().flatten() {
            if name == "__metadata__" {
                continue;
            }
            let offsets = info.get("data_offsets").and_then(|o| o.as_array());
            let bytes = match offsets.map(|o| o.as_slice()) {
                Some([a, b]) => b
                    .as_u64()
                    .unwrap_or(0)
                    .saturating_sub(a.as_u64().unwrap_or(0)),
                _ => 0,
            };
            size.total += bytes;
            size.largest = size.largest.max(bytes);
        }
    }
    if !found {
        return Err(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("{} holds no *.safetensors weights", dir.display()),
        ));
    }
    Ok(size)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GB: u64 = 1 << 30;

    fn snap(budget: u64, engines: u64, pinned: u64, jobs: u64) -> MemorySnapshot {
        MemorySnapshot {
            budget: budget * GB,
            engines: engines * GB,
            pinned: pinned * GB,
            jobs: jobs * GB,
        }
    }

    #[test]
    fn a_job_starts_when_it_fits_beside_engines_and_jobs() {
        assert_eq!(admit(4 * GB, &snap(16, 8, 0, 4)), Admission::Start);
    }

    #[test]
    fn a_job_waits_while_engines_or_jobs_hold_the_memory() {
        assert_eq!(
            admit(4 * GB, &snap(16, 10, 0, 4)),
            Admission::Wait {
                needed: 4 * GB,
                available: 2 * GB
            }
        );
    }

    #[test]
    fn a_job_larger_than_the_budget_beside_pinned_models_is_refused_with_numbers() {
        assert_eq!(
            admit(10 * GB, &snap(16, 8, 8, 0)),
            Admission::Refuse {
                needed: 10 * GB,
                available: 8 * GB,
                budget: 16 * GB
            }
        );
        // Without pins the same job only waits.
        assert!(matches!(
            admit(10 * GB, &snap(16, 8, 0, 0)),
            Admission::Wait { .. }
        ));
    }

    #[test]
    fn quantize_peak_is_bounded_by_one_shard_plus_the_largest_tensor() {
        let small = CheckpointSize {
            total: 300 << 20,
            largest: 30 << 20,
        };
        assert_eq!(
            quantize_peak_bytes(small, 4),
            (100 << 20) + (90 << 20) + MLX_OVERHEAD_BYTES
        );
        let big = CheckpointSize {
            total: 16 * GB,
            largest: GB,
        };
        assert_eq!(
            quantize_peak_bytes(big, 8),
            QUANTIZE_SHARD_BYTES + 3 * GB + MLX_OVERHEAD_BYTES
        );
    }
}
