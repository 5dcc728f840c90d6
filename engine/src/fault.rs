//! A fault switch for tests: makes the engine abort, exit out of memory, or hang after it
//! has generated N tokens, so that every recovery path of the supervisor can be tested
//! deterministically.
//!
//! Honoured only when `MLXD_ALLOW_FAULTS=1` is in the environment (a production engine
//! never has it; `MLXD_FAULT` alone is ignored with a warning):
//!
//! - `MLXD_FAULT=<kind>@<N>`: `abort` (SIGABRT, as a crashing native library would),
//!   `oom` (the model thread's next step fails with an allocation failure, as MLX reports one:
//!   the executor's own out-of-memory path runs, [`step_error`]), `device_lost` (the next step
//!   fails with CUDA's illegal memory access, as on an H100 whose memory another process took),
//!   `hang` (the whole process stops itself with SIGSTOP: no tokens, no
//!   `Stats`), or `stall` (the model thread stops for good while the rest of the process
//!   runs and sends `Stats`, as when a GPU stops answering), once this process has emitted N
//!   generated tokens, all requests together.
//! - `MLXD_FAULT=crawl@<N>`: once N tokens are out, the device reports 0 MiB free and every
//!   decode step of the model thread sleeps [`CRAWL_STEP_DELAY`] more, as on a GPU whose memory
//!   another process took and whose driver pages the engine's buffers out (BENCHMARKS-soak.md
//!   section 6a): the memory-pressure watch (`crate::app::memory_watch`) must end the engine
//!   as out of memory. `full@<N>`: the device reports 0 MiB free from then on, the steps keep
//!   their speed (an engine whose own buffers fill the device): the watch must not fire. Both
//!   need a device that reports its memory: a GPU, or `MLXD_FAULT_GPU_MEMORY` below.
//! - `MLXD_FAULT=crawl_prefill@<N>`: once this process has prefilled N prompt tokens (all
//!   prompts together, padding not counted; the warm-up's too, where it runs), the device
//!   reports 0 MiB free and every step that prefills sleeps [`CRAWL_STEP_DELAY`] more, while
//!   decode steps keep their speed: the prompts of an engine whose device filled before its
//!   first decode step crawl (BENCHMARKS-soak.md section 6c), and the memory-pressure watch
//!   must end it as out of memory on its prefill passes alone.
//! - `MLXD_FAULT=slow_load@<ms>`: a supervised engine waits that many milliseconds before it
//!   loads the model (a slow download or disk, to test waiting for a load).
//! - `MLXD_FAULT_ONCE=<path>` (optional): fire only if this file exists, and remove it when
//!   firing, so that the restarted engine runs clean. Without it, every engine fires. A
//!   `crawl_prefill` fault past its count fires at the first prefill step that finds the file,
//!   so that a test can arm it between two runs by creating the file (how many prompt tokens a
//!   clean run prefills depends on the tokenizer).
//! - `MLXD_FAULT_GPU_MEMORY=<free MiB>/<total MiB>`: the device reports this much memory
//!   ([`device_memory_override`]), so that the KV budget's start-up check against the GPU's
//!   free memory, and the memory-pressure watch, run on a machine without a GPU.
//! - `MLXD_FAULT_KV_SCALE=<factor>`: the memory-pressure watch counts the engine's KV this
//!   many times ([`kv_scale`]), so that a tiny test model holds a large model's share of the
//!   device (the start-up check keeps at least 2 GiB of a device for activations, so the
//!   stand-in device cannot be small enough for a few hundred KiB of KV to count).
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

/// What the switch does when it fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    Abort,
    OutOfMemory,
    /// The next step fails with CUDA's illegal memory access.
    DeviceLost,
    Hang,
    /// The model thread sleeps for good; the process lives on.
    Stall,
    /// Delays the load instead of firing on a token.
    SlowLoad,
    /// The device reports no free memory and every step is slowed ([`CRAWL_STEP_DELAY`]).
    Crawl,
    /// The device reports no free memory; the steps keep their speed.
    Full,
    /// Once N prompt tokens are prefilled, the device reports no free memory and every step
    /// that prefills is slowed ([`CRAWL_STEP_DELAY`]); decode steps are not.
    CrawlPrefill,
}

/// How much longer each decode step of the model thread runs under a `crawl` fault, and each
/// prefill step under `crawl_prefill`: enough to be many times a tiny test model's step on the
/// CPU (a few milliseconds).
pub const CRAWL_STEP_DELAY: std::time::Duration = std::time::Duration::from_millis(500);

