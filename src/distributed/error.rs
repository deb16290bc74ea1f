//! What can fail between processes.

/// A failed rendezvous or collective, naming the rank that saw it and, when a peer died or
/// stopped answering, the peers that did not answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("rank {rank}: {op}: {message}{}", silent_peers(.silent))]
pub struct DistError {
    /// The rank (of this process) that saw the failure.
    pub rank: usize,
    /// What it was doing (`store`, `process group`, `all_reduce`, `broadcast`, ...).
    pub op: &'static str,
    /// libtorch's or treetrain's account of it (a peer gone, a timeout, a port in use).
    pub message: String,
    /// The peers that did not answer once the collective failed: dead, or stuck elsewhere
    /// (empty when every peer answered or none was asked).
    pub silent: Vec<usize>,
}

impl DistError {
    /// An error of `rank` doing `op`.
    pub fn new(rank: usize, op: &'static str, message: impl Into<String>) -> Self {
        DistError {
            rank,
            op,
            message: message.into(),
            silent: Vec::new(),
        }
    }
}

/// `; no answer from rank 1 (it died or is stuck)` for the silent peers.
fn silent_peers(silent: &[usize]) -> String {
    let names: Vec<String> = silent.iter().map(|r| r.to_string()).collect();
    match names.len() {
        0 => String::new(),
        1 => format!("; no answer from rank {} (it died or is stuck)", names[0]),
        _ => format!("; no answer from ranks {} (they died or are stuck)", names.join(", ")),
    }
}
