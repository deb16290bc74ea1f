//! One forward and backward of a training loss, optionally with activation (gradient)
//! checkpointing at decoder-layer boundaries: the stack runs once without autograd keeping only
//! each layer's input; the loss is back-propagated to the last layer's output; then each layer,
//! last first, is run again with autograd and back-propagated from its output's gradient. Peak
//! activation memory is one layer's (plus the layer inputs) instead of the whole stack's, for one
//! more forward of the stack. Gradients are those of the plain forward (the recomputation is
//! the same arithmetic; LoRA dropout replays the masks it drew).

use std::sync::Arc;

use tch::{Kind, Tensor};

use super::attention::KeyValues;
use super::decoder::CausalLm;
use super::error::ModelError;
use super::hooks::{ParamUnit, Phase};
use super::layers::{Linear, LinearAdapter};
use super::layout::AttentionLayout;
use super::lora::DropoutStream;
use super::moe::{RouterLoss, RouterTally};

/// Whether to recompute layer activations in backward (`gradient_checkpointing`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Activations {
    /// Kept from the forward (fastest).
    #[default]
    Kept,
    /// Recomputed per decoder layer in backward (least memory).
    Recomputed,
}

impl Activations {
    /// `gradient_checkpointing = true` means [`Activations::Recomputed`].
    pub(crate) fn from_checkpointing(on: bool) -> Self {
        if on { Activations::Recomputed } else { Activations::Kept }
    }
}

impl CausalLm {
    /// Forward of `input_ids`, `position_ids` `[batch, seq]` under `layout`, then `head` on the
    /// final hidden states `[batch, seq, hidden]`, which returns the loss to back-propagate (or
    /// `None` when it back-propagated its own part already, e.g. a chunked head, and nothing
    /// reaches the layers) and what the caller wants back; then backward into every parameter's
    /// gradient (accumulated). A loss that does not require grad is not back-propagated.
    pub fn forward_backward<T>(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        layout: &AttentionLayout,
        activations: Activations,
        head: impl FnOnce(&Tensor) -> Result<(Option<Tensor>, T), ModelError>,
    ) -> Result<T, ModelError> {
        let pass = Inputs {
            input_ids,
            position_ids,
            layout,
            routing: None,
        };
        Ok(self.forward_backward_routed(pass, activations, None, head)?.0)
    }

    /// [`CausalLm::forward_backward`] adding `router`'s load-balancing loss of a mixture model
    /// to the loss (layer by layer when activations are recomputed); returns the loss's value
    /// (without its coefficient) too. Without a `router`, or for a dense model, nothing is added
    /// and the value is `None`.
    pub fn forward_backward_routed<T>(
        &self,
        pass: Inputs<'_>,
        activations: Activations,
        router: Option<&RouterLoss>,
        head: impl FnOnce(&Tensor) -> Result<(Option<Tensor>, T), ModelError>,
    ) -> Result<(T, Option<f64>), ModelError> {
        let Inputs {
            input_ids,
            position_ids,
            layout,
            routing,
        } = pass;
        self.check_activations_fit(input_ids, activations)?;
        self.begin_pass(super::Pass::ForwardBackward)?;
        let mut tally = self.router_tally(router, input_ids.numel() as i64)?;
        if activations == Activations::Kept && !self.in_lockstep() {
            let (hidden, routes) = self.forward_hidden_recorded(pass)?;
            let (loss, out) = head(&hidden)?;
            let aux = tally.as_mut().map(|t| t.whole_term(&routes)).transpose()?;
            if let Some(loss) = sum_of(loss, aux) {
                backward(&loss)?;
            }
            return Ok((out, tally.map(|t| t.value()).transpose()?));
        }
        // Layer by layer: recomputed, or (in lockstep) each layer's graph kept apart so its
        // parameters can be freed between its forward and its backward, and its gradients
        // reduced as soon as they are done.
        let keep = activations == Activations::Kept;
        // 1. Inputs, RoPE and mask as the plain forward makes them.
        let (ids, batch, seq) = self.checked_ids(input_ids, position_ids)?;
        let masks = self.layout_masks(layout, batch, seq)?;
        let (cos, sin) = self.rope(position_ids)?;
        let kv = || masks.key_values(layout, routing);
        // 2. The stack, keeping each layer's input [batch, seq, hidden] (a leaf, with the
        //    layer's output when kept) and where the dropout stream stood when it ran; every
        //    sparse layer's choices counted.
        self.gather(ParamUnit::Root)?;
        let (stack, x) = self.forward_stack(&ids, keep, (&cos, &sin), &kv, tally.as_mut())?;
        let after = stack.draws();
        // 3. The final norm and the head from a leaf at the last layer's output.
        let leaf = x.detach().set_requires_grad(true);
        let (loss, out) = head(&self.norm.forward(&leaf))?;
        if let Some(loss) = loss {
            backward(&loss)?;
        }
        // 4. Each layer, last first, back-propagated from its output's gradient (run again
        //    with autograd unless kept) and its router's share of the load-balancing loss.
        //    In lockstep, every layer takes part even without one.
        let mut grad = leaf.grad();
        if !grad.defined() && tally.is_some() {
            grad = leaf.zeros_like();
        }
        for (i, layer) in self.layers.iter().enumerate().rev() {
            if !grad.defined() && !self.in_lockstep() {
                break;
            }
            self.gather(ParamUnit::Layer(i))?;
            self.prefetch(i.checked_sub(1), Phase::BackwardPre)?;
            grad = match grad.defined() {
                true => self.layer_backward(layer, i, (&stack, tally.as_ref()), (&cos, &sin), &kv, &grad)?,
                false => grad,
            };
            self.prefetch(i.checked_sub(1), Phase::BackwardPost)?;
            self.reduce(ParamUnit::Layer(i))?;
            self.release(ParamUnit::Layer(i))?;
        }
        // 5. The embedding.
        if grad.defined() {
            backward(&(self.embed(&ids) * &grad).sum(Kind::Float))?;
        }
        if let Some(d) = &stack.dropout {
            d.set_draws(after);
        }
        Ok((out, tally.map(|t| t.value()).transpose()?))
    }

