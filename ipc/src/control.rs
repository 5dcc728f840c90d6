//! Child side of the control channel, shared by the real engine and the fake engine.
//!
//! # The engine contract
//!
//! `mlxd` starts an engine as `<engine-bin> --control` ([`CONTROL_FLAG`]) in its own
//! process group, with a cleared environment plus `PATH`, `HOME`, `LANG`, `RUST_LOG`,
//! `LD_LIBRARY_PATH`, `CUDA_VISIBLE_DEVICES` and a few more when set, and
//! [`SUPERVISOR_PID_ENV`] and `MLXD_MODEL`. stdin and stdout carry the control channel
//! (length-prefixed bincode frames, see [`crate::frame`]); stderr is the engine's log
//! (one line per event, JSON preferred), re-emitted by `mlxd` and kept for crash reports.
//!
//! ```text
//! set_parent_death_signal()?;              // first thing in main
//! let mut chan = ChildChannel::from_stdio()?;  // fd 1 now points at stderr
//! let launch = chan.read_launch()?;        // blocks for the Launch frame
//! let tx = chan.sender();                  // Clone + Send: Loading/Ready/Stats/Fatal
//! chan.watch_parent(|ev| ...);             // thread: Drain, Shutdown, Closed (stdin EOF)
//! tx.send_loading(LoadPhase::Weights, 0.5)?;  // optional progress while loading
//! let listener = socket::bind_unix(&launch.socket_path)?;  // stale file removed, 0600
//! tx.send_ready(ready)?;                   // only once the socket accepts connections
//! // every ~1 s: tx.send_stats(stats)?;
//! ```
//!
//! Obligations:
//! - [`ParentEvent::Closed`] (stdin EOF) or [`ParentEvent::Broken`]: exit at once.
//! - `Drain`: stop admitting new requests (answer 503), finish the ones in flight.
//! - `Shutdown`: stop admitting, finish in-flight work, exit 0. `mlxd` waits its grace
//!   period, then sends SIGTERM to the group, then SIGKILL.
//! - Before any controlled non-zero exit, send `Fatal` with the right [`FatalKind`]
//!   (`OutOfMemory` lets `mlxd` restart with smaller limits; `CannotLoad` before `Ready`
//!   when a restart would fail the same way — no such model, a refused option, offline —
//!   so `mlxd` does not retry; `LoadFailed` for a load another attempt may get through). Never print to stdout by hand: [`ChildChannel::from_stdio`] points fd 1
//!   at stderr so stray prints cannot corrupt the channel.
//! - A client that disconnects closes its connection on the unix socket: cancel the
//!   sequence.
//!
//! [`FatalKind`]: mlxd_protocol::control::FatalKind

use std::fs::File;
use std::io::{self, Read, Write};
use std::sync::{Arc, Mutex};

use mlxd_protocol::control::{
    ChildMsg, Fatal, FatalKind, Launch, LoadPhase, ParentMsg, Ready, Stats, PROTOCOL_VERSION,
};

use crate::frame::{read_frame, write_frame, FrameError};

/// The command-line flag that puts an engine binary in supervised mode.
pub const CONTROL_FLAG: &str = "--control";

