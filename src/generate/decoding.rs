//! The state of one batched decode: the cache, which slots hold real tokens, each row's next
//! position, the logits that choose the next tokens and (when recorded) each row's routing.

use tch::{Kind, Tensor};

use super::config::GenerateError;
use super::device_sampling::seen_mask;
use crate::device::Device;
use crate::model::moe::RoutingTrace;
use crate::model::{KvCache, StaticCache};

/// The decoding state after prefill: cache, which slots hold real tokens, per-row positions.
pub(super) struct Decoding<C: KvCache> {
    pub(super) cache: C,
    /// `[batch, slots]` bool: slots holding real (non-pad) tokens.
    pub(super) valid: Tensor,
    /// Next position id per row (= real tokens in the cache so far).
    pub(super) next_pos: Vec<i64>,
    /// Logits `[batch, vocab]` that choose each row's next token.
    pub(super) logits: Tensor,
    /// `[batch, vocab]` bool: the tokens each row has seen (prompt and completion so far), for
    /// the repetition penalty; only when one is set.
    pub(super) seen: Option<Tensor>,
    /// Per row, the routing of every token forwarded, when the generator records it.
    pub(super) routing: Option<Vec<RoutingTrace>>,
}

impl Decoding<StaticCache> {
    /// Drops what row `row` holds past its first `kept.len()` tokens (`kept`: those tokens):
    /// its later cache slots stop being attended, its next position and the tokens it has seen
    /// go back. The slots themselves stay used (every row advances the same slots).
    pub(super) fn rewind(&mut self, row: usize, kept: &[i64], vocab: i64) -> Result<(), GenerateError> {
        let r = row as i64;
        let valid = self.valid.f_get(r)?;
        let within = valid.f_cumsum(0, Kind::Int64)?.f_le(kept.len() as i64)?;
        let _ = valid.shallow_clone().f_logical_and_(&within)?;
        self.next_pos[row] = kept.len() as i64;
        if let Some(seen) = &self.seen {
            let fresh = seen_mask(&[kept.to_vec()], vocab, Device::of(seen))?;
            seen.f_get(r)?.f_copy_(&fresh.f_get(0)?)?;
        }
        Ok(())
    }

    /// The state of `rows` (indices into this one's rows, repeats allowed: a fork).
    pub(super) fn fork(&self, rows: &[i64]) -> Result<Self, GenerateError> {
        let index = Device::of(&self.valid).from_slice(rows)?;
        Ok(Decoding {
            cache: self.cache.fork(rows)?,
            valid: self.valid.f_index_select(0, &index)?,
            next_pos: rows.iter().map(|&r| self.next_pos[r as usize]).collect(),
            logits: self.logits.f_index_select(0, &index)?,
            seen: self.seen.as_ref().map(|s| s.f_index_select(0, &index)).transpose()?,
            routing: self
                .routing
                .as_ref()
                .map(|r| rows.iter().map(|&i| r[i as usize].clone()).collect()),
        })
    }
}

impl<C: KvCache> Decoding<C> {
    /// Appends to each row's trace the routing of the chunk's tokens where `real` `[batch, t]`
    /// (host, row-major) says the row forwarded one: `routes`, one per sparse layer, `[batch t,
    /// k]`.
    pub(super) fn record(&mut self, routes: &[crate::model::moe::Routing], real: &[bool]) -> Result<(), GenerateError> {
        let Some(traces) = &mut self.routing else {
            return Ok(());
        };
        if routes.is_empty() || traces.is_empty() {
            return Ok(());
        }
        let experts: Vec<&Tensor> = routes.iter().map(|r| &r.experts).collect();
        // `[batch t, sparse layers, k]` on the host.
        let all = Tensor::f_stack(&experts, 1)?.f_to_device(tch::Device::Cpu)?;
        let per_token = (all.size()[1] * all.size()[2]) as usize;
        let ids = Vec::<i64>::try_from(all.f_reshape([-1])?)?;
        let t = real.len() / traces.len();
        for (r, trace) in traces.iter_mut().enumerate() {
            trace.per_token = per_token;
            for j in (0..t).filter(|&j| real[r * t + j]) {
                let token = &ids[(r * t + j) * per_token..(r * t + j + 1) * per_token];
                trace.ids.extend(token.iter().map(|&e| e as u16));
            }
        }
        Ok(())
    }
}
