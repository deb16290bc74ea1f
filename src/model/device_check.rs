//! The device self-check: before work on a device other than the CPU, a few primitive ops and
//! a tiny seeded decoder's forward and backward run there and on the CPU and must agree. An
//! early backend (a PrivateUse1 plugin such as TorchNeuron's, or a broken CUDA install) that
//! lacks a kernel or falls back wrongly then fails here, naming the first op that differs,
//! instead of training on garbage. The same code checks CUDA and PrivateUse1 devices; it takes
//! milliseconds. `TREETRAIN_DEVICE_CHECK=0` skips it; `treetrain env --check-device DEVICE`
//! runs it alone.

use tch::{Kind, Tensor};

use super::config::HfConfig;
use super::error::ModelError;
use super::layout::AttentionLayout;
use super::loaded::{LoadOptions, Model};
use crate::device::Device;
use crate::util::SplitMix64;

/// The environment variable that turns the automatic check off (`0`).
pub const DEVICE_CHECK_ENV: &str = "TREETRAIN_DEVICE_CHECK";

/// Largest difference from the CPU accepted (fp32 on both sides; reductions may be ordered
/// differently on the device).
const TOLERANCE: f64 = 1e-4;

/// What a passed check compared.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceCheck {
    /// The device checked.
    pub device: String,
    /// Each op and its largest absolute difference from the CPU.
    pub ops: Vec<(&'static str, f64)>,
}

type Op = fn(&[Tensor]) -> Result<Tensor, tch::TchError>;

/// The primitive ops, in the order a failure is looked for.
const OPS: [(&str, Op); 7] = [
    ("a copy to the device and back", |x| copy(&x[0])),
    ("view (an in-place write through a view reaches its base)", |x| {
        let base = copy(&x[0])?;
        // A tensor source, not a scalar: tch turns a failed op with a scalar into a panic.
        base.f_view([-1])?.f_narrow(0, 0, 5)?.f_copy_(&x[3])?;
        Ok(base)
    }),
    ("mm", |x| x[0].f_mm(&x[1])),
    ("softmax", |x| x[0].f_softmax(-1, Kind::Float)),
    ("index_select", |x| x[0].f_index_select(0, &x[2])),
    ("cat", |x| Tensor::f_cat(&[&x[0], &x[1].f_tr()?], 0)),
    ("transpose then contiguous", |x| x[0].f_transpose(0, 1)?.f_contiguous()),
];

/// A new tensor holding `x`'s values (on `x`'s device).
fn copy(x: &Tensor) -> Result<Tensor, tch::TchError> {
    let mut y = x.f_empty_like()?;
    y.f_copy_(x)?;
    Ok(y)
}

/// Runs the self-check on `device` (the CPU passes at once).
pub fn check_device(device: Device) -> Result<DeviceCheck, ModelError> {
    let mut report = DeviceCheck {
        device: device.to_string(),
        ops: Vec::new(),
    };
    if device == Device::Cpu {
        return Ok(report);
    }
    let inputs = [
        seeded(&[8, 8], 1),
        seeded(&[8, 8], 2),
        Tensor::from_slice(&[3i64, 0, 7, 3]),
        Tensor::from_slice(&[7.0f32; 5]),
    ];
    let on_device: Vec<Tensor> = inputs.iter().map(|t| device.put(t)).collect::<Result<_, _>>()?;
    for (name, op) in OPS {
        let run = crate::device::privateuse1::checked(device, || -> Result<Tensor, ModelError> {
            Ok(Device::to_host(&op(&on_device)?)?)
        });
        let got = run.map_err(|e| failed(device, name, &e.to_string()))?;
        report.ops.push((name, compare(device, name, &op(&inputs)?, &got)?));
    }
    let (cpu_lp, cpu_grads) = decoder_run(Device::Cpu)?;
    let (lp, grads) = crate::device::privateuse1::checked(device, || decoder_run(device))
        .map_err(|e| failed(device, "a tiny decoder's forward and backward", &e.to_string()))?;
    report.ops.push((
        "a tiny decoder's forward (log-probs)",
        compare(device, "forward", &cpu_lp, &lp)?,
    ));
    let mut worst = 0.0f64;
    for ((name, a), (_, b)) in cpu_grads.iter().zip(&grads) {
        worst = worst.max(compare(device, &format!("backward (the gradient of `{name}`)"), a, b)?);
    }
    report.ops.push(("its backward (every gradient)", worst));
    Ok(report)
}