/// Environment variable the supervisor sets to its own pid, so a child can tell
/// whether it was orphaned before it armed `PR_SET_PDEATHSIG`.
pub const SUPERVISOR_PID_ENV: &str = "MLXD_SUPERVISOR_PID";

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error("control channel closed before the Launch frame")]
    ClosedBeforeLaunch,
    #[error("expected Launch as the first control frame, got {0}")]
    NotLaunch(&'static str),
    #[error("protocol version mismatch: supervisor speaks {parent}, engine speaks {child}")]
    Version { parent: u32, child: u32 },
    #[error("the supervisor (pid {expected}) is already gone")]
    ParentGone { expected: i32 },
    #[error("control channel setup: {0}")]
    Io(#[from] io::Error),
}

/// What the parent asked for after `Launch`, as seen by [`ChildChannel::watch_parent`].
#[derive(Debug)]
pub enum ParentEvent {
    Drain,
    Shutdown,
    /// Write the prefix cache to the SSD tier and answer `Spilled`.
    Spill,
    /// stdin reached end of file: the supervisor is gone or wants us gone. Exit now.
    Closed,
    /// The stream is corrupt; treat like `Closed`.
    Broken(FrameError),
}

/// Child end of the control channel.
pub struct ChildChannel {
    input: Box<dyn Read + Send>,
    sender: ControlSender,
}

impl ChildChannel {
    /// Takes over stdin and stdout. File descriptor 1 is then pointed at stderr, so a
    /// stray `println!` anywhere in the engine lands in the log instead of corrupting
    /// the control stream.
    pub fn from_stdio() -> Result<Self, ControlError> {
        use std::os::fd::AsFd;
        let control_out = io::stdout().as_fd().try_clone_to_owned()?;
        let control_in = io::stdin().as_fd().try_clone_to_owned()?;
        nix::unistd::dup2(2, 1).map_err(io::Error::from)?;
        let input = File::from(control_in);
        Ok(Self {
            input: Box::new(io::BufReader::new(input)),
            sender: ControlSender {
                out: Arc::new(Mutex::new(ControlOut::File(File::from(control_out)))),
            },
        })
    }

    /// A channel over arbitrary streams (tests).
    pub fn new(input: impl Read + Send + 'static, output: impl Write + Send + 'static) -> Self {
        Self {
            input: Box::new(io::BufReader::new(input)),
            sender: ControlSender {
                out: Arc::new(Mutex::new(ControlOut::Other(Box::new(output)))),
            },
        }
    }

    /// Blocks for the first frame, which must be a `Launch` of our protocol version.
    /// On a version mismatch a `Fatal(CannotLoad)` is sent before returning the error (a
    /// restart would meet the same version).
    pub fn read_launch(&mut self) -> Result<Launch, ControlError> {
        let launch = match read_frame::<ParentMsg, _>(&mut self.input)? {
            None => return Err(ControlError::ClosedBeforeLaunch),
            Some(ParentMsg::Launch(l)) => l,
            Some(ParentMsg::Drain) => return Err(ControlError::NotLaunch("Drain")),
            Some(ParentMsg::Shutdown) => return Err(ControlError::NotLaunch("Shutdown")),
            Some(ParentMsg::Spill) => return Err(ControlError::NotLaunch("Spill")),
        };
        if launch.version != PROTOCOL_VERSION {
            let err = ControlError::Version {
                parent: launch.version,
                child: PROTOCOL_VERSION,
            };
            // Best effort: the parent may already be unable to read.
            let _ = self
                .sender
                .send_fatal(FatalKind::CannotLoad, err.to_string());
            return Err(err);
        }
        Ok(launch)
    }

    /// A cloneable handle for sending messages to the parent from any thread.
    pub fn sender(&self) -> ControlSender {
        self.sender.clone()
    }

    /// Reads the rest of the parent's frames on a dedicated thread and calls `on_event`
    /// for each; the last call is always `Closed` or `Broken`. From tokio, pass a closure
    /// that forwards into an unbounded channel (`UnboundedSender::send` is synchronous).
    pub fn watch_parent<F>(self, mut on_event: F) -> std::thread::JoinHandle<()>
    where
        F: FnMut(ParentEvent) + Send + 'static,
    {
        let mut input = self.input;
        std::thread::Builder::new()
            .name("mlxd-control".into())
            .spawn(move || loop {
                match read_frame::<ParentMsg, _>(&mut input) {
                    Ok(Some(ParentMsg::Drain)) => on_event(ParentEvent::Drain),
                    Ok(Some(ParentMsg::Shutdown)) => on_event(ParentEvent::Shutdown),
                    Ok(Some(ParentMsg::Spill)) => on_event(ParentEvent::Spill),
                    Ok(Some(ParentMsg::Launch(_))) => {
                        on_event(ParentEvent::Broken(FrameError::Io(io::Error::new(
                            io::ErrorKind::InvalidData,
                            "second Launch frame",
                        ))));
                        return;
                    }
                    Ok(None) => {
                        on_event(ParentEvent::Closed);
                        return;
                    }
                    Err(e) => {
                        on_event(ParentEvent::Broken(e));
                        return;
                    }
                }
            })
            .expect("spawning the control-channel thread")
    }
}

/// Sends child → parent messages; cheap to clone, safe to use from any thread.
#[derive(Clone)]
pub struct ControlSender {
    out: Arc<Mutex<ControlOut>>,
}

/// Where child → parent frames go: the descriptor taken over from stdout, or any stream
/// (tests).
enum ControlOut {
    File(File),
    Other(Box<dyn Write + Send>),
}

impl Write for ControlOut {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Self::File(f) => f.write(buf),
            Self::Other(w) => w.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Self::File(f) => f.flush(),
            Self::Other(w) => w.flush(),
        }
    }
}

