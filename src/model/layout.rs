//! How tokens of a forward see each other.

use tch::{Kind, Tensor};

use crate::device::Device;

use super::error::ModelError;

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
    Segments(SegmentLayout),
}

/// The segments of an [`AttentionLayout::Segments`] layout: long ones attended one by one,
/// short ones batched (a few kernel calls instead of a few per segment: with many short
/// segments, as GRPO completions are, per-call overhead would otherwise dominate).
#[derive(Debug)]
pub struct SegmentLayout {
    /// Segments attended one by one, in position order.
    pub singles: Vec<SegmentAttention>,
    /// Groups of short segments attended in one padded call each.
    pub batches: Vec<SegmentBatch>,
    /// `[seq]` int64: row of each packed position in the concatenated outputs (singles' query
    /// ranges, then each batch's real queries); `None` when everything is in `singles`, in order.
    pub order: Option<Tensor>,
    /// Query positions covered.
    pub tokens: i64,
}

/// Short segments attended together: `G` segments padded to `q_max` queries and `k_max` keys.
#[derive(Debug)]
pub struct SegmentBatch {
    /// `[G * q_max]` int64: packed position of each query slot (padding slots repeat a real one).
    pub q_index: Tensor,
    /// `[G * k_max]` int64: packed position of each key slot (padding repeats the path's first).
    pub k_index: Tensor,
    /// `[G, 1, q_max, k_max]` bool: bottom-right causal over real keys; a padding query sees its
    /// first key only, so no row of scores is empty.
    pub mask: Tensor,
    /// Segments `G`.
    pub groups: i64,
    /// Longest segment.
    pub q_max: i64,
    /// Longest path.
    pub k_max: i64,
    /// `[real queries]` int64: the slot in `0..G * q_max` of each real query, segment by segment.
    pub out_slots: Tensor,
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

/// A block of a segment's queries and the part of the path it attends to.
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
    /// Keys it attends to: path positions `k_start..k_len` (`k_start` > 0 only where a sliding
    /// window hides the path's start from every query of the block).
    pub k_start: i64,
    /// End of those keys.
    pub k_len: i64,
    /// Bottom-right causal mask `[q_len, k_len - k_start]` (cut to the window where there is
    /// one); `None` for plain causal (`q_len == k_len`, no window).
    pub mask: Option<Tensor>,
}

/// Queries per block of a segment that continues a path.
pub const QUERY_BLOCK: i64 = 256;

/// Segments with paths up to this many keys are attended in padded batches.
pub(crate) const BATCHED_MAX_KEYS: i64 = 256;

/// Score entries (`G x q_max x k_max`, per head) one padded batch may hold.
const BATCH_SCORES: i64 = 1 << 20;

impl AttentionLayout {
    /// A segments layout from `cu_q` (`S + 1` segment boundaries), `cu_k` (`S + 1` boundaries in
    /// `kv_index`) and `kv_index` (key positions of every segment, concatenated), the tensors of
    /// TRL's tree packing. Paths that are one contiguous run of positions are sliced, not gathered.
    pub fn segments(cu_q: Vec<i64>, cu_k: Vec<i64>, kv_index: &[i64], device: Device) -> Result<Self, tch::TchError> {
        let mut segs = Vec::with_capacity(cu_q.len().saturating_sub(1));
        let mut short: Vec<(i64, i64, &[i64])> = Vec::new();
        for s in 0..cu_q.len().saturating_sub(1) {
            let (q_start, q_len) = (cu_q[s], cu_q[s + 1] - cu_q[s]);
            let path = &kv_index[cu_k[s] as usize..cu_k[s + 1] as usize];
            let k_len = path.len() as i64;
            if q_len >= 1 && k_len >= q_len && k_len <= BATCHED_MAX_KEYS {
                short.push((q_start, q_len, path));
            } else {
                segs.push(single(q_start, q_len, path, device)?);
            }
        }
        let tokens = segs.iter().map(|s| s.q_len).sum::<i64>() + short.iter().map(|s| s.1).sum::<i64>();
        if short.len() < 2 {
            // Nothing to batch: attend the odd short segment alone, in order.
            for (q_start, q_len, path) in short.drain(..) {
                segs.push(single(q_start, q_len, path, device)?);
            }
            segs.sort_by_key(|s| s.q_start);
        }
        short.sort_by_key(|s| (s.1, s.2.len()));
        let batches = batch_ranges(&short.iter().map(|s| (s.1, s.2.len() as i64)).collect::<Vec<_>>())
            .into_iter()
            .map(|range| segment_batch(&short[range], device))
            .collect::<Result<Vec<_>, _>>()?;
        let order = if batches.is_empty() {
            None
        } else {
            // Concatenated outputs: singles' ranges, then every batch's queries (the batches
            // take `short` in order).
            let mut at_position = vec![0i64; tokens as usize];
            let ranges = segs
                .iter()
                .map(|s| (s.q_start, s.q_len))
                .chain(short.iter().map(|s| (s.0, s.1)));
            for (row, p) in ranges.flat_map(|(start, len)| start..start + len).enumerate() {
                at_position[p as usize] = row as i64;
            }
            Some(device.from_slice(&at_position)?)
        };
        Ok(AttentionLayout::Segments(SegmentLayout {
            singles: segs,
            batches,
            order,
            tokens,
        }))
    }
}