    /// The tally of `router` for this model: none for a dense one, without a coefficient, or
    /// for a family whose reference adds no load-balancing loss (Muse Spark).
    fn router_tally(&self, router: Option<&RouterLoss>, tokens: i64) -> Result<Option<RouterTally>, ModelError> {
        let (Some(router), Some(mixture)) = (router, &self.config.mixture) else {
            return Ok(None);
        };
        if !mixture.load_balancing {
            return Ok(None);
        }
        let device = self.embed_tokens.device();
        let shape = (mixture.experts_per_token, mixture.num_experts);
        RouterTally::of(router, tokens, shape, device).map(Some)
    }

    /// The decoder layers from the embeddings `ids`' output, each gathered before and freed
    /// after its forward: without autograd, or (`keep`) each layer's graph kept from a leaf at
    /// its input. Returns what the backward needs and the last layer's output.
    fn forward_stack<'a>(
        &self,
        ids: &Tensor,
        keep: bool,
        (cos, sin): (&Tensor, &Tensor),
        kv: &dyn Fn() -> KeyValues<'a>,
        mut tally: Option<&mut RouterTally>,
    ) -> Result<(Stack, Tensor), ModelError> {
        let n = self.layers.len();
        let mut stack = Stack {
            inputs: Vec::with_capacity(n),
            outputs: Vec::with_capacity(n),
            router_logits: Vec::with_capacity(n),
            replay: Vec::with_capacity(n),
            dropout: self.dropout_stream(),
        };
        let mut x = tch::no_grad(|| self.embed(ids));
        for (i, layer) in self.layers.iter().enumerate() {
            stack.replay.push(stack.draws());
            self.gather(ParamUnit::Layer(i))?;
            self.prefetch(Some(i + 1), Phase::Forward)?;
            let (y, routing) = match keep {
                true => {
                    x = x.detach().set_requires_grad(true);
                    let (y, routing) = layer.forward_routed(&x, cos, sin, i, &mut kv())?;
                    stack.outputs.push(y.shallow_clone());
                    (y.detach(), routing)
                }
                false => tch::no_grad(|| layer.forward_routed(&x, cos, sin, i, &mut kv()))?,
            };
            if let (Some(t), Some(r)) = (tally.as_deref_mut(), &routing) {
                t.count(&r.logits)?;
            }
            // A kept layer's router logits keep their graph for its share of the loss.
            stack.router_logits.push(routing.filter(|_| keep).map(|r| r.logits));
            self.release(ParamUnit::Layer(i))?;
            stack.inputs.push(std::mem::replace(&mut x, y));
        }
        Ok((stack, x))
    }

    /// Layer `i`'s backward from its output's gradient `grad`: through its kept graph, or
    /// recomputed from its input with the dropout masks it drew; returns its input's gradient.
    fn layer_backward<'a>(
        &self,
        layer: &super::DecoderLayer,
        i: usize,
        (stack, tally): (&Stack, Option<&RouterTally>),
        (cos, sin): (&Tensor, &Tensor),
        kv: &dyn Fn() -> KeyValues<'a>,
        grad: &Tensor,
    ) -> Result<Tensor, ModelError> {
        let (input, y, logits) = match stack.outputs.get(i) {
            Some(y) => (
                stack.inputs[i].shallow_clone(),
                y.shallow_clone(),
                stack.router_logits[i].as_ref().map(Tensor::shallow_clone),
            ),
            None => {
                if let Some(d) = &stack.dropout {
                    d.set_draws(stack.replay[i]);
                }
                let input = stack.inputs[i].detach().set_requires_grad(true);
                let (y, routing) = layer.forward_routed(&input, cos, sin, i, &mut kv())?;
                (input, y, routing.map(|r| r.logits))
            }
        };
        let mut loss = (y * grad).sum(Kind::Float);
        if let (Some(t), Some(logits)) = (tally, logits) {
            loss += t.layer_term(&logits)?;
        }
        backward(&loss)?;
        Ok(input.grad())
    }

    /// A training step whose saved activations cannot fit the host's memory is an error naming
    /// the tokens that would fit, before anything is allocated (on a device, the device's own
    /// allocator reports it). In tokens, not rows: packed batches are forwarded as one row.
    fn check_activations_fit(&self, input_ids: &Tensor, activations: Activations) -> Result<(), ModelError> {
        let (&[batch, seq], crate::device::Device::Cpu) = (&input_ids.size()[..], self.device()) else {
            return Ok(());
        };
        let elt = self.kind().elt_size_in_bytes() as u128;
        let per_token = activation_floor(&self.config, 1, activations) * elt;
        let tokens = (batch.max(0) * seq.max(0)) as u128;
        let need = per_token * tokens;
        match crate::device::host_shortfall(need) {
            Some(available) => Err(ModelError::Input(format!(
                "a training step over {tokens} tokens keeps at least {:.1} GB of activations; {:.1} GB of memory is available, enough for about {} tokens: use fewer rows per batch (batch_size), shorter rows (max_length) or gradient_checkpointing",
                need as f64 / 1e9,
                available as f64 / 1e9,
                available / per_token.max(1)
            ))),
            None => Ok(()),
        }
    }

    /// The dropout stream of the attached LoRA adapter, if it has one.
    fn dropout_stream(&self) -> Option<Arc<DropoutStream>> {
        let lora = |l: &Linear| match &l.adapter {
            Some(LinearAdapter::Lora(d)) => Some(d.dropout.clone()),
            _ => None,
        };
        self.layers.iter().find_map(|layer| {
            let (a, m) = (&layer.self_attn, &layer.mlp);
            a.linears().into_iter().chain(m.linears()).find_map(lora)
        })
    }
}

