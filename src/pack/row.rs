use tch::{Device, Kind, Tensor};

use crate::model::{AttentionLayout, ModelConfig};

/// One maximal chain of the prefix tree: contiguous packed positions `start..start + len`
/// whose keys/values, with those of its ancestors, are what its queries attend to.
#[derive(Debug, Clone, PartialEq)]
pub struct Segment {
    /// First packed position.
    pub start: usize,
    /// Tokens in the segment.
    pub len: usize,
    /// Parent segment (None for a root).
    pub parent: Option<usize>,
    /// Root-to-segment path length (ancestors' tokens + own).
    pub path_len: usize,
    /// Rollouts passing through the segment.
    pub rollouts: usize,
}

/// How a row was packed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PackKind {
    /// Prefix tree: shared prefixes forwarded once.
    Tree,
    /// Sequence packing: rollouts laid end to end.
    Flat,
}

/// One packed micro-batch row: the data contract of TRL v1.16's tree packing.
///
/// With `N` forwarded tokens, `S` segments, `K` gathered key/value rows and `M` loss terms:
/// - `input_ids`, `position_ids` (`N`): unique tokens in DFS pre-order and their depth (= their
///   position in every rollout containing them).
/// - `shift_labels` (`N`): the token each position predicts where some rollout trains it, else -100.
/// - `tree_kv_index` (`K`): for each segment in order, the packed positions of its root-to-segment
///   path; `tree_cu_seqlens_q` / `tree_cu_seqlens_k` (`S + 1`): segment boundaries in the row and
///   path boundaries in `tree_kv_index`; `tree_max_seqlens`: longest segment, longest path.
/// - `token_index` (`M`): packed position whose hidden state predicts each trained token, rollouts
///   in insertion order, tokens in order; `old_log_probs`, `advantages`, `segment_id` (`M`): the
///   generator log-prob, the rollout's advantage and the rollout's index per loss term. A token
///   trained in several rollouts is several loss terms.
///
/// Attention: segment `s`'s queries see the keys `tree_kv_index[cu_k[s]..cu_k[s+1]]`, causally
/// aligned to the bottom right. Flat packing is the same contract with one segment per rollout.
#[derive(Debug, Clone, PartialEq)]
pub struct PackedRow {
    /// Tree or flat.
    pub kind: PackKind,
    /// `[N]`.
    pub input_ids: Vec<i64>,
    /// `[N]`.
    pub position_ids: Vec<i64>,
    /// `[N]`.
    pub shift_labels: Vec<i64>,
    /// `[K]`.
    pub tree_kv_index: Vec<i64>,
    /// `[S + 1]`.
    pub tree_cu_seqlens_q: Vec<i32>,
    /// `[S + 1]`.
    pub tree_cu_seqlens_k: Vec<i32>,
    /// Longest segment, longest path.
    pub tree_max_seqlens: [i32; 2],
    /// `[M]`.
    pub token_index: Vec<i64>,
    /// `[M]`.
    pub old_log_probs: Vec<f32>,
    /// `[M]`.
    pub advantages: Vec<f32>,
    /// `[M]`.
    pub segment_id: Vec<i64>,
    /// `[S]`, for displays and planning.
    pub segments: Vec<Segment>,
    /// Tokens a flat packing of the same rollouts forwards.
    pub raw_tokens: usize,
    /// Rollouts in the row.
    pub rollouts: usize,
    /// For each rollout, the packed position of each of its tokens.
    pub rollout_positions: Vec<Vec<u32>>,
    /// `[rollouts]`: each rollout's index in the planner's input (the step's rollout order),
    /// what places it in a step-wide micro-batch whatever row it landed in.
    pub sources: Vec<usize>,
}

impl PackedRow {
    /// Forwarded tokens `N`.
    pub fn len(&self) -> usize {
        self.input_ids.len()
    }

