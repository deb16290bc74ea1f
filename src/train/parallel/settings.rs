//! The sharding settings of both trainers: `fsdp` and `fsdp_config`, spelled as transformers'
//! `TrainingArguments`.

/// The `fsdp` setting of both trainers, spelled as transformers' `TrainingArguments.fsdp`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fsdp {
    /// Replicated data parallelism: every rank holds the parameters, gradients and optimizer
    /// state whole (DDP).
    #[default]
    NoShard,
    /// ZeRO-2: gradients reduce-scattered, fp32 master weights and AdamW moments sharded,
    /// parameters replicated.
    ShardGradOp,
    /// ZeRO-3: parameters sharded as well, gathered layer by layer around their uses.
    FullShard,
}

impl Fsdp {
    /// The name as written in a config.
    pub fn name(self) -> &'static str {
        match self {
            Fsdp::NoShard => "no_shard",
            Fsdp::ShardGradOp => "shard_grad_op",
            Fsdp::FullShard => "full_shard",
        }
    }
}

/// `fsdp_config`: the options of transformers' `fsdp_config` that `full_shard` reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FsdpConfig {
    /// Start the next layer's all-gather before the current layer's forward (default on, as
    /// PyTorch's FSDP2 does; transformers' FSDP1 default is off).
    pub forward_prefetch: bool,
    /// When the backward starts gathering the layer it back-propagates next.
    pub backward_prefetch: BackwardPrefetch,
}

impl Default for FsdpConfig {
    fn default() -> Self {
        FsdpConfig {
            forward_prefetch: true,
            backward_prefetch: BackwardPrefetch::BackwardPre,
        }
    }
}

/// FSDP's `backward_prefetch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BackwardPrefetch {
    /// Before the current layer's gradients are computed (most overlap, two layers whole).
    #[default]
    BackwardPre,
    /// After them, before their reduction.
    BackwardPost,
    /// Each layer gathered when its backward starts.
    NoPrefetch,
}

impl FsdpConfig {
    /// Whether a gather offered at `phase` is started early.
    pub(crate) fn prefetches(&self, phase: crate::model::Phase) -> bool {
        use crate::model::Phase;
        match phase {
            Phase::Forward => self.forward_prefetch,
            Phase::BackwardPre => self.backward_prefetch == BackwardPrefetch::BackwardPre,
            Phase::BackwardPost => self.backward_prefetch == BackwardPrefetch::BackwardPost,
        }
    }
}