/// Whether the automatic check runs (unless `TREETRAIN_DEVICE_CHECK=0`).
pub(crate) fn device_check_enabled() -> bool {
    std::env::var(DEVICE_CHECK_ENV).map_or(true, |v| v != "0")
}

/// A tiny Qwen3 with seeded weights on `device`: the log-probs of a fixed row and, after their
/// sum's backward, every parameter's gradient (by name), all copied to the host.
fn decoder_run(device: Device) -> Result<(Tensor, Vec<(String, Tensor)>), ModelError> {
    let config: HfConfig = serde_json::from_value(serde_json::json!({
        "model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
    }))
    .map_err(|e| ModelError::Input(e.to_string()))?;
    let options = LoadOptions {
        dtype: Some(Kind::Float),
        device,
    };
    let mut model = Model::declare(config, options)?;
    let mut vars: Vec<(String, Tensor)> = model.vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    tch::no_grad(|| -> Result<(), ModelError> {
        for (i, (_, v)) in vars.iter().enumerate() {
            v.shallow_clone().f_copy_(&(seeded(&v.size(), 100 + i as u64) * 0.2))?;
        }
        Ok(())
    })?;
    model.finish(device)?;
    let ids: Vec<i64> = (0..12).map(|i| (i * 7 + 3) % 64).collect();
    let input = device.put(&Tensor::from_slice(&ids[..11]).f_view([1, 11])?)?;
    let positions = device.put(&Tensor::arange(11, (Kind::Int64, tch::Device::Cpu)).f_view([1, 11])?)?;
    let targets = device.put(&Tensor::from_slice(&ids[1..]).f_view([1, 11, 1])?)?;
    let logits = model.lm.forward(&input, &positions, &AttentionLayout::Causal)?;
    let lp = logits.f_log_softmax(-1, Kind::Float)?.f_gather(2, &targets, false)?;
    lp.f_sum(Kind::Float)?.f_backward()?;
    let grads = vars
        .iter()
        .map(|(name, v)| Ok((name.clone(), Device::to_host(&v.f_grad()?)?)))
        .collect::<Result<_, ModelError>>()?;
    Ok((Device::to_host(&lp)?, grads))
}

/// The largest difference of `got` (from the device) from `want` (the CPU's), or the error.
fn compare(device: Device, name: &str, want: &Tensor, got: &Tensor) -> Result<f64, ModelError> {
    if want.size() != got.size() {
        return Err(failed(
            device,
            name,
            &format!("shape {:?}, the CPU's {:?}", got.size(), want.size()),
        ));
    }
    let diff = (got.f_to_kind(Kind::Double)? - want.f_to_kind(Kind::Double)?).f_abs()?;
    let worst = match diff.numel() {
        0 => 0.0,
        _ => diff.f_max()?.double_value(&[]),
    };
    let scale = want
        .f_to_kind(Kind::Double)?
        .f_abs()?
        .f_max()?
        .double_value(&[])
        .max(1.0);
    match worst.is_finite() && worst <= TOLERANCE * scale {
        true => Ok(worst),
        false => Err(failed(device, name, &format!("differs from the CPU by {worst:.3e}"))),
    }
}

fn failed(device: Device, op: &str, detail: &str) -> ModelError {
    ModelError::DeviceCheck {
        device: device.to_string(),
        op: op.into(),
        detail: detail.lines().next().unwrap_or_default().into(),
    }
}

/// Values in [-1, 1) from a seeded stream, on the host.
fn seeded(shape: &[i64], seed: u64) -> Tensor {
    let n: i64 = shape.iter().product();
    let mut rng = SplitMix64::new(seed);
    let values: Vec<f32> = (0..n).map(|_| (rng.next_f64() * 2.0 - 1.0) as f32).collect();
    Tensor::from_slice(&values).view(shape)
}

impl crate::display::Rich for DeviceCheck {
    fn html(&self) -> String {
        let rows: Vec<Vec<String>> = self
            .ops
            .iter()
            .map(|(op, d)| vec![crate::display::escape(op), format!("{d:.1e}")])
            .collect();
        crate::display::style::container(&crate::display::section(
            &format!("Device self-check of {}: passed", self.device),
            &crate::display::table(&["op", "largest difference from the CPU"], &rows),
        ))
    }
    fn text(&self) -> String {
        let mut s = format!("device self-check of {}: passed\n", self.device);
        for (op, d) in &self.ops {
            s.push_str(&format!("  {op}: {d:.1e}\n"));
        }
        s
    }
}

crate::display::rich_display!(DeviceCheck);
