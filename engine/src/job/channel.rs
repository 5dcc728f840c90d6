//! The job process's end of its channel to `mlxd`: [`JobMsg`] frames on stdout in the control
//! channel's framing (`mlxd_ipc::frame`), with fd 1 pointed at stderr so that no stray print
//! can corrupt them.
use std::fs::File;
use std::io::{self, Read};
use std::sync::{Arc, Mutex};

use mlxd_ipc::frame::write_frame;
use mlxd_protocol::jobs::{JobMsg, JobProgress};

use super::JobError;

/// Sends [`JobMsg`]s to the supervisor; cheap to clone, usable from any thread.
#[derive(Clone)]
pub struct Reporter {
    out: Arc<Mutex<File>>,
}

impl Reporter {
    /// Takes over stdout for frames and points fd 1 at stderr.
    pub fn from_stdio() -> io::Result<Self> {
        use std::os::fd::AsFd;
        let out = io::stdout().as_fd().try_clone_to_owned()?;
        // SAFETY: dup2 on two descriptors this process owns; fd 1 is re-pointed atomically.
        if unsafe { libc::dup2(2, 1) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Self {
            out: Arc::new(Mutex::new(File::from(out))),
        })
    }

    pub fn send(&self, msg: &JobMsg) -> Result<(), JobError> {
        let mut out = self.out.lock().unwrap_or_else(|p| p.into_inner());
        write_frame(&mut *out, msg).map_err(|e| JobError::Channel(e.to_string()))
    }

    pub fn progress(&self, progress: JobProgress) -> Result<(), JobError> {
        self.send(&JobMsg::Progress(progress))
    }
}

/// Exits the process when stdin reaches end of file (or fails): the supervisor is gone, and
/// nobody would read the result. (On Linux `PR_SET_PDEATHSIG` covers this too.)
pub fn exit_when_stdin_closes() {
    std::thread::Builder::new()
        .name("mlxd-job-stdin".into())
        .spawn(|| {
            let mut buf = [0u8; 64];
            let mut stdin = io::stdin();
            loop {
                match stdin.read(&mut buf) {
                    Ok(0) | Err(_) => {
                        tracing::warn!("the supervisor closed the job's stdin; stopping");
                        std::process::exit(1);
                    }
                    Ok(_) => {}
                }
            }
        })
        .expect("spawning the stdin watcher");
}
