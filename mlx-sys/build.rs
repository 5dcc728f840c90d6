//! Builds mlx-c 0.7.0 against the MLX that the project's virtualenv installed from PyPI,
//! adapting the bindings whose C++ signature changed since mlx-c was written (see
//! [`adapted_mlx_c`]).
//!
//! Inputs (each has an environment override, for packagers):
//! - MLX: `MLX_PREFIX` (a directory holding `lib/libmlx.*`, `include/`, `share/cmake/MLX`),
//!   else `<workspace>/.venv/lib/python3*/site-packages/mlx`.
//! - mlx-c sources: `MLX_C_SRC`, else `<workspace>/.deps/mlx-sys-0.7.0/src/mlx-c`, fetched by
//!   `scripts/setup.sh` from the published `mlx-sys` crate package.
//!
//! Outputs, read by dependents through `links = "mlx"` as `DEP_MLX_*`:
//! `LIB_DIR` (for each binary's rpath) and `VERSION` (checked against the loaded libmlx at start-up).

use std::env;
use std::fs;
use std::path::{Path, PathBuf};

const SETUP_HINT: &str = "run `scripts/setup.sh` from the repository root first";

fn main() {
    println!("cargo:rerun-if-env-changed=MLX_PREFIX");
    println!("cargo:rerun-if-env-changed=MLX_C_SRC");
    println!("cargo:rerun-if-changed=native");
    println!("cargo:rerun-if-changed=build.rs");

    let manifest =
        PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let workspace = manifest
        .parent()
        .expect("mlx-sys lives inside the workspace")
        .to_path_buf();
    println!(
        "cargo:rerun-if-changed={}",
        workspace.join("mlx-versions.env").display()
    );

    let pinned = pinned_mlx_version(&workspace);
    let mlx = find_mlx(&workspace);
    let found = installed_mlx_version(&mlx);
    if found != pinned {
        fail(&format!(
            "found MLX {found} at {}, but the project pins MLX {pinned} (mlx-versions.env); {SETUP_HINT}",
            mlx.display()
        ));
    }
    let mlx_c = adapted_mlx_c(&find_mlx_c(&workspace), &found);

    let dst = cmake::Config::new(manifest.join("native"))
        .define("MLX_C_SOURCE_DIR", &mlx_c)
        .define("MLX_DIR", mlx.join("share/cmake/MLX"))
        // mlx-c is a thin wrapper; an unoptimised build only slows every debug test run.
        .profile("Release")
        .build();

    let lib_dir = mlx.join("lib");
    println!("cargo:rustc-link-search=native={}/lib", dst.display());
    println!("cargo:rustc-link-lib=static=mlxc");
    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    println!("cargo:rustc-link-lib=dylib=mlx");
    if cfg!(target_os = "macos") {
        println!("cargo:rustc-link-lib=dylib=c++");
    } else {
        println!("cargo:rustc-link-lib=dylib=stdc++");
    }
    println!("cargo:lib_dir={}", lib_dir.display());
    println!("cargo:version={found}");
    println!("cargo:rustc-env=MLXD_MLX_BUILD_VERSION={found}");

    generate_bindings(&manifest, &mlx_c);
}

fn fail(message: &str) -> ! {
    eprintln!("error: {message}");
    panic!("{message}");
}

fn pinned_mlx_version(workspace: &Path) -> String {
    let path = workspace.join("mlx-versions.env");
    let text = fs::read_to_string(&path)
        .unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", path.display())));
    text.lines()
        .find_map(|line| line.trim().strip_prefix("MLX_VERSION="))
        .map(|v| v.trim().to_owned())
        .unwrap_or_else(|| fail(&format!("{} has no MLX_VERSION= line", path.display())))
}

