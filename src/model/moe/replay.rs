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

use crate::display::{Rich, rows_card, rows_text};
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

impl RoutingTrace {
    /// The card's rows: tokens, ids a token, distinct experts, the first token's choices.
    fn rows(&self) -> Vec<(&'static str, String)> {
        let distinct = self.ids.iter().collect::<std::collections::BTreeSet<_>>().len();
        let first = match self.tokens() {
            0 => "none recorded".to_string(),
            _ => self.token(0).iter().map(u16::to_string).collect::<Vec<_>>().join(" "),
        };
        vec![
            ("tokens recorded", self.tokens().to_string()),
            ("expert ids a token (sparse layers x k)", self.per_token.to_string()),
            ("distinct experts chosen", distinct.to_string()),
            ("first token's experts", first),
        ]
    }
}

impl Rich for RoutingTrace {
    fn html(&self) -> String {
        rows_card("Routing trace", &self.rows())
    }

    fn text(&self) -> String {
        format!("routing trace\n{}", rows_text(&self.rows()))
    }
}

crate::display::rich_display!(RoutingTrace);

impl RecordedRouting {
    /// The card's rows: layers and tokens recorded, the mode, the mismatch counted so far.
    fn rows(&self) -> Vec<(&'static str, String)> {
        let recorded: Vec<&Tensor> = self.experts.iter().flatten().collect();
        let tokens = recorded.first().map_or(0, |t| t.size()[0]);
        let counted = self.counted.f_sum(Kind::Int64).map_or(0, |t| t.int64_value(&[]));
        let (mismatched, compared) = self.mismatch();
        let share = match compared > 0.0 {
            true => format!(
                "{:.4} ({mismatched} of {compared} token-layer pairs)",
                mismatched / compared
            ),
            false => "nothing compared yet".to_string(),
        };
        vec![
            ("sparse layers recorded", recorded.len().to_string()),
            ("tokens", tokens.to_string()),
            ("counted (trained) tokens", counted.to_string()),
            (
                "mode",
                match self.replay {
                    true => "replayed: routed to the recorded experts".to_string(),
                    false => "compared: routed as usual".to_string(),
                },
            ),
            ("routing mismatch", share),
        ]
    }
}

impl Rich for RecordedRouting {
    fn html(&self) -> String {
        rows_card("Recorded routing", &self.rows())
    }

    fn text(&self) -> String {
        format!("recorded routing\n{}", rows_text(&self.rows()))
    }
}

crate::display::rich_display!(RecordedRouting);

/// `experts` `[tokens, k]` sorted along k (a top-k set in a comparable order).
fn sorted(experts: &Tensor) -> Result<Tensor, tch::TchError> {
    Ok(experts.f_sort(-1, false)?.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both cards say what was recorded, the mode and the mismatch counted so far.
    #[test]
    fn cards_say_what_was_recorded_and_the_mismatch() {
        let trace = RoutingTrace {
            ids: vec![3, 1, 3, 2],
            per_token: 2,
        };
        let text = trace.text();
        assert!(text.contains("tokens recorded: 2") && text.contains("distinct experts chosen: 3"));
        assert!(text.contains("first token's experts: 3 1"), "{text}");
        assert!(trace.html().contains("Routing trace") && trace.html().contains("3 1"));
        let recorded = Tensor::from_slice2(&[[0i64, 1], [2, 3], [-1, -1]]);
        let routing = RecordedRouting::new(
            vec![None, Some(recorded)],
            false,
            Tensor::from_slice(&[true, true, false]),
        );
        assert!(routing.text().contains("nothing compared yet"));
        routing
            .count(1, &Tensor::from_slice2(&[[1i64, 0], [2, 4], [5, 6]]))
            .unwrap();
        let text = routing.text();
        assert!(
            text.contains("sparse layers recorded: 1") && text.contains("tokens: 3"),
            "{text}"
        );
        assert!(text.contains("counted (trained) tokens: 2") && text.contains("compared: routed as usual"));
        assert!(
            text.contains("routing mismatch: 0.5000 (1 of 2 token-layer pairs)"),
            "{text}"
        );
        assert!(routing.html().contains("0.5000 (1 of 2 token-layer pairs)"));
    }
}