    /// Whether the row holds no token.
    pub fn is_empty(&self) -> bool {
        self.input_ids.is_empty()
    }

    /// Flat tokens / forwarded tokens.
    pub fn packing_ratio(&self) -> f64 {
        if self.input_ids.is_empty() {
            1.0
        } else {
            self.raw_tokens as f64 / self.input_ids.len() as f64
        }
    }

    /// Attention score pairs the row costs: per segment `q * k - q * (q - 1) / 2` (causal).
    pub fn attention_pairs(&self) -> u64 {
        self.segments
            .iter()
            .map(|s| {
                let (q, k) = (s.len as u64, s.path_len as u64);
                q * k - q * (q.saturating_sub(1)) / 2
            })
            .sum()
    }

    /// The distinct `(position, target)` pairs of the loss terms: how many rows the LM head
    /// computes for this row (a token trained in several rollouts that share it is one pair).
    pub(crate) fn distinct_terms(&self) -> usize {
        let pairs: std::collections::HashSet<(i64, i64)> =
            self.token_index.iter().copied().zip(self.targets()).collect();
        pairs.len()
    }

    /// Forward FLOPs of the row under `cfg` (backward scales every part alike, so ratios hold
    /// for forward + backward): `2 x` the linear weights per forwarded token (a mixture's router
    /// and chosen experts), `4 x layers x
    /// heads x head_dim` per causal attention pair ([`PackedRow::attention_pairs`]), the LM
    /// head per distinct term pair (`PackedRow::distinct_terms`). Norms, RoPE and the
    /// loss's elementwise work are left out (a few percent at these sizes).
    pub fn forward_flops(&self, cfg: &ModelConfig) -> f64 {
        let (h, layers) = (cfg.hidden_size as f64, cfg.num_layers as f64);
        let q = (cfg.num_heads * cfg.head_dim) as f64;
        let kv = (cfg.num_kv_heads * cfg.head_dim) as f64;
        let per_token = 2.0 * layers * (2.0 * h * q + 2.0 * h * kv + cfg.feed_forward_weights_per_token());
        let per_pair = 4.0 * layers * q;
        let head = 2.0 * h * cfg.vocab_size as f64;
        self.len() as f64 * per_token + self.attention_pairs() as f64 * per_pair + self.distinct_terms() as f64 * head
    }

