//! Routing recorded at generation, replayed or compared in a training forward (GRPO's routing
//! replay, the R3 method).
//!
//! The generator records, for every token it forwards, each sparse layer's chosen experts. The
//! update's forward over the same tokens either routes each recorded token to those experts,
//! with the routing weights recomputed from the current router (so the router still learns),
//! or routes as usual; either way it counts, on the counted (trained) tokens, how often the
//! experts it used differ as a set from the recorded ones: `routing_mismatch`.

use std::sync::Mutex;

use tch::{Kind, Tensor};

use crate::model::error::ModelError;

/// The experts a generated row's tokens were routed to, as the generator recorded them: per
/// token forwarded (the row's prompt, then each sampled token that was fed back; the last
/// sampled token is never forwarded), per sparse layer, the `k` chosen expert ids.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RoutingTrace {
    /// `[tokens][sparse layers][k]`, flattened.
    pub ids: Vec<u16>,
    /// Ids per token: sparse layers x `k`.
    pub per_token: usize,
}

impl RoutingTrace {
    /// Tokens recorded.
    pub fn tokens(&self) -> usize {
        self.ids.len().checked_div(self.per_token).unwrap_or(0)
    }

    /// Token `t`'s ids, sparse layer by sparse layer.
    pub fn token(&self, t: usize) -> &[u16] {
        &self.ids[t * self.per_token..(t + 1) * self.per_token]
    }
}

/// The recorded routing of one forward's tokens.
#[derive(Debug)]
pub struct RecordedRouting {
    /// Per layer (`None` for a dense one) `[tokens, k]` int64; a row of -1: not recorded
    /// (routed as usual, never counted).
    experts: Vec<Option<Tensor>>,
    replay: bool,
    counted: Tensor,
    tally: Mutex<Tally>,
}

/// Counted so far, and which layers were (a recomputed layer is not counted twice).
#[derive(Debug, Default)]
struct Tally {
    mismatched: f64,
    compared: f64,
    seen: Vec<bool>,
}

impl RecordedRouting {
    /// `experts` per layer of the model, replayed when `replay`; mismatches are counted at the
    /// tokens where `counted` `[tokens]` (bool) is true.
    pub fn new(experts: Vec<Option<Tensor>>, replay: bool, counted: Tensor) -> Self {
        let layers = experts.len();
        RecordedRouting {
            experts,
            replay,
            counted,
            tally: Mutex::new(Tally {
                seen: vec![false; layers],
                ..Tally::default()
            }),
        }
    }

    /// Layer `layer`'s recorded experts, when it is sparse.
    pub(crate) fn layer(&self, layer: usize) -> Option<&Tensor> {
        self.experts.get(layer)?.as_ref()
    }

    /// Whether the forward routes by the recorded experts.
    pub fn replays(&self) -> bool {
        self.replay
    }

    /// Counts layer `layer`'s experts `used` `[tokens, k]` against the recorded ones (once a
    /// layer).
    pub(crate) fn count(&self, layer: usize, used: &Tensor) -> Result<(), ModelError> {
        let Some(recorded) = self.layer(layer) else {
            return Ok(());
        };
        let mut tally = self.tally.lock().unwrap_or_else(|e| e.into_inner());
        if tally.seen.get(layer).copied().unwrap_or(true) {
            return Ok(());
        }
        tally.seen[layer] = true;
        let (set_used, set_recorded) = (sorted(used)?, sorted(&recorded.f_to_device(used.device())?)?);
        let valid = recorded.f_ge(0)?.f_all_dim(-1, false)?;
        let compared = valid.f_logical_and(&self.counted.f_to_device(used.device())?)?;
        let differs = set_used.f_ne_tensor(&set_recorded)?.f_any_dim(-1, false)?;
        let mismatched = differs.f_logical_and(&compared)?;
        tally.mismatched += mismatched.f_sum(Kind::Float)?.double_value(&[]);
        tally.compared += compared.f_sum(Kind::Float)?.double_value(&[]);
        Ok(())
    }

    /// `(mismatched, compared)` (token, sparse layer) pairs counted so far.
    pub fn mismatch(&self) -> (f64, f64) {
        let tally = self.tally.lock().unwrap_or_else(|e| e.into_inner());
        (tally.mismatched, tally.compared)
    }
}

/// `experts` `[tokens, k]` sorted along k (a top-k set in a comparable order).
fn sorted(experts: &Tensor) -> Result<Tensor, tch::TchError> {
    Ok(experts.f_sort(-1, false)?.0)
}
