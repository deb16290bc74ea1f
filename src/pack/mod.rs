//! Packing GRPO rollouts into micro-batch rows: prefix trees (shared prefixes forwarded once)
//! and flat sequence packing behind one token-budget planner, one row contract
//! ([`PackedRow`]) and one loss-term selection for both, and the log-probs of a row's terms.
//!
//! # The contract
//!
//! [`PackedRow`]'s doc comment states it: TRL v1.16.0's tree-packing contract, field for field.
//! Rollouts are folded into a trie keyed on (token, next token), laid out in DFS pre-order with
//! single-child chains merged into segments: `tree_kv_index`, `tree_cu_seqlens_q` / `_k`,
//! `token_index`, per-term `old_log_probs`, `advantages`, `segment_id`. Checked against TRL's
//! fixture and against TRL's own packer on 70 seeded rollout sets
//! (`tests/fixtures/trl_tree_packing.json`, made by `scripts/fixtures/make_tree_fixtures.py`),
//! plus property tests: every packed token sees exactly its rollout's prefix; tree and flat emit
//! the same loss terms; malformed input never panics.
//!
//! - [`PrefixTree`]: incremental, linear in tokens, `fits(budget)` on unique and trained tokens;
//!   [`pack_flat`] is the sequence-packing baseline with the same loss terms in the same order.
//! - [`plan`]: fills rows on unique tokens, keeps a group in one row, balances rows over ranks by
//!   attention load. [`Packing`] is looked at in this one place; nothing downstream branches on
//!   it.
//! - Tree attention: a row's [`PackedRow::layout`] is a
//!   [`AttentionLayout::Segments`](crate::model::AttentionLayout::Segments): each segment's
//!   queries attend to the keys gathered along its root-to-segment path (bottom-right causal).
//!   Short segments are attended in padded batches, the rest in query blocks
//!   ([`crate::model`]); the dense ancestor-interval mask is kept as the test oracle. Log-probs
//!   equal separate per-rollout forwards to 1e-5 and gradients of embeddings and LM head to 1e-4
//!   (fp32; `tests/tree_exactness.rs`).
//! - [`row_logprobs`]: the log-prob of every loss term of a row, with the LM head computed once
//!   per distinct `(position, target)` pair.
//! - Displays: [`TreeView`] (the tree as SVG with shared and unique colouring and trained-token
//!   marks, the segment table, the attention mask of short rows, a summary) and
//!   [`PackComparison`] (tree and flat packings of the same rollouts).
//!
//! How much faster the tree update is, against the work it saves: `cargo bench --bench
//! tree_vs_flat` and `cargo bench --bench grpo` (`benches/README.md`).

mod compare_view;
mod draw;
mod error;
mod fxhash;
mod logprobs;
mod planner;
mod rollout;
mod row;
mod sequence;
mod terms;
mod token_view;
mod tree;
mod view;

pub use compare_view::PackComparison;
pub use error::PackError;
pub use logprobs::row_logprobs;
pub(crate) use logprobs::{DistinctTerms, TermPairs, distinct_terms, row_logprobs_at, weighted_sum};
pub use planner::{PackPlan, Packing, RowBuilder, plan, plan_rows};
pub use rollout::Rollout;
pub use row::{PackKind, PackedRow, Segment};
pub use sequence::{FlatRow, pack_flat};
pub use token_view::{SegmentTokens, TokenRow};
pub use tree::{PrefixTree, pack_tree};
pub use view::TreeView;
