//! Classifying why an engine exited. Pure functions, unit-tested.

use std::fmt;

use mlxd_protocol::control::{Fatal, FatalKind};
use nix::sys::signal::Signal;

const SIGKILL: i32 = Signal::SIGKILL as i32;

/// Why an engine process ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExitCause {
    /// `Fatal(OutOfMemory)`, MLX's allocation-failure text on stderr, or a SIGKILL that
    /// the kernel's OOM killer recorded (the cgroup's `oom_kill` counter rose). A SIGKILL
    /// with no such record is a [`Crash`](Self::Crash): someone else killed it, and
    /// treating that as memory pressure would shrink the limits for nothing.
    OutOfMemory { detail: String },
    /// Died before `Ready` (any other reason).
    LoadFailed { detail: String },
    /// The engine reported (`Fatal(CannotLoad)`) that the load cannot succeed as asked:
    /// no such model, a refused option, a download impossible offline. The detail says
    /// why and what to do; restarting would fail the same way.
    CannotLoad { detail: String },
    /// Killed by a signal or exited with a code, after `Ready`.
    Crash {
        signal: Option<i32>,
        code: Option<i32>,
    },
    /// We asked it to stop.
    Requested,
}

impl ExitCause {
    /// Stable machine-readable code, used as the OpenAI error `code`.
    pub fn code(&self) -> &'static str {
        match self {
            Self::OutOfMemory { .. } => "out_of_memory",
            // Still a failed load for clients; the pool tells the two apart.
            Self::LoadFailed { .. } | Self::CannotLoad { .. } => "load_failed",
            Self::Crash { .. } => "crash",
            Self::Requested => "stopped",
        }
    }

    pub fn is_requested(&self) -> bool {
        matches!(self, Self::Requested)
    }

    /// Whether restarting the engine cannot help.
    pub fn is_permanent(&self) -> bool {
        matches!(self, Self::CannotLoad { .. })
    }
}

impl fmt::Display for ExitCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::OutOfMemory { detail } => write!(f, "out of memory ({detail})"),
            Self::LoadFailed { detail } => write!(f, "load failed ({detail})"),
            Self::CannotLoad { detail } => write!(f, "cannot load: {detail}"),
            Self::Crash {
                signal: Some(s), ..
            } => write!(f, "crashed (killed by signal {s}{})", signal_name(*s)),
            Self::Crash { code: Some(c), .. } => write!(f, "crashed (exit code {c})"),
            // Without a status: reported when its control channel closed (the status is logged
            // once it is reaped), or its wait failed.
            Self::Crash { .. } => write!(f, "crashed"),
            Self::Requested => write!(f, "stopped on request"),
        }
    }
}

/// `", SIGKILL"` and the like, for messages; empty for a number that is no signal.
fn signal_name(s: i32) -> String {
    Signal::try_from(s)
        .map(|sig| format!(", {}", sig.as_str()))
        .unwrap_or_default()
}

/// An exit with its evidence: the cause and the last stderr lines.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExitReport {
    pub cause: ExitCause,
    pub stderr_tail: Vec<String>,
    /// Whether the process's exit status was read. An engine whose control channel closed
    /// is reported before (its GPU context takes ~100 ms more to go), then again once reaped.
    pub reaped: bool,
}

impl ExitReport {
    pub fn new(cause: ExitCause, stderr_tail: Vec<String>) -> Self {
        Self {
            cause,
            stderr_tail,
            reaped: true,
        }
    }

    /// A report made when the engine's control channel closed, before its status is known.
    pub fn before_reaping(cause: ExitCause, stderr_tail: Vec<String>) -> Self {
        Self {
            reaped: false,
            ..Self::new(cause, stderr_tail)
        }
    }

    /// The cause plus the last stderr line, for error messages sent to clients.
    pub fn summary(&self) -> String {
        match self.stderr_tail.iter().rev().find(|l| !l.trim().is_empty()) {
            // The engine's own message is complete for these; its log line repeats it.
            Some(line)
                if !matches!(
                    self.cause,
                    ExitCause::OutOfMemory { .. } | ExitCause::CannotLoad { .. }
                ) =>
            {
                format!("{}; last log line: {}", self.cause, truncate(line, 300))
            }
            _ => self.cause.to_string(),
        }
    }
}

fn truncate(s: &str, max: usize) -> &str {
    match s.char_indices().nth(max) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

/// How the process ended, as the OS reports it: neither field when its exit is reported
/// before it can be reaped (its control channel closed; `engine::Supervised::run`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawExit {
    pub code: Option<i32>,
    pub signal: Option<i32>,
}