/// Set once a `crawl`, `full` or `crawl_prefill` fault has fired: the device reports 0 MiB
/// free.
static MEMORY_FULL: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// Set once a `crawl` fault has fired: each step sleeps [`CRAWL_STEP_DELAY`].
static CRAWLING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// Set once a `crawl_prefill` fault has fired: each prefill step sleeps [`CRAWL_STEP_DELAY`].
static PREFILL_CRAWLING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FaultSpec {
    pub kind: FaultKind,
    /// Fires when this many tokens have been emitted (at least 1); for
    /// [`FaultKind::CrawlPrefill`], prompt tokens prefilled; for [`FaultKind::SlowLoad`], the
    /// milliseconds the load waits.
    pub after_tokens: u64,
    /// Fires only while this file exists (it is removed on firing).
    pub once: Option<PathBuf>,
}

/// Reads `<kind>@<N>`.
pub fn parse(spec: &str, once: Option<PathBuf>) -> Result<FaultSpec, String> {
    let (kind, n) = spec.split_once('@').ok_or_else(|| {
        format!(
            "MLXD_FAULT={spec:?}: expected <abort|oom|device_lost|hang|stall|crawl|full>@<tokens>, \
             crawl_prefill@<prompt tokens> or slow_load@<ms>"
        )
    })?;
    let kind = match kind.trim() {
        "abort" => FaultKind::Abort,
        "oom" => FaultKind::OutOfMemory,
        "device_lost" => FaultKind::DeviceLost,
        "hang" => FaultKind::Hang,
        "stall" => FaultKind::Stall,
        "slow_load" => FaultKind::SlowLoad,
        "crawl" => FaultKind::Crawl,
        "full" => FaultKind::Full,
        "crawl_prefill" => FaultKind::CrawlPrefill,
        other => {
            let known =
                "abort, oom, device_lost, hang, stall, crawl, full, crawl_prefill or slow_load";
            return Err(format!(
                "MLXD_FAULT={spec:?}: unknown fault {other:?}; expected {known}"
            ));
        }
    };
    let after_tokens = n
        .trim()
        .parse::<u64>()
        .ok()
        .filter(|&n| n >= 1)
        .ok_or_else(|| {
            format!("MLXD_FAULT={spec:?}: the count must be an integer >= 1, got {n:?}")
        })?;
    Ok(FaultSpec {
        kind,
        after_tokens,
        once,
    })
}

struct Armed {
    spec: FaultSpec,
    /// Tokens counted towards the spec's: generated ones, or for
    /// [`FaultKind::CrawlPrefill`] prompt tokens prefilled.
    emitted: AtomicU64,
}

/// The error the model thread's next step fails with, once an `oom` or `device_lost` fault
/// has fired ([`step_error`]).
static STEP_ERROR: Mutex<Option<String>> = Mutex::new(None);

static ARMED: OnceLock<Armed> = OnceLock::new();

/// Reads the switch from the environment. `Ok(None)` when no fault is asked for (or
/// faults are not allowed); an error for a malformed spec, which the engine refuses to
/// start with.
pub fn from_env() -> Result<Option<FaultSpec>, String> {
    let Some(spec) = std::env::var_os("MLXD_FAULT") else {
        return Ok(None);
    };
    let spec = spec.to_string_lossy().into_owned();
    if std::env::var("MLXD_ALLOW_FAULTS").as_deref() != Ok("1") {
        tracing::warn!(fault = %spec, "MLXD_FAULT is ignored without MLXD_ALLOW_FAULTS=1");
        return Ok(None);
    }
    let once = std::env::var_os("MLXD_FAULT_ONCE").map(PathBuf::from);
    parse(&spec, once).map(Some)
}

/// The device memory `MLXD_FAULT_GPU_MEMORY` stands in for (see the module comment); `None`
/// when it is unset or faults are not allowed. A malformed value is an error the engine
/// refuses to start with.
pub fn device_memory_override() -> Result<Option<crate::cache::DeviceMemory>, String> {
    let Some(value) = std::env::var_os("MLXD_FAULT_GPU_MEMORY") else {
        return Ok(None);
    };
    let value = value.to_string_lossy().into_owned();
    if std::env::var("MLXD_ALLOW_FAULTS").as_deref() != Ok("1") {
        tracing::warn!(%value, "MLXD_FAULT_GPU_MEMORY is ignored without MLXD_ALLOW_FAULTS=1");
        return Ok(None);
    }
    parse_device_memory(&value).map(Some)
}

/// The device's memory as this process sees it: `stand_in` ([`device_memory_override`]) or
/// the device's, with no free memory once a `crawl`, `full` or `crawl_prefill` fault has fired. `None` where
/// the device does not report its free memory. Read by the KV budget at load and by the
/// memory-pressure watch.
pub fn observed_memory(
    stand_in: Option<crate::cache::DeviceMemory>,
) -> Result<Option<crate::cache::DeviceMemory>, String> {
    let memory = match stand_in {
        Some(m) => Some(m),
        None => crate::device::device_memory()?,
    };
    Ok(memory.map(|m| crate::cache::DeviceMemory {
        free: if memory_full() { 0 } else { m.free },
        total: m.total,
    }))
}