    /// Per forwarded token `[N]`, the rollouts whose sequence holds it (its segment's).
    pub fn token_rollouts(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.len()];
        for s in &self.segments {
            for w in out.iter_mut().skip(s.start).take(s.len) {
                *w = s.rollouts as f32;
            }
        }
        out
    }

    /// Ancestor-interval form of the mask: query `q` sees key `k` iff
    /// `enter[k] <= enter[q] < leave[k]`. `enter` is the packed position itself.
    pub fn intervals(&self) -> (Vec<i64>, Vec<i64>) {
        let mut end: Vec<usize> = self.segments.iter().map(|s| s.start + s.len).collect();
        for s in (0..self.segments.len()).rev() {
            if let Some(p) = self.segments[s].parent {
                end[p] = end[p].max(end[s]);
            }
        }
        let mut leave = vec![0i64; self.len()];
        for (s, seg) in self.segments.iter().enumerate() {
            for l in &mut leave[seg.start..seg.start + seg.len] {
                *l = end[s] as i64;
            }
        }
        ((0..self.len() as i64).collect(), leave)
    }

    /// The dense boolean mask `[N, N]` (true = query row sees key column), built from the
    /// intervals: the test oracle for [`PackedRow::layout`].
    pub fn dense_mask(&self) -> Tensor {
        let (_, leave) = self.intervals();
        let n = self.len() as i64;
        let q = Tensor::arange(n, (Kind::Int64, Device::Cpu));
        let leave = Tensor::from_slice(&leave);
        let k = q.view([1, n]);
        let qq = q.view([n, 1]);
        k.le_tensor(&qq).logical_and(&qq.lt_tensor(&leave.view([1, n])))
    }

    /// `(input_ids, position_ids)` `[1, N]` and the segment layout for the model's forward.
    pub fn layout(&self, device: crate::device::Device) -> Result<(Tensor, Tensor, AttentionLayout), tch::TchError> {
        let n = self.len() as i64;
        let ids = device.from_slice(&self.input_ids)?.f_view([1, n])?;
        let pos = device.from_slice(&self.position_ids)?.f_view([1, n])?;
        let layout = AttentionLayout::segments(
            self.tree_cu_seqlens_q.iter().map(|&x| i64::from(x)).collect(),
            self.tree_cu_seqlens_k.iter().map(|&x| i64::from(x)).collect(),
            &self.tree_kv_index,
            device,
        )?;
        Ok((ids, pos, layout))
    }

    /// Checks that the fields agree with each other (lengths, boundaries, indices in range), so a
    /// hand-made or edited row fails with a message instead of an index panic in the forward.
    pub fn check(&self) -> Result<(), String> {
        let (n, m) = (self.len(), self.token_index.len());
        if self.position_ids.len() != n || self.shift_labels.len() != n {
            return Err(format!(
                "{} position_ids and {} shift_labels for {n} input_ids",
                self.position_ids.len(),
                self.shift_labels.len()
            ));
        }
        if self.old_log_probs.len() != m || self.advantages.len() != m || self.segment_id.len() != m {
            return Err(format!(
                "{} old_log_probs, {} advantages and {} segment_id for {m} loss terms",
                self.old_log_probs.len(),
                self.advantages.len(),
                self.segment_id.len()
            ));
        }
        let bounds = |name: &str, cu: &[i32], end: usize| -> Result<(), String> {
            let ok = cu.first() == Some(&0)
                && cu.last().is_some_and(|&e| e as usize == end)
                && cu.windows(2).all(|w| w[0] <= w[1]);
            if ok {
                Ok(())
            } else {
                Err(format!("{name} must rise from 0 to {end}"))
            }
        };
        bounds("tree_cu_seqlens_q", &self.tree_cu_seqlens_q, n)?;
        bounds("tree_cu_seqlens_k", &self.tree_cu_seqlens_k, self.tree_kv_index.len())?;
        if self.tree_cu_seqlens_q.len() != self.tree_cu_seqlens_k.len() {
            return Err("tree_cu_seqlens_q and tree_cu_seqlens_k differ in length".into());
        }
        for (name, v) in [
            ("tree_kv_index", &self.tree_kv_index),
            ("token_index", &self.token_index),
        ] {
            if let Some(p) = v.iter().find(|&&p| p < 0 || p as usize >= n) {
                return Err(format!("{name} holds {p}, outside 0..{n}"));
            }
        }
        if let Some(s) = self.segment_id.iter().find(|&&s| s < 0 || s as usize >= self.rollouts) {
            return Err(format!("segment_id {s} but the row holds {} rollouts", self.rollouts));
        }
        Ok(())
    }

    /// Targets of the loss terms `[M]`: the label at each term's position.
    pub fn targets(&self) -> Vec<i64> {
        self.token_index
            .iter()
            .map(|&p| self.shift_labels[p as usize])
            .collect()
    }

    /// The row as TRL names its fields (plain lists), for `treetrain pack`.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "shift_labels": self.shift_labels,
            "tree_kv_index": self.tree_kv_index,
            "tree_cu_seqlens_q": self.tree_cu_seqlens_q,
            "tree_cu_seqlens_k": self.tree_cu_seqlens_k,
            "tree_max_seqlens": self.tree_max_seqlens,
            "token_index": self.token_index,
            "old_log_probs": self.old_log_probs,
            "advantages": self.advantages,
            "segment_id": self.segment_id,
            "packing_ratio": self.packing_ratio(),
        })
    }
}
