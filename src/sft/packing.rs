//! SFT packing exactly as TRL v1.16 documents it: best-fit decreasing (`bfd`, truncating),
//! `bfd_split` (overflow split off and packed elsewhere, no token lost) and `wrapped`
//! (concatenate everything, cut into rows of exactly the length).
//!
//! Every packed row keeps its sequences' lengths: position ids restart at 0 for each sequence
//! and attention never crosses a sequence boundary (the model's packed layout), so a packed
//! row's per-sequence loss equals the unpacked one. `wrapped` ignores boundaries by design.

/// A packing strategy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum PackingStrategy {
    /// Best-fit decreasing; sequences longer than the row are truncated.
    Bfd,
    /// Best-fit decreasing; the overflow of a long sequence becomes its own piece.
    BfdSplit,
    /// Concatenate and cut every `length` tokens.
    Wrapped,
}

impl std::str::FromStr for PackingStrategy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "bfd" => Ok(PackingStrategy::Bfd),
            "bfd_split" => Ok(PackingStrategy::BfdSplit),
            "wrapped" => Ok(PackingStrategy::Wrapped),
            other => Err(format!(
                "unknown packing strategy {other:?}: expected bfd, bfd_split or wrapped"
            )),
        }
    }
}

/// One packed row: which pieces of which sequences it holds.
#[derive(Debug, Clone, PartialEq)]
pub struct PackedSequences {
    /// `(sequence index, start, len)` per piece, in row order.
    pub pieces: Vec<(usize, usize, usize)>,
}

impl PackedSequences {
    /// Tokens in the row.
    pub fn len(&self) -> usize {
        self.pieces.iter().map(|p| p.2).sum()
    }

    /// Whether the row is empty.
    pub fn is_empty(&self) -> bool {
        self.pieces.is_empty()
    }

    /// Lengths of the row's sequences (TRL's `seq_lengths`).
    pub fn seq_lengths(&self) -> Vec<usize> {
        self.pieces.iter().map(|p| p.2).collect()
    }

    /// The row's tokens gathered from `sequences`.
    pub fn gather<T: Copy>(&self, sequences: &[Vec<T>]) -> Vec<T> {
        self.pieces
            .iter()
            .flat_map(|&(i, s, l)| sequences[i][s..s + l].iter().copied())
            .collect()
    }

    /// Position ids: 0.. for every sequence of the row.
    pub fn position_ids(&self) -> Vec<i64> {
        self.pieces.iter().flat_map(|p| 0..p.2 as i64).collect()
    }
}

/// Packs sequences of `lengths` into rows of at most `length` tokens.
pub fn pack(lengths: &[usize], length: usize, strategy: PackingStrategy) -> Result<Vec<PackedSequences>, String> {
    if length == 0 {
        return Err("packing length must be at least 1".into());
    }
    match strategy {
        PackingStrategy::Wrapped => Ok(wrapped(lengths, length)),
        PackingStrategy::Bfd | PackingStrategy::BfdSplit => {
            // Pieces in input order; a split sequence's overflow pieces follow it directly.
            let mut pieces: Vec<(usize, usize, usize)> = Vec::new();
            for (i, &n) in lengths.iter().enumerate() {
                if n == 0 {
                    continue;
                }
                if strategy == PackingStrategy::Bfd {
                    pieces.push((i, 0, n.min(length)));
                } else {
                    let mut start = 0;
                    while start < n {
                        let l = length.min(n - start);
                        pieces.push((i, start, l));
                        start += l;
                    }
                }
            }
            Ok(best_fit_decreasing(pieces, length))
        }
    }
}

