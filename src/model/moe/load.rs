//! How a batch's tokens spread over a mixture model's experts, layer by layer: what a router
//! that collapses onto a few experts (or a load-balancing loss that works) looks like.

use tch::{Kind, Tensor};

use crate::display::{self, Heatmap, Rich, escape};
use crate::model::error::ModelError;
use crate::model::layout::AttentionLayout;
use crate::model::loaded::Model;

/// Choices per expert of every sparse layer for some scored tokens ([`Model::expert_load`]).
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertLoad {
    /// The sparse layers' indices in the stack.
    pub layers: Vec<usize>,
    /// `counts[i][e]`: the (token, slot) choices of expert `e` at sparse layer `layers[i]`.
    pub counts: Vec<Vec<u64>>,
    /// Tokens scored.
    pub tokens: u64,
}

impl ExpertLoad {
    /// Each layer's choices as shares of its `tokens x k` slots (a balanced router gives every
    /// expert `1 / experts`).
    pub fn shares(&self) -> Vec<Vec<f64>> {
        self.counts
            .iter()
            .map(|row| {
                let total = row.iter().sum::<u64>().max(1) as f64;
                row.iter().map(|&c| c as f64 / total).collect()
            })
            .collect()
    }

    /// The largest share any expert takes in any layer.
    pub fn max_share(&self) -> f64 {
        self.shares().iter().flatten().copied().fold(0.0, f64::max)
    }
}

impl Model {
    /// The expert choices of every sparse layer when `rows` are scored (each forwarded alone).
    /// A dense model is an error.
    pub fn expert_load(&self, rows: &[&[i64]]) -> Result<ExpertLoad, ModelError> {
        let Some(mixture) = &self.lm.config.mixture else {
            return Err(ModelError::Input("expert_load needs a mixture-of-experts model".into()));
        };
        let layers: Vec<usize> = (0..mixture.sparse_layers.len())
            .filter(|&l| mixture.is_sparse(l))
            .collect();
        let mut counts = vec![vec![0u64; mixture.num_experts as usize]; layers.len()];
        let mut tokens = 0;
        for row in rows.iter().filter(|r| !r.is_empty()) {
            let n = row.len() as i64;
            let ids = Tensor::from_slice(row).view([1, n]);
            let pos = Tensor::arange(n, (Kind::Int64, tch::Device::Cpu)).view([1, n]);
            let (_, routes) = tch::no_grad(|| self.lm.forward_hidden_routed(&ids, &pos, &AttentionLayout::Causal))?;
            for (layer, routing) in counts.iter_mut().zip(routes) {
                let chosen = routing
                    .experts
                    .f_reshape([-1])?
                    .f_bincount(None::<Tensor>, mixture.num_experts)?;
                for (c, x) in layer
                    .iter_mut()
                    .zip(Vec::<i64>::try_from(chosen.f_to_device(tch::Device::Cpu)?)?)
                {
                    *c += x as u64;
                }
            }
            tokens += row.len() as u64;
        }
        Ok(ExpertLoad { layers, counts, tokens })
    }
}

impl Rich for ExpertLoad {
    fn html(&self) -> String {
        let map = Heatmap {
            title: format!(
                "Expert load over {} tokens (share of each layer's choices)",
                self.tokens
            ),
            rows: self.layers.iter().map(|l| format!("layer {l}")).collect(),
            columns: "expert".into(),
            values: self.shares(),
        };
        display::style::container(&display::section(
            "Expert load",
            &format!(
                "{}<p class=\"muted\">{}</p>",
                map.to_svg(),
                escape(&format!(
                    "Balanced: {:.3} each; the largest share is {:.3}.",
                    1.0 / self.counts.first().map_or(1, Vec::len).max(1) as f64,
                    self.max_share()
                ))
            ),
        ))
    }

    fn text(&self) -> String {
        let mut out = format!("expert load over {} tokens (shares per layer)\n", self.tokens);
        for (l, shares) in self.layers.iter().zip(self.shares()) {
            let cells: Vec<String> = shares.iter().map(|s| format!("{s:.2}")).collect();
            out.push_str(&format!("layer {l}: {}\n", cells.join(" ")));
        }
        out
    }
}

crate::display::rich_display!(ExpertLoad);
