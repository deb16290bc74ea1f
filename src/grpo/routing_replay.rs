//! GRPO's routing replay (the R3 method; NeMo-RL and SkyRL ship it): the routing a mixture
//! model's generator recorded for each rollout, laid onto a packed row's positions for the
//! update's forward, which replays it (`routing_replay = true`) or only compares with it
//! (`train/routing_mismatch` either way).
//!
//! A packed position's recorded experts come from the first rollout through it: in a tree,
//! every rollout through a shared token recorded it under the same prefix. Positions no trace
//! covers (a rollout's last token, which the generator never forwards; multi-turn
//! conversations, whose traces are not kept) route as usual and are not compared.

use tch::Tensor;

use crate::model::moe::{RecordedRouting, RoutingTrace};
use crate::model::{CausalLm, FeedForward, ModelError};
use crate::pack::PackedRow;

/// The traces of a step's rollouts, in the order the update planned them (a packed row's
/// `sources`), and whether the update replays them.
#[derive(Debug, Default)]
pub(crate) struct StepRouting<'a> {
    traces: Vec<Option<&'a RoutingTrace>>,
    replay: bool,
}

impl<'a> StepRouting<'a> {
    /// `traces` rollout by rollout, replayed when `replay`.
    pub(crate) fn new(traces: Vec<Option<&'a RoutingTrace>>, replay: bool) -> Self {
        StepRouting { traces, replay }
    }

    /// The recorded routing of `row`'s positions for `policy`'s sparse layers; `None` when no
    /// rollout of the row has a trace that fits the model.
    pub(crate) fn of_row(&self, policy: &CausalLm, row: &PackedRow) -> Result<Option<RecordedRouting>, ModelError> {
        let Some(mixture) = &policy.config.mixture else {
            return Ok(None);
        };
        let sparse: Vec<usize> = (0..policy.layers.len())
            .filter(|&i| matches!(policy.layers[i].mlp, FeedForward::Sparse(_)))
            .collect();
        let k = mixture.experts_per_token as usize;
        let per_token = sparse.len() * k;
        let n = row.len();
        let mut ids = vec![-1i64; n * per_token];
        let mut filled = vec![false; n];
        for (j, positions) in row.rollout_positions.iter().enumerate() {
            let trace = row.sources.get(j).and_then(|&s| self.traces.get(s).copied().flatten());
            let Some(trace) = trace.filter(|t| t.per_token == per_token) else {
                continue;
            };
            for (t, &p) in positions.iter().enumerate().take(trace.tokens()) {
                let p = p as usize;
                if !filled[p] {
                    filled[p] = true;
                    let dst = &mut ids[p * per_token..(p + 1) * per_token];
                    dst.iter_mut().zip(trace.token(t)).for_each(|(d, &e)| *d = i64::from(e));
                }
            }
        }
        if !filled.iter().any(|&f| f) {
            return Ok(None);
        }
        let device = policy.device();
        let all = device
            .from_slice(&ids)?
            .f_view([n as i64, sparse.len() as i64, k as i64])?;
        let mut experts: Vec<Option<Tensor>> = (0..policy.layers.len()).map(|_| None).collect();
        for (s, &layer) in sparse.iter().enumerate() {
            experts[layer] = Some(all.f_select(1, s as i64)?.f_contiguous()?);
        }
        let mut counted = vec![false; n];
        for &p in &row.token_index {
            counted[p as usize] = true;
        }
        let counted = device.from_slice(&counted)?;
        Ok(Some(RecordedRouting::new(experts, self.replay, counted)))
    }
}
