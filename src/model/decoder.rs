//! The decoder stack and the causal-LM head.

use tch::{Kind, Tensor, nn};

use crate::device::Device;

use super::attention::{Attention, KeyValues};
use super::cache::KvCache;
use super::config::ModelConfig;
use super::cpu_kernels::CpuOps;
use super::error::ModelError;
use super::feed_forward::FeedForward;
use super::hooks::ParamUnit;
use super::layers::{Linear, RmsNorm};
use super::layout::AttentionLayout;
use super::moe::Routing;
use super::rope;

/// `model.layers.{i}`: pre-norm attention and MLP with residuals.
#[derive(Debug)]
pub struct DecoderLayer {
    /// `self_attn`.
    pub self_attn: Attention,
    /// `mlp`: dense or a mixture of experts.
    pub mlp: FeedForward,
    /// Norm before attention.
    pub input_layernorm: RmsNorm,
    /// Norm before the MLP.
    pub post_attention_layernorm: RmsNorm,
}

impl DecoderLayer {
    /// Declares the parameters of layer `index` under `path`.
    pub fn new(path: nn::Path, cfg: &ModelConfig, index: usize) -> Self {
        DecoderLayer {
            self_attn: Attention::new(&path / "self_attn", cfg),
            mlp: FeedForward::new(&path / "mlp", cfg, index),
            input_layernorm: RmsNorm::new(&path / "input_layernorm", cfg.hidden_size, cfg.rms_norm_eps),
            post_attention_layernorm: RmsNorm::new(
                &path / "post_attention_layernorm",
                cfg.hidden_size,
                cfg.rms_norm_eps,
            ),
        }
    }

    /// The same base tensors (shared, not copied) without adapters.
    pub fn base_view(&self) -> DecoderLayer {
        DecoderLayer {
            self_attn: self.self_attn.base_view(),
            mlp: self.mlp.base_view(),
            input_layernorm: self.input_layernorm.base_view(),
            post_attention_layernorm: self.post_attention_layernorm.base_view(),
        }
    }

    /// `x` `[batch, seq, hidden]` -> `[batch, seq, hidden]`; this is layer `index` of the
    /// stack, attending over `kv`.
    pub fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        index: usize,
        kv: &mut KeyValues<'_>,
    ) -> Result<Tensor, ModelError> {
        Ok(self.forward_routed(x, cos, sin, index, kv)?.0)
    }

    /// [`DecoderLayer::forward`], with the routing of a sparse layer.
    pub fn forward_routed(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        index: usize,
        kv: &mut KeyValues<'_>,
    ) -> Result<(Tensor, Option<Routing>), ModelError> {
        let ops = kv.cpu_ops();
        // 1. Pre-norm attention with its residual.
        let h = x + self
            .self_attn
            .forward(&self.input_layernorm.forward_with(x, ops), cos, sin, index, kv)?;
        // 2. Pre-norm feed-forward (dense or routed) with its residual.
        let (out, routing) = self
            .mlp
            .forward_with(&self.post_attention_layernorm.forward_with(&h, ops), ops)?;
        Ok((h + out, routing))
    }
}

/// A decoder-only causal language model (Qwen3, Qwen2, Llama) whose parameters live in a
/// [`nn::VarStore`] under their PyTorch `state_dict` names.
#[derive(Debug)]
pub struct CausalLm {
    /// The validated config.
    pub config: ModelConfig,
    /// `model.embed_tokens.weight` `[vocab, hidden]`.
    pub embed_tokens: Tensor,
    /// `model.layers`.
    pub layers: Vec<DecoderLayer>,
    /// `model.norm`.
    pub norm: RmsNorm,
    /// `lm_head` (None when tied to the embedding).
    pub lm_head: Option<Linear>,
    inv_freq: Tensor,
    device: Device,
    /// What a parallel strategy does around each unit's use (none by default).
    pub(crate) hooks: super::PassHooks,
}

impl CausalLm {
    /// Declares every parameter in `vs` (zero-initialised; load or initialise them next).
    pub fn new(vs: &nn::VarStore, config: ModelConfig) -> Self {
        let root = vs.root();
        let model = &root / "model";
        let embed_tokens =
            (&model / "embed_tokens").var("weight", &[config.vocab_size, config.hidden_size], nn::Init::Const(0.0));
        let layers = (0..config.num_layers)
            .map(|i| DecoderLayer::new(&model / "layers" / i, &config, i as usize))
            .collect();
        let norm = RmsNorm::new(&model / "norm", config.hidden_size, config.rms_norm_eps);
        let lm_head = (!config.tie_word_embeddings)
            .then(|| Linear::new(&root / "lm_head", config.hidden_size, config.vocab_size, false));
        let inv_freq = rope::inv_freq(&config, vs.device());
        CausalLm {
            config,
            embed_tokens,
            layers,
            norm,
            lm_head,
            inv_freq,
            device: vs.device().into(),
            hooks: Default::default(),
        }
    }

