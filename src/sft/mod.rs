//! Supervised fine-tuning, TRL-style: conversations or prompt/completion rows, assistant- or
//! completion-only loss, padded or packed batches (`bfd`, `bfd_split`, `wrapped`),
//! `pad_to_multiple_of`, gradient accumulation normalised over the whole window; the optimizer,
//! schedules, clipping, the non-finite policy and checkpoints come from [`crate::train`].

mod collate;
mod config;
mod packing;
mod tokenize;
mod trainer;
mod view;

pub use config::SftConfig;
pub use packing::{PackedSequences, PackingStrategy, pack};
pub use tokenize::{TokenizeOptions, TrainExample, tokenize};
pub use trainer::{SftEval, SftTrainer, StepMetrics, TrainerState};
