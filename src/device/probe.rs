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

/// What this process may still allocate, in bytes (None off Linux): the least of the host's
/// `MemAvailable`, the address space left under `ulimit -v` (`RLIMIT_AS` less `VmSize`), and
/// the room left in the process's cgroup (`memory.max` less `memory.current`). A limit of
/// either kind fails an allocation the host's free memory would allow.
pub(crate) fn available_host_bytes() -> Option<u128> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let available = kib_field(&info, "MemAvailable:")?;
    let address_space = address_space_left();
    let cgroup = cgroup_room();
    Some(
        [Some(available), address_space, cgroup]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(available),
    )
}

/// The number of kiB after `key` in a `/proc` table, in bytes.
fn kib_field(text: &str, key: &str) -> Option<u128> {
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kib: u128 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// `RLIMIT_AS`'s soft limit less the address space in use (None when unlimited).
fn address_space_left() -> Option<u128> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max address space"))?;
    let soft: u128 = line["Max address space".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    let used = kib_field(&std::fs::read_to_string("/proc/self/status").ok()?, "VmSize:")?;
    Some(soft.saturating_sub(used))
}

/// The cgroup v2 limit of this process less its use (None without one, or `max`).
fn cgroup_room() -> Option<u128> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = own.lines().find_map(|l| l.strip_prefix("0::"))?;
    let dir = Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/'));
    let read = |f: &str| -> Option<u128> { std::fs::read_to_string(dir.join(f)).ok()?.trim().parse().ok() };
    Some(read("memory.max")?.saturating_sub(read("memory.current")?))
}