    /// Moves every parameter of `vs` (this model's var store) and the RoPE table to `device`,
    /// in place: the handles the layers hold see the moved tensors. Called before
    /// [`CausalLm::tie_fused`], which ties buffers on the final device.
    pub(crate) fn place(&mut self, vs: &nn::VarStore, device: Device) -> Result<(), ModelError> {
        for (_, mut var) in vs.variables() {
            device.move_parameter(&mut var)?;
        }
        self.inv_freq = device.put(&self.inv_freq)?;
        self.device = device;
        Ok(())
    }

    /// Ties every layer's q/k/v and gate/up weights into shared buffers (see
    /// `model::projection`): called once the parameters have their final dtype and device.
    pub(crate) fn tie_fused(&mut self) -> Result<(), ModelError> {
        for layer in &mut self.layers {
            layer.self_attn.qkv.tie()?;
            layer.mlp.tie()?;
        }
        Ok(())
    }

    /// The LM head matrix `[vocab, hidden]` (the embedding when tied; a `modules_to_save`
    /// copy when an adapter trains it).
    pub fn lm_head_weight(&self) -> &Tensor {
        self.lm_head
            .as_ref()
            .map_or(&self.embed_tokens, Linear::effective_weight)
    }

    /// The tensors the model holds beside its parameters, by name: RoPE's `inv_freq` (under
    /// transformers' buffer name) and each layer's fused q/k/v and gate/up buffers (weights and
    /// biases). What must live on the model's device with the parameters.
    pub fn buffers(&self) -> Vec<(String, &Tensor)> {
        let mut out = vec![("model.rotary_emb.inv_freq".to_string(), &self.inv_freq)];
        for (i, layer) in self.layers.iter().enumerate() {
            let fused = [
                ("self_attn.qkv", layer.self_attn.qkv.buffers()),
                ("mlp.gate_up", layer.mlp.buffers()),
            ];
            for (name, (weight, bias)) in fused.into_iter().filter_map(|(n, f)| Some((n, f?))) {
                out.push((format!("model.layers.{i}.{name} (fused)"), weight));
                if let Some(b) = bias {
                    out.push((format!("model.layers.{i}.{name} bias (fused)"), b));
                }
            }
        }
        out
    }

    /// Every linear layer under its `state_dict` prefix (`model.layers.0.self_attn.q_proj`,
    /// ..., `lm_head`), in the order of the stack.
    pub(crate) fn linears_mut(&mut self) -> Vec<(String, &mut Linear)> {
        let mut out: Vec<(String, &mut Linear)> = Vec::new();
        for (i, layer) in self.layers.iter_mut().enumerate() {
            for (name, l) in layer.self_attn.linears_mut() {
                out.push((format!("model.layers.{i}.self_attn.{name}"), l));
            }
            for (name, l) in layer.mlp.linears_mut() {
                out.push((format!("model.layers.{i}.mlp.{name}"), l));
            }
        }
        if let Some(head) = self.lm_head.as_mut() {
            out.push(("lm_head".into(), head));
        }
        out
    }

    /// The same model without any adapter, sharing every base tensor (no weights copied): the
    /// reference policy of LoRA training. Callers make sure no adapter is merged into the base.
    pub fn base_view(&self) -> CausalLm {
        CausalLm {
            config: self.config.clone(),
            embed_tokens: self.embed_tokens.shallow_clone(),
            layers: self.layers.iter().map(DecoderLayer::base_view).collect(),
            norm: self.norm.base_view(),
            lm_head: self.lm_head.as_ref().map(Linear::base_view),
            inv_freq: self.inv_freq.shallow_clone(),
            device: self.device,
            // The base a LoRA reference reads is never sharded (only trained units are).
            hooks: Default::default(),
        }
    }

    /// The device the parameters live on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The parameters' dtype.
    pub fn kind(&self) -> Kind {
        self.embed_tokens.kind()
    }

    /// Final hidden states `[batch, seq, hidden]` for `input_ids` and `position_ids`
    /// `[batch, seq]` under `layout`.
    pub fn forward_hidden(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        layout: &AttentionLayout,
    ) -> Result<Tensor, ModelError> {
        let (ids, batch, seq) = self.checked_ids(input_ids, position_ids)?;
        let mask = layout.sdpa_mask(batch, seq, self.device())?;
        self.run_layers(
            &ids,
            position_ids,
            KeyValues::Layout {
                layout,
                mask: mask.as_ref(),
            },
            None,
        )
    }

    /// [`CausalLm::forward_hidden`] with every sparse layer's routing, in layer order (empty
    /// for a dense model): what the load-balancing loss reads
    /// ([`super::moe::load_balancing_loss`]).
    pub fn forward_hidden_routed(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        layout: &AttentionLayout,
    ) -> Result<(Tensor, Vec<Routing>), ModelError> {
        let (ids, batch, seq) = self.checked_ids(input_ids, position_ids)?;
        let mask = layout.sdpa_mask(batch, seq, self.device())?;
        let mut routes = Vec::new();
        let kv = KeyValues::Layout {
            layout,
            mask: mask.as_ref(),
        };
        let hidden = self.run_layers(&ids, position_ids, kv, Some(&mut routes))?;
        Ok((hidden, routes))
    }

