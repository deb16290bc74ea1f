//! One run per output folder: `output_dir/.treetrain.lock` names the process that writes there
//! (pid, host, start time). The lock appears with its contents (written beside it, then
//! hard-linked into place), so no lock is ever empty or half written. A second run is refused
//! while that process lives; the lock of a process that died (same host, pid gone) is taken
//! over; a lock that names no process (empty, not JSON, a folder, pid 0) is refused as
//! unreadable with the fix; the holder removes it when done. And before any training time is
//! spent, every folder a run writes is checked writable with real bytes.

use std::path::{Path, PathBuf};

use super::error::TrainError;

/// Creates `out` and checks a file can be written there, before any training time is spent.
pub(crate) fn check_writable(field: &'static str, out: &Path) -> Result<(), TrainError> {
    let fail = |e: std::io::Error| TrainError::config(field, format!("{}: cannot be written: {e}", out.display()));
    std::fs::create_dir_all(out).map_err(fail)?;
    let probe = out.join(format!(".treetrain-write-check-{}", std::process::id()));
    // Real bytes, flushed: an empty file can still be made on a full disk, and a filesystem
    // that allocates late reports the lack of space only when the data is synced.
    let written = std::fs::File::create(&probe).and_then(|mut f| {
        std::io::Write::write_all(&mut f, &[0u8; PROBE_BYTES])?;
        f.sync_all()
    });
    let _ = std::fs::remove_file(&probe);
    written.map_err(fail)
}

/// What the writability probe writes: more than a lock or a log line needs.
const PROBE_BYTES: usize = 64 * 1024;

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
            if place(&path, &text, me.token).map_err(io)? {
                return Ok(OutputLock { path, token: me.token });
            }
            match read_holder(&path) {
                // Another trainer of this process (a notebook's earlier cell): it hands over.
                Ok(h) if h.host == me.host && h.pid == me.pid => {
                    std::fs::write(&path, &text).map_err(io)?;
                    return Ok(OutputLock { path, token: me.token });
                }
                // A run that died without releasing (kill -9, a crash): its lock is stale.
                Ok(h) if h.host == me.host && !alive(h.pid) => {
                    let _ = std::fs::remove_file(&path);
                }
                Ok(h) => return Err(in_use(out, &path, &h)),
                Err(Unreadable::Gone) => {}
                Err(why) => return Err(unreadable(out, &path, why)),
            }
        }
        Err(TrainError::config(
            "output_dir",
            format!(
                "{}: another run keeps taking {} as this one starts",
                out.display(),
                path.display()
            ),
        ))
    }
}

/// Puts the lock `text` at `path` whole: written and synced beside it, then hard-linked into
/// place, which fails if a lock is there (false). Where hard links are not supported, created
/// exclusively and written in place.
fn place(path: &Path, text: &str, token: u64) -> std::io::Result<bool> {
    let staged = path.with_extension(format!("lock.{}-{token:x}", std::process::id()));
    let written = std::fs::File::create(&staged).and_then(|mut f| {
        std::io::Write::write_all(&mut f, text.as_bytes())?;
        f.sync_all()
    });
    let linked = written.and_then(|()| std::fs::hard_link(&staged, path));
    let _ = std::fs::remove_file(&staged);
    match linked {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) if e.kind() == std::io::ErrorKind::Unsupported || e.raw_os_error() == Some(libc::EPERM) => {
            match std::fs::File::options().write(true).create_new(true).open(path) {
                Ok(mut f) => match std::io::Write::write_all(&mut f, text.as_bytes()) {
                    Ok(()) => Ok(true),
                    Err(e) => {
                        let _ = std::fs::remove_file(path);
                        Err(e)
                    }
                },
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
                Err(e) => Err(e),
            }
        }
        Err(e) => Err(e),
    }
}