/// Padded score entries a batch may compute per real one (`G x q_max x k_max` against the sum
/// of `q_len x k_len` over its segments).
const BATCH_PADDING: i64 = 2;

/// Consecutive ranges of `segments` (`(q_len, k_len)`, sorted by `q_len`, then `k_len`), one
/// per padded attention call: a range grows while its padded scores stay within
/// [`BATCH_PADDING`] times its real ones and [`BATCH_SCORES`].
///
/// Why bound padding rather than the spread of path lengths alone: a GRPO tree mixes prompt
/// segments (tens of queries) with completion branches of a few tokens under paths of similar
/// length; padded to the longest segment, the branches' call would compute several times its
/// real scores, and attention would weigh more in the tree update than in the flat one (the
/// GRPO bench's tree/flat ratio against the work ratio shows it).
fn batch_ranges(segments: &[(i64, i64)]) -> Vec<std::ops::Range<usize>> {
    let mut ranges = Vec::new();
    let mut start = 0;
    while start < segments.len() {
        let (mut q_max, mut k_max) = segments[start];
        let mut real = q_max * k_max;
        let mut end = start + 1;
        while let Some(&(q, k)) = segments.get(end) {
            let (q_pad, k_pad) = (q_max.max(q), k_max.max(k));
            let padded = (end + 1 - start) as i64 * q_pad * k_pad;
            if padded > BATCH_SCORES || padded > BATCH_PADDING * (real + q * k) {
                break;
            }
            (q_max, k_max, real) = (q_pad, k_pad, real + q * k);
            end += 1;
        }
        ranges.push(start..end);
        start = end;
    }
    ranges
}

/// One segment attended on its own: its path sliced or gathered, queries in blocks.
fn single(q_start: i64, q_len: i64, path: &[i64], device: Device) -> Result<SegmentAttention, tch::TchError> {
    let k_len = path.len() as i64;
    let contiguous = path.windows(2).all(|w| w[1] == w[0] + 1);
    let keys = if contiguous && !path.is_empty() {
        KeySource::Contiguous {
            start: path[0],
            len: k_len,
        }
    } else {
        KeySource::Gather(device.from_slice(path)?)
    };
    let prefix = k_len - q_len;
    let blocks = if prefix == 0 {
        vec![QueryBlock {
            q_offset: 0,
            q_len,
            k_start: 0,
            k_len,
            mask: None,
        }]
    } else {
        (0..q_len)
            .step_by(QUERY_BLOCK as usize)
            .map(|off| {
                let len = QUERY_BLOCK.min(q_len - off);
                let k = prefix + off + len;
                let mask = device.put(&Tensor::f_ones([len, k], (Kind::Bool, device.host()))?.f_tril(k - len)?)?;
                Ok(QueryBlock {
                    q_offset: off,
                    q_len: len,
                    k_start: 0,
                    k_len: k,
                    mask: Some(mask),
                })
            })
            .collect::<Result<_, tch::TchError>>()?
    };
    Ok(SegmentAttention {
        q_start,
        q_len,
        keys,
        blocks,
    })
}

