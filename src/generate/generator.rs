//! Batched generation with a static KV cache: chunked prefill and one decode shape.

use tch::{Kind, Tensor};

use crate::device::{Device, privateuse1};

use super::completion::{Completion, FinishReason};
use super::config::{GenerateError, GenerationConfig};
use super::cpu_sampler::choose_rows;
use super::cuda_graph::GraphState;
use super::decoding::Decoding;
use super::device_sampling::seen_mask;
use crate::model::moe::RoutingTrace;
use crate::model::{CausalLm, DynamicCache, KvCache, StaticCache};
use crate::shapes::ShapeLedger;
use crate::util::SplitMix64;

/// Generates with any model it is handed; records every forward's input shape in `ledger`.
///
/// Holds no reference to the model, so a notebook can keep one generator (and its ledger)
/// across cells.
#[derive(Debug, Default)]
pub struct Generator {
    /// Shapes fed to the `prefill` and `decode` graphs across calls.
    pub ledger: ShapeLedger,
    /// Whether calls record the routing of a mixture model's tokens.
    record_routing: bool,
    /// The last call's traces, completion by completion, when recorded.
    routing: Option<Vec<RoutingTrace>>,
}

impl Generator {
    /// A generator with an empty ledger.
    pub fn new() -> Self {
        Generator::default()
    }

    /// Records, in later calls on a mixture model, every forwarded token's routing (each sparse
    /// layer's chosen experts): what GRPO's routing replay replays. CUDA graphs are not used
    /// while recording.
    pub fn record_routing(&mut self, on: bool) {
        self.record_routing = on;
    }

    /// The routing the last call recorded, completion by completion (`None` when not
    /// recording or for a dense model).
    pub fn take_routing(&mut self) -> Option<Vec<RoutingTrace>> {
        self.routing.take()
    }

    /// Whether this call records routing for `model`.
    fn records(&self, model: &CausalLm) -> bool {
        self.record_routing && model.config.mixture.is_some()
    }

    pub(super) fn check(
        &self,
        model: &CausalLm,
        prompts: &[Vec<i64>],
        cfg: &GenerationConfig,
    ) -> Result<(), GenerateError> {
        if prompts.is_empty() {
            return Err(GenerateError::Config("no prompts".into()));
        }
        if cfg.prefill_chunk_size < 1 {
            return Err(GenerateError::Config("prefill_chunk_size must be at least 1".into()));
        }
        if let Err((field, message)) = cfg.sampling.check() {
            return Err(GenerateError::Config(format!("{field} {message}")));
        }
        let vocab = model.config.vocab_size;
        for (index, p) in prompts.iter().enumerate() {
            if p.is_empty() {
                return Err(GenerateError::Prompt {
                    index,
                    message: "empty".into(),
                });
            }
            if let Some(t) = p.iter().find(|&&t| t < 0 || t >= vocab) {
                return Err(GenerateError::Prompt {
                    index,
                    message: format!("token {t} outside 0..{vocab}"),
                });
            }
            if let Some(message) = model.config.tower_token(p) {
                return Err(GenerateError::Prompt { index, message });
            }
        }
        if !(0..vocab).contains(&cfg.pad_token_id) {
            return Err(GenerateError::Config(format!(
                "pad_token_id {} outside 0..{vocab}",
                cfg.pad_token_id
            )));
        }
        Ok(())
    }

    /// Left-pads `prompts` to a multiple of the chunk size; returns ids, real-token mask and
    /// position ids, each `[batch, padded]`.
    fn pad(&self, prompts: &[Vec<i64>], cfg: &GenerationConfig) -> (i64, Vec<i64>, Vec<bool>, Vec<i64>) {
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(1) as i64;
        let padded = (longest + cfg.prefill_chunk_size - 1) / cfg.prefill_chunk_size * cfg.prefill_chunk_size;
        let (mut ids, mut real, mut pos) = (Vec::new(), Vec::new(), Vec::new());
        for p in prompts {
            let pad = padded as usize - p.len();
            ids.extend(std::iter::repeat_n(cfg.pad_token_id, pad).chain(p.iter().copied()));
            real.extend(std::iter::repeat_n(false, pad).chain(std::iter::repeat_n(true, p.len())));
            pos.extend(std::iter::repeat_n(0, pad).chain(0..p.len() as i64));
        }
        (padded, ids, real, pos)
    }