impl RawExit {
    /// No status: not known yet (reported before the process could be reaped), or its wait
    /// failed.
    pub const UNKNOWN: RawExit = RawExit {
        code: None,
        signal: None,
    };

    fn unknown(self) -> bool {
        self == Self::UNKNOWN
    }
}

/// What we know when an engine ends.
#[derive(Debug, Clone, Copy)]
pub struct Evidence<'a> {
    pub exit: RawExit,
    pub fatal: Option<&'a Fatal>,
    pub stderr_tail: &'a [String],
    pub was_ready: bool,
    pub stop_requested: bool,
    /// Set when mlxd itself killed the engine, with the reason (e.g. a load timeout).
    pub killed_for: Option<&'a str>,
    /// The kernel OOM killer's record for our cgroup while the engine ran, if readable.
    pub kernel_oom: Option<OomKills>,
}

/// The cgroup v2 `memory.events` `oom_kill` counter at spawn and at exit. Engines are
/// children of mlxd and share its cgroup, so a rise while the engine ran, together
/// with a SIGKILL nobody in mlxd sent, is the kernel OOM killer's evidence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OomKills {
    pub before: u64,
    pub after: u64,
}

/// The `oom_kill` counter of a cgroup v2 `memory.events` file.
pub fn parse_oom_kill(memory_events: &str) -> Option<u64> {
    memory_events.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == "oom_kill").then(|| v.trim().parse().ok()).flatten()
    })
}

/// The file holding this process's cgroup `oom_kill` counter, from `/proc/self/cgroup`:
/// cgroup v2 `memory.events` (`0::/path`), else cgroup v1 `memory.oom_control`
/// (`N:memory:/path`, which has the counter since Linux 4.13).
pub fn oom_counter_path(proc_self_cgroup: &str) -> Option<std::path::PathBuf> {
    let join = |root: &str, rel: &str, file: &str| {
        let mut p = std::path::PathBuf::from(root);
        p.push(rel.trim().trim_start_matches('/'));
        p.push(file);
        p
    };
    let v1 = proc_self_cgroup.lines().find_map(|l| {
        let (_, rest) = l.split_once(':')?;
        let (controllers, rel) = rest.split_once(':')?;
        controllers
            .split(',')
            .any(|c| c == "memory")
            .then(|| join("/sys/fs/cgroup/memory", rel, "memory.oom_control"))
    });
    let v2 = proc_self_cgroup
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(|rel| join("/sys/fs/cgroup", rel, "memory.events"));
    v1.or(v2)
}

/// Reads this process's cgroup `oom_kill` counter; `None` where none is readable
/// (macOS, a kernel before 4.13, a container without the memory controller).
pub fn read_oom_kills() -> Option<u64> {
    let cgroup = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = oom_counter_path(&cgroup)?;
    let text = std::fs::read_to_string(&path).ok().or_else(|| {
        // Inside a cgroup namespace the listed path is relative to a root we do not see;
        // the mount's top is then our own cgroup.
        let file = path.file_name()?;
        let root = if file == "memory.events" {
            "/sys/fs/cgroup"
        } else {
            "/sys/fs/cgroup/memory"
        };
        std::fs::read_to_string(std::path::Path::new(root).join(file)).ok()
    })?;
    parse_oom_kill(&text)
}

/// Text MLX (Metal and CUDA back ends) and the C++ runtime print on allocation failure.
const OOM_MARKERS: &[&str] = &[
    "[metal::malloc]",
    "[cuda::malloc]",
    "unable to allocate",
    "out of memory",
    "std::bad_alloc",
    "cudaerrormemoryallocation",
    "insufficient memory",
];

fn oom_line(tail: &[String]) -> Option<&String> {
    tail.iter().rev().find(|l| {
        let l = l.to_ascii_lowercase();
        OOM_MARKERS.iter().any(|m| l.contains(m))
    })
}

