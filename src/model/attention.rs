//! Grouped-query self-attention.

use tch::{Tensor, nn};

use super::cache::KvCache;
use super::config::ModelConfig;
use super::cpu_kernels::{CpuOps, QkvShape, decode_attention, qk_norm_rope};
use super::error::ModelError;
use super::gqa::{attend_masked, grouped_keys};
use super::layers::{Linear, RmsNorm};
use super::layout::{AttentionLayout, KeySource, SegmentLayout};
use super::norm::Norm;
use super::parts::QkNorm;
use super::projection::Projections;
use super::rope;
use super::window::Masked;

/// Where a layer's attention takes its keys and values from.
pub enum KeyValues<'a> {
    /// The forwarded tokens themselves, under a layout and its precomputed SDPA mask.
    Layout {
        /// What full-attention layers read.
        full: Masked<'a>,
        /// What sliding-window layers read (`None` in a model without them).
        sliding: Option<Masked<'a>>,
        /// The routing recorded when these tokens were generated, replayed or compared by the
        /// sparse layers (GRPO's routing replay).
        routing: Option<&'a super::moe::RecordedRouting>,
    },
    /// A KV cache: the chunk's keys and values are stored, then its queries attend over the
    /// cache's slots under `mask` `[batch, 1, t, slots]`.
    Cache {
        /// The cache.
        cache: &'a mut dyn KvCache,
        /// Which slots each query sees.
        mask: &'a Tensor,
        /// The same cut to the window, for sliding layers (`None` in a model without them).
        sliding_mask: Option<&'a Tensor>,
    },
}

impl<'a> KeyValues<'a> {
    /// The routing recorded for this forward's tokens, if any.
    pub(crate) fn routing(&self) -> Option<&'a super::moe::RecordedRouting> {
        match self {
            KeyValues::Layout { routing, .. } => *routing,
            KeyValues::Cache { .. } => None,
        }
    }

    /// The CPU ops a forward over these keys and values uses: the decode kernels in cached
    /// (generation) forwards, libtorch's elsewhere (see `super::cpu_kernels`).
    pub(crate) fn cpu_ops(&self) -> CpuOps {
        match self {
            KeyValues::Layout { .. } => CpuOps::Libtorch,
            KeyValues::Cache { .. } => CpuOps::Kernels,
        }
    }
}

/// `self_attn` of one decoder layer.
#[derive(Debug)]
pub struct Attention {
    /// `q_proj` `[heads * head_dim, hidden]`, `k_proj` and `v_proj` `[kv_heads * head_dim,
    /// hidden]`: one product where no graph is built.
    pub qkv: Projections<3>,
    /// `[hidden, heads * head_dim]`.
    pub o_proj: Linear,
    /// Per-head RMSNorm on queries (Qwen3).
    pub q_norm: Option<RmsNorm>,
    /// Per-head RMSNorm on keys (Qwen3).
    pub k_norm: Option<RmsNorm>,
    /// The output gate (Muse Spark): each head's output normed (weightless), times
    /// `sigmoid(gate_proj(x))`, before `o_proj`.
    pub gate: Option<OutputGate>,
    /// Weightless q/k norms, the queries then scaled (Muse Spark): `(eps, query_scale)`.
    weightless_qk: Option<(f64, f64)>,
    /// Whether RoPE rotates q and k on this layer.
    rope: bool,
    /// The sliding window of this layer, if it has one.
    window: Option<i64>,
    num_heads: i64,
    num_kv_heads: i64,
    head_dim: i64,
}

/// `sigmoid(gate_proj(x))` on the normed head outputs.
#[derive(Debug)]
pub struct OutputGate {
    /// `gate_proj` `[heads * head_dim, hidden]`.
    pub gate_proj: Linear,
    /// The weightless per-head norm (`o_norm`).
    pub norm: Norm,
}

