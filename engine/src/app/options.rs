//! What an engine runs with: `--draft`/`--draft-model` and `Launch.limits`/`Launch.options`
//! turned into [`RuntimeLimits`] and speculative decoding, refusing what cannot work.
use std::time::Duration;

use mlxd_protocol::control::Launch;
use mlxd_protocol::engine_options::{Draft, EngineOptions, MemoryWatch, OptionError};

use super::start_error::StartError;
use crate::cache::ssd::SsdConfig;
use crate::cache::KvQuant;
use crate::runtime::draft::NgramSizes;
use crate::runtime::RuntimeLimits;

/// Where drafts should come from, before the draft model is resolved in the store.
#[derive(Debug, Clone, PartialEq)]
pub enum DraftChoice {
    Ngram(NgramSizes),
    /// A model spec, as `--model` takes.
    Model(String),
}

/// Speculative decoding as asked for (`--draft`/`--draft-model`, or `Launch.options`).
#[derive(Debug, Clone, PartialEq)]
pub struct DraftOptions {
    pub choice: DraftChoice,
    pub num_draft: usize,
}

/// What a supervised engine runs with: limits, and speculative decoding if asked for.
#[derive(Debug, Clone)]
pub struct LaunchOptions {
    pub limits: RuntimeLimits,
    pub draft: Option<DraftOptions>,
}

/// The options of a supervised engine: `Launch.limits` and `Launch.options` over the
/// defaults. An unknown option, a value out of its domain or a combination that cannot work is
/// an error (the rules `mlxd` applied at config load), never ignored.
pub fn launch_options(launch: &Launch) -> Result<LaunchOptions, StartError> {
    let defaults = RuntimeLimits::default();
    let limits = RuntimeLimits {
        max_batch_size: launch.limits.max_batch_size.map(|n| n as usize),
        kv_budget_bytes: launch.limits.kv_budget_bytes,
        context_length: launch.limits.context_length.map(|n| n as usize),
        ..defaults
    };
    let options = EngineOptions::from_map(&launch.options).map_err(option_error)?;
    runtime_options(&options, limits)
}

fn option_error(e: OptionError) -> StartError {
    StartError::Option {
        key: e.key,
        value: e.value,
        reason: e.reason,
    }
}