/// What a layer-by-layer forward keeps for the backward: each layer's input (a leaf when its
/// graph is kept), its output with its graph (kept only), and where the LoRA adapter's dropout
/// stream stood when it ran (replayed by a recompute).
struct Stack {
    inputs: Vec<Tensor>,
    outputs: Vec<Tensor>,
    /// A kept sparse layer's router logits, with their graph.
    router_logits: Vec<Option<Tensor>>,
    replay: Vec<u64>,
    dropout: Option<Arc<DropoutStream>>,
}

impl Stack {
    /// Masks the dropout stream has drawn so far (0 without one).
    fn draws(&self) -> u64 {
        self.dropout.as_ref().map_or(0, |d| d.draws())
    }
}

/// Elements a training step keeps at least for `seq` tokens until its backward: per token
/// and layer the norms', attention's and residual's outputs (6 x hidden) and the MLP's gate, up
/// and product (3 x intermediate, or a mixture's `k` experts' and its routing), leaving out the attention weights (their size depends on the
/// layout's blocks); recomputed, each layer's input plus one layer's worth. A floor, not an
/// estimate: the peaks `benches/memory.rs` measures lie above it, so a step it refuses cannot fit.
fn activation_floor(config: &super::ModelConfig, seq: i64, activations: Activations) -> u128 {
    let feed_forward = match &config.mixture {
        // The smaller of the two kinds: a floor holds whichever kind a layer is.
        Some(m) => (3 * m.experts_per_token * m.expert_size + m.num_experts).min(3 * config.intermediate_size),
        None => 3 * config.intermediate_size,
    };
    let layer = (6 * config.hidden_size + feed_forward).max(0) as u128;
    let per_token = match activations {
        Activations::Kept => layer * config.num_layers.max(0) as u128,
        Activations::Recomputed => layer + (config.hidden_size * config.num_layers).max(0) as u128,
    };
    per_token * seq.max(0) as u128
}

/// The inputs of one forward: `input_ids` and `position_ids` `[batch, seq]` under `layout`.
#[derive(Debug, Clone, Copy)]
pub struct Inputs<'a> {
    /// `[batch, seq]` token ids.
    pub input_ids: &'a Tensor,
    /// `[batch, seq]` positions.
    pub position_ids: &'a Tensor,
    /// How the tokens attend.
    pub layout: &'a AttentionLayout,
    /// The routing recorded when the tokens were generated, replayed or compared by the
    /// sparse layers (GRPO's routing replay); `None` routes as usual.
    pub routing: Option<&'a super::moe::RecordedRouting>,
}

/// The head's loss plus the router's term, when there is either.
fn sum_of(loss: Option<Tensor>, aux: Option<Tensor>) -> Option<Tensor> {
    match (loss, aux) {
        (Some(l), Some(a)) => Some(l + a),
        (l, a) => l.or(a),
    }
}

/// `loss.backward()` when the loss depends on something trainable.
fn backward(loss: &Tensor) -> Result<(), ModelError> {
    if loss.requires_grad() {
        loss.f_backward()?;
    }
    Ok(())
}
