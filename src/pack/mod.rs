//! Packing GRPO rollouts into micro-batch rows: prefix trees (shared prefixes forwarded once)
//! and flat sequence packing behind one token-budget planner, one row contract
//! ([`PackedRow`]) and one loss-term selection for both, and the log-probs of a row's terms.

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
pub(crate) use logprobs::{DistinctTerms, TermPairs, distinct_terms, weighted_sum};
pub use logprobs::{row_logprobs, row_logprobs_at};
pub use planner::{PackPlan, Packing, RowBuilder, plan, plan_rows};
pub use rollout::Rollout;
pub use row::{PackKind, PackedRow, Segment};
pub use sequence::{FlatRow, pack_flat};
pub use token_view::{SegmentTokens, TokenRow};
pub use tree::{PrefixTree, pack_tree};
pub use view::TreeView;
