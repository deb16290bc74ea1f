use std::path::PathBuf;

use super::cuda::{CudaInfo, load_torch_cuda};
use super::neuron::NeuronInfo;
use super::policy::Platform;
use super::probe::HostProbe;

/// libtorch's answers about this process, gathered in one place so detection logic can be
/// tested with made-up values.
#[derive(Debug, Clone, PartialEq)]
pub struct TorchFacts {
    /// `torch.cuda.device_count()`.
    pub cuda_device_count: usize,
    /// cuDNN usable.
    pub cudnn: bool,
    /// MPS (Apple GPU) usable.
    pub mps: bool,
    /// Intra-op threads.
    pub threads: usize,
    /// Inter-op threads.
    pub interop_threads: usize,
    /// Built with OpenMP.
    pub openmp: bool,
    /// Built with MKL.
    pub mkl: bool,
    /// Built with oneDNN (MKLDNN).
    pub mkldnn: bool,
}

impl TorchFacts {
    /// Asks the linked libtorch.
    pub fn query() -> Self {
        TorchFacts {
            cuda_device_count: tch::Cuda::device_count().max(0) as usize,
            cudnn: tch::Cuda::cudnn_is_available(),
            mps: tch::utils::has_mps(),
            threads: tch::get_num_threads().max(0) as usize,
            interop_threads: tch::get_num_interop_threads().max(0) as usize,
            openmp: tch::utils::has_openmp(),
            mkl: tch::utils::has_mkl(),
            mkldnn: tch::utils::has_mkldnn(),
        }
    }
}

/// The host CPU.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuInfo {
    /// Model name from `/proc/cpuinfo`.
    pub model: Option<String>,
    /// Logical CPUs the OS offers this process.
    pub logical_cpus: usize,
    /// libtorch intra-op threads.
    pub torch_threads: usize,
    /// libtorch inter-op threads.
    pub torch_interop_threads: usize,
    /// `OMP_NUM_THREADS`, when set.
    pub omp_num_threads: Option<String>,
    /// libtorch built with OpenMP / MKL / oneDNN.
    pub openmp: bool,
    /// See `openmp`.
    pub mkl: bool,
    /// See `openmp`.
    pub mkldnn: bool,
}

/// Every accelerator this process can see, and what follows for a run.
#[derive(Debug, Clone, PartialEq)]
pub struct Accelerators {
    /// The host CPU.
    pub cpu: CpuInfo,
    /// CUDA status with an explanation when unavailable.
    pub cuda: CudaInfo,
    /// Apple MPS usable.
    pub mps: bool,
    /// AWS Neuron devices, when present.
    pub neuron: Option<NeuronInfo>,
    /// The outcome of loading `TREETRAIN_TORCH_CUDA`'s `libtorch_cuda.so`, when that was asked for.
    pub cuda_load: Option<Result<PathBuf, String>>,
}

impl Accelerators {
    /// Detects on the running machine. When `TREETRAIN_TORCH_CUDA` names a torch 2.11.0 CUDA
    /// `lib` folder, its `libtorch_cuda.so` is loaded first (before libtorch caches "no CUDA").
    pub(crate) fn detect() -> Self {
        let probe = HostProbe::system();
        let cuda_load = probe.var("TREETRAIN_TORCH_CUDA").map(|dir| {
            let dir = PathBuf::from(dir);
            load_torch_cuda(&dir).map(|()| dir).map_err(|e| e.to_string())
        });
        let mut acc = Self::detect_with(&probe, &TorchFacts::query());
        acc.cuda_load = cuda_load;
        acc
    }

    /// Detection against any probe and libtorch facts (tests use a fake root).
    pub fn detect_with(probe: &HostProbe, torch: &TorchFacts) -> Self {
        let model = probe.read("/proc/cpuinfo").and_then(|s| {
            s.lines().find_map(|l| {
                let (k, v) = l.split_once(':')?;
                (k.trim() == "model name").then(|| v.trim().to_string())
            })
        });
        let cpu = CpuInfo {
            model,
            logical_cpus: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            torch_threads: torch.threads,
            torch_interop_threads: torch.interop_threads,
            omp_num_threads: probe.var("OMP_NUM_THREADS").map(str::to_string),
            openmp: torch.openmp,
            mkl: torch.mkl,
            mkldnn: torch.mkldnn,
        };
        Accelerators {
            cpu,
            cuda: CudaInfo::from_parts(probe, torch.cuda_device_count, torch.cudnn),
            mps: torch.mps,
            neuron: NeuronInfo::detect(probe),
            cuda_load: None,
        }
    }

    /// The platform a run here should plan for: Neuron when present (its shape policies matter
    /// most), else CUDA, else MPS, else CPU.
    pub fn platform(&self) -> Platform {
        if self.neuron.is_some() {
            Platform::Neuron
        } else if self.cuda.available {
            Platform::Cuda
        } else if self.mps {
            Platform::Mps
        } else {
            Platform::Cpu
        }
    }

    /// The tch device tensors go to without a PrivateUse1 backend loaded. Neuron maps to CPU: tch cannot name TorchNeuron's
    /// PrivateUse1 device.
    pub fn tch_device(&self) -> tch::Device {
        match self.platform() {
            Platform::Cuda => tch::Device::Cuda(0),
            Platform::Mps => tch::Device::Mps,
            Platform::Cpu | Platform::Neuron => tch::Device::Cpu,
        }
    }

    /// Plain statements a user should read before a run (Neuron limits, failed loads, warnings).
    pub fn notes(&self) -> Vec<String> {
        let mut notes = Vec::new();
        if let Some(n) = &self.neuron {
            notes.push(
                "Neuron found. treetrain computes there through PyTorch's PrivateUse1 device once TorchNeuron's \
                 library is loaded (TREETRAIN_PRIVATEUSE1_LIB; see the Neuron guide, src/guide/neuron.md: never run on Trainium). Until \
                 then tensors run on CPU, while the Neuron policies (pad_to_multiple_of 128, bf16, shape ledger) \
                 still apply to planning."
                    .to_string(),
            );
            notes.extend(n.warnings.iter().cloned());
        }
        if let Some(Err(e)) = &self.cuda_load {
            notes.push(format!("TREETRAIN_TORCH_CUDA: {e}"));
        }
        notes
    }
}