    /// `input_ids` `[batch, seq]` on the model's device as int64, checked against
    /// `position_ids`' shape and the vocabulary; with `batch` and `seq`.
    pub(crate) fn checked_ids(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
    ) -> Result<(Tensor, i64, i64), ModelError> {
        let size = input_ids.size();
        let [batch, seq] = size[..] else {
            return Err(ModelError::Input(format!(
                "input_ids must be [batch, seq], got {size:?}"
            )));
        };
        if position_ids.size() != size {
            return Err(ModelError::Input(format!(
                "position_ids has shape {:?}, input_ids {size:?}",
                position_ids.size()
            )));
        }
        let ids = self.device.put(input_ids)?.f_to_kind(Kind::Int64)?;
        let (lo, hi) = (ids.f_min()?.int64_value(&[]), ids.f_max()?.int64_value(&[]));
        if batch * seq > 0 && (lo < 0 || hi >= self.config.vocab_size) {
            return Err(ModelError::Input(format!(
                "token ids must lie in 0..{}, found {}",
                self.config.vocab_size,
                if lo < 0 { lo } else { hi }
            )));
        }
        Ok((ids, batch, seq))
    }

    /// RoPE's `cos`, `sin` `[batch, seq, head_dim]` at `position_ids`.
    pub(crate) fn rope(&self, position_ids: &Tensor) -> Result<(Tensor, Tensor), ModelError> {
        Ok(rope::cos_sin(
            &self.inv_freq,
            &self.device.put(position_ids)?,
            self.kind(),
        ))
    }

    /// The token embeddings of `ids` `[batch, seq]` -> `[batch, seq, hidden]`.
    pub(crate) fn embed(&self, ids: &Tensor) -> Tensor {
        Tensor::embedding(&self.embed_tokens, ids, -1, false, false)
    }

    /// The stack itself: embed `ids` (already validated, on the model's device), every layer
    /// over `kv`, the final norm; sparse layers' routing into `routes` when asked.
    fn run_layers(
        &self,
        ids: &Tensor,
        position_ids: &Tensor,
        mut kv: KeyValues<'_>,
        mut routes: Option<&mut Vec<Routing>>,
    ) -> Result<Tensor, ModelError> {
        let (cos, sin) = self.rope(position_ids)?;
        self.gather(ParamUnit::Root)?;
        let mut x = self.embed(ids);
        for (i, layer) in self.layers.iter().enumerate() {
            self.gather(ParamUnit::Layer(i))?;
            self.prefetch(Some(i + 1), super::Phase::Forward)?;
            let (y, routing) = layer.forward_routed(&x, &cos, &sin, i, &mut kv)?;
            if let (Some(routes), Some(r)) = (routes.as_deref_mut(), routing) {
                routes.push(r);
            }
            x = y;
            self.release(ParamUnit::Layer(i))?;
        }
        Ok(self.norm.forward_with(&x, kv.cpu_ops()))
    }

    /// Final hidden states `[batch, t, hidden]` of a chunk of `t` new tokens continuing what
    /// `cache` holds. `mask` `[batch, 1, t, slots]` (true = attend) covers the cache's key slots
    /// after this chunk is stored ([`KvCache::slots_after`]); the chunk's keys and values are
    /// stored in the cache.
    pub fn forward_cached(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        cache: &mut dyn KvCache,
        mask: &Tensor,
    ) -> Result<Tensor, ModelError> {
        let size = input_ids.size();
        let [batch, t] = size[..] else {
            return Err(ModelError::Input(format!("input_ids must be [batch, t], got {size:?}")));
        };
        let want = [batch, 1, t, cache.slots_after(t)];
        if mask.size() != want {
            return Err(ModelError::Input(format!(
                "cache mask has shape {:?}, expected {want:?}",
                mask.size()
            )));
        }
        let ids = self.device.put(input_ids)?.f_to_kind(Kind::Int64)?;
        let hidden = self.run_layers(
            &ids,
            position_ids,
            KeyValues::Cache {
                cache: &mut *cache,
                mask,
            },
            None,
        )?;
        cache.advance(t);
        Ok(hidden)
    }

    /// Logits `[..., vocab]` of hidden states `[..., hidden]` (full vocabulary: prefer
    /// [`super::logprobs::target_logprobs`] for long inputs).
    pub fn logits(&self, hidden: &Tensor) -> Tensor {
        super::layers::linear(hidden, self.lm_head_weight(), None)
    }

    /// [`CausalLm::logits`] of the hidden states a cached (generation) forward returned,
    /// through the decode kernel where it applies (`super::cpu_kernels`).
    pub fn decode_logits(&self, hidden: &Tensor) -> Tensor {
        super::layers::linear_with(hidden, self.lm_head_weight(), None, CpuOps::Kernels)
    }

    /// Logits `[batch, seq, vocab]` for a forward under `layout`.
    pub fn forward(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        layout: &AttentionLayout,
    ) -> Result<Tensor, ModelError> {
        Ok(self.logits(&self.forward_hidden(input_ids, position_ids, layout)?))
    }
}
