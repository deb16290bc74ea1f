//! Micro-batches of training rows and the tensors one forward takes.

use tch::Tensor;

use super::packing::{PackingStrategy, pack};
use super::tokenize::TrainExample;
use crate::train::TrainError;
use crate::util::SplitMix64;

/// A piece of a training row: `(row, start, len)` of its tokens.
pub(crate) type Piece = (usize, usize, usize);

/// A micro-batch: per batch row, the pieces laid end to end in it.
pub(crate) type MicroBatch = Vec<Vec<Piece>>;

/// How rows become micro-batches and tensors.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Collator {
    /// Sequences (or packed rows) per micro-batch.
    pub batch_size: usize,
    /// Packed rows of `max_length` tokens, or one sequence per batch row.
    pub packing: Option<PackingStrategy>,
    /// Row length of packing.
    pub max_length: usize,
    /// Batch lengths are padded to a multiple of this.
    pub pad_multiple: Option<usize>,
    /// Id written into padding.
    pub pad_id: i64,
}

/// A micro-batch as tensors `[b, t]` (ids, positions, sequence ids; -1 on padding), the flat
/// predicting positions and targets of its trained tokens, and (real, forwarded) token counts.
pub(crate) struct BatchTensors {
    pub ids: Tensor,
    pub pos: Tensor,
    pub seq: Tensor,
    pub src: Vec<i64>,
    pub tgt: Vec<i64>,
    pub real: usize,
    pub total: usize,
}

impl Collator {
    /// The micro-batches of epoch `epoch` over `rows`: a permutation seeded by `seed + epoch`,
    /// batched, or packed and the packed rows shuffled again (as TRL's sampler shuffles its
    /// packed dataset). An epoch without a micro-batch is an error (a step would wait forever).
    ///
    /// Why the second shuffle: best-fit decreasing lays rows out longest first, so without it
    /// every epoch would train its longest conversations first and its shortest last, and a
    /// model would end each epoch (and its training) on one kind of data, unlearning what the
    /// other kind taught (`datasets/README.md` has a case).
    pub(super) fn epoch(&self, rows: &[TrainExample], seed: u64, epoch: u64) -> Result<Vec<MicroBatch>, TrainError> {
        let mut order: Vec<usize> = (0..rows.len()).collect();
        let mut rng = SplitMix64::new(seed.wrapping_add(epoch));
        rng.shuffle(&mut order);
        let batch_rows: Vec<Vec<Piece>> = match self.packing {
            None => order.iter().map(|&i| vec![(i, 0, rows[i].input_ids.len())]).collect(),
            Some(strategy) => {
                let lengths: Vec<usize> = order.iter().map(|&i| rows[i].input_ids.len()).collect();
                let mut packed: Vec<Vec<Piece>> = pack(&lengths, self.max_length, strategy)
                    .map_err(|e| TrainError::config("tokenize.max_length", e))?
                    .into_iter()
                    .map(|r| r.pieces.iter().map(|&(p, start, len)| (order[p], start, len)).collect())
                    .collect();
                rng.shuffle(&mut packed);
                packed
            }
        };
        let batches = self.batches(batch_rows);
        if batches.is_empty() {
            return Err(TrainError::Data(format!("epoch {epoch} has no micro-batch")));
        }
        Ok(batches)
    }

    /// Rows in order, one sequence per batch row (evaluation).
    pub(crate) fn in_order(&self, rows: &[TrainExample]) -> Vec<MicroBatch> {
        self.batches(
            rows.iter()
                .enumerate()
                .map(|(i, r)| vec![(i, 0, r.input_ids.len())])
                .collect(),
        )
    }

    fn batches(&self, rows: Vec<Vec<Piece>>) -> Vec<MicroBatch> {
        rows.chunks(self.batch_size.max(1))
            .map(<[Vec<Piece>]>::to_vec)
            .collect()
    }

    /// Trained tokens of a micro-batch (what [`Collator::tensors`] emits as targets: masked
    /// positions after each piece's first token).
    pub(super) fn trained_tokens(rows: &[TrainExample], mb: &MicroBatch) -> usize {
        mb.iter()
            .flatten()
            .map(|&(i, start, len)| {
                rows[i].loss_mask[start..start + len]
                    .iter()
                    .skip(1)
                    .filter(|&&m| m == 1)
                    .count()
            })
            .sum()
    }

