//! Parameter dtypes a run can choose, by the names PyTorch and transformers use.

use std::fmt;
use std::str::FromStr;

use tch::Kind;

/// A parameter dtype: `fp32` (`float32`), `bf16` (`bfloat16`) or `fp16` (`float16`); a
/// `torch.` prefix and any case are accepted, as in `config.json`'s `torch_dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Dtype {
    /// 32-bit float.
    #[default]
    #[value(alias = "float32")]
    Fp32,
    /// bfloat16.
    #[value(alias = "bfloat16")]
    Bf16,
    /// IEEE half.
    #[value(alias = "float16")]
    Fp16,
}

crate::util::serde_via_str!(Dtype);

impl Dtype {
    /// The tch kind.
    pub fn kind(self) -> Kind {
        match self {
            Dtype::Fp32 => Kind::Float,
            Dtype::Bf16 => Kind::BFloat16,
            Dtype::Fp16 => Kind::Half,
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(match self {
            Dtype::Fp32 => "fp32",
            Dtype::Bf16 => "bf16",
            Dtype::Fp16 => "fp16",
        })
    }
}

impl FromStr for Dtype {
    type Err = UnknownDtype;
    fn from_str(name: &str) -> Result<Self, UnknownDtype> {
        match name.trim().to_ascii_lowercase().trim_start_matches("torch.") {
            "float32" | "fp32" | "f32" | "float" => Ok(Dtype::Fp32),
            "bfloat16" | "bf16" => Ok(Dtype::Bf16),
            "float16" | "fp16" | "f16" | "half" => Ok(Dtype::Fp16),
            other => Err(UnknownDtype {
                value: format!("{other:?}"),
                expected: "float32, bfloat16 or float16",
            }),
        }
    }
}

/// A run's `dtype` setting: `auto` (the default) takes the device's preferred dtype when the run
/// starts ([`super::Platform::preferred_dtype`]: bf16 on CUDA and Neuron, fp32 on CPU
/// and MPS), any [`Dtype`] name fixes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DtypeSetting {
    /// The device's preferred dtype.
    #[default]
    Auto,
    /// This dtype on every device.
    Fixed(Dtype),
}

crate::util::serde_via_str!(DtypeSetting);

impl DtypeSetting {
    /// The dtype a run on `device` computes in.
    pub fn resolve(self, device: super::Device) -> Dtype {
        match self {
            DtypeSetting::Auto => super::Platform::of(device).preferred_dtype(),
            DtypeSetting::Fixed(d) => d,
        }
    }
}

impl From<Dtype> for DtypeSetting {
    fn from(d: Dtype) -> Self {
        DtypeSetting::Fixed(d)
    }
}

impl fmt::Display for DtypeSetting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DtypeSetting::Auto => f.pad("auto"),
            DtypeSetting::Fixed(d) => d.fmt(f),
        }
    }
}

impl FromStr for DtypeSetting {
    type Err = UnknownDtype;
    fn from_str(name: &str) -> Result<Self, UnknownDtype> {
        if name.trim().eq_ignore_ascii_case("auto") {
            return Ok(DtypeSetting::Auto);
        }
        name.parse::<Dtype>()
            .map(DtypeSetting::Fixed)
            .map_err(|_| UnknownDtype {
                value: format!("{:?}", name.trim()),
                expected: "auto, float32, bfloat16 or float16",
            })
    }
}

/// A dtype name that is none of [`Dtype`]'s (or `auto`, where a [`DtypeSetting`] is read).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("config field `dtype` = {value}: expected {expected}")]
pub struct UnknownDtype {
    /// The name as written (quoted).
    pub value: String,
    /// The names that are accepted.
    pub expected: &'static str,
}

/// The tch kind a dtype name denotes (see [`Dtype`]).
pub(crate) fn parse_kind(name: &str) -> Result<Kind, UnknownDtype> {
    name.parse::<Dtype>().map(Dtype::kind)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_auto_setting_follows_the_device_and_a_fixed_one_does_not() {
        let auto: DtypeSetting = "auto".parse().unwrap();
        assert_eq!(auto, DtypeSetting::default());
        assert_eq!(auto.resolve(crate::device::Device::Cpu), Dtype::Fp32);
        assert_eq!(auto.resolve(crate::device::Device::Cuda(0)), Dtype::Bf16);
        let fixed: DtypeSetting = "torch.float16".parse().unwrap();
        assert_eq!(fixed.resolve(crate::device::Device::Cuda(0)), Dtype::Fp16);
        assert_eq!(fixed.to_string(), "fp16");
        assert_eq!(DtypeSetting::Auto.to_string(), "auto");
        let err = "int4".parse::<DtypeSetting>().unwrap_err().to_string();
        assert!(err.contains("auto") && err.contains("int4"), "{err}");
    }

    #[test]
    fn names_round_trip_and_errors_list_the_choices() {
        for d in [Dtype::Fp32, Dtype::Bf16, Dtype::Fp16] {
            assert_eq!(d.to_string().parse::<Dtype>().unwrap(), d);
        }
        assert_eq!("torch.BFloat16".parse::<Dtype>().unwrap(), Dtype::Bf16);
        let err = "int8".parse::<Dtype>().unwrap_err().to_string();
        assert!(err.contains("expected float32, bfloat16 or float16"), "{err}");
    }
}
