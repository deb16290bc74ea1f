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
use super::logprobs::LmHead;
use super::moe::Routing;
use super::norm::Norm;
use super::parts::LayerNorms;
use super::recompute::Inputs;
use super::residual::Residual;
use super::rope;
use super::window::LayoutMasks;

/// `model.layers.{i}`: attention and the feed-forward block, each normed before (and in a
/// sandwich layer after) and joined to the residual stream, by the parts the config chose.
#[derive(Debug)]
pub struct DecoderLayer {
    /// `self_attn`.
    pub self_attn: Attention,
    /// `mlp`: dense or a mixture of experts.
    pub mlp: FeedForward,
    /// Norm before attention (`input_layernorm`).
    pub input_layernorm: Norm,
    /// Norm after attention (a sandwich layer's weightless `post_attention_layernorm`).
    pub post_attention_norm: Option<Norm>,
    /// Norm before the MLP: `post_attention_layernorm` in a pre-norm layer,
    /// `pre_feedforward_layernorm` in a sandwich one.
    pub pre_feedforward_norm: Norm,
    /// Norm after the MLP (a sandwich layer's `post_feedforward_layernorm`).
    pub post_feedforward_norm: Option<Norm>,
    /// How attention joins the residual stream (`post_attention_residual_gate`).
    pub attention_residual: Residual,
    /// How the MLP joins it (`post_feedforward_residual_gate`).
    pub feedforward_residual: Residual,
}

impl DecoderLayer {
    /// Declares the parameters of layer `index` under `path`.
    pub fn new(path: nn::Path, cfg: &ModelConfig, index: usize) -> Self {
        let (h, eps, parts) = (cfg.hidden_size, cfg.rms_norm_eps, &cfg.parts);
        let (post_eps, pre_feedforward) = match parts.norms {
            LayerNorms::PreNorm => (eps, "post_attention_layernorm"),
            LayerNorms::Sandwich { post_norm_eps } => (post_norm_eps, "pre_feedforward_layernorm"),
        };
        let ((pre_a, post_a), (pre_f, post_f)) = (parts.norms.kinds(true), parts.norms.kinds(false));
        DecoderLayer {
            self_attn: Attention::new(&path / "self_attn", cfg, index),
            mlp: FeedForward::new(&path / "mlp", cfg, index),
            input_layernorm: Norm::new(pre_a, &path / "input_layernorm", h, eps),
            post_attention_norm: post_a.map(|k| Norm::new(k, &path / "post_attention_layernorm", h, post_eps)),
            pre_feedforward_norm: Norm::new(pre_f, &path / pre_feedforward, h, eps),
            post_feedforward_norm: post_f.map(|k| Norm::new(k, &path / "post_feedforward_layernorm", h, post_eps)),
            attention_residual: Residual::new(&path / "post_attention_residual_gate", h, parts.residual_gate),
            feedforward_residual: Residual::new(&path / "post_feedforward_residual_gate", h, parts.residual_gate),
        }
    }

