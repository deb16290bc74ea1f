//! The load-balancing loss transformers adds for Qwen3-MoE (Switch Transformer's): over every
//! sparse layer's router, `E * sum_e f_e * P_e`, where `f_e` is the share of (token, slot)
//! choices that went to expert `e` (no gradient) and `P_e` its mean router probability.
//!
//! A training pass adds `coef x` that loss ([`RouterLoss`]) layer by layer: with the choices of
//! every layer counted in the forward, the loss is a sum over layers of
//! `coef E / R^2 sum_e T_e mass_{l,e}` (`T_e` choices of expert `e`, `R` weighted tokens over
//! all sparse layers, `mass_{l,e}` layer `l`'s probability mass on `e`), so a layer recomputed in
//! backward adds its own term ([`RouterTally::layer_term`]).

use tch::{Kind, Tensor};

use crate::model::error::ModelError;

/// The loss from each sparse layer's router logits `[n, experts]` (in the model's dtype, as the
/// routers returned them) with `top_k` experts a token; `mask` `[n]` (1 = a real token) leaves
/// padding out. Like transformers, the probabilities and the top-k are taken again in the
/// logits' dtype, and the choice counts and probabilities accumulate in fp32. A balanced router
/// gives `top_k`.
pub fn load_balancing_loss(logits: &[Tensor], top_k: i64, mask: Option<&Tensor>) -> Result<Tensor, ModelError> {
    let Some(first) = logits.first() else {
        return Err(ModelError::Input(
            "the load-balancing loss needs a sparse layer's router logits".into(),
        ));
    };
    let (n, experts) = match first.size()[..] {
        [n, e] => (n, e),
        ref s => {
            return Err(ModelError::Input(format!(
                "router logits of shape {s:?}; want [tokens, experts]"
            )));
        }
    };
    if let Some(l) = logits.iter().find(|l| l.size() != [n, experts]) {
        return Err(ModelError::Input(format!(
            "router logits of shapes {:?} and {:?}; every layer's must be [tokens, experts] alike",
            first.size(),
            l.size()
        )));
    }
    let weights = match mask {
        Some(m) if m.numel() as i64 == n => m.f_to_kind(Kind::Float)?.f_reshape([n])?.f_to_device(first.device())?,
        Some(m) => {
            return Err(ModelError::Input(format!(
                "a mask of {} values for {n} tokens",
                m.numel()
            )));
        }
        None => Tensor::f_ones([n], (Kind::Float, first.device()))?,
    };
    let mut tally = RouterTally::new(1.0, top_k, weights, experts)?;
    for l in logits {
        tally.count(l)?;
    }
    let mut total = Tensor::f_zeros([], (Kind::Float, first.device()))?;
    for l in logits {
        total += tally.layer_term(l)?;
    }
    Ok(total)
}

/// The load-balancing loss a training pass adds: `coef x` the loss over the pass's tokens,
/// each token weighted by `token_weights` `[batch x seq]` (row-major, as the input ids; 0
/// leaves a padding token out, and a token of a prefix tree counts once for every rollout
/// through it, so a tree row's loss is that of its rollouts as one padded batch).
#[derive(Debug)]
pub struct RouterLoss {
    /// `router_aux_loss_coef`.
    pub coef: f64,
    /// `[batch x seq]` fp32.
    pub token_weights: Tensor,
}

/// The loss of one pass being put together: every sparse layer's choices counted in the
/// forward, then each layer's differentiable term.
#[derive(Debug)]
pub(crate) struct RouterTally {
    coef: f64,
    top_k: i64,
    weights: Tensor,
    /// Weighted choices per expert `[E]`, over the layers counted.
    chosen: Tensor,
    /// Weighted probability mass per expert `[E]` (no graph), over the layers counted.
    mass: Tensor,
    layers: usize,
}