/// Classifies an exit. Order matters: a requested stop wins; then the engine's own
/// `Fatal`; then out-of-memory evidence (MLX's text, the kernel's record); then "before
/// Ready" means a load failure. Anything else after Ready is a crash.
pub fn classify(ev: Evidence<'_>) -> ExitCause {
    if ev.stop_requested {
        return ExitCause::Requested;
    }
    if let Some(reason) = ev.killed_for {
        return if ev.was_ready {
            ExitCause::Crash {
                signal: ev.exit.signal,
                code: ev.exit.code,
            }
        } else {
            ExitCause::LoadFailed {
                detail: reason.to_string(),
            }
        };
    }
    if let Some(f) = ev.fatal {
        return match f.kind {
            FatalKind::OutOfMemory => ExitCause::OutOfMemory {
                detail: f.message.clone(),
            },
            FatalKind::LoadFailed => ExitCause::LoadFailed {
                detail: f.message.clone(),
            },
            FatalKind::Internal if !ev.was_ready => ExitCause::LoadFailed {
                detail: f.message.clone(),
            },
            FatalKind::CannotLoad if !ev.was_ready => ExitCause::CannotLoad {
                detail: f.message.clone(),
            },
            FatalKind::Internal | FatalKind::CannotLoad => ExitCause::Crash {
                signal: ev.exit.signal,
                code: ev.exit.code,
            },
        };
    }
    if let Some(line) = oom_line(ev.stderr_tail) {
        return ExitCause::OutOfMemory {
            detail: truncate(line.trim(), 300).to_string(),
        };
    }
    // A SIGKILL, or an exit reported before its status was known: the OOM killer's record
    // tells them apart from another process's kill.
    if ev.exit.signal == Some(SIGKILL) || ev.exit.unknown() {
        if let Some(k) = ev.kernel_oom.filter(|k| k.after > k.before) {
            return ExitCause::OutOfMemory {
                detail: format!(
                    "killed by the kernel OOM killer (cgroup oom_kill count {} -> {})",
                    k.before, k.after
                ),
            };
        }
    }
    if !ev.was_ready {
        let how = match (ev.exit.signal, ev.exit.code) {
            (Some(s), _) => format!("killed by signal {s}{} before ready", signal_name(s)),
            (None, Some(c)) => format!("exit code {c} before ready"),
            (None, None) => "exited before ready".into(),
        };
        return ExitCause::LoadFailed { detail: how };
    }
    ExitCause::Crash {
        signal: ev.exit.signal,
        code: ev.exit.code,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev<'a>(code: Option<i32>, signal: Option<i32>, tail: &'a [String]) -> Evidence<'a> {
        Evidence {
            exit: RawExit { code, signal },
            fatal: None,
            stderr_tail: tail,
            was_ready: true,
            stop_requested: false,
            killed_for: None,
            kernel_oom: None,
        }
    }

    #[test]
    fn our_own_kill_during_load_is_a_load_failure_not_oom() {
        let e = Evidence {
            was_ready: false,
            killed_for: Some("not ready after 5s"),
            ..ev(None, Some(libc::SIGKILL), &[])
        };
        assert_eq!(
            classify(e),
            ExitCause::LoadFailed {
                detail: "not ready after 5s".into()
            }
        );
    }

    #[test]
    fn requested_stop_wins() {
        let e = Evidence {
            stop_requested: true,
            ..ev(None, Some(libc::SIGKILL), &[])
        };
        assert_eq!(classify(e), ExitCause::Requested);
    }

    #[test]
    fn fatal_message_decides() {
        let f = Fatal {
            kind: FatalKind::OutOfMemory,
            message: "KV cache needs 4 GiB, 1 GiB free".into(),
        };
        let e = Evidence {
            fatal: Some(&f),
            ..ev(Some(1), None, &[])
        };
        assert!(
            matches!(classify(e), ExitCause::OutOfMemory { detail } if detail.contains("4 GiB"))
        );
    }

    #[test]
    fn a_load_that_cannot_succeed_is_permanent_and_says_only_why() {
        let f = Fatal {
            kind: FatalKind::CannotLoad,
            message: "\"smolm2-135m\" is not a known model; did you mean smollm2-135m?".into(),
        };
        let tail = vec![r#"{"level":"ERROR","message":"load failed"}"#.to_string()];
        let e = Evidence {
            fatal: Some(&f),
            was_ready: false,
            ..ev(Some(2), None, &tail)
        };
        let cause = classify(e);
        assert!(cause.is_permanent(), "{cause:?}");
        assert_eq!(cause.code(), "load_failed");
        let summary = ExitReport::new(cause, tail).summary();
        assert_eq!(
            summary,
            "cannot load: \"smolm2-135m\" is not a known model; did you mean smollm2-135m?"
        );
        // Sent after Ready it is nonsense from the engine: a crash, retried.
        let e = Evidence {
            fatal: Some(&f),
            ..ev(Some(2), None, &[])
        };
        assert!(matches!(classify(e), ExitCause::Crash { .. }));
        // An ordinary load failure stays retryable.
        let f = Fatal {
            kind: FatalKind::LoadFailed,
            message: "disk hiccup".into(),
        };
        let e = Evidence {
            fatal: Some(&f),
            was_ready: false,
            ..ev(Some(2), None, &[])
        };
        assert!(!classify(e).is_permanent());
    }

    #[test]
    fn mlx_allocation_text_means_oom() {
        let tail = vec![
            "loading".to_string(),
            "libc++abi: terminating ... [metal::malloc] Unable to allocate 17179869184 bytes."
                .into(),
        ];
        assert!(matches!(
            classify(ev(None, Some(libc::SIGABRT), &tail)),
            ExitCause::OutOfMemory { .. }
        ));
    }

    #[test]
    fn an_unexplained_sigkill_is_a_crash_not_oom() {
        let c = classify(ev(None, Some(libc::SIGKILL), &[]));
        assert_eq!(
            c,
            ExitCause::Crash {
                signal: Some(libc::SIGKILL),
                code: None
            }
        );
        assert_eq!(c.to_string(), "crashed (killed by signal 9, SIGKILL)");
        // The counter was readable and did not move: still a crash.
        let e = Evidence {
            kernel_oom: Some(OomKills {
                before: 2,
                after: 2,
            }),
            ..ev(None, Some(libc::SIGKILL), &[])
        };
        assert!(matches!(classify(e), ExitCause::Crash { .. }));
    }

    #[test]
    fn a_sigkill_the_kernel_oom_killer_recorded_is_oom() {
        let e = Evidence {
            kernel_oom: Some(OomKills {
                before: 2,
                after: 3,
            }),
            ..ev(None, Some(libc::SIGKILL), &[])
        };
        assert!(
            matches!(classify(e), ExitCause::OutOfMemory { detail } if detail.contains("2 -> 3"))
        );
        // The same record with the status not known yet (reported when the engine's control
        // channel closed): out of memory too.
        let e = Evidence {
            kernel_oom: Some(OomKills {
                before: 2,
                after: 3,
            }),
            ..ev(None, None, &[])
        };
        assert!(matches!(classify(e), ExitCause::OutOfMemory { .. }));
        // Another process's OOM kill does not explain an engine that exited by itself.
        let e = Evidence {
            kernel_oom: Some(OomKills {
                before: 2,
                after: 3,
            }),
            ..ev(Some(1), None, &[])
        };
        assert!(matches!(classify(e), ExitCause::Crash { .. }));
    }

    #[test]
    fn cgroup_memory_events_parse() {
        let events = "low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n";
        assert_eq!(parse_oom_kill(events), Some(2));
        assert_eq!(parse_oom_kill("oom 3\n"), None);
        assert_eq!(parse_oom_kill("oom_kill x\n"), None);
        assert_eq!(
            oom_counter_path("0::/user.slice/mlxd.service\n"),
            Some("/sys/fs/cgroup/user.slice/mlxd.service/memory.events".into())
        );
        assert_eq!(
            oom_counter_path("0::/\n"),
            Some("/sys/fs/cgroup/memory.events".into())
        );
        assert_eq!(
            oom_counter_path("5:devices:/\n4:memory:/box/1\n0::/\n"),
            Some("/sys/fs/cgroup/memory/box/1/memory.oom_control".into())
        );
        assert_eq!(oom_counter_path("12:cpu:/x\n"), None);
    }

    #[test]
    fn before_ready_is_load_failure() {
        let e = Evidence {
            was_ready: false,
            ..ev(Some(2), None, &[])
        };
        assert_eq!(
            classify(e),
            ExitCause::LoadFailed {
                detail: "exit code 2 before ready".into()
            }
        );
    }

    #[test]
    fn signal_or_code_after_ready_is_crash() {
        let c = classify(ev(None, Some(libc::SIGABRT), &[]));
        assert_eq!(c.to_string(), "crashed (killed by signal 6, SIGABRT)");
        assert_eq!(
            classify(ev(Some(3), None, &[])),
            ExitCause::Crash {
                signal: None,
                code: Some(3)
            }
        );
    }

    #[test]
    fn summary_includes_last_line() {
        let r = ExitReport::new(
            ExitCause::Crash {
                signal: None,
                code: Some(3),
            },
            vec!["a".into(), "boom".into(), "".into()],
        );
        assert_eq!(r.summary(), "crashed (exit code 3); last log line: boom");
    }
}