/// How many times the memory-pressure watch counts the engine's KV: `MLXD_FAULT_KV_SCALE`
/// (see the module comment), 1 when it is unset or faults are not allowed. A malformed value
/// is an error.
pub fn kv_scale() -> Result<u64, String> {
    let Some(value) = std::env::var_os("MLXD_FAULT_KV_SCALE") else {
        return Ok(1);
    };
    let value = value.to_string_lossy().into_owned();
    if std::env::var("MLXD_ALLOW_FAULTS").as_deref() != Ok("1") {
        tracing::warn!(%value, "MLXD_FAULT_KV_SCALE is ignored without MLXD_ALLOW_FAULTS=1");
        return Ok(1);
    }
    match value.trim().parse::<u64>() {
        Ok(factor) if factor >= 1 => Ok(factor),
        _ => Err(format!(
            "MLXD_FAULT_KV_SCALE={value:?}: expected a whole factor of at least 1"
        )),
    }
}

/// Reads `<free MiB>/<total MiB>`.
fn parse_device_memory(value: &str) -> Result<crate::cache::DeviceMemory, String> {
    let mib = |n: &str| n.trim().parse::<u64>().ok().map(|n| n << 20);
    match value.split_once('/').map(|(f, t)| (mib(f), mib(t))) {
        Some((Some(free), Some(total))) if free <= total => {
            Ok(crate::cache::DeviceMemory { free, total })
        }
        _ => Err(format!(
            "MLXD_FAULT_GPU_MEMORY={value:?}: expected <free MiB>/<total MiB>, free at most total"
        )),
    }
}

/// Whether a `crawl`, `full` or `crawl_prefill` fault has fired: the device's memory then
/// reads 0 MiB free.
pub fn memory_full() -> bool {
    MEMORY_FULL.load(Ordering::SeqCst)
}

/// Called by the model thread before each step: the error that step fails with, once an
/// `oom` or `device_lost` fault has fired (once: the step after it runs normally, as the
/// executor has failed or handed on every request by then).
pub fn step_error() -> Option<String> {
    // Every step calls this: without an armed switch (production) it takes no lock.
    ARMED.get()?;
    STEP_ERROR.lock().unwrap_or_else(|e| e.into_inner()).take()
}

/// Called by the model thread after each decode step: sleeps [`CRAWL_STEP_DELAY`] once a
/// `crawl` fault has fired, inside the time the step is measured by.
pub fn on_step() {
    if CRAWLING.load(Ordering::Relaxed) {
        std::thread::sleep(CRAWL_STEP_DELAY);
    }
}

/// Called by the model thread after each step's prefill passes, inside the time the step is
/// measured by, with the prompt tokens they prefilled (padding not counted): sleeps
/// [`CRAWL_STEP_DELAY`] once a `crawl_prefill` fault has fired, and counts the tokens towards
/// an armed one, which fires on the first step at or past its count (where `MLXD_FAULT_ONCE`
/// is set, the first such step that finds the file); that step runs at its speed.
pub fn on_prefill(tokens: usize) {
    if PREFILL_CRAWLING.load(Ordering::Relaxed) {
        std::thread::sleep(CRAWL_STEP_DELAY);
    }
    let Some(armed) = ARMED.get() else {
        return;
    };
    if armed.spec.kind != FaultKind::CrawlPrefill {
        return;
    }
    let n = armed.emitted.fetch_add(tokens as u64, Ordering::Relaxed) + tokens as u64;
    if n < armed.spec.after_tokens || PREFILL_CRAWLING.load(Ordering::Relaxed) {
        return;
    }
    if let Some(path) = &armed.spec.once {
        // Only the engine that removes the file fires.
        if std::fs::remove_file(path).is_err() {
            return;
        }
    }
    fire(armed, &format!("{n} prompt tokens prefilled"));
}

/// Arms the switch for this process.
pub fn arm(spec: FaultSpec) {
    tracing::warn!(?spec, "fault switch armed (MLXD_ALLOW_FAULTS=1)");
    let _ = ARMED.set(Armed {
        spec,
        emitted: AtomicU64::new(0),
    });
}

/// How long the load waits first, when a `slow_load` fault is armed.
pub fn load_delay() -> Option<std::time::Duration> {
    let armed = ARMED.get()?;
    (armed.spec.kind == FaultKind::SlowLoad)
        .then(|| std::time::Duration::from_millis(armed.spec.after_tokens))
}

