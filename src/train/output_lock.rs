//! One run per output folder: `output_dir/.treetrain.lock` names the process that writes there
//! (pid, host, start time). A second run is refused while that process lives; the lock of a
//! process that died (same host, pid gone) is taken over; the holder removes it when done. And
//! before any training time is spent, every folder a run writes is checked writable.

use std::path::{Path, PathBuf};

use super::error::TrainError;

/// Creates `out` and checks a file can be written there, before any training time is spent.
pub(crate) fn check_writable(field: &'static str, out: &Path) -> Result<(), TrainError> {
    let fail = |e: std::io::Error| TrainError::config(field, format!("{}: cannot be written: {e}", out.display()));
    std::fs::create_dir_all(out).map_err(fail)?;
    let probe = out.join(format!(".treetrain-write-check-{}", std::process::id()));
    std::fs::write(&probe, b"").map_err(fail)?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// The lock file's name inside `output_dir`.
pub(crate) const LOCK_FILE: &str = ".treetrain.lock";

/// Who holds an output folder.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct Holder {
    pid: u32,
    host: String,
    /// Seconds since the Unix epoch.
    started: i64,
    /// Tells two holders of one process apart (two trainers in one notebook kernel).
    token: u64,
}

/// A held output folder; dropping it releases the folder.
#[derive(Debug)]
pub(crate) struct OutputLock {
    path: PathBuf,
    token: u64,
}

impl OutputLock {
    /// Takes `out` for this process, or says which run holds it.
    pub(crate) fn acquire(out: &Path) -> Result<Self, TrainError> {
        let path = out.join(LOCK_FILE);
        let me = Holder {
            pid: std::process::id(),
            host: crate::util::host_name(),
            started: crate::util::clock::unix_seconds(),
            token: crate::util::SplitMix64::new(
                u64::from(std::process::id()) ^ crate::util::clock::since_epoch().as_nanos() as u64,
            )
            .next_u64(),
        };
        let io = |e: std::io::Error| TrainError::config("output_dir", format!("{}: {e}", path.display()));
        let text = serde_json::to_string(&me).unwrap_or_default();
        for _ in 0..3 {
            match std::fs::File::options().write(true).create_new(true).open(&path) {
                Ok(mut f) => {
                    std::io::Write::write_all(&mut f, text.as_bytes()).map_err(io)?;
                    return Ok(OutputLock { path, token: me.token });
                }
                Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(io(e)),
                Err(_) => {}
            }
            let holder = std::fs::read_to_string(&path)
                .ok()
                .and_then(|t| serde_json::from_str::<Holder>(&t).ok());
            match holder {
                // Another trainer of this process (a notebook's earlier cell): it hands over.
                Some(h) if h.host == me.host && h.pid == me.pid => {
                    std::fs::write(&path, &text).map_err(io)?;
                    return Ok(OutputLock { path, token: me.token });
                }
                // A run that died without releasing (kill -9, a crash): its lock is stale.
                Some(h) if h.host == me.host && !alive(h.pid) => {
                    let _ = std::fs::remove_file(&path);
                }
                other => return Err(in_use(out, &path, other)),
            }
        }
        Err(in_use(out, &path, None))
    }
}

impl Drop for OutputLock {
    fn drop(&mut self) {
        let ours = std::fs::read_to_string(&self.path)
            .ok()
            .and_then(|t| serde_json::from_str::<Holder>(&t).ok())
            .is_some_and(|h| h.token == self.token);
        if ours {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

fn in_use(out: &Path, lock: &Path, holder: Option<Holder>) -> TrainError {
    let who = match holder {
        Some(h) => format!(
            "process {} on {} since {} UTC",
            h.pid,
            h.host,
            crate::util::clock::run_stamp(h.started)
        ),
        None => "a run that is starting".into(),
    };
    TrainError::config(
        "output_dir",
        format!(
            "{} is in use by another run ({who}): wait for it to end, choose another output_dir, or delete {} if that run is gone",
            out.display(),
            lock.display()
        ),
    )
}

/// Whether process `pid` of this host is running.
fn alive(pid: u32) -> bool {
    let Ok(pid) = i32::try_from(pid) else {
        return false;
    };
    // SAFETY: signal 0 sends nothing; it only checks that the process exists and may be
    // signalled (EPERM: it exists, owned by another user).
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_live_holder_refuses_a_dead_one_hands_over_and_drop_releases() {
        let out = std::env::temp_dir().join(format!("treetrain-lock-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        std::fs::create_dir_all(&out).unwrap();
        let write = |pid: u32, host: &str| {
            let h = Holder {
                pid,
                host: host.into(),
                started: 0,
                token: 1,
            };
            std::fs::write(out.join(LOCK_FILE), serde_json::to_string(&h).unwrap()).unwrap();
        };
        // pid 1 (init) lives on every Linux host; this host's name makes it "this host".
        write(1, &crate::util::host_name());
        let err = OutputLock::acquire(&out).unwrap_err().to_string();
        assert!(
            err.contains("in use by another run (process 1 on") && err.contains(LOCK_FILE),
            "{err}"
        );
        write(1, "another-host");
        assert!(
            OutputLock::acquire(&out).is_err(),
            "another host's lock cannot be checked: kept"
        );
        write(i32::MAX as u32, &crate::util::host_name());
        let lock = OutputLock::acquire(&out).unwrap();
        assert!(out.join(LOCK_FILE).exists());
        drop(lock);
        assert!(!out.join(LOCK_FILE).exists());
        let _ = std::fs::remove_dir_all(&out);
    }
}
