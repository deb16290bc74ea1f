//! Key/value caches for incremental decoding: a static one of fixed shape (one compiled graph
//! on Neuron, any dtype) and a growing one (the comparison baseline).

use tch::{Kind, Tensor};

use crate::device::Device;

use super::config::ModelConfig;
use super::error::ModelError;
use super::host_memory;

/// What a cached forward needs from a cache.
pub trait KvCache {
    /// Tokens already cached (the position where the next chunk is written).
    fn len(&self) -> i64;
    /// Whether nothing is cached.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Stores this chunk's `k`, `v` `[batch, kv_heads, t, head_dim]` for `layer` and returns the
    /// keys and values attention runs over (`[batch, kv_heads, slots, head_dim]`).
    fn store(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor), ModelError>;
    /// Marks `t` more tokens as cached (after every layer stored its chunk).
    fn advance(&mut self, t: i64);
    /// Key slots attention sees after storing a chunk of `t` tokens (the mask's last dim).
    fn slots_after(&self, t: i64) -> i64;
    /// This cache as a [`StaticCache`], when it is one (what a captured decode graph needs).
    fn as_static(&mut self) -> Option<&mut StaticCache> {
        None
    }
}

/// A preallocated cache: per layer `[batch, kv_heads, max_len, head_dim]` in the model's dtype,
/// so every decode step has the same shapes. Writing past `max_len` is an error, never a
/// silent truncation. Supports snapshots and rollback (speculative or retried continuations).
#[derive(Debug)]
pub struct StaticCache {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    len: i64,
    /// Capacity in tokens.
    pub max_len: i64,
    /// `[1]` int64 on the cache's device: when set, one-token chunks are written at the slot it
    /// holds (a device value a captured CUDA graph reads at replay) instead of at `len`.
    device_slot: Option<Tensor>,
}

impl StaticCache {
    /// Zeroed buffers for `batch` rows of up to `max_len` tokens.
    pub fn new(cfg: &ModelConfig, batch: i64, max_len: i64, kind: Kind, device: Device) -> Result<Self, ModelError> {
        let shape = [batch, cfg.num_kv_heads, max_len, cfg.head_dim];
        let buffers = || -> Result<Vec<Tensor>, tch::TchError> {
            match device {
                // Every decode step reads the cache's filled slots: one buffer in huge pages.
                Device::Cpu => host_memory::zeros_in_one_buffer(cfg.num_layers, &shape, kind),
                _ => (0..cfg.num_layers).map(|_| device.zeros(&shape, kind)).collect(),
            }
        };
        Ok(StaticCache {
            k: buffers()?,
            v: buffers()?,
            len: 0,
            max_len,
            device_slot: None,
        })
    }

    /// Where the buffers live.
    pub fn device(&self) -> Device {
        self.k.first().map_or(Device::Cpu, Device::of)
    }

    /// Rows in the cache.
    pub fn batch(&self) -> i64 {
        self.k.first().map_or(0, |t| t.size()[0])
    }

    /// The current length, to roll back to later.
    pub fn snapshot(&self) -> i64 {
        self.len
    }

    /// Forgets everything after `len` tokens (the buffers keep their shape).
    pub fn rollback(&mut self, len: i64) -> Result<(), ModelError> {
        if len < 0 || len > self.len {
            return Err(ModelError::Input(format!(
                "cannot roll back to {len}: the cache holds {}",
                self.len
            )));
        }
        self.len = len;
        Ok(())
    }

    /// Empties the cache.
    pub fn reset(&mut self) {
        self.len = 0;
    }

    /// A new cache whose row `i` copies row `rows[i]` of this one: prefill a prompt once, then
    /// fork it into the slots of its G completions.
    pub fn fork(&self, rows: &[i64]) -> Result<Self, ModelError> {
        let device = self.k.first().map_or(Device::Cpu, Device::of);
        let index = device.from_slice(rows)?;
        let select = |buffers: &[Tensor]| -> Result<Vec<Tensor>, tch::TchError> {
            buffers.iter().map(|t| t.f_index_select(0, &index)).collect()
        };
        Ok(StaticCache {
            k: select(&self.k)?,
            v: select(&self.v)?,
            len: self.len,
            max_len: self.max_len,
            device_slot: None,
        })
    }

    /// From now on, writes one-token chunks at the slot the returned `[1]` int64 tensor holds
    /// (on the cache's device), which the caller sets to [`KvCache::len`] before each step: the
    /// form of write a captured CUDA graph can replay at a new position. Other chunk sizes are
    /// refused while it is on.
    pub fn write_at_device_slot(&mut self) -> Result<Tensor, ModelError> {
        let slot = self.device().zeros(&[1], Kind::Int64)? + self.len;
        self.device_slot = Some(slot.shallow_clone());
        Ok(slot)
    }
}

impl KvCache for StaticCache {
    fn len(&self) -> i64 {
        self.len
    }

    fn store(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor), ModelError> {
        let t = k.size()[2];
        if self.len + t > self.max_len {
            return Err(ModelError::Input(format!(
                "static cache overflow: {} cached + {t} new tokens > max_cache_len {}",
                self.len, self.max_len
            )));
        }
        match &self.device_slot {
            Some(slot) if t == 1 => {
                let _ = self.k[layer].f_index_copy_(2, slot, k)?;
                let _ = self.v[layer].f_index_copy_(2, slot, v)?;
            }
            Some(_) => {
                return Err(ModelError::Input(format!(
                    "a cache writing at a device slot takes one token at a time, not {t}"
                )));
            }
            None => {
                self.k[layer].narrow(2, self.len, t).f_copy_(k)?;
                self.v[layer].narrow(2, self.len, t).f_copy_(v)?;
            }
        }
        Ok((self.k[layer].shallow_clone(), self.v[layer].shallow_clone()))
    }

    fn advance(&mut self, t: i64) {
        self.len += t;
    }

    fn slots_after(&self, _t: i64) -> i64 {
        self.max_len
    }

    fn as_static(&mut self) -> Option<&mut StaticCache> {
        Some(self)
    }
}

/// A cache that grows by concatenation: no capacity, but a new shape every step.
#[derive(Debug, Default)]
pub(crate) struct DynamicCache {
    k: Vec<Option<Tensor>>,
    v: Vec<Option<Tensor>>,
    len: i64,
}

impl DynamicCache {
    /// An empty cache for `layers` layers.
    pub(crate) fn new(layers: usize) -> Self {
        DynamicCache {
            k: (0..layers).map(|_| None).collect(),
            v: (0..layers).map(|_| None).collect(),
            len: 0,
        }
    }
}

impl KvCache for DynamicCache {
    fn len(&self) -> i64 {
        self.len
    }

    fn store(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor), ModelError> {
        let grow = |slot: &mut Option<Tensor>, new: &Tensor| {
            let t = match slot.take() {
                Some(old) => Tensor::cat(&[&old, new], 2),
                None => new.shallow_clone(),
            };
            *slot = Some(t.shallow_clone());
            t
        };
        Ok((grow(&mut self.k[layer], k), grow(&mut self.v[layer], v)))
    }

    fn advance(&mut self, t: i64) {
        self.len += t;
    }

    fn slots_after(&self, t: i64) -> i64 {
        self.len + t
    }
}
