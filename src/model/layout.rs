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
    pub(crate) fn sdpa_mask(
        &self,
        batch: i64,
        seq: i64,
        device: Device,
    ) -> Result<Option<Tensor>, ModelError> {
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
        };
        Ok(Some(mask.unsqueeze(1)))
    }
}
