//! Where MLX keeps the GPU kernels it compiles at first use.
//!
//! MLX's CUDA backend compiles many kernels the first time a process runs them and keeps the
//! result on disk, by default under the temporary directory (`/tmp/mlx/<version>/ptx`). On a
//! fresh H100 that compiling cost an engine's warm-up about 95 s (2026-12-05; 1.6 s once the
//! kernels are on disk), and `/tmp` is emptied by a reboot, so every reboot would pay it again
//! on the first load. The engine points MLX at a directory in the model store instead
//! (`<home>/kernels/mlx-<version>`), which lives as long as the models do. A directory the
//! user chose (`MLX_PTX_CACHE_DIR` already set) is left alone.
use std::path::{Path, PathBuf};

/// MLX's variable for its compiled-kernel directory.
pub const PTX_CACHE_ENV: &str = "MLX_PTX_CACHE_DIR";

/// The kernel directory for MLX `version` under the store `home`: compiled kernels are only
/// valid for the MLX that compiled them.
pub fn dir_for(home: &Path, version: &str) -> PathBuf {
    home.join("kernels").join(format!("mlx-{version}"))
}

/// Points MLX at [`dir_for`] unless `MLX_PTX_CACHE_DIR` is set; call before MLX compiles
/// anything (first thing in the engine's `main`, before other threads read the environment).
/// Returns the directory in use, or an error naming the directory that could not be made (the
/// engine then runs with MLX's default, and the caller says so).
pub fn keep_in_store(home: &Path) -> Result<PathBuf, String> {
    if let Some(chosen) = std::env::var_os(PTX_CACHE_ENV) {
        return Ok(PathBuf::from(chosen));
    }
    let dir = dir_for(home, &crate::device::loaded_mlx_version());
    std::fs::create_dir_all(&dir)
        .map_err(|e| format!("creating the kernel cache {}: {e}", dir.display()))?;
    std::env::set_var(PTX_CACHE_ENV, &dir);
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_are_kept_per_mlx_version_in_the_store() {
        assert_eq!(
            dir_for(Path::new("/store"), "0.32.4"),
            Path::new("/store/kernels/mlx-0.32.4")
        );
    }
}
