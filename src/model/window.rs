//! Sliding-window attention over every layout and the KV cache: a query sees the last
//! `window` positions of its own path, itself included (transformers' `kv_idx > q_idx -
//! window` on one sequence).
//!
//! Why one rule serves every layout: in each of them a query's visible keys are the tokens of
//! its root-to-query path, in position order, ending with itself (a sequence's earlier tokens
//! in a padded or packed row; the ancestors' segments and its own in a tree; a row's cached
//! slots in generation). Keeping, of each mask row, the keys with at most `window` visible keys
//! at or after them keeps exactly the last `window` positions of the path, whatever the
//! padding, packing or cache layout between them.

use tch::{Kind, Tensor};

use crate::device::Device;

use super::error::ModelError;
use super::layout::{
    AttentionLayout, KeySource, QUERY_BLOCK, QueryBlock, SegmentAttention, SegmentBatch, SegmentLayout,
};

/// `mask` (bool `[..., q, k]`, true = attend) cut to each query's last `window` visible keys.
pub(crate) fn window_mask(mask: &Tensor, window: i64) -> Result<Tensor, tch::TchError> {
    let at_or_after = mask.f_flip([-1])?.f_cumsum(-1, Kind::Int64)?.f_flip([-1])?;
    mask.f_logical_and(&at_or_after.f_le(window)?)
}

/// What one forward's attention reads: the layout and its SDPA mask, for full-attention layers
/// and (in a model with sliding layers) for the sliding ones.
#[derive(Debug)]
pub(crate) struct LayoutMasks {
    mask: Option<Tensor>,
    sliding: Option<(Option<AttentionLayout>, Option<Tensor>)>,
}

/// A layout with the SDPA mask precomputed from it (`None`: causal, or per-segment attention).
#[derive(Debug, Clone, Copy)]
pub struct Masked<'a> {
    /// The attention pattern.
    pub layout: &'a AttentionLayout,
    /// Its SDPA mask.
    pub mask: Option<&'a Tensor>,
}

impl LayoutMasks {
    /// The masks of `layout` over `[batch, seq]` tokens, with the windowed ones when `window`.
    pub(crate) fn new(
        layout: &AttentionLayout,
        batch: i64,
        seq: i64,
        device: Device,
        window: Option<i64>,
    ) -> Result<Self, ModelError> {
        let mask = layout.sdpa_mask(batch, seq, device)?;
        let sliding = match (window, layout) {
            (None, _) => None,
            (Some(w), AttentionLayout::Segments(s)) => {
                Some((Some(AttentionLayout::Segments(s.windowed(w, device)?)), None))
            }
            (Some(w), _) if mask.is_none() && seq <= w => Some((None, None)),
            (Some(w), _) => {
                let full = match &mask {
                    Some(m) => m.shallow_clone(),
                    None => device.ones(&[1, 1, seq, seq], Kind::Bool)?.f_tril(0)?,
                };
                Some((None, Some(window_mask(&full, w)?)))
            }
        };
        Ok(LayoutMasks { mask, sliding })
    }

    /// The keys and values of a forward over `layout` (the layout these masks were made for),
    /// with the routing recorded for its tokens.
    pub(crate) fn key_values<'a>(
        &'a self,
        layout: &'a AttentionLayout,
        routing: Option<&'a super::moe::RecordedRouting>,
    ) -> super::KeyValues<'a> {
        super::KeyValues::Layout {
            full: self.full(layout),
            sliding: self.sliding(layout),
            routing,
        }
    }

    /// What the full-attention layers read.
    pub(crate) fn full<'a>(&'a self, layout: &'a AttentionLayout) -> Masked<'a> {
        Masked {
            layout,
            mask: self.mask.as_ref(),
        }
    }

    /// What the sliding layers read (`None` in a model without them).
    pub(crate) fn sliding<'a>(&'a self, layout: &'a AttentionLayout) -> Option<Masked<'a>> {
        self.sliding.as_ref().map(|(own, mask)| Masked {
            layout: own.as_ref().unwrap_or(layout),
            mask: mask.as_ref(),
        })
    }
}

