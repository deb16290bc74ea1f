//! How a batch's tokens spread over a mixture model's experts, layer by layer: what a router
//! that collapses onto a few experts (or a load-balancing loss that works) looks like.

use tch::{Kind, Tensor};

use crate::device::privateuse1;

use crate::display::{self, Heatmap, Rich, escape};
use crate::model::error::ModelError;
use crate::model::layout::AttentionLayout;
use crate::model::loaded::Model;
use crate::model::moe::Routing;

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
        privateuse1::checked(self.device(), || {
            let mut load = self.empty_load()?;
            for row in rows.iter().filter(|r| !r.is_empty()) {
                let n = row.len() as i64;
                let ids = self.device().from_slice(row)?.f_view([1, n])?;
                let positions: Vec<i64> = (0..n).collect();
                let pos = self.device().from_slice(&positions)?.f_view([1, n])?;
                self.route_into(&mut load, (&ids, &pos, &AttentionLayout::Causal), None)?;
                load.tokens += n as u64;
            }
            Ok(load)
        })
    }

    /// The expert choices of one forward of `ids`, `pos` `[1, n]` under `layout` (a packed
    /// row's), token `t` counted `weights[t]` times (the rollouts through it, for a prefix
    /// tree): what [`crate::grpo::GrpoTrainer::expert_load`] shows.
    pub(crate) fn expert_load_of(
        &self,
        inputs: (&Tensor, &Tensor, &AttentionLayout),
        weights: &[i64],
    ) -> Result<ExpertLoad, ModelError> {
        let mut load = self.empty_load()?;
        self.route_into(&mut load, inputs, Some(&Tensor::from_slice(weights)))?;
        load.tokens += weights.iter().sum::<i64>() as u64;
        Ok(load)
    }

    /// Forwards `inputs` without autograd and adds every sparse layer's choices to `load`.
    fn route_into(
        &self,
        load: &mut ExpertLoad,
        (ids, pos, layout): (&Tensor, &Tensor, &AttentionLayout),
        weights: Option<&Tensor>,
    ) -> Result<(), ModelError> {
        let (_, routes) = tch::no_grad(|| self.lm.forward_hidden_routed(ids, pos, layout))?;
        load.add(&routes, weights)
    }

    /// No choices yet, one row per sparse layer; a dense model is an error.
    fn empty_load(&self) -> Result<ExpertLoad, ModelError> {
        let Some(mixture) = &self.lm.config.mixture else {
            return Err(ModelError::Input("expert_load needs a mixture-of-experts model".into()));
        };
        let layers: Vec<usize> = (0..mixture.sparse_layers.len())
            .filter(|&l| mixture.is_sparse(l))
            .collect();
        let counts = vec![vec![0u64; mixture.num_experts as usize]; layers.len()];
        Ok(ExpertLoad {
            layers,
            counts,
            tokens: 0,
        })
    }
}

impl ExpertLoad {
    /// Adds each sparse layer's choices in `routes`, token `t` counted `weights[t]` times
    /// (once without weights).
    fn add(&mut self, routes: &[Routing], weights: Option<&Tensor>) -> Result<(), ModelError> {
        for (layer, routing) in self.counts.iter_mut().zip(routes) {
            let experts = routing.experts.f_to_device(tch::Device::Cpu)?;
            let k = experts.size().last().copied().unwrap_or(1);
            let slot_weights = weights
                .map(|w| w.f_view([-1, 1])?.f_expand([-1, k], false)?.f_reshape([-1]))
                .transpose()?;
            let chosen = experts
                .f_reshape([-1])?
                .f_bincount(slot_weights.as_ref(), layer.len() as i64)?;
            let chosen = Vec::<f64>::try_from(chosen.f_to_kind(Kind::Double)?)?;
            for (c, x) in layer.iter_mut().zip(chosen) {
                *c += x.round() as u64;
            }
        }
        Ok(())
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