/// One padded call for segments `(q_start, q_len, path)` with `q_len <= path.len()`.
fn segment_batch(group: &[(i64, i64, &[i64])], device: Device) -> Result<SegmentBatch, tch::TchError> {
    let g = group.len() as i64;
    let q_max = group.iter().map(|s| s.1).max().unwrap_or(1);
    let k_max = group.iter().map(|s| s.2.len() as i64).max().unwrap_or(1);
    let mut q_index = Vec::with_capacity((g * q_max) as usize);
    let mut k_index = Vec::with_capacity((g * k_max) as usize);
    let mut mask = vec![false; (g * q_max * k_max) as usize];
    let mut out_slots = Vec::new();
    for (j, &(q_start, q_len, path)) in group.iter().enumerate() {
        let k_len = path.len() as i64;
        let prefix = k_len - q_len;
        for i in 0..q_max {
            q_index.push(q_start + i.min(q_len - 1));
            let row = ((j as i64 * q_max + i) * k_max) as usize;
            if i < q_len {
                out_slots.push(j as i64 * q_max + i);
                for m in &mut mask[row..row + (prefix + i + 1) as usize] {
                    *m = true;
                }
            } else {
                mask[row] = true;
            }
        }
        k_index.extend(
            path.iter()
                .copied()
                .chain(std::iter::repeat_n(path[0], (k_max - k_len) as usize)),
        );
    }
    Ok(SegmentBatch {
        q_index: device.from_slice(&q_index)?,
        k_index: device.from_slice(&k_index)?,
        mask: device.put(&Tensor::f_from_slice(&mask)?.f_view([g, 1, q_max, k_max])?)?,
        groups: g,
        q_max,
        k_max,
        out_slots: device.from_slice(&out_slots)?,
    })
}

impl AttentionLayout {
    /// The layout of one row holding sequences of `lengths` (positions restart at 0 for each):
    /// returns the layout ([`AttentionLayout::packed`]'s) and `position_ids` `[1, sum]`.
    pub fn packed_row(lengths: &[i64], device: Device) -> Result<(Self, Tensor), tch::TchError> {
        let mut seq = Vec::new();
        let mut pos = Vec::new();
        for (i, &len) in lengths.iter().enumerate() {
            seq.extend(std::iter::repeat_n(i as i64, len as usize));
            pos.extend(0..len);
        }
        let n = seq.len() as i64;
        let pos = device.from_slice(&pos)?.f_view([1, n])?;
        Ok((Self::packed(&seq, n, device)?, pos))
    }

    /// Packed rows as one row (`[batch, seq]` flattened to `[1, batch * seq]`, which is how the
    /// forward must then be given them): `sequence_ids` (host, row-major, `row_len` a row) gives
    /// each token's sequence within its row, negative = padding; a token sees earlier tokens of
    /// its own sequence only. Each run of one sequence is a causal segment
    /// ([`AttentionLayout::segments`]: attention costs its triangle, no `[seq, seq]` mask), and so
    /// is each run of padding (whose outputs nothing reads). On a PrivateUse1 device (Neuron),
    /// which compiles one graph per distinct set of shapes, it is [`AttentionLayout::Packed`]
    /// instead: one dense mask, one shape per batch shape.
    pub fn packed(sequence_ids: &[i64], row_len: i64, device: Device) -> Result<Self, tch::TchError> {
        let n = sequence_ids.len() as i64;
        if device.is_privateuse1() {
            let rows = if row_len > 0 { n / row_len } else { 0 };
            return Ok(AttentionLayout::Packed {
                sequence_ids: device.from_slice(sequence_ids)?.f_view([rows, row_len])?,
            });
        }
        let mut cu = vec![0i64];
        for p in 1..n {
            let new_row = row_len > 0 && p % row_len == 0;
            let (a, b) = (sequence_ids[p as usize - 1], sequence_ids[p as usize]);
            if new_row || a != b && (a >= 0 || b >= 0) {
                cu.push(p);
            }
        }
        if n > 0 {
            cu.push(n);
        }
        let kv_index: Vec<i64> = (0..n).collect();
        Self::segments(cu.clone(), cu, &kv_index, device)
    }