    /// The same base tensors (shared, not copied) without adapters.
    pub fn base_view(&self) -> DecoderLayer {
        DecoderLayer {
            self_attn: self.self_attn.base_view(),
            mlp: self.mlp.base_view(),
            input_layernorm: self.input_layernorm.base_view(),
            post_attention_norm: self.post_attention_norm.as_ref().map(Norm::base_view),
            pre_feedforward_norm: self.pre_feedforward_norm.base_view(),
            post_feedforward_norm: self.post_feedforward_norm.as_ref().map(Norm::base_view),
            attention_residual: self.attention_residual.base_view(),
            feedforward_residual: self.feedforward_residual.base_view(),
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
        let post = |norm: &Option<Norm>, y: Tensor| match norm {
            Some(n) => n.forward_with(&y, ops),
            None => y,
        };
        // 1. Normed attention (normed after, in a sandwich layer), joined to the residual.
        let a = self
            .self_attn
            .forward(&self.input_layernorm.forward_with(x, ops), cos, sin, index, kv)?;
        let h = self.attention_residual.join(x, &post(&self.post_attention_norm, a));
        // 2. The same for the feed-forward block (dense or routed; to the experts recorded at
        //    generation where they are replayed, and compared with them where recorded).
        let recorded = kv.routing();
        let replayed = recorded.filter(|r| r.replays()).and_then(|r| r.layer(index));
        let (f, routing) = self
            .mlp
            .forward_with(&self.pre_feedforward_norm.forward_with(&h, ops), ops, replayed)?;
        if let (Some(r), Some(routing)) = (recorded, &routing) {
            r.count(index, &routing.experts)?;
        }
        let out = self
            .feedforward_residual
            .join(&h, &post(&self.post_feedforward_norm, f));
        Ok((out, routing))
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
        let model = match config.parts.language_model {
            true => &root / "model" / "language_model",
            false => &root / "model",
        };
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

    /// Where the decoder's parameters sit in the `state_dict`: `model`, or
    /// `model.language_model` in a multimodal checkpoint.
    pub(crate) fn prefix(&self) -> &'static str {
        match self.config.parts.language_model {
            true => "model.language_model",
            false => "model",
        }
    }

    /// The LM head with what wraps its logits: what every log-prob and logit of the model
    /// goes through.
    pub fn head(&self) -> LmHead<'_> {
        LmHead {
            weight: self.lm_head_weight(),
            softcap: self.config.parts.logit_softcap,
        }
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
        let mut out = vec![(format!("{}.rotary_emb.inv_freq", self.prefix()), &self.inv_freq)];
        for (i, layer) in self.layers.iter().enumerate() {
            let fused = [
                ("self_attn.qkv", layer.self_attn.qkv.buffers()),
                ("mlp.gate_up", layer.mlp.buffers()),
            ];
            for (name, (weight, bias)) in fused.into_iter().filter_map(|(n, f)| Some((n, f?))) {
                out.push((format!("{}.layers.{i}.{name} (fused)", self.prefix()), weight));
                if let Some(b) = bias {
                    out.push((format!("{}.layers.{i}.{name} bias (fused)", self.prefix()), b));
                }
            }
        }
        out
    }

    /// Every linear layer under its `state_dict` prefix (`model.layers.0.self_attn.q_proj`,
    /// ..., `lm_head`), in the order of the stack.
    pub(crate) fn linears_mut(&mut self) -> Vec<(String, &mut Linear)> {
        let mut out: Vec<(String, &mut Linear)> = Vec::new();
        let prefix = self.prefix();
        for (i, layer) in self.layers.iter_mut().enumerate() {
            for (name, l) in layer.self_attn.linears_mut() {
                out.push((format!("{prefix}.layers.{i}.self_attn.{name}"), l));
            }
            for (name, l) in layer.mlp.linears_mut() {
                out.push((format!("{prefix}.layers.{i}.mlp.{name}"), l));
            }
        }
        if let Some(head) = self.lm_head.as_mut() {
            out.push(("lm_head".into(), head));
        }
        out
    }

