use std::fmt;
use std::str::FromStr;

use super::error::DeviceError;
use super::place::{BackendName, Device};
use super::privateuse1;

/// The kind of machine a run targets; policies depend on it, not on the tch device, because
/// Neuron runs are planned on any machine (a PrivateUse1 device runs them for real).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, clap::ValueEnum)]
pub enum Platform {
    /// Host CPU.
    #[default]
    Cpu,
    /// NVIDIA GPU through libtorch's CUDA backend.
    #[value(alias = "gpu")]
    Cuda,
    /// Apple GPU.
    Mps,
    /// AWS Trainium/Inferentia (TorchNeuron's `neuron` PrivateUse1 device).
    #[value(alias = "trainium", alias = "xla")]
    Neuron,
}

crate::util::serde_via_str!(Platform, PadTo, DeviceSpec);

impl Platform {
    /// The platform of a device ([`Device::platform`]).
    pub fn of(device: Device) -> Platform {
        device.platform()
    }

    /// The dtype a run should default to here (`dtype = "auto"`). Neuron: bf16 (static-cache
    /// generation needs it and float64 runs as float32 anyway); CUDA: bf16, what transformers
    /// users get from `bf16=True`; CPU and MPS: fp32, for exactness and because CPU bf16
    /// matmuls are not faster than fp32 ones on most hosts.
    pub fn preferred_dtype(self) -> super::Dtype {
        use super::dtype::Dtype;
        match self {
            Platform::Neuron | Platform::Cuda => Dtype::Bf16,
            Platform::Cpu | Platform::Mps => Dtype::Fp32,
        }
    }

    /// Seconds one new input shape costs before a step can run: a graph compile on Neuron
    /// (the order of a minute, as TRL v1.16 reports for Trainium2), nothing on eager backends.
    pub(crate) fn compiles_per_shape(self) -> bool {
        matches!(self, Platform::Neuron)
    }
}

impl fmt::Display for Platform {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(match self {
            Platform::Cpu => "cpu",
            Platform::Cuda => "cuda",
            Platform::Mps => "mps",
            Platform::Neuron => "neuron",
        })
    }
}

impl FromStr for Platform {
    type Err = DeviceError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "cpu" => Ok(Platform::Cpu),
            "cuda" | "gpu" => Ok(Platform::Cuda),
            "mps" => Ok(Platform::Mps),
            "neuron" | "trainium" | "xla" => Ok(Platform::Neuron),
            _ => Err(DeviceError::UnknownPlatform(s.to_string())),
        }
    }
}

/// `pad_to_multiple_of`, as TRL v1.16 defines it.
///
/// Padding sequence lengths up to a multiple bounds the number of distinct shapes a run feeds
/// the compiler. `Auto` is 128 on Neuron (one compile per shape) and no padding elsewhere,
/// where padding only wastes compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PadTo {
    /// 128 on Neuron, none elsewhere.
    #[default]
    Auto,
    /// Never pad beyond the longest row.
    None,
    /// Pad to a multiple of this many tokens (at least 1).
    Multiple(usize),
}

impl PadTo {
    /// The multiple Neuron gets under `Auto`.
    pub(crate) const NEURON_MULTIPLE: usize = 128;

    /// The multiple in force on `platform`, or `None` for no padding.
    pub fn resolve(self, platform: Platform) -> Option<usize> {
        match self {
            PadTo::Auto if platform == Platform::Neuron => Some(Self::NEURON_MULTIPLE),
            PadTo::Auto | PadTo::None => None,
            PadTo::Multiple(m) => Some(m.max(1)),
        }
    }

    /// `len` rounded up to the multiple in force on `platform`.
    pub fn padded_len(self, len: usize, platform: Platform) -> usize {
        round_up(len, self.resolve(platform))
    }
}

/// `len` rounded up to a multiple of `multiple` (unchanged for `None`).
pub(crate) fn round_up(len: usize, multiple: Option<usize>) -> usize {
    match multiple {
        Some(m) if m > 1 => len.div_ceil(m) * m,
        _ => len,
    }
}

impl fmt::Display for PadTo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PadTo::Auto => f.write_str("auto"),
            PadTo::None => f.write_str("none"),
            PadTo::Multiple(m) => write!(f, "{m}"),
        }
    }
}

impl FromStr for PadTo {
    type Err = DeviceError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(PadTo::Auto),
            "none" | "null" | "" => Ok(PadTo::None),
            n => match n.parse::<usize>() {
                Ok(m) if m >= 1 => Ok(PadTo::Multiple(m)),
                _ => Err(DeviceError::InvalidPadTo(s.to_string())),
            },
        }
    }
}