/// Called once for each generated token handed to a client. Does nothing unless armed.
pub fn on_token() {
    let Some(armed) = ARMED.get() else {
        return;
    };
    if matches!(
        armed.spec.kind,
        FaultKind::SlowLoad | FaultKind::CrawlPrefill
    ) {
        return;
    }
    let n = armed.emitted.fetch_add(1, Ordering::Relaxed) + 1;
    if n != armed.spec.after_tokens {
        return;
    }
    if let Some(path) = &armed.spec.once {
        // Only the engine that removes the file fires.
        if std::fs::remove_file(path).is_err() {
            return;
        }
    }
    fire(armed, &format!("{n} generated tokens"));
}

/// Fires the armed fault, `after` saying what reached its count.
fn fire(armed: &Armed, after: &str) {
    let what = format!("injected fault after {after} (MLXD_FAULT)");
    match armed.spec.kind {
        FaultKind::Abort => {
            tracing::error!("{what}: aborting");
            std::process::abort();
        }
        FaultKind::OutOfMemory => {
            let message =
                format!("{what}: cudaMallocAsync(&data, size, stream) failed: out of memory");
            tracing::error!("{message}: the next step fails with it");
            *STEP_ERROR.lock().unwrap_or_else(|e| e.into_inner()) = Some(message);
        }
        FaultKind::DeviceLost => {
            let message = format!(
                "{what}: cudaGetLastError() failed: an illegal memory access was encountered"
            );
            tracing::error!("{message}: the next step fails with it");
            *STEP_ERROR.lock().unwrap_or_else(|e| e.into_inner()) = Some(message);
        }
        // Never fires on a token (see `load_delay`).
        FaultKind::SlowLoad => {}
        FaultKind::Crawl => {
            tracing::error!("{what}: the device reports 0 MiB free and every step is slowed");
            MEMORY_FULL.store(true, Ordering::SeqCst);
            CRAWLING.store(true, Ordering::SeqCst);
        }
        FaultKind::Full => {
            tracing::error!("{what}: the device reports 0 MiB free");
            MEMORY_FULL.store(true, Ordering::SeqCst);
        }
        FaultKind::CrawlPrefill => {
            tracing::error!(
                "{what}: the device reports 0 MiB free and every prefill step is slowed"
            );
            MEMORY_FULL.store(true, Ordering::SeqCst);
            PREFILL_CRAWLING.store(true, Ordering::SeqCst);
        }
        FaultKind::Stall => {
            tracing::error!("{what}: the model thread stops");
            loop {
                std::thread::sleep(std::time::Duration::from_secs(3600));
            }
        }
        FaultKind::Hang => {
            tracing::error!("{what}: stopping the process (SIGSTOP)");
            // SAFETY: raise(3) with a valid signal number has no memory-safety preconditions.
            unsafe {
                libc::raise(libc::SIGSTOP);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_device_memory_and_refuses_a_malformed_one() {
        let m = parse_device_memory("2148/4096").unwrap();
        assert_eq!((m.free, m.total), (2148 << 20, 4096 << 20));
        for bad in ["2148", "x/4096", "5000/4096", ""] {
            assert!(parse_device_memory(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn parses_kinds_and_counts() {
        assert_eq!(
            parse("abort@3", None).unwrap(),
            FaultSpec {
                kind: FaultKind::Abort,
                after_tokens: 3,
                once: None
            }
        );
        assert_eq!(parse("oom@1", None).unwrap().kind, FaultKind::OutOfMemory);
        let hang = parse("hang@12", Some("/tmp/x".into())).unwrap();
        assert_eq!(hang.kind, FaultKind::Hang);
        assert_eq!(hang.once, Some(PathBuf::from("/tmp/x")));
        let slow = parse("slow_load@1500", None).unwrap();
        assert_eq!((slow.kind, slow.after_tokens), (FaultKind::SlowLoad, 1500));
        assert_eq!(parse("crawl@40", None).unwrap().kind, FaultKind::Crawl);
        assert_eq!(parse("full@40", None).unwrap().kind, FaultKind::Full);
        let prefill = parse("crawl_prefill@300", None).unwrap();
        assert_eq!(
            (prefill.kind, prefill.after_tokens),
            (FaultKind::CrawlPrefill, 300)
        );
    }

    #[test]
    fn malformed_specs_say_what_is_wrong() {
        for (bad, says) in [
            ("abort", "expected"),
            ("explode@3", "unknown fault"),
            ("explode@3", "crawl_prefill"),
            ("oom@0", ">= 1"),
            ("oom@x", ">= 1"),
        ] {
            let e = parse(bad, None).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
