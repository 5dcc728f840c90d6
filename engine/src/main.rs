fn main() {
    if let Err(e) = mlxd_engine::mlx_runtime::check_mlx_version() {
        eprintln!("{e}");
        std::process::exit(1);
    }
    println!("mlx {}", mlxd_engine::mlx_runtime::loaded_mlx_version());
}
