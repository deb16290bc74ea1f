use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// What detection may look at: a file-system root and an environment.
///
/// [`HostProbe::system`] is the real machine; [`HostProbe::fake`] points at a folder laid out
/// like one (`dev/neuron0`, `proc/driver/nvidia/version`, ...) for tests.
#[derive(Debug, Clone)]
pub struct HostProbe {
    root: PathBuf,
    env: BTreeMap<String, String>,
}

impl HostProbe {
    /// The running machine and this process's environment.
    pub fn system() -> Self {
        Self {
            root: PathBuf::from("/"),
            env: std::env::vars().collect(),
        }
    }

    /// A fake machine rooted at `root` with exactly the given environment.
    pub fn fake(root: impl Into<PathBuf>, env: &[(&str, &str)]) -> Self {
        Self {
            root: root.into(),
            env: env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        }
    }

    /// An absolute machine path (`/dev/neuron0`) under this probe's root.
    pub fn path(&self, absolute: &str) -> PathBuf {
        self.root.join(absolute.trim_start_matches('/'))
    }

    /// Whether a machine path exists.
    pub fn exists(&self, absolute: &str) -> bool {
        self.path(absolute).exists()
    }

    /// A machine file's contents, trimmed, if readable.
    pub fn read(&self, absolute: &str) -> Option<String> {
        std::fs::read_to_string(self.path(absolute))
            .ok()
            .map(|s| s.trim().to_string())
    }

    /// File names in a machine folder, sorted; empty when unreadable.
    pub fn list(&self, absolute: &str) -> Vec<String> {
        list_dir(&self.path(absolute))
    }

    /// An environment variable, if set and not empty.
    pub fn var(&self, name: &str) -> Option<&str> {
        self.env.get(name).map(String::as_str).filter(|v| !v.is_empty())
    }
}

fn list_dir(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|it| {
            it.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// The host memory available now, when `need` bytes exceed it (None when they fit, or when
/// the amount cannot be read): what a size check before an allocation asks.
pub fn host_shortfall(need: u128) -> Option<u128> {
    available_host_bytes().filter(|&available| need > available)
}

/// `MemAvailable` of `/proc/meminfo`, in bytes (None off Linux).
pub(crate) fn available_host_bytes() -> Option<u128> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u128 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
