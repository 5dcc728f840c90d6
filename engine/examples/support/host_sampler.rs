//! A sampling profiler of the host for the benchmarks: where a decode step's host time goes
//! (graph building, MLX's evaluation, the CUDA driver), which the step trace only splits in two.
//!
//! `SIGPROF` fires as the process spends CPU time (`setitimer(ITIMER_PROF)`, asked for every
//! millisecond; the kernel delivers at its tick, every 4 ms at 250 Hz, so a short phase needs
//! many repeats to be sampled well); the handler records the interrupted thread's id and its
//! return addresses (glibc's `backtrace`, which unwinds through MLX's and the driver's frames
//! by their `.eh_frame`) into a buffer allocated before the timer starts. [`Sampler::finish`]
//! writes the samples, the threads' names and `/proc/self/maps`;
//! `scripts/bench/host_profile.py` turns them into functions on the machine that has the same
//! binaries unstripped. Nothing here runs unless a benchmark is given a file to write
//! (`MLXD_HOST_PROFILE`).
use std::ffi::{c_int, c_void};
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};

/// Return addresses kept per sample (deeper frames are dropped).
const DEPTH: usize = 48;
/// Samples kept: a minute of one busy thread at the sampling rate.
const CAPACITY: usize = 60_000;
/// Words per sample: the thread id, the number of frames, the frames.
const SLOT: usize = DEPTH + 2;

extern "C" {
    /// glibc's `execinfo.h` unwinder.
    fn backtrace(buffer: *mut *mut c_void, size: c_int) -> c_int;
}

static BUFFER: AtomicPtr<usize> = AtomicPtr::new(std::ptr::null_mut());
static NEXT: AtomicUsize = AtomicUsize::new(0);
/// Whether a signal takes a sample ([`Sampler::set_sampling`]).
static ACTIVE: AtomicBool = AtomicBool::new(true);

extern "C" fn on_sigprof(_: c_int) {
    let buffer = BUFFER.load(Ordering::Acquire);
    if buffer.is_null() || !ACTIVE.load(Ordering::Relaxed) {
        return;
    }
    let i = NEXT.fetch_add(1, Ordering::Relaxed);
    if i >= CAPACITY {
        return;
    }
    // SAFETY: slot `i` is this handler's alone (the index was taken atomically) and lies inside
    // the buffer of `CAPACITY * SLOT` words, which lives until the process exits.
    unsafe {
        let slot = buffer.add(i * SLOT);
        *slot = thread_id();
        let frames = backtrace(slot.add(2).cast(), DEPTH as c_int);
        *slot.add(1) = frames.max(0) as usize;
    }
}

/// The calling thread's kernel id (its `/proc/self/task` entry); async-signal-safe.
#[cfg(target_os = "linux")]
fn thread_id() -> usize {
    // SAFETY: `gettid` takes no arguments and cannot fail.
    unsafe { libc::syscall(libc::SYS_gettid) as usize }
}

#[cfg(not(target_os = "linux"))]
fn thread_id() -> usize {
    0
}

/// A running sampler; [`Sampler::finish`] stops it and writes what it took.
pub struct Sampler {
    path: std::path::PathBuf,
}

impl Sampler {
    /// Starts sampling when `MLXD_HOST_PROFILE` names a file; `None` otherwise. Linux only
    /// (thread ids and `/proc/self/maps`): elsewhere the variable is an error.
    pub fn from_env() -> anyhow::Result<Option<Self>> {
        let Some(path) = std::env::var_os("MLXD_HOST_PROFILE") else {
            return Ok(None);
        };
        anyhow::ensure!(
            cfg!(target_os = "linux"),
            "MLXD_HOST_PROFILE samples the host on Linux only"
        );
        let words = vec![0usize; CAPACITY * SLOT].into_boxed_slice();
        BUFFER.store(Box::leak(words).as_mut_ptr(), Ordering::Release);
        // The first call loads the unwinder (`dlopen`), which a signal handler must not do.
        let mut warm = [std::ptr::null_mut::<c_void>(); 4];
        // SAFETY: the buffer holds the 4 entries asked for.
        unsafe { backtrace(warm.as_mut_ptr(), 4) };
        // SAFETY: the handler only touches atomics and its own slot; `sigaction` and
        // `setitimer` get fully initialised structures.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_sigprof as *const () as usize;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            anyhow::ensure!(
                libc::sigaction(libc::SIGPROF, &action, std::ptr::null_mut()) == 0,
                "sigaction(SIGPROF): {}",
                std::io::Error::last_os_error()
            );
            let tick = libc::timeval {
                tv_sec: 0,
                tv_usec: 1000,
            };
            let timer = libc::itimerval {
                it_interval: tick,
                it_value: tick,
            };
            anyhow::ensure!(
                libc::setitimer(libc::ITIMER_PROF, &timer, std::ptr::null_mut()) == 0,
                "setitimer: {}",
                std::io::Error::last_os_error()
            );
        }
        Ok(Some(Self { path: path.into() }))
    }

    /// Whether signals take samples from now on (off: a benchmark's untimed work; the timer
    /// keeps running).
    #[allow(dead_code)] // not every benchmark turns it off
    pub fn set_sampling(&self, on: bool) {
        ACTIVE.store(on, Ordering::Relaxed);
    }

    /// Stops the timer and writes `S <tid> <address>…` per sample, `T <tid> <name>` per thread
    /// that was sampled, and `M <line>` per line of `/proc/self/maps`.
    pub fn finish(self) -> anyhow::Result<()> {
        // SAFETY: a zeroed timer disarms it.
        unsafe {
            let off: libc::itimerval = std::mem::zeroed();
            libc::setitimer(libc::ITIMER_PROF, &off, std::ptr::null_mut());
        }
        let taken = NEXT.load(Ordering::Relaxed).min(CAPACITY);
        let buffer = BUFFER.load(Ordering::Acquire);
        let mut out = std::io::BufWriter::new(std::fs::File::create(&self.path)?);
        let mut threads = std::collections::BTreeSet::new();
        for i in 0..taken {
            // SAFETY: slots below `taken` were written by the handler, which no longer runs
            // (a signal already in flight may still write a slot at or above `taken`).
            let slot = unsafe { std::slice::from_raw_parts(buffer.add(i * SLOT), SLOT) };
            let frames = slot[1].min(DEPTH);
            threads.insert(slot[0]);
            write!(out, "S {}", slot[0])?;
            for address in &slot[2..2 + frames] {
                write!(out, " {address:x}")?;
            }
            writeln!(out)?;
        }
        for tid in threads {
            let name = std::fs::read_to_string(format!("/proc/self/task/{tid}/comm"))
                .unwrap_or_else(|_| "(exited)".into());
            writeln!(out, "T {tid} {}", name.trim())?;
        }
        for line in std::fs::read_to_string("/proc/self/maps")?.lines() {
            writeln!(out, "M {line}")?;
        }
        out.flush()?;
        eprintln!(
            "host profile: {taken} samples ({} dropped) in {}",
            NEXT.load(Ordering::Relaxed).saturating_sub(CAPACITY),
            self.path.display()
        );
        Ok(())
    }
}