/// Longest first (stable); each piece into the open row with the least room that still fits it,
/// else a new row.
fn best_fit_decreasing(mut pieces: Vec<(usize, usize, usize)>, length: usize) -> Vec<PackedSequences> {
    pieces.sort_by_key(|p| std::cmp::Reverse(p.2));
    let mut rows: Vec<PackedSequences> = Vec::new();
    // Rows by remaining room: room -> row indices in creation order (a BTreeMap keeps the best
    // fit a range query away, so packing stays O(n log n)).
    let mut by_room: std::collections::BTreeMap<usize, std::collections::VecDeque<usize>> = Default::default();
    for p in pieces {
        let fit = by_room.range(p.2..).next().map(|(&room, _)| room);
        let row = match fit {
            Some(room) => {
                let list = by_room.get_mut(&room).expect("room listed");
                let row = list.pop_front().expect("non-empty list");
                if list.is_empty() {
                    by_room.remove(&room);
                }
                row
            }
            None => {
                rows.push(PackedSequences { pieces: Vec::new() });
                rows.len() - 1
            }
        };
        rows[row].pieces.push(p);
        let room = length - rows[row].len();
        if room > 0 {
            by_room.entry(room).or_default().push_back(row);
        }
    }
    rows
}

fn wrapped(lengths: &[usize], length: usize) -> Vec<PackedSequences> {
    let mut rows = vec![PackedSequences { pieces: Vec::new() }];
    for (i, &n) in lengths.iter().enumerate() {
        let mut start = 0;
        while start < n {
            let room = length - rows.last().map_or(0, PackedSequences::len);
            if room == 0 {
                rows.push(PackedSequences { pieces: Vec::new() });
                continue;
            }
            let l = room.min(n - start);
            rows.last_mut().expect("a row").pieces.push((i, start, l));
            start += l;
        }
    }
    rows.retain(|r| !r.is_empty());
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture() -> Vec<Vec<i64>> {
        vec![vec![1, 2, 3, 4, 5], vec![6, 7], vec![8, 9, 10], vec![11]]
    }

    fn run(strategy: PackingStrategy) -> (Vec<Vec<i64>>, Vec<Vec<usize>>) {
        let seqs = fixture();
        let lengths: Vec<usize> = seqs.iter().map(Vec::len).collect();
        let rows = pack(&lengths, 4, strategy).unwrap();
        (
            rows.iter().map(|r| r.gather(&seqs)).collect(),
            rows.iter().map(PackedSequences::seq_lengths).collect(),
        )
    }

    #[test]
    fn trl_documented_examples() {
        let (rows, lens) = run(PackingStrategy::Bfd);
        assert_eq!(rows, vec![vec![1, 2, 3, 4], vec![8, 9, 10, 11], vec![6, 7]]);
        assert_eq!(lens, vec![vec![4], vec![3, 1], vec![2]]);
        let (rows, lens) = run(PackingStrategy::BfdSplit);
        assert_eq!(rows, vec![vec![1, 2, 3, 4], vec![8, 9, 10, 5], vec![6, 7, 11]]);
        assert_eq!(lens, vec![vec![4], vec![3, 1], vec![2, 1]]);
        let (rows, _) = run(PackingStrategy::Wrapped);
        assert_eq!(rows, vec![vec![1, 2, 3, 4], vec![5, 6, 7, 8], vec![9, 10, 11]]);
    }

    #[test]
    fn positions_restart_per_sequence_and_nothing_is_lost_when_splitting() {
        let seqs = fixture();
        let rows = pack(&[5, 2, 3, 1], 4, PackingStrategy::BfdSplit).unwrap();
        assert_eq!(rows[1].position_ids(), vec![0, 1, 2, 0]);
        let mut all: Vec<i64> = rows.iter().flat_map(|r| r.gather(&seqs)).collect();
        all.sort_unstable();
        assert_eq!(all, (1..=11).collect::<Vec<i64>>());
        assert!(rows.iter().all(|r| r.len() <= 4));
        assert!(pack(&[3], 0, PackingStrategy::Bfd).is_err());
        assert!("bfd_split".parse::<PackingStrategy>().is_ok() && "first_fit".parse::<PackingStrategy>().is_err());
    }
}
