use std::fmt;
use std::str::FromStr;

use super::DeviceError;

/// The kind of machine a run targets; policies depend on it, not on the tch device, because
/// Neuron runs are planned here while tch itself cannot address Neuron.
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
    /// The platform of a tch device (tch has no PrivateUse1 device: Neuron never comes back).
    pub fn of(device: tch::Device) -> Platform {
        match device {
            tch::Device::Cuda(_) => Platform::Cuda,
            tch::Device::Mps => Platform::Mps,
            tch::Device::Cpu | tch::Device::Vulkan => Platform::Cpu,
        }
    }

    /// The dtype a run should default to here (`dtype = "auto"`). Neuron: bf16 (static-cache
    /// generation needs it and float64 runs as float32 anyway); CUDA: bf16, what transformers
    /// users get from `bf16=True`; CPU and MPS: fp32, for exactness and because CPU bf16
    /// matmuls are not faster than fp32 ones on most hosts.
    pub fn preferred_dtype(self) -> crate::model::Dtype {
        use crate::model::Dtype;
        match self {
            Platform::Neuron | Platform::Cuda => Dtype::Bf16,
            Platform::Cpu | Platform::Mps => Dtype::Fp32,
        }
    }

    /// Seconds one new input shape costs before a step can run: a graph compile on Neuron
    /// (about a minute, TRL v1.16's measurement), nothing on eager backends.
    pub fn compiles_per_shape(self) -> bool {
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
/// the compiler. `Auto` is 128 on Neuron (one compile per shape, about a minute each) and no
/// padding elsewhere, where padding only wastes compute.
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
    pub const NEURON_MULTIPLE: usize = 128;

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
pub fn round_up(len: usize, multiple: Option<usize>) -> usize {
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

/// Where a run's parameters live: `cpu`, `cuda` (= `cuda:0`), `cuda:N`, `mps`, or `auto` (the
/// first CUDA device when libtorch sees one, else CPU). Parsing checks the spelling; whether the
/// device exists is checked by [`DeviceSpec::resolve`], when the run starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    /// Host CPU.
    #[default]
    Cpu,
    /// CUDA device `N`.
    Cuda(usize),
    /// Apple GPU.
    Mps,
    /// CUDA device 0 when libtorch sees one, else CPU.
    Auto,
}

impl DeviceSpec {
    /// The tch device, or an error when libtorch cannot see the CUDA device named (rather than
    /// a silent CPU run).
    pub fn resolve(self) -> Result<tch::Device, DeviceError> {
        match self {
            DeviceSpec::Cpu => Ok(tch::Device::Cpu),
            DeviceSpec::Mps => Ok(tch::Device::Mps),
            DeviceSpec::Auto => Ok(tch::Device::cuda_if_available()),
            DeviceSpec::Cuda(i) => {
                let n = tch::Cuda::device_count().max(0) as usize;
                if i < n {
                    Ok(tch::Device::Cuda(i))
                } else {
                    Err(DeviceError::UnknownDevice {
                        name: self.to_string(),
                        reason: format!("libtorch sees {n} CUDA device(s) (`treetrain env` says why)"),
                    })
                }
            }
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Cuda(i) => write!(f, "cuda:{i}"),
            DeviceSpec::Mps => f.write_str("mps"),
            DeviceSpec::Auto => f.write_str("auto"),
        }
    }
}

impl FromStr for DeviceSpec {
    type Err = DeviceError;
    fn from_str(name: &str) -> Result<Self, Self::Err> {
        match name.trim().to_ascii_lowercase().as_str() {
            "cpu" => Ok(DeviceSpec::Cpu),
            "mps" => Ok(DeviceSpec::Mps),
            "auto" => Ok(DeviceSpec::Auto),
            "cuda" | "gpu" => Ok(DeviceSpec::Cuda(0)),
            other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(i)) => Ok(DeviceSpec::Cuda(i)),
                _ => Err(DeviceError::UnknownDevice {
                    name: name.to_string(),
                    reason: "expected cpu, cuda, cuda:N, mps or auto".into(),
                }),
            },
        }
    }
}

/// The tch device a `device` setting names ([`DeviceSpec`] parsed, then resolved).
pub fn parse_device(name: &str) -> Result<tch::Device, DeviceError> {
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
        assert_eq!(Platform::Neuron.preferred_dtype(), crate::model::Dtype::Bf16);
        assert_eq!(Platform::Cpu.preferred_dtype(), crate::model::Dtype::Fp32);
        assert_eq!(Platform::of(tch::Device::Cuda(1)), Platform::Cuda);
        assert_eq!(Platform::of(tch::Device::Cpu), Platform::Cpu);
    }

    #[test]
    fn device_names_parse_or_say_why_not() {
        assert_eq!(parse_device("cpu").unwrap(), tch::Device::Cpu);
        assert_eq!(parse_device(" MPS ").unwrap(), tch::Device::Mps);
        let auto = parse_device("auto").unwrap();
        assert_eq!(auto, tch::Device::cuda_if_available());
        let n = tch::Cuda::device_count() as usize;
        let err = parse_device(&format!("cuda:{n}")).unwrap_err().to_string();
        assert!(err.contains(&format!("sees {n} CUDA device")), "{err}");
        assert!(
            parse_device("tpu")
                .unwrap_err()
                .to_string()
                .contains("expected cpu, cuda")
        );
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