impl Attention {
    /// Declares layer `layer`'s `{path}.{q,k,v,o}_proj` (and what its parts add: `q_norm`,
    /// `k_norm`, `gate_proj`).
    pub fn new(path: nn::Path, cfg: &ModelConfig, layer: usize) -> Self {
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let (q, kv) = (cfg.num_heads * d, cfg.num_kv_heads * d);
        let per_head = cfg.parts.qk_norm == QkNorm::PerHead;
        let span = cfg.parts.layers.get(layer).copied();
        Attention {
            gate: cfg.parts.attention_gate.then(|| OutputGate {
                gate_proj: Linear::new(&path / "gate_proj", h, q, false),
                norm: Norm::Weightless { eps: cfg.rms_norm_eps },
            }),
            weightless_qk: match cfg.parts.qk_norm {
                QkNorm::Weightless { query_scale } => Some((cfg.rms_norm_eps, query_scale)),
                _ => None,
            },
            rope: span.is_none_or(|s| s.rope),
            window: span.and_then(|s| s.window),
            qkv: Projections::new(
                ["q_proj", "k_proj", "v_proj"],
                [
                    Linear::new(&path / "q_proj", h, q, cfg.qkv_bias),
                    Linear::new(&path / "k_proj", h, kv, cfg.qkv_bias),
                    Linear::new(&path / "v_proj", h, kv, cfg.qkv_bias),
                ],
            ),
            o_proj: Linear::new(&path / "o_proj", q, h, cfg.o_bias),
            q_norm: per_head.then(|| RmsNorm::new(&path / "q_norm", d, cfg.rms_norm_eps)),
            k_norm: per_head.then(|| RmsNorm::new(&path / "k_norm", d, cfg.rms_norm_eps)),
            num_heads: cfg.num_heads,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: d,
        }
    }

    /// The same base tensors (shared, not copied) without adapters.
    pub fn base_view(&self) -> Attention {
        Attention {
            qkv: self.qkv.base_view(),
            o_proj: self.o_proj.base_view(),
            q_norm: self.q_norm.as_ref().map(RmsNorm::base_view),
            k_norm: self.k_norm.as_ref().map(RmsNorm::base_view),
            gate: self.gate.as_ref().map(|g| OutputGate {
                gate_proj: g.gate_proj.base_view(),
                norm: g.norm.base_view(),
            }),
            weightless_qk: self.weightless_qk,
            rope: self.rope,
            window: self.window,
            num_heads: self.num_heads,
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
        }
    }

    /// `q_proj`.
    pub fn q_proj(&self) -> &Linear {
        &self.qkv.maps()[0]
    }

    /// `k_proj`.
    pub fn k_proj(&self) -> &Linear {
        &self.qkv.maps()[1]
    }

    /// `v_proj`.
    pub fn v_proj(&self) -> &Linear {
        &self.qkv.maps()[2]
    }

    /// The linear layers by name within `self_attn`.
    pub(crate) fn linears_mut(&mut self) -> Vec<(&'static str, &mut Linear)> {
        let [q, k, v] = self.qkv.named_mut();
        let mut out = vec![q, k, v, ("o_proj", &mut self.o_proj)];
        if let Some(g) = &mut self.gate {
            out.push(("gate_proj", &mut g.gate_proj));
        }
        out
    }

    /// The linear layers, in `state_dict` order.
    pub fn linears(&self) -> Vec<&Linear> {
        let [q, k, v] = self.qkv.maps();
        let mut out = vec![q, k, v, &self.o_proj];
        out.extend(self.gate.as_ref().map(|g| &g.gate_proj));
        out
    }

