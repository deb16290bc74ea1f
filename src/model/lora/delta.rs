//! What a wrapped layer adds to its output: `scale * B (A (dropout(x)))`, and the dropout
//! masks, drawn on the tensor's device from a seeded counter (no global generator, so a run
//! resumes with the same masks).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tch::{Kind, Tensor};

/// The dropout of one adapter, shared by all its layers: probability, seed, whether the model
/// is training, and how many masks were drawn (saved with checkpoints).
#[derive(Debug)]
pub(crate) struct DropoutStream {
    p: f64,
    seed: u64,
    training: AtomicBool,
    draws: AtomicU64,
}

impl DropoutStream {
    /// Dropout with probability `p`, masks keyed by `seed` and the draw count.
    pub(crate) fn new(p: f64, seed: u64) -> Self {
        DropoutStream {
            p,
            seed,
            training: AtomicBool::new(false),
            draws: AtomicU64::new(0),
        }
    }

    /// Dropout applies only while training (evaluation and generation see the whole input).
    pub(crate) fn set_training(&self, training: bool) {
        self.training.store(training, Ordering::Relaxed);
    }

    /// Masks drawn so far.
    pub(crate) fn draws(&self) -> u64 {
        self.draws.load(Ordering::Relaxed)
    }

    /// Continues the stream after `draws` masks (resuming a run).
    pub(crate) fn set_draws(&self, draws: u64) {
        self.draws.store(draws, Ordering::Relaxed);
    }

    /// `x` with each element zeroed with probability `p` and the rest scaled by `1 / (1 - p)`
    /// (`nn.Dropout`); `x` itself when not training or `p = 0`.
    pub(crate) fn apply(&self, x: &Tensor) -> Tensor {
        if self.p == 0.0 || !self.training.load(Ordering::Relaxed) {
            return x.shallow_clone();
        }
        let draw = self.draws.fetch_add(1, Ordering::Relaxed);
        let key = crate::util::SplitMix64::new(self.seed ^ draw.wrapping_mul(0xD1B5_4A32_D192_ED03)).next_u64();
        let keep = uniform_like(x, key).ge(self.p).to_kind(x.kind());
        x * keep / (1.0 - self.p)
    }
}

/// Logical right shift of int64 values (torch's `>>` is arithmetic).
fn shr(z: &Tensor, k: i64) -> Tensor {
    z.bitwise_right_shift_tensor_scalar(k)
        .bitwise_and((1i64 << (64 - k)) - 1)
}

/// Uniform values in `[0, 1)` shaped like `x`, on its device: SplitMix64's finaliser applied to
/// `key + index * golden` in wrapping int64 arithmetic, top 24 bits.
fn uniform_like(x: &Tensor, key: u64) -> Tensor {
    // 0..n on x's own device, without naming it (tch cannot name a PrivateUse1 device).
    let idx = x.ones_like().to_kind(Kind::Int64).view([-1]).cumsum(0, Kind::Int64) - 1;
    let mut z = idx * (0x9E37_79B9_7F4A_7C15u64 as i64) + (key as i64);
    z = z.bitwise_xor_tensor(&shr(&z, 30)) * (0xBF58_476D_1CE4_E5B9u64 as i64);
    z = z.bitwise_xor_tensor(&shr(&z, 27)) * (0x94D0_49BB_1331_11EBu64 as i64);
    z = z.bitwise_xor_tensor(&shr(&z, 31));
    (shr(&z, 40).to_kind(Kind::Float) / (1u64 << 24) as f64).view(x.size().as_slice())
}

/// The adapter of one wrapped linear layer.
#[derive(Debug)]
pub struct LoraDelta {
    /// `lora_A.weight` `[r, in]` (f32, as PEFT keeps adapters by default).
    pub lora_a: Tensor,
    /// `lora_B.weight` `[out, r]` (f32).
    pub lora_b: Tensor,
    /// `lora_alpha / r` (rsLoRA: `/ sqrt(r)`).
    pub scale: f64,
    /// Folded into the base weight: the forward adds nothing more.
    pub merged: bool,
    pub(crate) dropout: Arc<DropoutStream>,
}

impl LoraDelta {
    /// `scale * B (A (dropout(x)))` for `x` `[..., in]`, computed in f32 and returned in `x`'s
    /// dtype; `None` once merged.
    pub fn forward(&self, x: &Tensor) -> Option<Tensor> {
        if self.merged {
            return None;
        }
        let h = self.dropout.apply(x).to_kind(Kind::Float);
        let out = h
            .linear::<Tensor>(&self.lora_a, None)
            .linear::<Tensor>(&self.lora_b, None)
            * self.scale;
        Some(out.to_kind(x.kind()))
    }

    /// `scale * B A` `[out, in]` in f32: what merging adds to the base weight.
    pub(crate) fn delta_weight(&self) -> Tensor {
        self.lora_b.matmul(&self.lora_a) * self.scale
    }
}