/// The lowest descriptor number the control channel moves to once the GPU is set up
/// ([`ControlSender::move_above_gpu`]), or 64 below the process's descriptor limit when that
/// is lower.
pub const CONTROL_FD_FLOOR: i32 = 1000;

/// [`CONTROL_FD_FLOOR`] within this process's descriptor limit.
fn control_fd_floor() -> io::Result<i32> {
    let (soft, _) = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .map_err(io::Error::from)?;
    let room = i32::try_from(soft.saturating_sub(64)).unwrap_or(i32::MAX);
    Ok(CONTROL_FD_FLOOR.min(room).max(3))
}

impl ControlSender {
    /// Moves the channel to a new descriptor numbered [`CONTROL_FD_FLOOR`] or above (the old
    /// one is closed), for an engine whose GPU context now exists. When such a process dies,
    /// the descriptors opened after its GPU context close at once, and those opened before
    /// it only after the driver tore the context down, ~100 ms later on an H100
    /// (`scripts/bench/exit_order.py`): the supervisor learns of the death from this
    /// channel's end, so it learns early. No-op for a channel over another stream.
    pub fn move_above_gpu(&self) -> io::Result<()> {
        use std::os::fd::{AsRawFd, FromRawFd};
        let mut out = self.out.lock().unwrap_or_else(|p| p.into_inner());
        let ControlOut::File(file) = &mut *out else {
            return Ok(());
        };
        let moved = nix::fcntl::fcntl(
            file.as_raw_fd(),
            nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(control_fd_floor()?),
        )
        .map_err(io::Error::from)?;
        // SAFETY: `moved` is a descriptor fcntl just created for us and nothing else owns.
        *file = unsafe { File::from_raw_fd(moved) };
        Ok(())
    }

    pub fn send(&self, msg: &ChildMsg) -> Result<(), FrameError> {
        // A poisoned lock only means another thread panicked mid-write; the frame
        // boundary may be broken, and the parent will notice. Keep going.
        let mut out = self.out.lock().unwrap_or_else(|p| p.into_inner());
        write_frame(&mut *out, msg)
    }

    pub fn send_loading(&self, phase: LoadPhase, progress: f32) -> Result<(), FrameError> {
        self.send(&ChildMsg::Loading { phase, progress })
    }

    pub fn send_ready(&self, ready: Ready) -> Result<(), FrameError> {
        self.send(&ChildMsg::Ready(ready))
    }

    pub fn send_stats(&self, stats: Stats) -> Result<(), FrameError> {
        self.send(&ChildMsg::Stats(stats))
    }

    pub fn send_fatal(
        &self,
        kind: FatalKind,
        message: impl Into<String>,
    ) -> Result<(), FrameError> {
        self.send(&ChildMsg::Fatal(Fatal {
            kind,
            message: message.into(),
        }))
    }
}