    /// The boolean mask `[batch, 1, seq, seq]` SDPA takes, or `None` for plain causal.
    pub(crate) fn sdpa_mask(&self, batch: i64, seq: i64, device: Device) -> Result<Option<Tensor>, ModelError> {
        if !matches!(self, AttentionLayout::Causal | AttentionLayout::Segments(_)) {
            check_mask_fits(batch, seq, device)?;
        }
        // f_ ops: an allocation that fails is an error naming the shape, never a panic.
        let causal = || -> Result<Tensor, ModelError> { Ok(device.ones(&[seq, seq], Kind::Bool)?.f_tril(0)?) };
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
                let keys = device.put(attention_mask)?.f_ne(0)?.f_view([batch, 1, seq])?;
                let eye = device.eye(seq, Kind::Bool)?.f_unsqueeze(0)?;
                causal()?.f_unsqueeze(0)?.f_logical_and(&keys)?.f_logical_or(&eye)?
            }
            AttentionLayout::Packed { sequence_ids } => {
                check(sequence_ids, "sequence_ids", &[batch, seq])?;
                let s = device.put(sequence_ids)?;
                let same = s
                    .f_unsqueeze(2)?
                    .f_eq_tensor(&s.f_unsqueeze(1)?)?
                    .f_logical_and(&s.f_ge(0)?.f_unsqueeze(1)?)?;
                let eye = device.eye(seq, Kind::Bool)?.f_unsqueeze(0)?;
                causal()?.f_unsqueeze(0)?.f_logical_and(&same)?.f_logical_or(&eye)?
            }
            AttentionLayout::Dense { mask } => {
                check(mask, "mask", &[batch, seq, seq])?;
                device.put(mask)?.to_kind(Kind::Bool)
            }
            AttentionLayout::Segments(layout) => {
                let covered = layout.tokens;
                let mut ordered = layout.singles.iter().scan(0, |at, s| {
                    let ok = s.q_start == *at;
                    *at += s.q_len;
                    Some(ok)
                });
                let ordered = layout.order.is_some() || ordered.all(|ok| ok);
                if batch != 1 || covered != seq || !ordered {
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

/// A dense `[batch, seq, seq]` mask (and the few of its size built on the way) on the host must
/// fit the memory available: packed rows of tens of thousands of tokens need gigabytes.
fn check_mask_fits(batch: i64, seq: i64, device: Device) -> Result<(), ModelError> {
    if device != Device::Cpu {
        return Ok(());
    }
    // The mask, the causal and identity `[seq, seq]` masks and one intermediate of the mask's size.
    let need = (2 * batch.max(0) as u128 + 2) * (seq.max(0) as u128).pow(2);
    match crate::device::host_shortfall(need) {
        Some(available) => Err(ModelError::Input(format!(
            "the attention mask of {batch} row(s) of {seq} tokens needs {:.1} GB; {:.1} GB of memory is available: shorten the rows (max_length) or use fewer per batch",
            need as f64 / 1e9,
            available as f64 / 1e9
        ))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::{BATCH_PADDING, batch_ranges};

    /// Padded and real scores of one call over `segments`.
    fn padded_and_real(segments: &[(i64, i64)]) -> (i64, i64) {
        let q = segments.iter().map(|s| s.0).max().unwrap_or(0);
        let k = segments.iter().map(|s| s.1).max().unwrap_or(0);
        (segments.len() as i64 * q * k, segments.iter().map(|s| s.0 * s.1).sum())
    }

    #[test]
    fn batches_tile_the_segments_and_bound_their_padding() {
        // A GRPO-like tree: prompt segments (q = k) among short branches under similar paths.
        let mut segments: Vec<(i64, i64)> = (0..40)
            .map(|i| (1 + i % 24, 40 + i % 23))
            .chain((0..16).map(|i| (38 + i % 5, 38 + i % 5)))
            .collect();
        segments.sort();
        let ranges = batch_ranges(&segments);
        let mut next = 0;
        for range in &ranges {
            assert_eq!(range.start, next, "ranges tile in order");
            next = range.end;
            let (padded, real) = padded_and_real(&segments[range.clone()]);
            assert!(
                range.len() == 1 || padded <= BATCH_PADDING * real,
                "{range:?}: {padded} > {BATCH_PADDING} x {real}"
            );
        }
        assert_eq!(next, segments.len());
        // Padding everything to the longest segment would compute several times the real scores.
        let (padded, real) = padded_and_real(&segments);
        assert!(padded > 3 * real, "{padded} vs {real}");
        assert!(
            ranges.len() < segments.len() / 4,
            "{} calls for {} segments",
            ranges.len(),
            segments.len()
        );
    }

    #[test]
    fn equal_segments_share_one_batch() {
        assert_eq!(batch_ranges(&[(8, 40); 30]), vec![0..30]);
        assert!(batch_ranges(&[]).is_empty());
    }
}
