//! Which c10d backend carries a multi-process run's collectives: Gloo (host memory; tensors on a
//! device go through it) or NCCL (each rank's GPU, no host copy).

use crate::device::DeviceSpec;

use super::DistError;
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
    /// (`cuda:i` is GPU `i + local_rank`, as the trainer places ranks).
    pub fn choose(self, device: DeviceSpec, local_rank: usize, rank: usize) -> Result<BackendChoice, DistError> {
        if self == CommBackend::Gloo {
            return Ok(BackendChoice::Gloo(None));
        }
        let gpu = match device {
            DeviceSpec::Cuda(i) => Some(i + local_rank),
            DeviceSpec::Auto if cuda_available() => Some(local_rank),
            _ => None,
        };
        // A run off CUDA has nothing for NCCL: Gloo goes without saying.
        if gpu.is_none() && self == CommBackend::Auto {
            return Ok(BackendChoice::Gloo(None));
        }
        let nccl = gpu
            .ok_or_else(|| format!("the run's device is {device}, not a CUDA GPU"))
            .and_then(|device| {
                let lib = NcclLibrary::load()?;
                let v = lib.checked_versions()?;
                let said = format!("NCCL {} on cuda:{device}", version_string(v.runtime));
                Ok(BackendChoice::Nccl { device, said })
            });
        match (self, nccl) {
            (_, Ok(chosen)) => Ok(chosen),
            (CommBackend::Nccl, Err(why)) => Err(DistError::new(rank, "distributed_backend = nccl", why)),
            (_, Err(why)) => Ok(BackendChoice::Gloo(Some(why))),
        }
    }
}

/// Whether libtorch sees a GPU, after loading `TREETRAIN_TORCH_CUDA`'s library if set.
fn cuda_available() -> bool {
    let _ = crate::device::load_torch_cuda_from_env();
    tch::Cuda::is_available()
}
