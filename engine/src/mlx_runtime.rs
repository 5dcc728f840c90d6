//! Start-up checks on the libmlx this process loaded.
use std::ffi::CStr;

/// The version string of the libmlx loaded at run time.
pub fn loaded_mlx_version() -> String {
    // SAFETY: mlx_string_new/mlx_version/mlx_string_data/mlx_string_free are used as mlx-c
    // documents: the string is created, filled, read while alive, then freed.
    unsafe {
        let mut s = mlx_sys::mlx_string_new();
        mlx_sys::mlx_version(&mut s);
        let text = CStr::from_ptr(mlx_sys::mlx_string_data(s))
            .to_string_lossy()
            .into_owned();
        mlx_sys::mlx_string_free(s);
        text
    }
}

/// Fails unless the loaded libmlx is the version this binary was built against: libmlx has no
/// ABI stability across patch releases, so a mismatch would crash later in obscure ways.
pub fn check_mlx_version() -> Result<(), String> {
    let loaded = loaded_mlx_version();
    let built = mlx_sys::MLX_BUILD_VERSION;
    if loaded == built {
        Ok(())
    } else {
        Err(format!(
            "this mlxd-engine was built against MLX {built} but loaded libmlx {loaded}; \
             install MLX {built} (scripts/setup.sh) or point LD_LIBRARY_PATH at it"
        ))
    }
}