    /// Mask `[batch, 1, t, slots]`: query `i` (slot `start + i`) sees valid slots up to its own,
    /// and always itself (so padding rows stay finite).
    fn mask(valid: &Tensor, start: i64, t: i64, slots: i64, device: Device) -> Result<Tensor, tch::TchError> {
        // f_ ops: an allocation that fails is an error, not a panic.
        let slot = device.arange(slots, Kind::Int64)?.f_view([1, slots])?;
        let query = (device.arange(t, Kind::Int64)?.f_add_scalar(start)?).f_view([t, 1])?;
        let causal = slot.f_le_tensor(&query)?;
        let own = slot.f_eq_tensor(&query)?;
        let valid = valid.f_narrow(1, 0, slots)?.f_unsqueeze(1)?;
        valid
            .f_logical_and(&causal.f_unsqueeze(0)?)?
            .f_logical_or(&own.f_unsqueeze(0)?)?
            .f_unsqueeze(1)
    }

    fn prefill<C: KvCache>(
        &mut self,
        model: &CausalLm,
        prompts: &[Vec<i64>],
        cfg: &GenerationConfig,
        cache: C,
        slots_total: i64,
    ) -> Result<Decoding<C>, GenerateError> {
        let device = model.device();
        let b = prompts.len() as i64;
        let mut st = Decoding {
            cache,
            valid: device.zeros(&[b, slots_total], Kind::Bool)?,
            next_pos: vec![0; prompts.len()],
            logits: Tensor::new(),
            seen: match cfg.sampling.repetition_penalty != 1.0 {
                true => Some(device.zeros(&[b, model.config.vocab_size], Kind::Bool)?),
                false => None,
            },
            routing: self
                .records(model)
                .then(|| vec![RoutingTrace::default(); prompts.len()]),
        };
        self.extend(model, &mut st, prompts, cfg)?;
        Ok(st)
    }

    /// Appends `tails[r]` to row `r` of `st` (a prompt into an empty cache, or what follows a
    /// turn), chunk by chunk, and leaves the logits after each row's last token: tails are
    /// left-padded to one multiple of the chunk size, so every row's last token sits in the
    /// last slot and the shape stays `[batch, chunk]`. Positions continue each row's own.
    pub(super) fn extend<C: KvCache>(
        &mut self,
        model: &CausalLm,
        st: &mut Decoding<C>,
        tails: &[Vec<i64>],
        cfg: &GenerationConfig,
    ) -> Result<(), GenerateError> {
        let device = model.device();
        let b = tails.len() as i64;
        let (padded, ids, real, mut pos) = self.pad(tails, cfg);
        for (row, p) in pos.chunks_mut(padded as usize).zip(&st.next_pos) {
            row.iter_mut().for_each(|x| *x += p);
        }
        let ids = device.from_slice(&ids)?.f_view([b, padded])?;
        let pos = device.from_slice(&pos)?.f_view([b, padded])?;
        let real_t = device.from_slice(&real)?.f_view([b, padded])?;
        let first = st.cache.len();
        if first + padded > st.valid.size()[1] {
            return Err(GenerateError::Config(format!(
                "the cache holds {} positions: {first} used, {padded} more needed",
                st.valid.size()[1]
            )));
        }
        st.valid.narrow(1, first, padded).copy_(&real_t);
        let chunk = cfg.prefill_chunk_size;
        let mut last = None;
        for start in (0..padded).step_by(chunk as usize) {
            self.ledger.record("prefill", &[b, chunk]);
            let slots = st.cache.slots_after(chunk);
            let mask = Self::mask(&st.valid, first + start, chunk, slots, device)?;
            let (h, routes) = model.forward_cached_routed(
                &ids.narrow(1, start, chunk),
                &pos.narrow(1, start, chunk),
                &mut st.cache,
                &mask,
                st.routing.is_some(),
            )?;
            let real_chunk: Vec<bool> = (0..b as usize)
                .flat_map(|r| (start..start + chunk).map(move |j| (r, j)))
                .map(|(r, j)| real[r * padded as usize + j as usize])
                .collect();
            st.record(&routes, &real_chunk)?;
            last = Some(h.select(1, chunk - 1));
        }
        let last = last.ok_or_else(|| GenerateError::Config("nothing to prefill".into()))?;
        st.logits = model.decode_logits(&last).to_kind(Kind::Float);
        for (p, t) in st.next_pos.iter_mut().zip(tails) {
            *p += t.len() as i64;
        }
        if let Some(seen) = &st.seen {
            let _ = seen
                .shallow_clone()
                .f_logical_or_(&seen_mask(tails, model.config.vocab_size, device)?)?;
        }
        Ok(())
    }