impl RouterTally {
    /// An empty tally of `coef x` the loss with `top_k` of `experts` experts a token.
    pub(crate) fn new(coef: f64, top_k: i64, weights: Tensor, experts: i64) -> Result<Self, ModelError> {
        let zeros = || Tensor::f_zeros([experts], (Kind::Float, weights.device()));
        Ok(RouterTally {
            coef,
            top_k,
            chosen: zeros()?,
            mass: zeros()?,
            weights,
            layers: 0,
        })
    }

    /// The tally of `loss` over a pass of `tokens` tokens for a model with `top_k` of `experts`
    /// experts a token on `device`.
    pub(crate) fn of(
        loss: &RouterLoss,
        tokens: i64,
        (top_k, experts): (i64, i64),
        device: tch::Device,
    ) -> Result<Self, ModelError> {
        if loss.token_weights.numel() as i64 != tokens {
            return Err(ModelError::Input(format!(
                "the router loss weighs {} tokens; the pass has {tokens}",
                loss.token_weights.numel()
            )));
        }
        let weights = loss
            .token_weights
            .f_to_kind(Kind::Float)?
            .f_reshape([-1])?
            .f_to_device(device)?;
        Self::new(loss.coef, top_k, weights, experts)
    }

    /// Weighted probabilities `[n, E]` of one layer's logits (in their dtype, then fp32).
    fn probs(&self, logits: &Tensor) -> Result<Tensor, ModelError> {
        let p = logits.f_softmax(-1, logits.kind())?.f_to_kind(Kind::Float)?;
        Ok(p * self.weights.unsqueeze(-1))
    }

    /// Counts one sparse layer's choices and probability mass (without a graph).
    pub(crate) fn count(&mut self, logits: &Tensor) -> Result<(), ModelError> {
        let logits = logits.detach();
        let p = logits.f_softmax(-1, logits.kind())?;
        let (_, top) = p.f_topk(self.top_k, -1, true, true)?;
        let one_hot = p
            .f_zeros_like()?
            .f_to_kind(Kind::Float)?
            .f_scatter_value(1, &top, 1.0)?;
        let w = self.weights.unsqueeze(-1);
        self.chosen += (one_hot * &w).f_sum_dim_intlist(0, false, Kind::Float)?;
        self.mass += self.probs(&logits)?.f_sum_dim_intlist(0, false, Kind::Float)?;
        self.layers += 1;
        Ok(())
    }

    /// Weighted tokens over the layers counted (`R`).
    fn tokens(&self) -> Result<f64, ModelError> {
        Ok(self.weights.f_sum(Kind::Float)?.double_value(&[]) * self.layers as f64)
    }

    /// The loss itself (without `coef`) over the layers counted.
    pub(crate) fn value(&self) -> Result<f64, ModelError> {
        let r = self.tokens()?;
        if r <= 0.0 {
            // No real token: nothing to balance (transformers divides 0 by 0 here).
            return Ok(0.0);
        }
        let experts = self.chosen.size()[0] as f64;
        Ok(experts * (&self.chosen * &self.mass).f_sum(Kind::Float)?.double_value(&[]) / r / r)
    }

    /// `coef x` the whole loss, differentiable through every sparse layer's router logits in
    /// `routes` (each counted first).
    pub(crate) fn whole_term(&mut self, routes: &[super::Routing]) -> Result<Tensor, ModelError> {
        for r in routes {
            self.count(&r.logits)?;
        }
        let mut total = Tensor::f_zeros([], (Kind::Float, self.weights.device()))?;
        for r in routes {
            total += self.layer_term(&r.logits)?;
        }
        Ok(total)
    }

    /// `coef x` the part of the loss one counted layer contributes, differentiable through its
    /// router `logits`: `coef E / R^2 sum_e T_e mass_e`.
    pub(crate) fn layer_term(&self, logits: &Tensor) -> Result<Tensor, ModelError> {
        let r = self.tokens()?.max(f64::MIN_POSITIVE);
        let scale = self.coef * self.chosen.size()[0] as f64 / (r * r);
        let mass = self.probs(logits)?.f_sum_dim_intlist(0, false, Kind::Float)?;
        Ok((mass * &self.chosen).f_sum(Kind::Float)? * scale)
    }
}
