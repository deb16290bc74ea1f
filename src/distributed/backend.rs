//! Which c10d backend carries a multi-process run's collectives: Gloo (host memory; tensors on a
//! device go through it) or NCCL (each rank's GPU, no host copy).

use crate::device::DeviceSpec;

use super::error::DistError;
use super::nccl::{NcclLibrary, version_string};

/// The `distributed_backend` setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum CommBackend {
    /// NCCL when the run's device is a GPU and the NCCL library loads with the NCCL version it
    /// was built for; else Gloo (on a GPU run, saying why once).
    #[default]
    Auto,
    /// Gloo, whatever the device.
    Gloo,
    /// NCCL; a run that cannot have it stops with the reason.
    Nccl,
}

/// The backend a rank uses, and what it says about the choice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendChoice {
    /// Gloo; with `auto`, why not NCCL (said once by rank 0).
    Gloo(Option<String>),
    /// NCCL.
    Nccl {
        /// The rank's CUDA device.
        device: usize,
        /// What rank 0 says: the NCCL version and the device.
        said: String,
    },
}

impl CommBackend {
    /// The backend for a rank of local rank `local_rank` whose device setting is `device`
    /// (placed by `rank_gpu`).
    pub fn choose(self, device: DeviceSpec, local_rank: usize, rank: usize) -> Result<BackendChoice, DistError> {
        if self == CommBackend::Gloo {
            return Ok(BackendChoice::Gloo(None));
        }
        let gpu = rank_gpu(device, local_rank);
        // A run off CUDA has nothing for NCCL: Gloo goes without saying.
        if gpu.is_none() && self == CommBackend::Auto {
            return Ok(BackendChoice::Gloo(None));
        }
        let nccl = match gpu {
            None => Err(format!("the run's device is {device}, not a CUDA GPU")),
            Some(RankGpu { shared: true, .. }) => Err(
                "this host runs more ranks (LOCAL_WORLD_SIZE) than it has GPUs, and NCCL needs a GPU of its own for each rank".into(),
            ),
            Some(RankGpu { index, .. }) => NcclLibrary::load().and_then(|lib| {
                let v = lib.checked_versions()?;
                let said = format!("NCCL {} on cuda:{index}", version_string(v.runtime));
                Ok(BackendChoice::Nccl { device: index, said })
            }),
        };
        match (self, nccl) {
            (_, Ok(chosen)) => Ok(chosen),
            (CommBackend::Nccl, Err(why)) => Err(DistError::new(rank, "distributed_backend = nccl", why)),
            (_, Err(why)) => Ok(BackendChoice::Gloo(Some(why))),
        }
    }
}

/// The CUDA device of one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RankGpu {
    /// Its index.
    pub index: usize,
    /// Whether the host's ranks share their GPUs (more ranks than GPUs).
    pub shared: bool,
}

/// The CUDA device of the rank of local rank `local_rank` whose device setting is `device`;
/// `None` off CUDA. `cuda:i` is GPU `i + local_rank`, as accelerate and torchrun scripts place
/// ranks (`auto` with a GPU: `i` = 0). Where a host runs more ranks (`LOCAL_WORLD_SIZE`) than it
/// has GPUs from `i` on, they share them in turn (a Gloo run on one GPU), rather than name a GPU
/// that does not exist.
pub(crate) fn rank_gpu(device: DeviceSpec, local_rank: usize) -> Option<RankGpu> {
    let first = match device {
        DeviceSpec::Cuda(i) => i,
        DeviceSpec::Auto => 0,
        _ => return None,
    };
    // `TREETRAIN_TORCH_CUDA`'s library first: libtorch sees no GPU without it.
    let _ = crate::device::load_torch_cuda_from_env();
    if device == DeviceSpec::Auto && !tch::Cuda::is_available() {
        return None;
    }
    let count = tch::Cuda::device_count().max(0) as usize;
    let local_size = std::env::var("LOCAL_WORLD_SIZE")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(local_rank + 1);
    Some(place_rank(first, local_rank, local_size, count))
}

/// [`rank_gpu`]'s rule: ranks from GPU `first`, in turn over the `count - first` GPUs there are
/// when `local_size` ranks do not fit (a count of 0, no GPU seen: as asked, for the device's
/// own error).
fn place_rank(first: usize, local_rank: usize, local_size: usize, count: usize) -> RankGpu {
    let available = count.saturating_sub(first);
    if count == 0 || first + local_size.max(local_rank + 1) <= count || available == 0 {
        return RankGpu {
            index: first + local_rank,
            shared: false,
        };
    }
    RankGpu {
        index: first + local_rank % available,
        shared: true,
    }
}

#[cfg(test)]
mod tests {
    use super::{RankGpu, place_rank};

    #[test]
    fn ranks_take_a_gpu_each_or_share_the_ones_there_are() {
        let at = |index, shared| RankGpu { index, shared };
        // One GPU a rank, from `first`.
        assert_eq!(place_rank(0, 1, 2, 2), at(1, false));
        assert_eq!(place_rank(2, 1, 2, 8), at(3, false));
        // Two ranks on one GPU: both on it, shared.
        assert_eq!(place_rank(0, 0, 2, 1), at(0, true));
        assert_eq!(place_rank(0, 1, 2, 1), at(0, true));
        // Four ranks from cuda:1 of 3 GPUs: 1, 2, 1, 2.
        let placed: Vec<usize> = (0..4).map(|r| place_rank(1, r, 4, 3).index).collect();
        assert_eq!(placed, [1, 2, 1, 2]);
        // No GPU seen, or a first GPU past the last: as asked, for the device's own error.
        assert_eq!(place_rank(0, 1, 2, 0), at(1, false));
        assert_eq!(place_rank(4, 1, 2, 2), at(5, false));
    }
}