    /// Decodes one completion per row of `st`; a row's last chosen token is left out of the
    /// cache (`next_pos` counts what is in it), so a later [`Generator::extend`] starts there.
    pub(super) fn decode<C: KvCache>(
        &mut self,
        model: &CausalLm,
        st: &mut Decoding<C>,
        prompt_index: &[usize],
        cfg: &GenerationConfig,
    ) -> Result<Vec<Completion>, GenerateError> {
        let b = st.next_pos.len();
        let mut rngs: Vec<SplitMix64> = (0..b).map(|r| cfg.sampling.row_stream(r)).collect();
        let mut out: Vec<Completion> = prompt_index
            .iter()
            .map(|&i| Completion {
                prompt_index: i,
                output_ids: Vec::new(),
                logprobs: Vec::new(),
                untruncated_logprobs: Vec::new(),
                finish_reason: FinishReason::Length,
            })
            .collect();
        let mut done = vec![false; b];
        let mut graph = GraphState::new(cfg, model)?;
        for step in 0..cfg.max_new_tokens {
            let fresh: Vec<bool> = done.iter().map(|d| !d).collect();
            let next = choose_next(st, &mut out, &mut done, cfg, &mut rngs)?;
            if done.iter().all(|&d| d) || step + 1 == cfg.max_new_tokens {
                break;
            }
            self.forward_chosen(model, st, &next, &fresh, &mut graph)?;
        }
        Ok(out)
    }

    /// Forwards the chosen tokens (padding for finished rows: the same shape every step) and
    /// leaves the next logits in `st`. Only `fresh` rows (those that chose a token this step,
    /// the one that finished a row included) get a valid slot and advance their position, so
    /// a finished row's cache holds its own tokens only and can be continued.
    fn forward_chosen<C: KvCache>(
        &mut self,
        model: &CausalLm,
        st: &mut Decoding<C>,
        next: &[i64],
        fresh: &[bool],
        graph: &mut GraphState,
    ) -> Result<(), GenerateError> {
        let device = model.device();
        let b = next.len() as i64;
        let start = st.cache.len();
        let slots = st.cache.slots_after(1);
        if slots > st.valid.size()[1] {
            st.valid = Tensor::cat(
                &[&st.valid, &device.zeros(&[b, slots - st.valid.size()[1]], Kind::Bool)?],
                1,
            );
        }
        let fresh_t = device.from_slice(fresh)?.f_view([b, 1])?;
        st.valid.narrow(1, start, 1).copy_(&fresh_t);
        let pos: Vec<i64> = st.next_pos.clone();
        for (p, &f) in st.next_pos.iter_mut().zip(fresh) {
            if f {
                *p += 1;
            }
        }
        // Slots past this one are not valid yet, so the valid slots are exactly what the new
        // token may see: no causal term needed (fewer ops on the hot path).
        let mask = st.valid.narrow(1, 0, slots).view([b, 1, 1, slots]);
        self.ledger.record("decode", &[b, 1]);
        if st.routing.is_none()
            && let Some(logits) = graph.step(model, &mut st.cache, &mask, next, &pos)?
        {
            st.logits = logits;
            return Ok(());
        }
        let ids = device.from_slice(next)?.f_view([b, 1])?;
        let pos = device.from_slice(&pos)?.f_view([b, 1])?;
        let recording = st.routing.is_some();
        let (h, routes) = model.forward_cached_routed(&ids, &pos, &mut st.cache, &mask, recording)?;
        st.record(&routes, fresh)?;
        st.logits = model.decode_logits(&h.select(1, 0)).to_kind(Kind::Float);
        Ok(())
    }

    /// The prefill cache of `prompts` (`rows` of them) for a call that will hold `total_rows`
    /// rows at once (forked groups), refused before any allocation when the positions exceed
    /// the model's or the cache cannot fit in the host's available memory.
    fn static_cache(
        &self,
        model: &CausalLm,
        rows: i64,
        total_rows: usize,
        prompts: &[Vec<i64>],
        cfg: &GenerationConfig,
    ) -> Result<StaticCache, GenerateError> {
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
        let index = prompts.iter().position(|p| p.len() == longest).unwrap_or(0);
        model
            .config
            .check_positions(
                longest.saturating_add(cfg.max_new_tokens),
                &format!("prompt {index} + max_new_tokens {}", cfg.max_new_tokens),
            )
            .map_err(GenerateError::Config)?;
        let (padded, ..) = self.pad(prompts, cfg);
        let need = padded + cfg.max_new_tokens as i64;
        let max_len = cfg.max_cache_len.unwrap_or(need);
        if max_len < need {
            return Err(GenerateError::Config(format!(
                "max_cache_len {max_len} < padded prompt {padded} + max_new_tokens {}",
                cfg.max_new_tokens
            )));
        }
        check_cache_fits(
            model,
            total_rows,
            max_len as usize,
            cfg.prefill_chunk_size.max(1) as usize,
        )?;
        Ok(StaticCache::new(
            &model.config,
            rows,
            max_len,
            model.kind(),
            model.device(),
        )?)
    }

