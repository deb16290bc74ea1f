//! How tokens of a forward see each other.

use tch::{Device, Kind, Tensor};

use super::ModelError;

/// The attention pattern of one forward over `[batch, seq]` tokens.
///
/// Everything except attention runs once per token whatever the layout; the layout decides
/// only which keys each query may see. Every layout is causal.
#[derive(Debug)]
pub enum AttentionLayout {
    /// Each row is one sequence, no padding.
    Causal,
    /// A padded batch: `attention_mask` `[batch, seq]` is 1 on tokens and 0 on padding (left or
    /// right). Padding queries see only themselves so no row of scores is empty.
    Padded {
        /// `[batch, seq]`, integer or bool.
        attention_mask: Tensor,
    },
    /// Packed rows: `sequence_ids` `[batch, seq]` gives each token's sequence within its row
    /// (negative = padding); a token sees earlier tokens of its own sequence only.
    Packed {
        /// `[batch, seq]`, int64.
        sequence_ids: Tensor,
    },
    /// An explicit boolean mask `[batch, seq, seq]` (true = query row may see key column):
    /// the reference oracle, and the dense form of any other layout.
    Dense {
        /// `[batch, seq, seq]`, bool.
        mask: Tensor,
    },
    /// One row (batch 1) cut into contiguous query segments, each attending to its own list of
    /// key positions, causally aligned to the bottom right: tree packing (a segment sees its
    /// root-to-segment path) and flat packing (a sequence sees itself). Attention costs the
    /// sum over segments of `q_len x k_len`, not `seq x seq`. Build with
    /// [`AttentionLayout::segments`].
    Segments(Vec<SegmentAttention>),
}

/// Where one segment's keys come from.
#[derive(Debug)]
pub enum KeySource {
    /// Positions `start..start + len` of the row: a slice, no copy.
    Contiguous {
        /// First key position.
        start: i64,
        /// Number of keys.
        len: i64,
    },
    /// Arbitrary positions `[k_len]` (int64), gathered.
    Gather(Tensor),
}

/// One segment of an [`AttentionLayout::Segments`] layout.
#[derive(Debug)]
pub struct SegmentAttention {
    /// First query position.
    pub q_start: i64,
    /// Queries.
    pub q_len: i64,
    /// Keys and values of the whole path (gathered once per layer).
    pub keys: KeySource,
    /// Query blocks, each attending to a prefix of the path.
    pub blocks: Vec<QueryBlock>,
}

/// A block of a segment's queries and the prefix of the path it attends to.
///
/// A segment's queries see the whole path of their ancestors plus a causal part of their own
/// tokens. One masked call over the full path would compute every (query, key) pair of that
/// rectangle; cutting the queries into blocks that each take only the keys they can see keeps
/// the computed pairs within one block's triangle of the causal count.
#[derive(Debug)]
pub struct QueryBlock {
    /// Offset of the block's first query in the segment.
    pub q_offset: i64,
    /// Queries in the block.
    pub q_len: i64,
    /// Keys it attends to: the first `k_len` of the path.
    pub k_len: i64,
    /// Bottom-right causal mask `[q_len, k_len]`; `None` when `q_len == k_len` (plain causal).
    pub mask: Option<Tensor>,
}

/// Queries per block of a segment that continues a path.
pub const QUERY_BLOCK: i64 = 256;