impl SegmentLayout {
    /// The same segments, each query block and padded batch masked to the window.
    pub(crate) fn windowed(&self, window: i64, device: Device) -> Result<SegmentLayout, tch::TchError> {
        let singles = self
            .singles
            .iter()
            .map(|s| {
                let blocks = s
                    .blocks
                    .iter()
                    .map(|b| windowed_block(b, window, device))
                    .collect::<Result<Vec<_>, _>>()?
                    .into_iter()
                    .flatten()
                    .collect();
                Ok(SegmentAttention {
                    q_start: s.q_start,
                    q_len: s.q_len,
                    keys: match &s.keys {
                        KeySource::Contiguous { start, len } => KeySource::Contiguous {
                            start: *start,
                            len: *len,
                        },
                        KeySource::Gather(idx) => KeySource::Gather(idx.shallow_clone()),
                    },
                    blocks,
                })
            })
            .collect::<Result<_, tch::TchError>>()?;
        let batches = self
            .batches
            .iter()
            .map(|b| {
                Ok(SegmentBatch {
                    q_index: b.q_index.shallow_clone(),
                    k_index: b.k_index.shallow_clone(),
                    mask: window_mask(&b.mask, window)?,
                    groups: b.groups,
                    q_max: b.q_max,
                    k_max: b.k_max,
                    out_slots: b.out_slots.shallow_clone(),
                })
            })
            .collect::<Result<_, tch::TchError>>()?;
        Ok(SegmentLayout {
            singles,
            batches,
            order: self.order.as_ref().map(Tensor::shallow_clone),
            tokens: self.tokens,
        })
    }
}

/// A query block cut to the window: each query sees the last `window` path positions up to its
/// own, so the block reads only the keys from its first query's window on (`k_start`), under
/// a banded mask. A plain causal block longer than the window is cut into blocks of
/// [`QUERY_BLOCK`] queries first, each reading its own stretch of keys: attention then costs
/// about `queries x window` rather than the causal triangle.
fn windowed_block(b: &QueryBlock, window: i64, device: Device) -> Result<Vec<QueryBlock>, tch::TchError> {
    if b.k_len - b.k_start <= window && b.mask.is_none() {
        return Ok(vec![copy_block(b)]);
    }
    // Path position of the block's first query.
    let first = b.k_len - b.q_len;
    let pieces: Vec<(i64, i64)> = match b.mask {
        Some(_) => vec![(0, b.q_len)],
        None => (0..b.q_len)
            .step_by(QUERY_BLOCK as usize)
            .map(|off| (off, QUERY_BLOCK.min(b.q_len - off)))
            .collect(),
    };
    pieces
        .into_iter()
        .map(|(off, len)| {
            let (q0, k_len) = (first + off, first + off + len);
            let k_start = (q0 - window + 1).max(b.k_start).max(0);
            // Query i (path position q0 + i) sees key j (position k_start + j) when
            // q0 + i - window < k_start + j <= q0 + i.
            let lead = q0 - k_start;
            let ones = Tensor::f_ones([len, k_len - k_start], (Kind::Bool, device.host()))?;
            let band = ones.f_tril(lead)?.f_triu(lead - window + 1)?;
            Ok(QueryBlock {
                q_offset: b.q_offset + off,
                q_len: len,
                k_start,
                k_len,
                mask: Some(device.put(&band)?),
            })
        })
        .collect()
}

/// The same block (its mask shared, not copied).
fn copy_block(b: &QueryBlock) -> QueryBlock {
    QueryBlock {
        q_offset: b.q_offset,
        q_len: b.q_len,
        k_start: b.k_start,
        k_len: b.k_len,
        mask: b.mask.as_ref().map(Tensor::shallow_clone),
    }
}