    /// One completion per prompt, with a static cache: two shapes per call (`prefill`
    /// `[batch, chunk]` and `decode` `[batch, 1]`), whatever the prompt lengths.
    pub fn generate(
        &mut self,
        model: &CausalLm,
        prompts: &[Vec<i64>],
        cfg: &GenerationConfig,
    ) -> Result<Vec<Completion>, GenerateError> {
        self.check(model, prompts, cfg)?;
        privateuse1::checked(model.device(), || {
            let cache = self.static_cache(model, prompts.len() as i64, prompts.len(), prompts, cfg)?;
            let slots = cache.max_len;
            self.one_per_prompt(model, prompts, cfg, cache, slots)
        })
    }

    /// Prefill into `cache` (`slots` wide), then decode one completion per prompt.
    fn one_per_prompt<C: KvCache>(
        &mut self,
        model: &CausalLm,
        prompts: &[Vec<i64>],
        cfg: &GenerationConfig,
        cache: C,
        slots: i64,
    ) -> Result<Vec<Completion>, GenerateError> {
        let mut st = tch::no_grad(|| self.prefill(model, prompts, cfg, cache, slots))?;
        let index: Vec<usize> = (0..prompts.len()).collect();
        let out = tch::no_grad(|| self.decode(model, &mut st, &index, cfg));
        self.routing = st.routing.take();
        out
    }

    /// `group` completions per prompt (GRPO), prefix-shared: each prompt is prefilled once and
    /// its cache rows forked into the `group` decoding slots. Completions come prompt by prompt.
    pub fn generate_groups(
        &mut self,
        model: &CausalLm,
        prompts: &[Vec<i64>],
        group: usize,
        cfg: &GenerationConfig,
    ) -> Result<Vec<Completion>, GenerateError> {
        self.check(model, prompts, cfg)?;
        if group == 0 {
            return Err(GenerateError::Config("num_generations must be at least 1".into()));
        }
        privateuse1::checked(model.device(), || {
            let (mut forked, prompt_index) = self.prefill_groups(model, prompts, group, cfg)?;
            let out = tch::no_grad(|| self.decode(model, &mut forked, &prompt_index, cfg));
            self.routing = forked.routing.take();
            out
        })
    }

    /// Prefills every prompt once into a static cache and forks its rows into `group` decoding
    /// rows, prompt by prompt; returns the state and the prompt of each row.
    pub(super) fn prefill_groups(
        &mut self,
        model: &CausalLm,
        prompts: &[Vec<i64>],
        group: usize,
        cfg: &GenerationConfig,
    ) -> Result<(Decoding<StaticCache>, Vec<usize>), GenerateError> {
        // The prompts' cache and its fork into every group row live at once.
        let total = prompts.len().saturating_mul(group.saturating_add(1));
        let cache = self.static_cache(model, prompts.len() as i64, total, prompts, cfg)?;
        let slots = cache.max_len;
        let st = tch::no_grad(|| self.prefill(model, prompts, cfg, cache, slots))?;
        let rows: Vec<i64> = (0..prompts.len() as i64)
            .flat_map(|p| std::iter::repeat_n(p, group))
            .collect();
        let forked = tch::no_grad(|| st.fork(&rows))?;
        Ok((forked, rows.iter().map(|&r| r as usize).collect()))
    }

    /// The same as [`Generator::generate`] with a growing cache (a new shape every step): the
    /// baseline static caching is compared with.
    pub fn generate_dynamic(
        &mut self,
        model: &CausalLm,
        prompts: &[Vec<i64>],
        cfg: &GenerationConfig,
    ) -> Result<Vec<Completion>, GenerateError> {
        self.check(model, prompts, cfg)?;
        let cache = DynamicCache::new(model.config.num_layers as usize);
        let (padded, ..) = self.pad(prompts, cfg);
        privateuse1::checked(model.device(), || {
            self.one_per_prompt(model, prompts, cfg, cache, padded)
        })
    }
}

