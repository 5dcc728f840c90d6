//! With `in-process`, this crate's tests and examples link libmlx: like the engine's binaries,
//! they find it through an rpath (a dependency's rpath does not reach the final link).
fn main() {
    if std::env::var_os("CARGO_FEATURE_IN_PROCESS").is_some() {
        let lib_dir = std::env::var("DEP_MLX_LIB_DIR").expect("mlx-sys publishes DEP_MLX_LIB_DIR");
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib_dir}");
    }
}