/// Why a lock file names no process.
#[derive(Debug)]
enum Unreadable {
    /// Removed between finding it and reading it: try again.
    Gone,
    /// It is a folder.
    Folder,
    /// Nothing in it.
    Empty,
    /// Not a treetrain lock (the parser's complaint).
    NotALock(String),
    /// It names pid 0, which is no process.
    PidZero,
    /// It could not be read (the OS's reason).
    Io(String),
}

/// The holder `path` names, or why it names none.
fn read_holder(path: &Path) -> Result<Holder, Unreadable> {
    if path.is_dir() {
        return Err(Unreadable::Folder);
    }
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(Unreadable::Gone),
        Err(e) => return Err(Unreadable::Io(e.to_string())),
    };
    if text.trim().is_empty() {
        return Err(Unreadable::Empty);
    }
    match serde_json::from_str::<Holder>(&text) {
        Ok(h) if h.pid == 0 => Err(Unreadable::PidZero),
        Ok(h) => Ok(h),
        Err(e) => Err(Unreadable::NotALock(e.to_string())),
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

fn in_use(out: &Path, lock: &Path, h: &Holder) -> TrainError {
    let who = format!(
        "process {} on {} since {} UTC",
        h.pid,
        h.host,
        crate::util::clock::run_stamp(h.started)
    );
    TrainError::config(
        "output_dir",
        format!(
            "{} is in use by another run ({who}): wait for it to end, choose another output_dir, or delete {} if that run is gone",
            out.display(),
            lock.display()
        ),
    )
}

fn unreadable(out: &Path, lock: &Path, why: Unreadable) -> TrainError {
    let what = match why {
        Unreadable::Gone => "gone".to_string(),
        Unreadable::Folder => "a folder, not a file".into(),
        Unreadable::Empty => "empty".into(),
        Unreadable::NotALock(e) => format!("not a treetrain lock ({e})"),
        Unreadable::PidZero => "naming pid 0, which is no process".into(),
        Unreadable::Io(e) => format!("unreadable ({e})"),
    };
    TrainError::config(
        "output_dir",
        format!(
            "{}: its lock {} is {what}, so no run can be said to hold it (treetrain writes a lock whole, naming its process): delete it if no run is using this folder, or choose another output_dir",
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

    /// A lock that names no process is refused as unreadable, saying what it is and what to
    /// do, never as "a run that is starting"; a taken lock leaves no staged file beside it.
    #[test]
    fn unreadable_locks_are_named_with_the_fix_and_placing_leaves_nothing_beside() {
        let out = std::env::temp_dir().join(format!("treetrain-lock-bad-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        std::fs::create_dir_all(&out).unwrap();
        let lock = out.join(LOCK_FILE);
        let pid_zero = format!(
            r#"{{"pid":0,"host":"{}","started":0,"token":1}}"#,
            crate::util::host_name()
        );
        for (contents, said) in [
            ("", "is empty"),
            ("garbage", "is not a treetrain lock"),
            (pid_zero.as_str(), "naming pid 0"),
        ] {
            std::fs::write(&lock, contents).unwrap();
            let err = OutputLock::acquire(&out).unwrap_err().to_string();
            assert!(
                err.contains(said) && err.contains("delete it if no run is using this folder"),
                "{err}"
            );
            assert!(!err.contains("starting"), "{err}");
        }
        std::fs::remove_file(&lock).unwrap();
        std::fs::create_dir(&lock).unwrap();
        let err = OutputLock::acquire(&out).unwrap_err().to_string();
        assert!(err.contains("is a folder, not a file"), "{err}");
        std::fs::remove_dir(&lock).unwrap();
        let held = OutputLock::acquire(&out).unwrap();
        let names: Vec<String> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, [LOCK_FILE], "the lock alone, read whole: {names:?}");
        assert!(read_holder(&lock).is_ok_and(|h| h.pid == std::process::id()));
        drop(held);
        let _ = std::fs::remove_dir_all(&out);
    }
}
