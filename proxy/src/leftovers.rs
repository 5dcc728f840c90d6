//! What an `mlxd` killed without its shutdown leaves in the temporary directory: its private
//! runtime directory (`/tmp/mlxd-<uid>-<pid>/`, or `$XDG_RUNTIME_DIR/mlxd-<pid>/`) with the
//! engines' sockets. A later `mlxd` removes those whose process is gone at its start; a
//! directory of a live `mlxd` (another server on the same machine) is left alone.

use std::path::{Path, PathBuf};

/// The pid in a runtime directory's name of the default form, for the current user:
/// `mlxd-<uid>-<pid>` or `mlxd-<pid>`.
fn runtime_dir_pid(name: &str, uid: u32) -> Option<i32> {
    let rest = name.strip_prefix("mlxd-")?;
    let pid = match rest.split_once('-') {
        Some((u, pid)) if u.parse::<u32>().ok()? == uid => pid,
        Some(_) => return None,
        None => rest,
    };
    pid.parse().ok().filter(|p| *p > 0)
}

fn alive(pid: i32) -> bool {
    // EPERM: it exists under another user.
    !matches!(
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None),
        Err(nix::errno::Errno::ESRCH)
    )
}

/// Removes the runtime directories beside `own` (this process's default runtime directory)
/// that belong to this user and to an `mlxd` that is gone. Returns what it removed, and what
/// it could not remove with the reason.
pub fn sweep_runtime_dirs(own: &Path) -> (Vec<PathBuf>, Vec<(PathBuf, std::io::Error)>) {
    use std::os::unix::fs::MetadataExt;
    let uid = nix::unistd::geteuid().as_raw();
    let (mut removed, mut failed) = (Vec::new(), Vec::new());
    let Some(parent) = own.parent() else {
        return (removed, failed);
    };
    for entry in std::fs::read_dir(parent).into_iter().flatten().flatten() {
        let path = entry.path();
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| runtime_dir_pid(n, uid))
        else {
            continue;
        };
        let ours = std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir() && m.uid() == uid);
        if path == own || !ours || alive(pid) {
            continue;
        }
        match std::fs::remove_dir_all(&path) {
            Ok(()) => removed.push(path),
            Err(e) => failed.push((path, e)),
        }
    }
    (removed, failed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_of_runtime_dirs() {
        assert_eq!(runtime_dir_pid("mlxd-1000-42", 1000), Some(42));
        assert_eq!(runtime_dir_pid("mlxd-42", 1000), Some(42));
        assert_eq!(runtime_dir_pid("mlxd-0-42", 1000), None);
        assert_eq!(runtime_dir_pid("mlxd-x", 1000), None);
        assert_eq!(runtime_dir_pid("other-1000-42", 1000), None);
    }

    /// Issue 23, finding 9: `kill -9` of `mlxd` left `/tmp/mlxd-<uid>-<pid>/` for good.
    #[test]
    fn only_runtime_dirs_of_a_gone_mlxd_are_removed() {
        let tmp = tempfile::tempdir().unwrap();
        let uid = nix::unistd::geteuid().as_raw();
        let own = tmp
            .path()
            .join(format!("mlxd-{uid}-{}", std::process::id()));
        // Beyond the kernel's pid range: no such process. Pid 1 is alive.
        let gone = tmp.path().join(format!("mlxd-{uid}-2147483646"));
        let gone_xdg = tmp.path().join("mlxd-2147483645");
        let live = tmp.path().join(format!("mlxd-{uid}-1"));
        let other = tmp.path().join("mlxd-cache");
        for d in [&own, &gone, &gone_xdg, &live, &other] {
            std::fs::create_dir(d).unwrap();
        }
        std::fs::write(gone.join("engine-0.sock"), b"").unwrap();
        let (mut removed, failed) = sweep_runtime_dirs(&own);
        removed.sort();
        assert!(failed.is_empty(), "{failed:?}");
        let mut want = vec![gone_xdg.clone(), gone.clone()];
        want.sort();
        assert_eq!(removed, want);
        assert!(own.exists() && live.exists() && other.exists());
        assert!(!gone.exists() && !gone_xdg.exists());
    }
}
