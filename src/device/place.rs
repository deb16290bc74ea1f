//! treetrain's device: what tch's `Device` names, plus PyTorch's PrivateUse1 device (TorchNeuron's
//! `neuron`), which tch cannot name.
//!
//! Every tensor treetrain makes is created where tch can create it ([`Device::host`]: the device
//! itself, or the CPU for PrivateUse1) and moved with [`Device::put`]; on tch's own devices that
//! move is a no-op. Parameters are moved in place ([`Device::move_parameter`]), so the handles
//! layers hold keep seeing them.

use std::fmt;

use tch::{Kind, Tensor};

use super::policy::Platform;
use super::privateuse1;

/// The most bytes of a backend name a [`Device`] keeps (names are short: `neuron`).
const NAME_BYTES: usize = 24;

/// A PrivateUse1 backend's registered name, held inline so [`Device`] stays `Copy`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct BackendName {
    bytes: [u8; NAME_BYTES],
    len: u8,
}

impl BackendName {
    /// `name`, cut to its first 24 bytes (at a character boundary).
    pub fn new(name: &str) -> Self {
        let mut end = name.len().min(NAME_BYTES);
        while !name.is_char_boundary(end) {
            end -= 1;
        }
        let mut bytes = [0; NAME_BYTES];
        bytes[..end].copy_from_slice(&name.as_bytes()[..end]);
        BackendName { bytes, len: end as u8 }
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        std::str::from_utf8(&self.bytes[..self.len as usize]).unwrap_or("privateuseone")
    }
}

impl fmt::Debug for BackendName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

/// Where tensors live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Device {
    /// Host CPU.
    #[default]
    Cpu,
    /// CUDA device `N`.
    Cuda(usize),
    /// Apple GPU.
    Mps,
    /// Device `index` of the PrivateUse1 backend registered as `name` (TorchNeuron: `neuron`).
    PrivateUse1 {
        /// The backend's registered name.
        name: BackendName,
        /// Which of its devices.
        index: usize,
    },
}

impl Device {
    /// The tch device, when tch can name it (not for PrivateUse1).
    pub fn tch(self) -> Option<tch::Device> {
        match self {
            Device::Cpu => Some(tch::Device::Cpu),
            Device::Cuda(i) => Some(tch::Device::Cuda(i)),
            Device::Mps => Some(tch::Device::Mps),
            Device::PrivateUse1 { .. } => None,
        }
    }

    /// Where tensors for this device are created before [`Device::put`] moves them: the device
    /// itself, or the CPU for PrivateUse1 (tch cannot create tensors there).
    pub fn host(self) -> tch::Device {
        self.tch().unwrap_or(tch::Device::Cpu)
    }

    /// Whether this is a PrivateUse1 device.
    pub(crate) fn is_privateuse1(self) -> bool {
        matches!(self, Device::PrivateUse1 { .. })
    }

    /// `t` on this device (`t` itself, shallowly, when it is there already).
    pub fn put(self, t: &Tensor) -> Result<Tensor, tch::TchError> {
        match self {
            Device::PrivateUse1 { index, .. } => privateuse1::to_device(t, index),
            _ => t.f_to_device(self.host()),
        }
    }

    /// `data` as a 1-D tensor here.
    pub fn from_slice<T: tch::kind::Element>(self, data: &[T]) -> Result<Tensor, tch::TchError> {
        self.put(&Tensor::f_from_slice(data)?)
    }

    /// Zeros of `shape` and `kind` here.
    pub fn zeros(self, shape: &[i64], kind: Kind) -> Result<Tensor, tch::TchError> {
        self.put(&Tensor::f_zeros(shape, (kind, self.host()))?)
    }

    /// Ones of `shape` and `kind` here.
    pub fn ones(self, shape: &[i64], kind: Kind) -> Result<Tensor, tch::TchError> {
        self.put(&Tensor::f_ones(shape, (kind, self.host()))?)
    }

    /// `0..end` as `kind` here.
    pub fn arange(self, end: i64, kind: Kind) -> Result<Tensor, tch::TchError> {
        self.put(&Tensor::f_arange(end, (kind, self.host()))?)
    }

    /// The `n` x `n` identity as `kind` here.
    pub(crate) fn eye(self, n: i64, kind: Kind) -> Result<Tensor, tch::TchError> {
        self.put(&Tensor::f_eye(n, (kind, self.host()))?)
    }

