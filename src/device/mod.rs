//! Accelerator detection and the per-platform policies that follow from it.
//!
//! Detection reads the machine through a [`HostProbe`] (a root folder and an environment map),
//! so every rule is testable against a fake root. libtorch queries (CUDA device count, MPS) are
//! passed in as [`TorchFacts`] for the same reason.
//!
//! | platform | [`Device`] | `PadTo::Auto` | preferred dtype |
//! |----------|------------|---------------|-----------------|
//! | CPU      | `Cpu`      | none          | f32             |
//! | CUDA     | `Cuda(i)`  | none          | bf16            |
//! | MPS      | `Mps`      | none          | f32             |
//! | Neuron   | `PrivateUse1 {name: neuron}` (through the shim: [`privateuse1`]) | 128 | bf16 |

mod accelerators;
mod cuda;
mod cuda_memory;
mod dtype;
mod error;
mod neuron;
mod place;
mod policy;
pub mod privateuse1;
mod probe;

pub use accelerators::{Accelerators, CpuInfo, TorchFacts};
pub use cuda::{CudaDevice, CudaInfo, load_torch_cuda, load_torch_cuda_from_env};
pub use cuda_memory::{CudaMemoryStats, cuda_memory_stats, reset_cuda_peak};
pub(crate) use dtype::parse_kind;
pub use dtype::{Dtype, DtypeSetting, UnknownDtype};
pub use error::DeviceError;
pub use neuron::{NeuronInfo, parse_visible_cores};
pub use place::{BackendName, Device};
pub(crate) use policy::round_up;
pub use policy::{DeviceSpec, PadTo, Platform, parse_device};
pub(crate) use probe::available_host_bytes;
pub use probe::{HostProbe, host_shortfall};