    /// Projects `x` `[batch, seq, hidden]` to `(q, k, v)`, each `[batch, heads, seq, head_dim]`
    /// (k and v with `kv_heads`), rotated by `cos`/`sin` `[batch, seq, head_dim]`; with `ops`.
    pub fn project(&self, x: &Tensor, cos: &Tensor, sin: &Tensor, ops: CpuOps) -> (Tensor, Tensor, Tensor) {
        let (b, t) = (x.size()[0], x.size()[1]);
        // 1. q, k, v: `[b, t, (heads + 2 kv_heads) * d]` as one product where no graph is built.
        let projected = self.qkv.forward(x, ops);
        // 2. The decode kernels norm and rotate that product in place, in one pass (the
        //    layers they know: rotated, with Qwen3's norms or none).
        if let Some(y) = projected.fused().filter(|_| self.rope && self.weightless_qk.is_none())
            && ops.kernel(|| self.norm_rope_in_place(y, cos, sin)).is_some()
        {
            return self.heads_of(y, b, t);
        }
        // 3. Otherwise each map's output `[b, t, heads, d]`, normed per head (Qwen3), rotated.
        //    (Slices of the fused product along its last dimension: reshape is still a view.)
        let [q, k, v] = projected.split();
        let split = |y: Tensor, heads: i64| y.reshape([b, t, heads, self.head_dim]);
        let mut q = split(q, self.num_heads);
        let mut k = split(k, self.num_kv_heads);
        let v = split(v, self.num_kv_heads).transpose(1, 2);
        if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
            q = qn.forward(&q);
            k = kn.forward(&k);
        }
        if let Some((eps, scale)) = self.weightless_qk {
            let norm = Norm::Weightless { eps };
            q = norm.forward(&q) * scale;
            k = norm.forward(&k);
        }
        let (q, k) = (q.transpose(1, 2), k.transpose(1, 2));
        match self.rope {
            true => (rope::apply(&q, cos, sin), rope::apply(&k, cos, sin), v),
            false => (q, k, v),
        }
    }

    /// Norms (where the model has q/k norms) and rotates the q and k heads of the fused product
    /// `y` `[batch, seq, (heads + 2 kv_heads) * head_dim]` in place, in one pass
    /// (`cpu_kernels::qk_norm_rope`); `None`, `y` untouched, where the kernel does not apply.
    fn norm_rope_in_place(&self, y: &Tensor, cos: &Tensor, sin: &Tensor) -> Option<()> {
        let norms = match (&self.q_norm, &self.k_norm) {
            (Some(q), Some(k)) => Some((&q.weight, &k.weight, q.eps())),
            _ => None,
        };
        let shape = QkvShape {
            heads: self.num_heads,
            kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
        };
        qk_norm_rope(y, shape, cos, sin, norms).then_some(())
    }

    /// `(q, k, v)` as [`Attention::project`] returns them, as views of the fused product `y`.
    fn heads_of(&self, y: &Tensor, b: i64, t: i64) -> (Tensor, Tensor, Tensor) {
        let d = self.head_dim;
        let (nq, nkv) = (self.num_heads * d, self.num_kv_heads * d);
        let heads = |start: i64, n: i64, h: i64| y.narrow(-1, start, n).view([b, t, h, d]).transpose(1, 2);
        (
            heads(0, nq, self.num_heads),
            heads(nq, nkv, self.num_kv_heads),
            heads(nq + nkv, nkv, self.num_kv_heads),
        )
    }

    /// Scaled dot-product attention of `q` `[batch, heads, q_len, head_dim]` over `k`, `v`
    /// `[batch, kv_heads or heads, k_len, head_dim]` under `mask` `[batch, 1, q_len, k_len]`
    /// (true = attend; `None` = causal), the heads merged: `[batch, q_len, heads * head_dim]`.
    fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>) -> Tensor {
        let scale = (self.head_dim as f64).powf(-0.5);
        // Grouped-query attention inside the kernel (`enable_gqa`) where keys come at
        // `kv_heads`: repeating the keys and values of a whole KV cache every decode step would
        // copy more than the attention itself reads.
        let gqa = k.size()[1] != q.size()[1];
        let out = Tensor::scaled_dot_product_attention(q, k, v, mask, 0.0, mask.is_none(), scale, gqa);
        let (b, t) = (q.size()[0], q.size()[2]);
        out.transpose(1, 2).reshape([b, t, self.num_heads * self.head_dim])
    }

    /// The merged heads `[..., heads * head_dim]` through the output gate (where the layer has
    /// one, with `x` the attention's input `[..., hidden]`) and `o_proj`: `[..., hidden]`.
    fn output(&self, merged: &Tensor, x: &Tensor, ops: CpuOps) -> Tensor {
        let Some(g) = &self.gate else {
            return self.o_proj.forward_with(merged, ops);
        };
        let size = merged.size();
        let normed = g.norm.forward(&merged.reshape([-1, self.num_heads, self.head_dim]));
        let gated = normed.view(size.as_slice()) * g.gate_proj.forward_with(x, ops).sigmoid();
        self.o_proj.forward_with(&gated, ops)
    }

    /// Self-attention of `x` `[batch, seq, hidden]` for layer `layer`, over the keys and values
    /// `kv` says: the tokens themselves under a layout, or a KV cache this chunk is stored in.
    pub fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        layer: usize,
        kv: &mut KeyValues<'_>,
    ) -> Result<Tensor, ModelError> {
        let ops = kv.cpu_ops();
        let unwindowed = || ModelError::Input(format!("layer {layer} has a sliding window; its masks were not made"));
        // 1. q `[b, heads, t, d]`, k and v `[b, kv_heads, t, d]`, rotated where the layer is.
        let (q, k, v) = self.project(x, cos, sin, ops);
        // 2. Attention under the layout (or its windowed form), or over the cache after
        //    storing this chunk: the heads merged, `[b, t, heads * d]`.
        let (merged, out_ops) = match kv {
            KeyValues::Layout { full, sliding, .. } => {
                let seen = match self.window {
                    Some(_) => sliding.ok_or_else(unwindowed)?,
                    None => *full,
                };
                let merged = match seen.layout {
                    AttentionLayout::Segments(layout) => self.attend_segments(&q, &k, &v, layout),
                    _ => {
                        let (k, _) = self.grouped_keys(&k, seen.mask.is_some());
                        let (v, _) = self.grouped_keys(&v, seen.mask.is_some());
                        self.attend(&q, &k, &v, seen.mask)
                    }
                };
                (merged, CpuOps::Libtorch)
            }
            KeyValues::Cache {
                cache,
                mask,
                sliding_mask,
            } => {
                let mask = match self.window {
                    Some(_) => sliding_mask.ok_or_else(unwindowed)?,
                    None => *mask,
                };
                let (k_all, v_all) = cache.store(layer, &k, &v)?;
                let scale = (self.head_dim as f64).powf(-0.5);
                // The decode kernels' output goes on through them; libtorch's through its own.
                match ops.kernel(|| decode_attention(&q, &k_all, &v_all, mask, scale)) {
                    Some(merged) => (merged, ops),
                    None => (self.attend(&q, &k_all, &v_all, Some(mask)), CpuOps::Libtorch),
                }
            }
        };
        // 3. Through the output gate where the layer has one, and `o_proj`: `[b, t, hidden]`.
        Ok(self.output(&merged, x, out_ops))
    }

    /// Per-segment attention over one row: `q` `[1, heads, n, d]`, `k`, `v`
    /// `[1, kv_heads, n, d]`; each segment's queries see their own key list. The heads merged,
    /// `[1, n, heads * d]`.
    ///
    /// Outputs are collected as token-major rows `[tokens, heads * d]`, the layout `o_proj`
    /// takes, and batched segments gather their queries, keys and values as such rows (dim 0).
    /// Why rows: the backward of a gather adds each gathered slot back into its source, and
    /// libtorch does that per index: along dim 0 of `[n, heads * d]` one contiguous row per
    /// index, along dim 2 of `[1, heads, n, d]` one strided slice per index, which is slower.
    /// A tree gathers its shared prefix once per branch, many key slots per token where flat
    /// packing gathers about one, so this cost weighs more in the tree's update (the GRPO
    /// bench's tree/flat ratio shows it). Keys and values stay at `kv_heads` in every call
    /// ([`super::gqa`]).
    fn attend_segments(&self, q: &Tensor, k: &Tensor, v: &Tensor, layout: &SegmentLayout) -> Tensor {
        let n = q.size()[2];
        let mut rows = self.attend_singles(q, k, v, layout);
        if !layout.batches.is_empty() {
            let token_rows = |t: &Tensor| {
                let heads = t.size()[1];
                t.transpose(1, 2).reshape([n, heads * self.head_dim])
            };
            rows.extend(self.attend_batches(&token_rows(q), &token_rows(k), &token_rows(v), layout));
        }
        let out = Tensor::cat(&rows, 0);
        let out = match &layout.order {
            Some(order) => out.index_select(0, order),
            None => out,
        };
        out.view([1, n, self.num_heads * self.head_dim])
    }

    /// [`grouped_keys`] for this layer's heads.
    fn grouped_keys(&self, t: &Tensor, masked: bool) -> (Tensor, bool) {
        grouped_keys(t, self.num_heads / self.num_kv_heads, masked)
    }

    /// The output rows `[q_len, heads * d]` of every query block of the layout's single
    /// segments, in order: `q` `[1, heads, n, d]`, `k` and `v` `[1, kv_heads, n, d]`.
    fn attend_singles(&self, q: &Tensor, k: &Tensor, v: &Tensor, layout: &SegmentLayout) -> Vec<Tensor> {
        let scale = (self.head_dim as f64).powf(-0.5);
        let gqa = self.num_heads != self.num_kv_heads;
        let mut rows = Vec::new();
        for s in &layout.singles {
            let (ks, vs) = match &s.keys {
                KeySource::Contiguous { start, len } => (k.narrow(2, *start, *len), v.narrow(2, *start, *len)),
                KeySource::Gather(idx) => (k.index_select(2, idx), v.index_select(2, idx)),
            };
            for b in &s.blocks {
                let qs = q.narrow(2, s.q_start + b.q_offset, b.q_len);
                let keys = b.k_len - b.k_start;
                let (kb, vb) = (ks.narrow(2, b.k_start, keys), vs.narrow(2, b.k_start, keys));
                let out = match &b.mask {
                    Some(mask) => attend_masked(&qs, &kb, &vb, mask, scale),
                    None => Tensor::scaled_dot_product_attention(&qs, &kb, &vb, None::<&Tensor>, 0.0, true, scale, gqa),
                };
                rows.push(out.transpose(1, 2).reshape([b.q_len, self.num_heads * self.head_dim]));
            }
        }
        rows
    }

    /// The output rows `[real queries, heads * d]` of each padded batch of the layout, from
    /// token-major `q` `[n, heads * d]`, `k` and `v` `[n, kv_heads * d]`.
    fn attend_batches(&self, q: &Tensor, k: &Tensor, v: &Tensor, layout: &SegmentLayout) -> Vec<Tensor> {
        let scale = (self.head_dim as f64).powf(-0.5);
        let d = self.head_dim;
        layout
            .batches
            .iter()
            .map(|b| {
                // [n, h * d] -> [G * len, h * d] -> [G, h, len, d]
                let gather = |t: &Tensor, index: &Tensor, len: i64| {
                    let heads = t.size()[1] / d;
                    t.index_select(0, index).view([b.groups, len, heads, d]).transpose(1, 2)
                };
                let (keys, values) = (gather(k, &b.k_index, b.k_max), gather(v, &b.k_index, b.k_max));
                let out = attend_masked(&gather(q, &b.q_index, b.q_max), &keys, &values, &b.mask, scale);
                out.transpose(1, 2)
                    .reshape([b.groups * b.q_max, self.num_heads * d])
                    .index_select(0, &b.out_slots)
            })
            .collect()
    }
}