    /// `t` in host memory, readable from Rust (tch names the CPU, whatever device `t` is on).
    pub fn to_host(t: &Tensor) -> Result<Tensor, tch::TchError> {
        t.f_to_device(tch::Device::Cpu)
    }

    /// Moves the parameter `var` here in place: the var store's handle and every shallow copy
    /// (the layers') see the moved data. On tch's devices this is `set_data`.
    pub(crate) fn move_parameter(self, var: &mut Tensor) -> Result<(), tch::TchError> {
        match self {
            Device::PrivateUse1 { index, .. } => privateuse1::move_into(var, index),
            _ => {
                let moved = tch::no_grad(|| var.f_to_device(self.host()))?;
                var.set_data(&moved);
                Ok(())
            }
        }
    }

    /// The device `t` lives on. tch reports PrivateUse1 tensors as MPS, so MPS is asked of
    /// libtorch itself.
    pub fn of(t: &Tensor) -> Device {
        match t.device() {
            tch::Device::Cpu | tch::Device::Vulkan => Device::Cpu,
            tch::Device::Cuda(i) => Device::Cuda(i),
            tch::Device::Mps => match privateuse1::index_of(t) {
                Some(index) => Device::PrivateUse1 {
                    name: registered_name(),
                    index,
                },
                None => Device::Mps,
            },
        }
    }

    /// The platform whose policies apply. Every PrivateUse1 backend gets Neuron's (static
    /// shapes, `pad_to_multiple_of = auto` = 128, bf16): treetrain's PrivateUse1 support is
    /// built for graph-compiling backends like it.
    pub fn platform(self) -> Platform {
        match self {
            Device::Cpu => Platform::Cpu,
            Device::Cuda(_) => Platform::Cuda,
            Device::Mps => Platform::Mps,
            Device::PrivateUse1 { .. } => Platform::Neuron,
        }
    }
}

/// The registered backend's name (`privateuseone` when libtorch has none).
fn registered_name() -> BackendName {
    let name = privateuse1::registered().ok().flatten().map(|b| b.name);
    BackendName::new(name.as_deref().unwrap_or("privateuseone"))
}

impl From<tch::Device> for Device {
    fn from(d: tch::Device) -> Self {
        match d {
            tch::Device::Cpu | tch::Device::Vulkan => Device::Cpu,
            tch::Device::Cuda(i) => Device::Cuda(i),
            tch::Device::Mps => Device::Mps,
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
            Device::Mps => f.write_str("mps"),
            Device::PrivateUse1 { name, index } => write!(f, "{}:{index}", name.as_str()),
        }
    }
}

impl crate::display::Rich for Device {
    fn html(&self) -> String {
        let platform = self.platform().to_string();
        crate::display::kv_card(
            "Device",
            [
                ("device", self.to_string().as_str()),
                ("policies of", platform.as_str()),
            ],
        )
    }

    fn text(&self) -> String {
        format!("device {self} (policies of {})", self.platform())
    }
}

crate::display::rich_display!(Device);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_kept_inline_and_cut_at_a_character() {
        assert_eq!(BackendName::new("neuron").as_str(), "neuron");
        let long = "é".repeat(20);
        let cut = BackendName::new(&long);
        assert_eq!(cut.as_str(), "é".repeat(12));
        let d = Device::PrivateUse1 {
            name: BackendName::new("neuron"),
            index: 1,
        };
        assert_eq!(d.to_string(), "neuron:1");
        assert_eq!(d.host(), tch::Device::Cpu);
        assert_eq!(d.platform(), Platform::Neuron);
        assert_eq!(Device::Cuda(2).to_string(), "cuda:2");
        use crate::display::Rich;
        assert_eq!(d.text(), "device neuron:1 (policies of neuron)");
        assert!(d.html().contains("<td>neuron:1</td>"), "{}", d.html());
    }

    #[test]
    fn tch_devices_round_trip_and_put_is_a_no_op_there() {
        let t = Tensor::from_slice(&[1f32, 2.0]);
        assert_eq!(Device::of(&t), Device::Cpu);
        let same = Device::Cpu.put(&t).unwrap();
        assert_eq!(Vec::<f32>::try_from(&same).unwrap(), vec![1.0, 2.0]);
        assert_eq!(Device::from(tch::Device::Cuda(3)), Device::Cuda(3));
        let mut var = Tensor::zeros([2], (tch::Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
        Device::Cpu.move_parameter(&mut var).unwrap();
        assert!(var.requires_grad());
    }
}
