//! `mlxd show MODEL`: what a model in the store is, as lines for people. The facts come from
//! [`mlxd_store::facts`], which the Ollama `/api/show` route reads too.

use mlxd_store::facts::ModelFacts;

use crate::config::Bytes;

/// A parameter count the way model cards write it: `134.5M`, `7.6B`.
pub fn parameters(n: u64) -> String {
    let n = n as f64;
    match n {
        n if n >= 1e9 => format!("{:.1}B", n / 1e9),
        n if n >= 1e6 => format!("{:.1}M", n / 1e6),
        n if n >= 1e3 => format!("{:.1}K", n / 1e3),
        n => format!("{n}"),
    }
}

/// The facts of `name` as aligned `key  value` lines; the template itself only when
/// `template` is set (it can be long).
pub fn render(name: &str, facts: &ModelFacts, template: bool) -> String {
    let unknown = || "unknown".to_string();
    let architecture = match &facts.model_type {
        Some(t) if *t != facts.architecture => format!("{} ({t})", facts.architecture),
        _ => facts.architecture.clone(),
    };
    let mut rows: Vec<(&str, String)> = vec![
        ("model", name.to_string()),
        ("architecture", architecture),
        (
            "parameters",
            facts.parameters.map(parameters).unwrap_or_else(unknown),
        ),
        ("quantization", facts.quantization.clone()),
        (
            "context length",
            facts
                .context_length
                .map(|c| c.to_string())
                .unwrap_or_else(unknown),
        ),
    ];
    if let Some(l) = facts.layers {
        rows.push(("layers", l.to_string()));
    }
    if let Some(h) = facts.hidden_size {
        rows.push(("embedding length", h.to_string()));
    }
    if let Some(v) = facts.vocab_size {
        rows.push(("vocabulary", v.to_string()));
    }
    rows.push((
        "template",
        match facts.chat_format {
            Some(f) => format!("{f} chat format"),
            None => "none (completions only)".into(),
        },
    ));
    rows.push(("license", facts.license.clone().unwrap_or_else(unknown)));
    rows.push(("location", facts.dir.display().to_string()));
    rows.push(("size", Bytes(facts.size_bytes).to_string()));
    let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    let mut out: String = rows
        .iter()
        .map(|(k, v)| format!("{k:<width$}  {v}\n"))
        .collect();
    if template {
        if let Some(t) = &facts.chat_template {
            out.push('\n');
            out.push_str(t.trim_end());
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_lines() {
        assert_eq!(parameters(134_515_008), "134.5M");
        assert_eq!(parameters(7_615_616_512), "7.6B");
        assert_eq!(parameters(999), "999");
        let facts = ModelFacts {
            dir: "/s/models/smol-q8".into(),
            architecture: "LlamaForCausalLM".into(),
            model_type: Some("llama".into()),
            parameters: Some(134_515_008),
            quantization: "mlx 8-bit".into(),
            context_length: Some(8192),
            layers: Some(30),
            hidden_size: Some(576),
            vocab_size: None,
            chat_format: Some("chatml"),
            chat_template: Some("<|im_start|>{{ x }}\n".into()),
            license: None,
            size_bytes: 3 << 20,
        };
        let text = render("smol-q8", &facts, false);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "model             smol-q8");
        assert!(text.contains("architecture      LlamaForCausalLM (llama)\n"));
        assert!(text.contains("parameters        134.5M\n"));
        assert!(text.contains("context length    8192\n"));
        assert!(text.contains("template          chatml chat format\n"));
        assert!(text.contains("license           unknown\n"));
        assert!(text.contains("location          /s/models/smol-q8\n"));
        assert!(!text.contains("vocabulary") && !text.contains("{{ x }}"));
        assert!(render("smol-q8", &facts, true).ends_with("\n<|im_start|>{{ x }}\n"));
    }
}