    /// Every sparse layer's experts under their `state_dict` prefix
    /// (`model.layers.1.mlp.experts`), in the order of the stack.
    pub(crate) fn experts_mut(&mut self) -> Vec<(String, &mut super::moe::Experts)> {
        let prefix = self.prefix();
        let mut out = Vec::new();
        for (i, layer) in self.layers.iter_mut().enumerate() {
            if let FeedForward::Sparse(m) = &mut layer.mlp {
                out.push((format!("{prefix}.layers.{i}.mlp.experts"), &mut m.experts));
            }
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
        let masks = self.layout_masks(layout, batch, seq)?;
        self.run_layers(&ids, position_ids, masks.key_values(layout, None), None)
    }

    /// The masks a forward of `[batch, seq]` tokens under `layout` needs, the sliding
    /// layers' included.
    pub(crate) fn layout_masks(
        &self,
        layout: &AttentionLayout,
        batch: i64,
        seq: i64,
    ) -> Result<LayoutMasks, ModelError> {
        LayoutMasks::new(layout, batch, seq, self.device(), self.config.parts.window())
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
        self.forward_hidden_recorded(Inputs {
            input_ids,
            position_ids,
            layout,
            routing: None,
        })
    }

    /// [`CausalLm::forward_hidden_routed`] of `inputs`, with their recorded routing replayed or
    /// compared where they carry one.
    pub(crate) fn forward_hidden_recorded(&self, inputs: Inputs<'_>) -> Result<(Tensor, Vec<Routing>), ModelError> {
        let (ids, batch, seq) = self.checked_ids(inputs.input_ids, inputs.position_ids)?;
        let masks = self.layout_masks(inputs.layout, batch, seq)?;
        let mut routes = Vec::new();
        let kv = masks.key_values(inputs.layout, inputs.routing);
        let hidden = self.run_layers(&ids, inputs.position_ids, kv, Some(&mut routes))?;
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

    /// The token embeddings of `ids` `[batch, seq]` -> `[batch, seq, hidden]`, normed where
    /// the model norms them. The padding id's row gets no gradient, as `nn.Embedding`'s
    /// `padding_idx` (transformers' `pad_token_id`) has it.
    pub(crate) fn embed(&self, ids: &Tensor) -> Tensor {
        // A tower's placeholder (a token the decoder alone never sees with its tower's output)
        // embeds as token 0, as transformers' multimodal model feeds it to its decoder; rows a
        // user gives are refused them before (`ModelConfig::tower_token`).
        let ids = self
            .config
            .parts
            .tower_tokens
            .iter()
            .fold(ids.shallow_clone(), |ids, (_, id)| {
                let at = ids.eq(*id);
                ids.masked_fill(&at, 0)
            });
        let ids = &ids;
        let pad = self
            .config
            .pad_token_id
            .filter(|p| (0..self.config.vocab_size).contains(p))
            .unwrap_or(-1);
        let x = Tensor::embedding(&self.embed_tokens, ids, pad, false, false);
        match self.config.parts.embedding_norm {
            true => Norm::Weightless {
                eps: self.config.rms_norm_eps,
            }
            .forward(&x),
            false => x,
        }
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
        Ok(self
            .forward_cached_routed(input_ids, position_ids, cache, mask, false)?
            .0)
    }

    /// [`CausalLm::forward_cached`], with every sparse layer's routing of the chunk when
    /// `routed` (what the generator records for routing replay).
    pub fn forward_cached_routed(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        cache: &mut dyn KvCache,
        mask: &Tensor,
        routed: bool,
    ) -> Result<(Tensor, Vec<Routing>), ModelError> {
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
        let window = self.config.parts.window();
        let sliding_mask = window.map(|w| super::window::window_mask(mask, w)).transpose()?;
        let mut routes = Vec::new();
        let hidden = self.run_layers(
            &ids,
            position_ids,
            KeyValues::Cache {
                cache: &mut *cache,
                mask,
                sliding_mask: sliding_mask.as_ref(),
            },
            routed.then_some(&mut routes),
        )?;
        cache.advance(t);
        Ok((hidden, routes))
    }

    /// Logits `[..., vocab]` of hidden states `[..., hidden]` (full vocabulary: prefer
    /// [`super::logprobs::target_logprobs`] for long inputs).
    pub fn logits(&self, hidden: &Tensor) -> Tensor {
        let head = self.head();
        match head.softcap {
            None => super::layers::linear(hidden, head.weight, None),
            Some(_) => head.wrap(super::layers::linear(hidden, head.weight, None).to_kind(Kind::Float)),
        }
    }

    /// [`CausalLm::logits`] of the hidden states a cached (generation) forward returned,
    /// through the decode kernel where it applies (`super::cpu_kernels`).
    pub fn decode_logits(&self, hidden: &Tensor) -> Tensor {
        let head = self.head();
        match head.softcap {
            None => super::layers::linear_with(hidden, head.weight, None, CpuOps::Kernels),
            Some(_) => {
                head.wrap(super::layers::linear_with(hidden, head.weight, None, CpuOps::Kernels).to_kind(Kind::Float))
            }
        }
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