/// Where a run's parameters live: `cpu`, `cuda` (= `cuda:0`), `cuda:N`, `mps`, `neuron`
/// (= `neuron:0`), `neuron:N` or the registered name of another PrivateUse1 backend (with
/// `:N`), or `auto` (the first CUDA device when libtorch sees one, else device 0 of a loaded
/// PrivateUse1 backend, else CPU). Parsing checks the spelling; whether the device exists is
/// checked by [`DeviceSpec::resolve`], when the run starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    /// Host CPU.
    #[default]
    Cpu,
    /// CUDA device `N`.
    Cuda(usize),
    /// Apple GPU.
    Mps,
    /// Device `N` of the PrivateUse1 backend (TorchNeuron's `neuron`, or whichever is loaded).
    PrivateUse1(usize),
    /// CUDA device 0 when libtorch sees one, else PrivateUse1 device 0 when a backend is
    /// loaded, else CPU.
    Auto,
}

impl DeviceSpec {
    /// The device, or an error when this process cannot use the one named (rather than a
    /// silent CPU run): a CUDA index libtorch does not see, a PrivateUse1 device with no backend
    /// loaded ([`privateuse1::LIBRARY_ENV`]) or past its device count.
    pub fn resolve(self) -> Result<Device, DeviceError> {
        if matches!(self, DeviceSpec::Auto | DeviceSpec::Cuda(_)) {
            super::load_torch_cuda_from_env().transpose()?;
        }
        match self {
            DeviceSpec::Cpu => Ok(Device::Cpu),
            DeviceSpec::Mps => Ok(Device::Mps),
            DeviceSpec::Auto if tch::Cuda::is_available() => Ok(Device::Cuda(0)),
            DeviceSpec::Auto => match current_backend()? {
                Some(b) if b.device_count > 0 => privateuse1_device(&b, 0),
                _ => Ok(Device::Cpu),
            },
            DeviceSpec::Cuda(i) => {
                let n = tch::Cuda::device_count().max(0) as usize;
                if i < n {
                    Ok(Device::Cuda(i))
                } else {
                    let why =
                        super::Accelerators::detect_with(&super::HostProbe::system(), &super::TorchFacts::query())
                            .cuda
                            .unavailable_reason
                            .unwrap_or_else(|| "`treetrain env` says why".into());
                    Err(DeviceError::UnknownDevice {
                        name: self.to_string(),
                        reason: format!("libtorch sees {n} CUDA device(s): {why}"),
                    })
                }
            }
            DeviceSpec::PrivateUse1(index) => match current_backend()? {
                Some(b) => privateuse1_device(&b, index),
                None => Err(DeviceError::UnknownDevice {
                    name: format!("neuron:{index}"),
                    reason: format!(
                        "no PrivateUse1 backend is loaded: set {} to the backend's library (TorchNeuron: \
                         the one its torch-neuronx package installs; see the Neuron guide, src/guide/neuron.md)",
                        privateuse1::LIBRARY_ENV
                    ),
                }),
            },
        }
    }
}

/// The backend loaded from [`privateuse1::LIBRARY_ENV`], else the one already registered.
fn current_backend() -> Result<Option<privateuse1::Backend>, DeviceError> {
    match privateuse1::load_from_env()? {
        Some(backend) => Ok(Some(backend)),
        None => privateuse1::registered(),
    }
}

/// Device `index` of `backend`, checked against its device count.
fn privateuse1_device(backend: &privateuse1::Backend, index: usize) -> Result<Device, DeviceError> {
    if index >= backend.device_count {
        return Err(DeviceError::UnknownDevice {
            name: format!("{}:{index}", backend.name),
            reason: format!(
                "backend {:?} (from {}) has {} device(s)",
                backend.name,
                backend.library_list(),
                backend.device_count
            ),
        });
    }
    Ok(Device::PrivateUse1 {
        name: BackendName::new(&backend.name),
        index,
    })
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Cuda(i) => write!(f, "cuda:{i}"),
            DeviceSpec::Mps => f.write_str("mps"),
            DeviceSpec::PrivateUse1(i) => write!(f, "neuron:{i}"),
            DeviceSpec::Auto => f.write_str("auto"),
        }
    }
}

impl FromStr for DeviceSpec {
    type Err = DeviceError;
    fn from_str(name: &str) -> Result<Self, Self::Err> {
        let lower = name.trim().to_ascii_lowercase();
        let (base, index) = match lower.split_once(':') {
            Some((base, i)) => match i.parse::<usize>() {
                Ok(i) => (base, Some(i)),
                Err(_) => return Err(unknown_device(name)),
            },
            None => (lower.as_str(), None),
        };
        match (base, index) {
            ("cpu", None) => Ok(DeviceSpec::Cpu),
            ("mps", None) => Ok(DeviceSpec::Mps),
            ("auto", None) => Ok(DeviceSpec::Auto),
            ("cuda" | "gpu", i) => Ok(DeviceSpec::Cuda(i.unwrap_or(0))),
            ("neuron" | "privateuseone", i) => Ok(DeviceSpec::PrivateUse1(i.unwrap_or(0))),
            (other, i) if is_registered_backend(other) => Ok(DeviceSpec::PrivateUse1(i.unwrap_or(0))),
            _ => Err(unknown_device(name)),
        }
    }
}