/// What checked engine options (from `Launch.options` or the flags) mean for the runtime,
/// over `limits`.
pub fn runtime_options(
    options: &EngineOptions,
    mut limits: RuntimeLimits,
) -> Result<LaunchOptions, StartError> {
    options.check().map_err(option_error)?;
    limits.prompt_cache_bytes = options.prompt_cache_bytes();
    limits.kv_quant = options.kv_quant().map(|(bits, group_size)| KvQuant {
        bits: bits as i32,
        group_size: group_size as i32,
    });
    limits.quantized_kv_start = options.quantized_kv_start.unwrap_or(0) as usize;
    limits.parallelism = options.distributed_mode.unwrap_or_default();
    if let Some(seconds) = options.distributed_step_timeout {
        limits.group_step_timeout = Duration::from_secs(seconds);
    }
    if let Some(seconds) = options.step_timeout {
        limits.step_timeout = Some(Duration::from_secs(seconds));
    }
    match options.memory_watch {
        None => {}
        Some(MemoryWatch::Off) => limits.memory_watch = None,
        Some(MemoryWatch::Seconds(s)) => limits.memory_watch = Some(Duration::from_secs(s)),
    }
    if let Some(times) = options.memory_watch_slowdown {
        limits.memory_watch_slowdown = times;
    }
    if let Some(n) = options.state_snapshot_every {
        limits.state_snapshot_every = n as usize;
    }
    if let Some(n) = options.prefill_step_tokens {
        limits.prefill_step_tokens = Some(n as usize);
    }
    if let Some(n) = options.prefill_pad_to {
        limits.prefill_pad_to = n as usize;
    }
    limits.warm_up = options.warm_up;
    limits.adapters = options.adapter_list();
    limits.ssd = options.ssd_cache.clone().map(|dir| SsdConfig {
        dir,
        max_bytes: options.ssd_cache_max_bytes(),
        demote_idle: options.ssd_demote_idle.map(Duration::from_secs_f64),
        checkpoint_every: options.generation_checkpoint.map(|n| n as usize),
    });
    let choice = match (options.draft, &options.draft_model) {
        (Some(Draft::Ngram), _) => {
            let (min, max) = options.ngram_sizes();
            let sizes = NgramSizes::new(min as usize, max as usize).map_err(|reason| {
                StartError::Option {
                    key: "ngram_min".into(),
                    value: min.to_string(),
                    reason,
                }
            })?;
            Some(DraftChoice::Ngram(sizes))
        }
        (None, Some(spec)) => Some(DraftChoice::Model(spec.clone())),
        (None, None) => None,
    };
    Ok(LaunchOptions {
        limits,
        draft: choice.map(|choice| DraftOptions {
            choice,
            num_draft: options.num_draft_tokens() as usize,
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlxd_protocol::control::{Limits, PROTOCOL_VERSION};

    fn launch(options: &[(&str, &str)]) -> Launch {
        Launch {
            version: PROTOCOL_VERSION,
            model: "m".into(),
            socket_path: "/tmp/s".into(),
            limits: Limits {
                max_batch_size: Some(8),
                kv_budget_bytes: Some(1 << 20),
                context_length: None,
            },
            options: options
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
    }

    #[test]
    fn limits_and_options_become_runtime_limits() {
        let o = launch_options(&launch(&[("prompt_cache", "0.5"), ("kv_bits", "8")])).unwrap();
        assert_eq!(o.draft, None);
        let l = o.limits;
        assert_eq!(l.max_batch_size, Some(8));
        assert_eq!(l.kv_budget_bytes, Some(1 << 20));
        assert_eq!(l.prompt_cache_bytes, 1 << 29);
        assert_eq!(
            l.kv_quant,
            Some(KvQuant {
                bits: 8,
                group_size: 64
            })
        );
        let l = launch_options(&launch(&[])).unwrap().limits;
        assert_eq!(l.kv_quant, None);
        assert_eq!(
            l.prompt_cache_bytes,
            RuntimeLimits::default().prompt_cache_bytes
        );
        // The memory-pressure watch: on by default, a window, a factor, or off.
        assert_eq!(
            (l.memory_watch, l.memory_watch_slowdown),
            (
                Some(crate::runtime::DEFAULT_MEMORY_WATCH),
                crate::runtime::DEFAULT_MEMORY_WATCH_SLOWDOWN
            )
        );
        let l = launch_options(&launch(&[
            ("memory_watch", "5"),
            ("memory_watch_slowdown", "20"),
        ]))
        .unwrap()
        .limits;
        assert_eq!(
            (l.memory_watch, l.memory_watch_slowdown),
            (Some(Duration::from_secs(5)), 20)
        );
        let l = launch_options(&launch(&[("memory_watch", "off")]))
            .unwrap()
            .limits;
        assert_eq!(l.memory_watch, None);
    }

    #[test]
    fn ssd_options_become_the_tier_config() {
        let o = launch_options(&launch(&[
            ("ssd_cache", "/var/cache/kv"),
            ("ssd_cache_max", "2"),
            ("ssd_demote_idle", "30"),
            ("generation_checkpoint", "64"),
        ]))
        .unwrap();
        assert_eq!(
            o.limits.ssd,
            Some(SsdConfig {
                dir: "/var/cache/kv".into(),
                max_bytes: Some(2 << 30),
                demote_idle: Some(Duration::from_secs(30)),
                checkpoint_every: Some(64),
            })
        );
        let unlimited = launch_options(&launch(&[("ssd_cache", "d"), ("ssd_cache_max", "0")]))
            .unwrap()
            .limits
            .ssd
            .unwrap();
        assert_eq!(unlimited.max_bytes, None);
        assert_eq!(launch_options(&launch(&[])).unwrap().limits.ssd, None);
    }

    #[test]
    fn draft_options_become_speculation() {
        let o = launch_options(&launch(&[("draft", "ngram"), ("ngram_max", "6")])).unwrap();
        assert_eq!(
            o.draft,
            Some(DraftOptions {
                choice: DraftChoice::Ngram(NgramSizes { min: 2, max: 6 }),
                num_draft: crate::runtime::draft::DEFAULT_NUM_DRAFT,
            })
        );
        let o = launch_options(&launch(&[
            ("draft_model", "tiny"),
            ("num_draft_tokens", "5"),
        ]))
        .unwrap();
        assert_eq!(
            o.draft,
            Some(DraftOptions {
                choice: DraftChoice::Model("tiny".into()),
                num_draft: 5,
            })
        );
    }

    #[test]
    fn unknown_or_out_of_range_options_are_refused_with_the_reason() {
        for (opts, needle) in [
            (&[("kv_bits", "5")][..], "expected 4 or 8"),
            (&[("prompt_cache", "-1")][..], "between 0 and"),
            (&[("kv_group_size", "64")][..], "needs kv_bits"),
            (
                &[("kv_bits", "4"), ("kv_group_size", "48")][..],
                "32, 64 or 128",
            ),
            (
                &[("speculative", "yes")][..],
                "unknown option (known: prompt_cache",
            ),
            (&[("draft", "eagle")][..], "expected \"ngram\""),
            (
                &[("draft", "ngram"), ("draft_model", "smollm2-135m")][..],
                "exclude each other",
            ),
            (&[("ngram_max", "3")][..], "needs draft"),
            (&[("quantized_kv_start", "256")][..], "needs kv_bits"),
            (
                &[("kv_bits", "8"), ("quantized_kv_start", "-1")][..],
                "a number of tokens",
            ),
            (&[("num_draft_tokens", "3")][..], "needs draft"),
            (&[("generation_checkpoint", "8")][..], "needs ssd_cache"),
            (&[("ssd_cache_max", "1")][..], "needs ssd_cache"),
            (
                &[("ssd_cache", "/tmp/x"), ("generation_checkpoint", "0")][..],
                "from 1 to",
            ),
            (
                &[("ssd_cache", "/tmp/x"), ("ssd_demote_idle", "-3")][..],
                "seconds > 0",
            ),
            (&[("ssd_cache", " ")][..], "expected a directory"),
            (
                &[("draft", "ngram"), ("num_draft_tokens", "0")][..],
                "1 to 16",
            ),
            (
                &[("draft", "ngram"), ("ngram_min", "4"), ("ngram_max", "2")][..],
                "ngram_min <= ngram_max",
            ),
        ] {
            let e = launch_options(&launch(opts))
                .expect_err("refused")
                .to_string();
            assert!(e.contains(needle), "{opts:?}: {e}");
        }
    }
}
