//! What a conversion did with each GGML tensor type: the MLX form it became and how far the
//! result is from GGML's own dequantization. [`super::convert_gguf_with`] returns it and writes
//! it into the directory's stamp, so the error of a conversion can always be looked up.
use std::collections::BTreeMap;

use serde_json::{json, Value};

use super::gguf::GgmlType;
use super::quant::ErrorStats;

/// One GGML type's tensors in a conversion.
#[derive(Debug, Clone, PartialEq)]
pub struct TypeReport {
    pub tensors: usize,
    /// What the tensors became, e.g. `affine 4-bit, group 32, float16 scales`.
    pub output: String,
    /// All of the type's elements together.
    pub error: ErrorStats,
    /// The tensor with the largest error, and that error.
    pub worst: Option<(String, f64)>,
}

/// Per GGML type (by its GGUF name, e.g. `Q4_K`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ConversionReport {
    pub types: BTreeMap<String, TypeReport>,
}

/// The name llama.cpp gives a type (`Q4_K`, `F16`).
pub fn type_name(ty: GgmlType) -> String {
    let debug = format!("{ty:?}").to_uppercase();
    match debug.strip_suffix('K') {
        Some(base) if base.starts_with('Q') => format!("{base}_K"),
        _ => debug,
    }
}

impl ConversionReport {
    pub(crate) fn add(&mut self, ty: GgmlType, output: String, tensor: &str, error: ErrorStats) {
        let entry = self
            .types
            .entry(type_name(ty))
            .or_insert_with(|| TypeReport {
                tensors: 0,
                output: output.clone(),
                error: ErrorStats::default(),
                worst: None,
            });
        entry.tensors += 1;
        entry.error.merge(&error);
        if entry.worst.as_ref().is_none_or(|(_, e)| error.max_abs > *e) {
            entry.worst = Some((tensor.to_string(), error.max_abs));
        }
    }

    /// Whether every element equals GGML's dequantization.
    pub fn is_exact(&self) -> bool {
        self.types.values().all(|t| t.error.is_exact())
    }

    /// One line per type, for logs.
    pub fn lines(&self) -> Vec<String> {
        self.types
            .iter()
            .map(|(name, t)| {
                let err = if t.error.is_exact() {
                    "exact".to_string()
                } else {
                    format!(
                        "max abs error {:.3e}, RMS error {:.3e} ({:.3e} of the weights' RMS){}",
                        t.error.max_abs,
                        t.error.rms(),
                        t.error.relative_rms(),
                        t.worst
                            .as_ref()
                            .map(|(n, _)| format!(", worst in {n}"))
                            .unwrap_or_default()
                    )
                };
                format!(
                    "{name}: {} tensors, {} elements -> {}: {err}",
                    t.tensors, t.error.elements, t.output
                )
            })
            .collect()
    }

    pub fn to_json(&self) -> Value {
        let types: serde_json::Map<String, Value> = self
            .types
            .iter()
            .map(|(name, t)| {
                (
                    name.clone(),
                    json!({
                        "tensors": t.tensors,
                        "elements": t.error.elements,
                        "output": t.output,
                        "exact": t.error.is_exact(),
                        "max_abs_error": t.error.max_abs,
                        "rms_error": t.error.rms(),
                        "relative_rms_error": t.error.relative_rms(),
                        "worst_tensor": t.worst.as_ref().map(|(n, _)| n),
                    }),
                )
            })
            .collect();
        Value::Object(types)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_lines() {
        assert_eq!(type_name(GgmlType::Q4K), "Q4_K");
        assert_eq!(type_name(GgmlType::Q8_0), "Q8_0");
        assert_eq!(type_name(GgmlType::Bf16), "BF16");
        let mut r = ConversionReport::default();
        let mut e = ErrorStats::default();
        e.add(1.0, 1.0);
        r.add(GgmlType::Q4_0, "affine 4-bit".into(), "a", e);
        assert!(r.is_exact());
        e.add(0.5, 0.25);
        r.add(GgmlType::Q6K, "affine 8-bit".into(), "b", e);
        assert!(!r.is_exact());
        let lines = r.lines();
        assert!(lines[0].ends_with("exact"), "{lines:?}");
        assert!(lines[1].contains("max abs error 2.500e-1"), "{lines:?}");
        assert!(lines[1].contains("worst in b"), "{lines:?}");
        assert_eq!(r.to_json()["Q6_K"]["exact"], false);
    }
}
