//! Which scaled-dot-product-attention kernel libtorch picks for each kind of call the model
//! makes: the kernel decides what a long tree costs on a GPU (flash and cuDNN stream keys; the
//! math kernel materialises every score), and it changes with the device, dtype, head shape and
//! whether a mask is given, so it is asked of libtorch (`_fused_sdp_choice`), not assumed.

use tch::{Kind, Tensor};

use super::config::ModelConfig;
use super::layout::{BATCHED_MAX_KEYS, QUERY_BLOCK};
use crate::device::Device;

/// A kernel of libtorch's SDPA dispatcher (`sdp::SDPBackend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SdpaKernel {
    /// The composite implementation: every score materialised.
    Math,
    /// FlashAttention.
    Flash,
    /// Memory-efficient attention (xFormers' kernel).
    Efficient,
    /// cuDNN's fused attention.
    Cudnn,
    /// A backend registered by an out-of-tree device (PrivateUse1).
    Overrideable,
    /// A code this libtorch returned that the list above lacks (or an error, -1).
    Other(i64),
}

impl SdpaKernel {
    /// From `_fused_sdp_choice`'s code.
    pub(crate) fn from_code(code: i64) -> Self {
        match code {
            0 => SdpaKernel::Math,
            1 => SdpaKernel::Flash,
            2 => SdpaKernel::Efficient,
            3 => SdpaKernel::Cudnn,
            4 => SdpaKernel::Overrideable,
            c => SdpaKernel::Other(c),
        }
    }

    /// The name PyTorch gives it (`torch.nn.attention.SDPBackend`).
    pub fn name(self) -> String {
        match self {
            SdpaKernel::Math => "math".into(),
            SdpaKernel::Flash => "flash_attention".into(),
            SdpaKernel::Efficient => "efficient_attention".into(),
            SdpaKernel::Cudnn => "cudnn_attention".into(),
            SdpaKernel::Overrideable => "overrideable".into(),
            SdpaKernel::Other(c) => format!("code {c}"),
        }
    }
}

/// The kinds of SDPA call the model's forwards make.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionCall {
    /// A causal row or a segment that starts its own path (training and scoring): no mask,
    /// keys at `kv_heads`.
    Causal,
    /// A block of queries continuing a long path (a tree's branch): a bottom-right mask.
    PathBlock,
    /// Short segments padded into one call: a mask per segment.
    SegmentBatch,
    /// One generated token per row over a KV cache: a slot mask, keys at `kv_heads`.
    Decode,
}

impl AttentionCall {
    /// Every kind, in the order a report lists them.
    pub const ALL: [AttentionCall; 4] = [
        AttentionCall::Causal,
        AttentionCall::PathBlock,
        AttentionCall::SegmentBatch,
        AttentionCall::Decode,
    ];

    /// Snake-case name for reports.
    pub fn name(self) -> &'static str {
        match self {
            AttentionCall::Causal => "causal",
            AttentionCall::PathBlock => "path_block",
            AttentionCall::SegmentBatch => "segment_batch",
            AttentionCall::Decode => "decode",
        }
    }

    /// `(batch, queries, keys, masked, training)` of a representative call.
    fn shape(self) -> (i64, i64, i64, bool, bool) {
        match self {
            AttentionCall::Causal => (1, 2048, 2048, false, true),
            AttentionCall::PathBlock => (1, QUERY_BLOCK, 2048 + QUERY_BLOCK, true, true),
            AttentionCall::SegmentBatch => (8, 16, BATCHED_MAX_KEYS, true, true),
            AttentionCall::Decode => (8, 1, 1024, true, false),
        }
    }
}

/// The kernel libtorch picks for each [`AttentionCall`] of a model of `cfg` on `device` in
/// `kind`, with keys grouped as the model's attention groups them (the decode over a cache
/// always at `kv_heads`).
pub fn sdpa_kernels(
    cfg: &ModelConfig,
    device: Device,
    kind: Kind,
) -> Result<Vec<(AttentionCall, SdpaKernel)>, tch::TchError> {
    let (h, kv, d) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
    AttentionCall::ALL
        .iter()
        .map(|&call| {
            let (b, q_len, k_len, masked, training) = call.shape();
            let make = |heads: i64, len: i64| -> Result<Tensor, tch::TchError> {
                Ok(device.zeros(&[b, heads, len, d], kind)?.set_requires_grad(training))
            };
            // A masked training call on a device that folds the query heads into the query
            // length (every device but the CPU: `super::gqa`) asks for `rep * q_len` queries at `kv_heads`, ungrouped.
            let folded = masked && training && h != kv && device != Device::Cpu;
            let (q_heads, q_rows, gqa) = match folded {
                true => (kv, q_len * (h / kv), false),
                false => (h, q_len, h != kv),
            };
            let q = make(q_heads, q_rows)?;
            let (k, v) = (make(kv, k_len)?, make(kv, k_len)?);
            let mask = match masked {
                true => Some(device.ones(&[b, 1, q_rows, k_len], Kind::Bool)?.f_tril(k_len - q_len)?),
                false => None,
            };
            let scale = (d as f64).powf(-0.5);
            let code = Tensor::f_internal_fused_sdp_choice(&q, &k, &v, mask.as_ref(), 0.0, !masked, scale, gqa)?;
            Ok((call, SdpaKernel::from_code(code)))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// libtorch's CPU flash kernel takes masks and grouped heads, so every call kind of a GQA
    /// model gets it in fp32; the codes round-trip.
    #[test]
    fn cpu_picks_flash_for_every_call_kind() {
        let hf: crate::model::HfConfig = serde_json::from_value(serde_json::json!({
            "model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 8, "max_position_embeddings": 4096
        }))
        .unwrap();
        let cfg = hf.validate().unwrap();
        let got = sdpa_kernels(&cfg, Device::Cpu, Kind::Float).unwrap();
        assert_eq!(got.len(), AttentionCall::ALL.len());
        for (call, kernel) in got {
            assert_eq!(kernel, SdpaKernel::Flash, "{}", call.name());
        }
        assert_eq!(SdpaKernel::from_code(3).name(), "cudnn_attention");
        assert_eq!(SdpaKernel::from_code(9), SdpaKernel::Other(9));
    }
}