    /// The tensors of a micro-batch: pieces concatenated per batch row (positions restart at 0
    /// for each piece, which attends only to itself), right-padded to a common length rounded
    /// up to the pad multiple.
    pub(super) fn tensors(&self, rows: &[TrainExample], mb: &MicroBatch) -> BatchTensors {
        let parts: Vec<RowParts> = mb.iter().map(|pieces| RowParts::of(rows, pieces)).collect();
        let longest = parts.iter().map(|r| r.ids.len()).max().unwrap_or(1);
        let t = crate::device::round_up(longest, self.pad_multiple);
        let b = parts.len();
        let mut out = BatchTensors {
            ids: Tensor::new(),
            pos: Tensor::new(),
            seq: Tensor::new(),
            src: Vec::new(),
            tgt: Vec::new(),
            real: 0,
            total: b * t,
        };
        let (mut ids, mut pos, mut seq) = (
            Vec::with_capacity(b * t),
            Vec::with_capacity(b * t),
            Vec::with_capacity(b * t),
        );
        for (k, r) in parts.iter().enumerate() {
            for j in 1..r.ids.len() {
                if r.mask[j] == 1 && r.seq[j] == r.seq[j - 1] {
                    out.src.push((k * t + j - 1) as i64);
                    out.tgt.push(r.ids[j]);
                }
            }
            out.real += r.ids.len();
            let pad = t - r.ids.len();
            ids.extend(r.ids.iter().copied().chain(std::iter::repeat_n(self.pad_id, pad)));
            pos.extend(r.pos.iter().copied().chain(std::iter::repeat_n(0, pad)));
            seq.extend(r.seq.iter().copied().chain(std::iter::repeat_n(-1, pad)));
        }
        let shape = [b as i64, t as i64];
        out.ids = Tensor::from_slice(&ids).view(shape);
        out.pos = Tensor::from_slice(&pos).view(shape);
        out.seq = Tensor::from_slice(&seq).view(shape);
        out
    }
}

/// One batch row before padding: ids, positions, sequence index and loss mask per token.
#[derive(Default)]
struct RowParts {
    ids: Vec<i64>,
    pos: Vec<i64>,
    seq: Vec<i64>,
    mask: Vec<u8>,
}

impl RowParts {
    fn of(rows: &[TrainExample], pieces: &[Piece]) -> Self {
        let mut r = RowParts::default();
        for (s, &(i, start, len)) in pieces.iter().enumerate() {
            let ex = &rows[i];
            r.ids.extend(&ex.input_ids[start..start + len]);
            r.pos.extend(0..len as i64);
            r.seq.extend(std::iter::repeat_n(s as i64, len));
            r.mask.extend(&ex.loss_mask[start..start + len]);
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example(len: usize) -> TrainExample {
        TrainExample {
            input_ids: vec![1; len],
            loss_mask: vec![1; len],
        }
    }

    /// Packed rows come in a seeded random order, not best-fit decreasing's longest-first: the
    /// rows holding the long sequences are spread over the epoch.
    #[test]
    fn packed_rows_are_shuffled_within_an_epoch() {
        // 100 long sequences, 900 short: best-fit decreasing makes 100 rows of a long one and
        // five short ones, then ~34 rows of short ones only, in that order.
        let rows: Vec<TrainExample> = (0..1000).map(|i| example(if i % 10 == 0 { 300 } else { 40 })).collect();
        let collator = Collator {
            batch_size: 1,
            packing: Some(PackingStrategy::Bfd),
            max_length: 512,
            pad_multiple: None,
            pad_id: 0,
        };
        let longest = |batches: &[MicroBatch]| -> Vec<usize> {
            batches
                .iter()
                .map(|b| b[0].iter().map(|p| p.2).max().unwrap_or(0))
                .collect()
        };
        let epoch = longest(&collator.epoch(&rows, 3, 0).unwrap());
        let short_only_early = epoch[..epoch.len() / 2].iter().filter(|&&l| l == 40).count();
        // Longest-first would put none of them in the first half; shuffled, about 17.
        assert!(short_only_early >= 5, "{epoch:?}");
        assert_ne!(epoch, longest(&collator.epoch(&rows, 3, 1).unwrap()), "epochs differ");
        assert_eq!(epoch, longest(&collator.epoch(&rows, 3, 0).unwrap()), "seeded");
    }
}
