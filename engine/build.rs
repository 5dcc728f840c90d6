//! Each binary that links libmlx finds it through an rpath (a dependency's rpath does not reach
//! the final link) and binds every symbol at start-up (`-z now`), so a libmlx of another version
//! fails at once instead of at the first missing symbol.
fn main() {
    let lib_dir = std::env::var("DEP_MLX_LIB_DIR").expect("mlx-sys publishes DEP_MLX_LIB_DIR");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{lib_dir}");
    if !cfg!(target_os = "macos") {
        println!("cargo:rustc-link-arg=-Wl,-z,now");
    }
}
