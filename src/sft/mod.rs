//! Supervised fine-tuning. So far: TRL's SFT packing strategies (the trainer itself is the next
//! piece of work; see the project's issue on the SFT trainer).

mod packing;

pub use packing::{PackedSequences, PackingStrategy, pack};
