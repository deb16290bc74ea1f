//! Supervised fine-tuning, TRL-style: conversations or prompt/completion rows, assistant- or
//! completion-only loss, padded or packed batches (`bfd`, `bfd_split`, `wrapped`),
//! `pad_to_multiple_of`, AdamW with schedules, gradient accumulation normalised over the whole
//! window, clipping, checkpoints that resume bit-exact.

mod packing;
mod tokenize;
mod trainer;

pub use packing::{PackedSequences, PackingStrategy, pack};
pub use tokenize::{TokenizeOptions, TrainExample, tokenize};
pub use trainer::{NanPolicy, SftConfig, SftError, SftTrainer, StepMetrics, TrainerState};