impl AttentionLayout {
    /// A segments layout from `cu_q` (`S + 1` segment boundaries), `cu_k` (`S + 1` boundaries in
    /// `kv_index`) and `kv_index` (key positions of every segment, concatenated), the tensors of
    /// TRL's tree packing. Paths that are one contiguous run of positions are sliced, not gathered.
    pub fn segments(cu_q: Vec<i64>, cu_k: Vec<i64>, kv_index: &[i64], device: Device) -> Self {
        let mut segs = Vec::with_capacity(cu_q.len().saturating_sub(1));
        for s in 0..cu_q.len().saturating_sub(1) {
            let (q_start, q_len) = (cu_q[s], cu_q[s + 1] - cu_q[s]);
            let path = &kv_index[cu_k[s] as usize..cu_k[s + 1] as usize];
            let k_len = path.len() as i64;
            let contiguous = path.windows(2).all(|w| w[1] == w[0] + 1);
            let keys = if contiguous && !path.is_empty() {
                KeySource::Contiguous {
                    start: path[0],
                    len: k_len,
                }
            } else {
                KeySource::Gather(Tensor::from_slice(path).to_device(device))
            };
            let prefix = k_len - q_len;
            let blocks = if prefix == 0 {
                vec![QueryBlock {
                    q_offset: 0,
                    q_len,
                    k_len,
                    mask: None,
                }]
            } else {
                (0..q_len)
                    .step_by(QUERY_BLOCK as usize)
                    .map(|off| {
                        let len = QUERY_BLOCK.min(q_len - off);
                        let k = prefix + off + len;
                        let mask = Tensor::ones([len, k], (Kind::Bool, device)).tril(k - len);
                        QueryBlock {
                            q_offset: off,
                            q_len: len,
                            k_len: k,
                            mask: Some(mask),
                        }
                    })
                    .collect()
            };
            segs.push(SegmentAttention {
                q_start,
                q_len,
                keys,
                blocks,
            });
        }
        AttentionLayout::Segments(segs)
    }
}

impl AttentionLayout {
    /// A [`AttentionLayout::Packed`] layout for one row holding sequences of `lengths`
    /// (positions restart at 0 for each): returns the layout and `position_ids` `[1, sum]`.
    pub fn packed_row(lengths: &[i64], device: Device) -> (Self, Tensor) {
        let mut seq = Vec::new();
        let mut pos = Vec::new();
        for (i, &len) in lengths.iter().enumerate() {
            seq.extend(std::iter::repeat_n(i as i64, len as usize));
            pos.extend(0..len);
        }
        let n = seq.len() as i64;
        let seq = Tensor::from_slice(&seq).view([1, n]).to_device(device);
        let pos = Tensor::from_slice(&pos).view([1, n]).to_device(device);
        (AttentionLayout::Packed { sequence_ids: seq }, pos)
    }

    /// The boolean mask `[batch, 1, seq, seq]` SDPA takes, or `None` for plain causal.
    pub(crate) fn sdpa_mask(&self, batch: i64, seq: i64, device: Device) -> Result<Option<Tensor>, ModelError> {
        let causal = || Tensor::ones([seq, seq], (Kind::Bool, device)).tril(0);
        let check = |t: &Tensor, what: &str, want: &[i64]| {
            if t.size() != want {
                Err(ModelError::Input(format!(
                    "{what} has shape {:?}, expected {want:?}",
                    t.size()
                )))
            } else {
                Ok(())
            }
        };
        let mask = match self {
            AttentionLayout::Causal => return Ok(None),
            AttentionLayout::Padded { attention_mask } => {
                check(attention_mask, "attention_mask", &[batch, seq])?;
                let keys = attention_mask.to_device(device).ne(0).view([batch, 1, seq]);
                let eye = Tensor::eye(seq, (Kind::Bool, device)).unsqueeze(0);
                causal().unsqueeze(0).logical_and(&keys).logical_or(&eye)
            }
            AttentionLayout::Packed { sequence_ids } => {
                check(sequence_ids, "sequence_ids", &[batch, seq])?;
                let s = sequence_ids.to_device(device);
                let same = s
                    .unsqueeze(2)
                    .eq_tensor(&s.unsqueeze(1))
                    .logical_and(&s.ge(0).unsqueeze(1));
                let eye = Tensor::eye(seq, (Kind::Bool, device)).unsqueeze(0);
                causal().unsqueeze(0).logical_and(&same).logical_or(&eye)
            }
            AttentionLayout::Dense { mask } => {
                check(mask, "mask", &[batch, seq, seq])?;
                mask.to_device(device).to_kind(Kind::Bool)
            }
            AttentionLayout::Segments(segs) => {
                let covered: i64 = segs.iter().map(|s| s.q_len).sum();
                let ordered = segs.iter().scan(0, |at, s| {
                    let ok = s.q_start == *at;
                    *at += s.q_len;
                    Some(ok)
                });
                if batch != 1 || covered != seq || !ordered.clone().all(|ok| ok) {
                    return Err(ModelError::Input(format!(
                        "a segments layout needs one row whose segments tile it in order: batch {batch}, {seq} tokens, segments cover {covered}"
                    )));
                }
                return Ok(None);
            }
        };
        Ok(Some(mask.unsqueeze(1)))
    }
}
