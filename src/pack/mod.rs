//! Packing GRPO rollouts into micro-batch rows: prefix trees (shared prefixes forwarded once)
//! and flat sequence packing, the token-budget planner, and the GRPO loss over packed rows.

mod error;
mod fxhash;
mod loss;
mod planner;
mod rollout;
mod row;
mod sequence;
mod tree;
mod view;

pub use error::PackError;
pub use loss::{
    GrpoLoss, GrpoLossConfig, TermWeights, grpo_loss, grpo_loss_with_reference, row_logprobs, row_logprobs_at,
};
pub use planner::{PackPlan, plan};
pub use rollout::Rollout;
pub use row::{PackKind, PackedRow, Segment};
pub use sequence::pack_flat;
pub use tree::PrefixTree;
pub use view::TreeView;
