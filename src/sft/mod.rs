//! Supervised fine-tuning, TRL-style: conversations or prompt/completion rows, assistant- or
//! completion-only loss, padded or packed batches (`bfd`, `bfd_split`, `wrapped`),
//! `pad_to_multiple_of`, gradient accumulation normalised over the whole window; the optimizer,
//! schedules, clipping, the non-finite policy and checkpoints come from [`crate::train`].
//!
//! # Reference
//!
//! - Data ([`crate::data`]): TRL's formats: `messages` (extra fields, nulls, ShareGPT
//!   `from` / `value` tolerated), `prompt` / `completion` (strings or messages), and a per-row
//!   `tools` column the chat template renders as transformers' `tools=`. Malformed rows are
//!   typed errors naming the row and field, or skipped and counted (`skip_invalid_rows`).
//! - Packing: TRL's strategies exactly (`bfd`, `bfd_split`, `wrapped`); packed rows restart
//!   position ids per sequence and never attend across sequences; rows are shuffled each epoch,
//!   as TRL's sampler does.
//! - [`SftTrainer`]: padded or packed micro-batches, `pad_to_multiple_of` (shapes recorded in the
//!   trainer's ledger), gradient accumulation with the loss normalised over the whole window,
//!   clipping, non-finite steps skipped or stopped with the rows named, a JSONL log,
//!   `step()` / `train_for(n)` / `evaluate()` / `state`, and checkpoints (an HF model folder,
//!   optimizer and trainer state, written atomically) that resume bit-exactly on CPU.
//! - [`SftConfig`]: `SftConfig { train: TrainConfig { model, data, optimizer, .. },
//!   packing, .. }` in Rust; in TOML every field sits at the top level (`datasets/sft.toml`, the
//!   run that made the shipped `tiny-qwen3-sft`). Unknown keys and values outside a field's set
//!   are errors naming them.
//! - CLI: `treetrain sft --config sft.toml [--resume-from DIR/checkpoint-N|latest]`.
//! - Logs: `log.jsonl`, TensorBoard, `metrics.csv` (`report_to`; [`crate::guide::watching_runs`]).
//!
//! Throughput against TRL's `SFTTrainer`: `cargo bench --bench sft` (`benches/README.md`).

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