/// Whether `name` is the registered PrivateUse1 backend's (loading [`privateuse1::LIBRARY_ENV`]
/// first, so a backend under another name than `neuron` is known by it).
fn is_registered_backend(name: &str) -> bool {
    matches!(current_backend(), Ok(Some(b)) if b.name == name)
}

fn unknown_device(name: &str) -> DeviceError {
    DeviceError::UnknownDevice {
        name: name.to_string(),
        reason: "expected cpu, cuda, cuda:N, mps, neuron, neuron:N (or a loaded PrivateUse1 backend's name) or auto"
            .into(),
    }
}

/// The device a `device` setting names ([`DeviceSpec`] parsed, then resolved).
pub fn parse_device(name: &str) -> Result<Device, DeviceError> {
    name.parse::<DeviceSpec>()?.resolve()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_is_128_on_neuron_only() {
        assert_eq!(PadTo::Auto.resolve(Platform::Neuron), Some(128));
        for p in [Platform::Cpu, Platform::Cuda, Platform::Mps] {
            assert_eq!(PadTo::Auto.resolve(p), None);
            assert_eq!(PadTo::Auto.padded_len(130, p), 130);
        }
        assert_eq!(PadTo::Auto.padded_len(130, Platform::Neuron), 256);
        assert_eq!(PadTo::Auto.padded_len(128, Platform::Neuron), 128);
    }

    #[test]
    fn explicit_policies() {
        assert_eq!(PadTo::None.resolve(Platform::Neuron), None);
        assert_eq!(PadTo::Multiple(64).padded_len(65, Platform::Cpu), 128);
        assert_eq!(PadTo::Multiple(1).padded_len(65, Platform::Cpu), 65);
        assert_eq!(PadTo::Multiple(8).padded_len(0, Platform::Cpu), 0);
    }

    #[test]
    fn parse_and_print_round_trip() {
        for s in ["auto", "none", "128"] {
            assert_eq!(s.parse::<PadTo>().unwrap().to_string(), s);
        }
        assert!(matches!("0".parse::<PadTo>(), Err(DeviceError::InvalidPadTo(_))));
        assert!(matches!("-3".parse::<PadTo>(), Err(DeviceError::InvalidPadTo(_))));
        assert_eq!("Trainium".parse::<Platform>().unwrap(), Platform::Neuron);
        assert!("tpu".parse::<Platform>().is_err());
    }

    #[test]
    fn preferred_dtypes() {
        assert_eq!(Platform::Neuron.preferred_dtype(), crate::device::Dtype::Bf16);
        assert_eq!(Platform::Cpu.preferred_dtype(), crate::device::Dtype::Fp32);
        assert_eq!(Platform::of(Device::Cuda(1)), Platform::Cuda);
        assert_eq!(Platform::of(Device::Cpu), Platform::Cpu);
    }

    #[test]
    fn device_names_parse_or_say_why_not() {
        assert_eq!(parse_device("cpu").unwrap(), Device::Cpu);
        assert_eq!(parse_device(" MPS ").unwrap(), Device::Mps);
        let auto = parse_device("auto").unwrap();
        assert_eq!(auto, Device::from(tch::Device::cuda_if_available()));
        assert_eq!("neuron:1".parse::<DeviceSpec>().unwrap(), DeviceSpec::PrivateUse1(1));
        assert_eq!("Neuron".parse::<DeviceSpec>().unwrap(), DeviceSpec::PrivateUse1(0));
        assert_eq!("cuda:1".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda(1));
        let n = tch::Cuda::device_count() as usize;
        let err = parse_device(&format!("cuda:{n}")).unwrap_err().to_string();
        assert!(err.contains(&format!("sees {n} CUDA device")), "{err}");
        assert!(
            parse_device("tpu")
                .unwrap_err()
                .to_string()
                .contains("expected cpu, cuda")
        );
        assert!(parse_device("neuron:x").is_err());
        assert!(parse_device("cpu:1").is_err());
        assert!(parse_device("cuda:x").is_err());
    }

    #[test]
    fn typed_settings_read_from_config_text() {
        #[derive(serde::Deserialize)]
        struct Cfg {
            pad: PadTo,
            platform: Platform,
            device: DeviceSpec,
        }
        let c: Cfg = toml::from_str("pad = 128\nplatform = \"trainium\"\ndevice = \"cuda:1\"").unwrap();
        assert_eq!(
            (c.pad, c.platform, c.device),
            (PadTo::Multiple(128), Platform::Neuron, DeviceSpec::Cuda(1))
        );
        let err = toml::from_str::<Cfg>("pad = \"auto\"\nplatform = \"tpu\"\ndevice = \"cpu\"")
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("expected cpu, cuda, mps or neuron"), "{err}");
        assert_eq!(serde_json::to_string(&DeviceSpec::Cuda(2)).unwrap(), "\"cuda:2\"");
    }
}
