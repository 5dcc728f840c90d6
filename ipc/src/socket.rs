//! Socket-path rules: a private runtime directory (0700) holding one socket per engine
//! (0600), stale files removed before every bind.

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// `sun_path` is 108 bytes on Linux, including the terminating NUL.
pub const MAX_SOCKET_PATH: usize = 107;

#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    #[error("runtime directory {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("runtime directory {path} is owned by uid {owner}, not by us (uid {me})")]
    NotOwned { path: PathBuf, owner: u32, me: u32 },
    #[error("socket path {path} is {len} bytes; the limit is {MAX_SOCKET_PATH}")]
    TooLong { path: PathBuf, len: usize },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> SocketError + '_ {
    move |source| SocketError::Io {
        path: path.to_owned(),
        source,
    }
}

/// Creates `dir` (and parents) if needed, checks we own it, and sets mode 0700.
pub fn prepare_runtime_dir(dir: &Path) -> Result<(), SocketError> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(io_err(dir))?;
    let meta = fs::symlink_metadata(dir).map_err(io_err(dir))?;
    let me = nix::unistd::geteuid().as_raw();
    if meta.uid() != me {
        return Err(SocketError::NotOwned {
            path: dir.to_owned(),
            owner: meta.uid(),
            me,
        });
    }
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700)).map_err(io_err(dir))?;
    Ok(())
}

/// The default runtime directory: `$XDG_RUNTIME_DIR/mlxd-<pid>` or `/tmp/mlxd-<uid>-<pid>`.
pub fn default_runtime_dir() -> PathBuf {
    let pid = std::process::id();
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) if !d.is_empty() => Path::new(&d).join(format!("mlxd-{pid}")),
        _ => {
            let uid = nix::unistd::geteuid().as_raw();
            std::env::temp_dir().join(format!("mlxd-{uid}-{pid}"))
        }
    }
}

/// The socket for engine slot `slot` (a small integer, so paths stay short).
pub fn engine_socket_path(runtime_dir: &Path, slot: usize) -> Result<PathBuf, SocketError> {
    let path = runtime_dir.join(format!("engine-{slot}.sock"));
    let len = path.as_os_str().len();
    if len > MAX_SOCKET_PATH {
        return Err(SocketError::TooLong { path, len });
    }
    Ok(path)
}

/// Removes a leftover file at `path`; a missing file is fine.
pub fn remove_stale(path: &Path) -> io::Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Child side: removes a stale socket, binds, and restricts the socket to mode 0600.
pub fn bind_unix(path: &Path) -> io::Result<tokio::net::UnixListener> {
    remove_stale(path)?;
    let listener = tokio::net::UnixListener::bind(path)?;
    fs::set_permissions(path, fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn dir_and_socket_modes() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("rt");
        prepare_runtime_dir(&dir).unwrap();
        assert_eq!(fs::metadata(&dir).unwrap().mode() & 0o777, 0o700);
        let sock = engine_socket_path(&dir, 0).unwrap();
        fs::write(&sock, b"stale").unwrap();
        let _l = bind_unix(&sock).unwrap();
        assert_eq!(fs::metadata(&sock).unwrap().mode() & 0o777, 0o600);
        // Loosened permissions are tightened again.
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
        prepare_runtime_dir(&dir).unwrap();
        assert_eq!(fs::metadata(&dir).unwrap().mode() & 0o777, 0o700);
    }

    #[test]
    fn long_paths_are_refused() {
        let dir = PathBuf::from("/".to_string() + &"x".repeat(120));
        assert!(matches!(
            engine_socket_path(&dir, 0),
            Err(SocketError::TooLong { .. })
        ));
    }
}
