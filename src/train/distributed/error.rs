//! What can fail between processes.

/// A failed rendezvous or collective, naming the rank that saw it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("rank {rank}: {op}: {message}")]
pub struct DistError {
    /// The rank (of this process) that saw the failure.
    pub rank: usize,
    /// What it was doing (`store`, `process group`, `all_reduce`, `broadcast`, ...).
    pub op: &'static str,
    /// libtorch's or treetrain's account of it (a peer gone, a timeout, a port in use).
    pub message: String,
}

impl DistError {
    /// An error of `rank` doing `op`.
    pub fn new(rank: usize, op: &'static str, message: impl Into<String>) -> Self {
        DistError {
            rank,
            op,
            message: message.into(),
        }
    }
}
