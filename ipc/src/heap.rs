//! The C heap of a long-running process: glibc malloc settings that let freed memory go back
//! to the kernel, and the trims that return it. Both `mlxd` and the engines use them.
//!
//! glibc keeps freed memory for reuse, and three of its defaults made `mlxd` and its engines
//! grow and stay grown after a burst (issue 23, finding 10: `mlxd` 9 → 94 MiB after one 30 MB
//! body, 11 → 144 MiB after 2 000 slow connections; an engine 143 → 765 MiB after 600 refused
//! 200 KB prompts):
//! - the dynamic mmap threshold: once a large block (a request body, a tokenized prompt) that
//!   had its own mapping is freed, glibc raises the threshold to that block's size, so later
//!   blocks of up to 32 MiB come from the heap, and a freed heap block is kept;
//! - one arena per thread that allocates, up to eight per core, each keeping its own free
//!   memory;
//! - free pages in the middle of a heap are returned only by `malloc_trim`; `free` gives
//!   back only the top of the main heap.
//!
//! [`configure`] fixes the threshold and caps the arenas; [`spawn_trimmer`] trims at a fixed
//! period, so a burst's memory is back with the kernel within that period.
//! Elsewhere than on glibc (macOS, musl) both do nothing: those allocators return freed
//! memory by themselves.
use std::io;
use std::time::Duration;

/// Blocks of at least this many bytes get a mapping of their own, unmapped when freed.
/// Fixed, so that it does not follow the largest block freed so far.
pub const MMAP_THRESHOLD: usize = 256 << 10;

/// Free memory at the top of the main heap above which `free` gives it back.
pub const TRIM_THRESHOLD: usize = 1 << 20;

/// The most malloc arenas: the threads that allocate a lot (the tokio workers, the engine's
/// MLX thread) share them instead of each keeping a heap of its own.
pub const ARENA_MAX: usize = 2;

/// How often [`spawn_trimmer`] gives free heap pages back.
pub const TRIM_PERIOD: Duration = Duration::from_secs(5);

/// Applies [`MMAP_THRESHOLD`], [`TRIM_THRESHOLD`] and [`ARENA_MAX`]. Call first thing in
/// `main`, before other threads start: a thread's arena is chosen at its first allocation.
pub fn configure() -> io::Result<()> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    for (param, name, value) in [
        (libc::M_MMAP_THRESHOLD, "M_MMAP_THRESHOLD", MMAP_THRESHOLD),
        (libc::M_TRIM_THRESHOLD, "M_TRIM_THRESHOLD", TRIM_THRESHOLD),
        (libc::M_ARENA_MAX, "M_ARENA_MAX", ARENA_MAX),
    ] {
        // SAFETY: mallopt only changes malloc's tuning parameters; it returns 0 on error.
        if unsafe { libc::mallopt(param, value as libc::c_int) } == 0 {
            return Err(io::Error::other(format!(
                "mallopt({name}, {value}) was refused"
            )));
        }
    }
    Ok(())
}

/// Gives the free pages of every malloc arena back to the kernel; true when some were.
pub fn trim() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: malloc_trim takes each arena's lock itself and only releases free memory.
        unsafe { libc::malloc_trim(0) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// Trims every [`TRIM_PERIOD`] on a thread of its own, for the life of the process.
/// A trim walks the free blocks of each arena (about a millisecond for a heap of a few
/// hundred MiB), holding that arena's lock meanwhile.
pub fn spawn_trimmer() -> io::Result<()> {
    std::thread::Builder::new()
        .name("heap-trim".into())
        .spawn(|| loop {
            std::thread::sleep(TRIM_PERIOD);
            trim();
        })
        .map(drop)
}

/// This process's resident set size in bytes (`/proc/self/statm`; Linux only).
pub fn resident_bytes() -> io::Result<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm")?;
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| io::Error::other(format!("unexpected /proc/self/statm: {statm:?}")))?;
    // SAFETY: sysconf only reads a system constant.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Ok(pages * page.max(1) as u64)
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use super::*;

    /// What the settings and the trim are for: after a large block and then most of many
    /// small ones are freed (a body read in pieces; the survivors pin the pages around
    /// them), the process's resident memory comes back down.
    #[test]
    fn freed_blocks_return_to_the_kernel() {
        configure().unwrap();
        let before = resident_bytes().unwrap();
        // Freed first, as a whole body is: glibc's default would raise its thresholds.
        drop(std::hint::black_box(vec![1u8; 30 << 20]));
        let mut blocks: Vec<Vec<u8>> = (0..4096).map(|i| vec![i as u8; 16 << 10]).collect();
        let during = resident_bytes().unwrap();
        assert!(
            during > before + (48 << 20),
            "{before} -> {during}: the blocks should be resident"
        );
        // One block in 64 stays: 1 MiB, spread over the 64 MiB.
        let mut i = 0;
        blocks.retain(|_| {
            i += 1;
            i % 64 == 0
        });
        trim();
        let after = resident_bytes().unwrap();
        assert!(
            after < before + (8 << 20),
            "resident {} MiB before, {} MiB with the blocks, {} MiB after freeing and trimming",
            before >> 20,
            during >> 20,
            after >> 20
        );
        drop(std::hint::black_box(blocks));
    }
}
