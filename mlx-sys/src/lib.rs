//! Raw bindings to the MLX C API (mlx-c 0.7.0), standing in for the published `mlx-sys` 0.7.0
//! so that `mlx-rs` builds on Linux against an MLX installed from PyPI.
#![allow(non_upper_case_globals)]
#![allow(non_camel_case_types)]
#![allow(non_snake_case)]
#![allow(clippy::all)]

/// IEEE half-precision bits, shaped as bindgen renders ARM's `__fp16` (mlx-rs reads `.0`).
#[cfg(not(target_arch = "aarch64"))]
#[repr(transparent)]
#[derive(Debug, Default, Copy, Clone, PartialEq, Eq, Hash)]
pub struct float16_t(pub u16);

include!(concat!(env!("OUT_DIR"), "/bindings.rs"));

/// The MLX version this crate was compiled against (the wheel's `MLXConfigVersion.cmake`).
pub const MLX_BUILD_VERSION: &str = env!("MLXD_MLX_BUILD_VERSION");

/// mlx-rs seeds its default random state from `mach_approximate_time`, a macOS call. On other
/// systems this provides it from the monotonic clock, in nanoseconds.
#[cfg(not(target_os = "macos"))]
#[no_mangle]
pub extern "C" fn mach_approximate_time() -> u64 {
    let mut ts = TimeSpec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into the pointer we pass.
    unsafe { clock_gettime(CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64)
        .wrapping_mul(1_000_000_000)
        .wrapping_add(ts.tv_nsec as u64)
}

#[cfg(not(target_os = "macos"))]
#[repr(C)]
struct TimeSpec {
    tv_sec: i64,
    tv_nsec: i64,
}

#[cfg(not(target_os = "macos"))]
const CLOCK_MONOTONIC: i32 = 1;

#[cfg(not(target_os = "macos"))]
extern "C" {
    fn clock_gettime(clock: i32, ts: *mut TimeSpec) -> i32;
}