/// Arms `PR_SET_PDEATHSIG(SIGKILL)` so the kernel kills this process when the
/// supervisor dies, then checks the supervisor did not die before that (the pid in
/// [`SUPERVISOR_PID_ENV`], when set). Call first thing in `main`, from the main thread.
pub fn set_parent_death_signal() -> Result<(), ControlError> {
    // Linux only: elsewhere the engine relies on stdin reaching end of file.
    #[cfg(target_os = "linux")]
    nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL).map_err(io::Error::from)?;
    if let Some(expected) = std::env::var(SUPERVISOR_PID_ENV)
        .ok()
        .and_then(|v| v.parse::<i32>().ok())
    {
        if nix::unistd::getppid().as_raw() != expected {
            return Err(ControlError::ParentGone { expected });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{encode, read_frame};
    use mlxd_protocol::control::Limits;
    use std::sync::mpsc;

    fn launch(version: u32) -> ParentMsg {
        ParentMsg::Launch(Launch {
            version,
            model: "m".into(),
            socket_path: "/tmp/x.sock".into(),
            limits: Limits::default(),
            options: Default::default(),
        })
    }

    /// A writer whose bytes the test can read back.
    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);
    impl Write for Shared {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn launch_then_events_then_closed() {
        let mut input = encode(&launch(PROTOCOL_VERSION)).unwrap();
        input.extend(encode(&ParentMsg::Drain).unwrap());
        input.extend(encode(&ParentMsg::Shutdown).unwrap());
        let out = Shared::default();
        let mut chan = ChildChannel::new(io::Cursor::new(input), out.clone());
        assert_eq!(chan.read_launch().unwrap().model, "m");
        chan.sender().send_loading(LoadPhase::Weights, 0.5).unwrap();
        let (tx, rx) = mpsc::channel();
        chan.watch_parent(move |e| tx.send(format!("{e:?}")).unwrap())
            .join()
            .unwrap();
        let events: Vec<String> = rx.iter().collect();
        assert_eq!(events, ["Drain", "Shutdown", "Closed"]);
        let bytes = out.0.lock().unwrap().clone();
        let msg: ChildMsg = read_frame(&mut bytes.as_slice()).unwrap().unwrap();
        assert_eq!(
            msg,
            ChildMsg::Loading {
                phase: LoadPhase::Weights,
                progress: 0.5
            }
        );
    }

    #[test]
    fn version_mismatch_sends_fatal() {
        let input = encode(&launch(PROTOCOL_VERSION + 1)).unwrap();
        let out = Shared::default();
        let mut chan = ChildChannel::new(io::Cursor::new(input), out.clone());
        assert!(matches!(
            chan.read_launch(),
            Err(ControlError::Version { .. })
        ));
        let bytes = out.0.lock().unwrap().clone();
        let msg: ChildMsg = read_frame(&mut bytes.as_slice()).unwrap().unwrap();
        assert!(matches!(
            msg,
            ChildMsg::Fatal(Fatal {
                kind: FatalKind::CannotLoad,
                ..
            })
        ));
    }

    #[test]
    fn eof_before_launch() {
        let mut chan = ChildChannel::new(io::Cursor::new(Vec::new()), io::sink());
        assert!(matches!(
            chan.read_launch(),
            Err(ControlError::ClosedBeforeLaunch)
        ));
    }

    /// The channel moves to a descriptor at or above the floor, the old one closes, and frames
    /// still reach the reader.
    #[test]
    fn the_channel_moves_above_the_gpus_descriptors_and_keeps_working() {
        use std::os::fd::AsRawFd;
        let (reader, writer) = nix::unistd::pipe().unwrap();
        let low = writer.as_raw_fd();
        let sender = ControlSender {
            out: Arc::new(Mutex::new(ControlOut::File(File::from(writer)))),
        };
        sender.move_above_gpu().unwrap();
        let fd = match &*sender.out.lock().unwrap() {
            ControlOut::File(f) => f.as_raw_fd(),
            ControlOut::Other(_) => unreachable!("a file stays a file"),
        };
        assert!(
            fd >= control_fd_floor().unwrap() && fd > low,
            "moved to {fd}"
        );
        sender.send_stats(Stats::default()).unwrap();
        drop(sender);
        let mut reader = File::from(reader);
        assert!(matches!(
            read_frame::<ChildMsg, _>(&mut reader).unwrap(),
            Some(ChildMsg::Stats(_))
        ));
        // Its end: the old number no longer holds the pipe's write end either.
        assert!(read_frame::<ChildMsg, _>(&mut reader).unwrap().is_none());
    }
}
