//! Driving `mlxd run` on a real terminal: a private tmux server (its own socket), one window
//! running the command, keys sent as a person types them, and the screen read back.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};

/// What the shell prints once the chat has exited: a line of its own when the chat left the
/// cursor on a fresh line.
pub const AFTER: &str = "AFTER-MLXD";

/// How long a screen may take to show what a test waits for.
const LIMIT: Duration = Duration::from_secs(20);

pub struct Tmux {
    socket: String,
    dir: tempfile::TempDir,
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.tmux(&["kill-server"]);
    }
}

impl Tmux {
    /// `None` when tmux is not installed.
    pub fn new() -> Result<Option<Self>> {
        if Command::new("tmux").arg("-V").output().is_err() {
            return Ok(None);
        }
        let dir = tempfile::tempdir()?;
        let socket = format!("mlxd-test-{}-{}", std::process::id(), dir.path().display())
            .replace(['/', '.'], "-");
        Ok(Some(Self { socket, dir }))
    }

    fn tmux(&self, args: &[&str]) -> Result<String> {
        let o = Command::new("tmux")
            .arg("-L")
            .arg(&self.socket)
            .args(args)
            .output()
            .context("running tmux")?;
        ensure!(
            o.status.success(),
            "tmux {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        Ok(String::from_utf8_lossy(&o.stdout).into_owned())
    }

    fn exit_file(&self) -> std::path::PathBuf {
        self.dir.path().join("exit")
    }

    /// Runs `bin args` in a new 200x100 window, with `home` as its HOME and state directory
    /// (the chat's history goes to `home/state/mlxd/history`), then writes its exit code to a
    /// file and prints [`AFTER`].
    pub fn start(&self, bin: &Path, args: &[&str], home: &Path) -> Result<()> {
        let quote = |s: &str| format!("'{}'", s.replace('\'', r"'\''"));
        let mut cmd = vec![quote(&bin.display().to_string())];
        cmd.extend(args.iter().map(|a| quote(a)));
        // The shell catches SIGINT (a handler, which the command does not inherit, unlike an
        // ignored signal): Ctrl-C reaches the whole foreground group, and a shell killed by
        // it would close the window under the test.
        let script = format!(
            "trap : INT; env -u MLXD_URL -u MLXD_HOST -u MLXD_PORT -u MLXD_CONFIG HOME={home} \
             XDG_STATE_HOME={state} XDG_CONFIG_HOME={home}/config {cmd}; echo $? > {exit}; \
             echo {AFTER}; sleep 600",
            home = quote(&home.display().to_string()),
            state = quote(&home.join("state").display().to_string()),
            cmd = cmd.join(" "),
            exit = quote(&self.exit_file().display().to_string()),
        );
        self.tmux(&[
            "new-session",
            "-d",
            "-x",
            "200",
            "-y",
            "100",
            "sh",
            "-c",
            &script,
        ])?;
        Ok(())
    }

    /// Types `text` and Enter.
    pub fn type_line(&self, text: &str) -> Result<()> {
        if !text.is_empty() {
            self.tmux(&["send-keys", "-l", text])?;
        }
        self.tmux(&["send-keys", "Enter"])?;
        Ok(())
    }

    /// Sends tmux key names (`C-c`, `C-d`).
    pub fn keys(&self, keys: &[&str]) -> Result<()> {
        let mut args = vec!["send-keys"];
        args.extend_from_slice(keys);
        self.tmux(&args)?;
        Ok(())
    }

    /// The whole window, scrollback included.
    pub fn screen(&self) -> Result<String> {
        self.tmux(&["capture-pane", "-p", "-J", "-S", "-"])
    }

    /// Waits until the screen shows `needle` at least `n` times; returns the screen. A
    /// terminal offers no event for "this text appeared", so the screen is read every 50 ms.
    pub async fn wait_for_count(&self, needle: &str, n: usize) -> Result<String> {
        let deadline = Instant::now() + LIMIT;
        loop {
            let screen = self.screen()?;
            if screen.matches(needle).count() >= n {
                return Ok(screen);
            }
            if Instant::now() > deadline {
                bail!("{needle:?} x{n} did not appear within {LIMIT:?}; the screen:\n{screen}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub async fn wait_for(&self, needle: &str) -> Result<String> {
        self.wait_for_count(needle, 1).await
    }

    /// Waits for the command to exit and returns its exit code.
    pub async fn wait_exit(&self) -> Result<i32> {
        self.wait_for(AFTER).await?;
        let code = std::fs::read_to_string(self.exit_file())?;
        code.trim()
            .parse()
            .with_context(|| format!("exit code {code:?}"))
    }
}