fn find_mlx(workspace: &Path) -> PathBuf {
    if let Some(prefix) = env::var_os("MLX_PREFIX") {
        let prefix = PathBuf::from(prefix);
        if !prefix.join("share/cmake/MLX/MLXConfig.cmake").is_file() {
            fail(&format!(
                "MLX_PREFIX={} holds no share/cmake/MLX/MLXConfig.cmake",
                prefix.display()
            ));
        }
        return prefix;
    }
    let lib = workspace.join(".venv/lib");
    let candidates = fs::read_dir(&lib)
        .map(|dir| {
            dir.filter_map(|e| e.ok())
                .map(|e| e.path().join("site-packages/mlx"))
                .filter(|p| p.join("share/cmake/MLX/MLXConfig.cmake").is_file())
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    match candidates.as_slice() {
        [one] => one.clone(),
        [] => fail(&format!(
            "MLX was not found: no {}/python3*/site-packages/mlx with share/cmake/MLX; {SETUP_HINT} \
             (or set MLX_PREFIX to an MLX install)",
            lib.display()
        )),
        many => fail(&format!("several MLX installs under {}: {many:?}; set MLX_PREFIX", lib.display())),
    }
}

fn installed_mlx_version(mlx: &Path) -> String {
    let path = mlx.join("share/cmake/MLX/MLXConfigVersion.cmake");
    println!("cargo:rerun-if-changed={}", path.display());
    let text = fs::read_to_string(&path)
        .unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", path.display())));
    text.lines()
        .find_map(|line| line.trim().strip_prefix("set(PACKAGE_VERSION \""))
        .and_then(|rest| rest.split('"').next())
        .map(str::to_owned)
        .unwrap_or_else(|| fail(&format!("no PACKAGE_VERSION in {}", path.display())))
}

fn find_mlx_c(workspace: &Path) -> PathBuf {
    let path = env::var_os("MLX_C_SRC")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace.join(".deps/mlx-sys-0.7.0/src/mlx-c"));
    if !path.join("mlx/c/mlx.h").is_file() {
        fail(&format!(
            "the mlx-c sources were not found at {}; {SETUP_HINT} (or set MLX_C_SRC)",
            path.display()
        ));
    }
    println!("cargo:rerun-if-changed={}", path.display());
    path
}

/// MLX 0.32.3 inserted `global_scale` before `sorted_indices` in `gather_qmm`, and mlx-c 0.7.0
/// (written for 0.32.2) still passes `sorted_indices` there: it compiles, because a `bool`
/// converts to an `array`, and silently passes a scalar as the global scale. The C signature
/// stays as mlx-c declares it (mlx-rs binds it); only the C++ call gains the new argument.
/// Returns a copy of the sources with that call adapted, under `OUT_DIR`.
fn adapted_mlx_c(src: &Path, mlx_version: &str) -> PathBuf {
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("mlx-c");
    copy_tree(src, &out);
    if version_at_least(mlx_version, (0, 32, 3)) {
        let ops = out.join("mlx/c/ops.cpp");
        let text = fs::read_to_string(src.join("mlx/c/ops.cpp"))
            .unwrap_or_else(|e| fail(&format!("cannot read mlx-c's ops.cpp: {e}")));
        let start = text
            .find("extern \"C\" int mlx_gather_qmm(")
            .unwrap_or_else(|| fail("mlx-c's ops.cpp has no mlx_gather_qmm"));
        let end = start
            + text[start..]
                .find("\n}\n")
                .unwrap_or_else(|| fail("mlx_gather_qmm has no end in ops.cpp"));
        let body = &text[start..end];
        let old = "std::string(mode),\n            sorted_indices,";
        if body.matches(old).count() != 1 {
            fail("mlx_gather_qmm in ops.cpp no longer has the shape this adaptation expects");
        }
        let new = "std::string(mode),\n            std::nullopt /* global_scale */,\n            sorted_indices,";
        let patched = format!(
            "{}{}{}",
            &text[..start],
            body.replacen(old, new, 1),
            &text[end..]
        );
        write_if_changed(&ops, patched.as_bytes());
    }
    out
}

fn version_at_least(version: &str, min: (u32, u32, u32)) -> bool {
    let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    let v = (
        parts.next().unwrap_or(0),
        parts.next().unwrap_or(0),
        parts.next().unwrap_or(0),
    );
    v >= min
}

fn copy_tree(from: &Path, to: &Path) {
    fs::create_dir_all(to)
        .unwrap_or_else(|e| fail(&format!("cannot create {}: {e}", to.display())));
    let entries = fs::read_dir(from)
        .unwrap_or_else(|e| fail(&format!("cannot list {}: {e}", from.display())));
    for entry in entries {
        let entry = entry.unwrap_or_else(|e| fail(&format!("cannot list {}: {e}", from.display())));
        let path = entry.path();
        let dest = to.join(entry.file_name());
        if path.is_dir() {
            copy_tree(&path, &dest);
        } else {
            let bytes = fs::read(&path)
                .unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", path.display())));
            write_if_changed(&dest, &bytes);
        }
    }
}

/// Writes `bytes` to `path` unless it already holds them: an unchanged copy keeps its old
/// mtime, so the headers bindgen reports to cargo do not look newer than this script's output
/// (which would rebuild mlx-sys and mlx-rs on every build).
fn write_if_changed(path: &Path, bytes: &[u8]) {
    if fs::read(path).is_ok_and(|held| held == bytes) {
        return;
    }
    fs::write(path, bytes)
        .unwrap_or_else(|e| fail(&format!("cannot write {}: {e}", path.display())));
}

fn generate_bindings(manifest: &Path, mlx_c: &Path) {
    let mut headers: Vec<PathBuf> = fs::read_dir(mlx_c.join("mlx/c"))
        .unwrap_or_else(|e| fail(&format!("cannot list mlx-c headers: {e}")))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "h"))
        .collect();
    headers.sort();

    let arm_halves = cfg!(target_arch = "aarch64");
    let mut builder = bindgen::Builder::default()
        .clang_arg(format!("-I{}", mlx_c.display()))
        .header(manifest.join("native/bindgen_prelude.h").to_string_lossy())
        .blocklist_function("malloc")
        .blocklist_function("realloc");
    if !arm_halves {
        // Replaced by a newtype in lib.rs, matching the shape bindgen gives `__fp16` on ARM.
        builder = builder.blocklist_type("float16_t");
    }
    for header in &headers {
        builder = builder.header(header.to_string_lossy());
    }
    let bindings = builder
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()))
        .generate()
        .unwrap_or_else(|e| fail(&format!("bindgen failed on the mlx-c headers: {e}")));
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    bindings
        .write_to_file(out.join("bindings.rs"))
        .unwrap_or_else(|e| fail(&format!("cannot write bindings: {e}")));
}