impl crate::display::Rich for Generator {
    fn html(&self) -> String {
        self.ledger.html()
    }
    fn text(&self) -> String {
        self.ledger.text()
    }
}

crate::display::rich_display!(Generator);

/// Refuses a host KV cache of `rows` x `slots`, with the prefill's working set (a chunk's
/// attention scores and mask against every slot), larger than the memory available now (what
/// would otherwise end in an allocation failure or the kernel's OOM killer), saying what fits.
fn check_cache_fits(model: &CausalLm, rows: usize, slots: usize, chunk: usize) -> Result<(), GenerateError> {
    if model.device() != Device::Cpu {
        return Ok(());
    }
    let Some(available) = crate::device::available_host_bytes() else {
        return Ok(());
    };
    let cache = model.config.kv_cache_bytes(rows, slots, model.kind());
    // Scores in fp32 per head, plus the boolean mask, of one chunk's queries against all slots.
    let per_chunk_row = slots as u128 * (4 * model.config.num_heads as u128 + 1);
    let prefill = rows as u128 * chunk as u128 * per_chunk_row;
    if cache.saturating_add(prefill) <= available {
        return Ok(());
    }
    if prefill > cache {
        let fits = available.saturating_sub(cache) / (rows as u128 * per_chunk_row).max(1);
        return Err(GenerateError::Config(format!(
            "prefill_chunk_size {chunk}: a chunk of {rows} rows attending over {slots} positions needs {:.1} GB beside the KV cache's {:.1} GB; {:.1} GB of memory is available: a chunk of at most {fits} tokens fits",
            prefill as f64 / 1e9,
            cache as f64 / 1e9,
            available as f64 / 1e9
        )));
    }
    let per_row = model.config.kv_cache_bytes(1, slots, model.kind()).max(1);
    Err(GenerateError::Config(format!(
        "the KV cache of {rows} rows x {slots} positions needs {:.1} GB; {:.1} GB of memory is available: at most {} rows fit at this length",
        cache as f64 / 1e9,
        available as f64 / 1e9,
        available / per_row
    )))
}

/// Chooses the next token of every unfinished row from `st.logits` (on their device: only the
/// ids and log-probs come back) and records it in `out`; a row ends on an EOS id, a stop
/// sequence or a stop string. Finished rows get the pad id.
fn choose_next<C: KvCache>(
    st: &mut Decoding<C>,
    out: &mut [Completion],
    done: &mut [bool],
    cfg: &GenerationConfig,
    rngs: &mut [SplitMix64],
) -> Result<Vec<i64>, GenerateError> {
    let sampling = &cfg.sampling;
    // One uniform per unfinished sampling row and step, as the host sampler draws.
    let uniforms: Vec<f64> = rngs
        .iter_mut()
        .zip(done.iter())
        .map(|(rng, &d)| if sampling.do_sample && !d { rng.next_f64() } else { 0.0 })
        .collect();
    let chosen = choose_rows(&st.logits, st.seen.as_ref(), sampling, &uniforms)?;
    let mut next = vec![cfg.pad_token_id; done.len()];
    for r in 0..done.len() {
        if done[r] {
            continue;
        }
        let token = chosen.tokens[r];
        // NaN or infinite logits (a broken model or device) pick garbage tokens: an error,
        // never a completion.
        if !chosen.logprobs[r].is_finite() {
            return Err(GenerateError::NonFinite {
                row: r,
                step: out[r].output_ids.len(),
                device: Device::of(&st.logits).to_string(),
            });
        }
        next[r] = token;
        let o = &mut out[r];
        o.output_ids.push(token);
        o.logprobs.push(chosen.logprobs[r]);
        o.untruncated_logprobs.push(chosen.untruncated_logprobs[r]);
        if cfg.eos_token_ids.contains(&token) {
            done[r] = true;
            o.finish_reason = FinishReason::Eos;
        } else if cfg
            .stop_sequences
            .iter()
            .any(|s| !s.is_empty() && o.output_ids.ends_with(s))
            || cfg
                .stop_strings
                .as_ref()
                .is_some_and(|s| s.ends_in_last_token(&o.output_ids))
        {
            done[r] = true;
            o.finish_reason = FinishReason::Stop;
        }
    }
    if let Some(seen) = &st.seen {
        let ids = Device::of(seen).from_slice(&next)?.f_view([-1, 1])?;
        // (A finished row's pad id is marked too: it never samples again.)
        let _ = seen.shallow_clone().f_scatter_value_(1, &ids, 1)?;
    }
    Ok(next)
}
