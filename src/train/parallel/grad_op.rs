//! `fsdp = "shard_grad_op"` (ZeRO-2): every rank keeps the whole parameters but only its shard
//! of both AdamW moments (and of the fp32 master weights of a half-precision unit), and
//! receives only its shard of the summed gradients; the whole gradients are freed once
//! reduce-scattered. A step reduce-scatters each unit's gradients, clips by the global norm
//! (shard norms summed over ranks), applies AdamW to the shard and all-gathers the updated
//! shards into every rank's parameters.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use tch::{Kind, Tensor};

use super::settings::Fsdp;
use super::shards::Shards;
use super::units::units_of;
use super::{HeldState, Strategy};
use crate::distributed::{DistError, World};
use crate::model::ModelError;
use crate::train::adamw::{AdamWConfig, first_non_finite};

/// The state of a `shard_grad_op` run.
#[derive(Debug)]
pub(crate) struct ShardGradOp {
    shards: Shards,
    /// The fp32 master shard of each unit whose parameters are not fp32 (mixed precision); an
    /// fp32 unit's shard is read from its parameters.
    master: Vec<Option<Tensor>>,
}

impl ShardGradOp {
    /// This rank's shards over `params` (by name; the same on every rank).
    pub(crate) fn new(
        params: &BTreeMap<String, Tensor>,
        world: Arc<World>,
        config: AdamWConfig,
    ) -> Result<Self, ModelError> {
        let shards = Shards::new(units_of(params), world, config)?;
        let master = (0..shards.units.len())
            .map(
                |u| match shards.units[u].params.iter().any(|p| p.kind() != Kind::Float) {
                    true => shards.flat(u, &|_, p| p.f_to_kind(Kind::Float)).map(Some),
                    false => Ok(None),
                },
            )
            .collect::<Result<_, _>>()?;
        Ok(ShardGradOp { shards, master })
    }

    /// Unit `u`'s fp32 shard as the update reads it.
    fn current(&self, u: usize) -> Result<Tensor, tch::TchError> {
        match &self.master[u] {
            Some(master) => Ok(master.shallow_clone()),
            None => self.shards.flat(u, &|_, p| p.f_to_kind(Kind::Float)),
        }
    }

    /// Every rank's updated shard `p` of unit `u` (in the parameters' dtype) copied into the
    /// parameters.
    fn gather_into_params(&self, u: usize, p: &Tensor) -> Result<(), ModelError> {
        let params = &self.shards.units[u].params;
        let pieces = self.shards.gather_pieces(u, &p.f_to_kind(params[0].kind())?)?;
        tch::no_grad(|| -> Result<(), tch::TchError> {
            for (p, piece) in params.iter().zip(&pieces) {
                p.shallow_clone().f_copy_(&piece.f_to_kind(p.kind())?)?;
            }
            Ok(())
        })?;
        Ok(())
    }

    fn masters(&self) -> Vec<Option<&Tensor>> {
        self.master.iter().map(Option::as_ref).collect()
    }
}

impl Strategy for ShardGradOp {
    fn updates(&self) -> u64 {
        self.shards.step
    }

    fn reduce_grads(&mut self) -> Result<(), DistError> {
        self.shards.grads = (0..self.shards.units.len())
            .map(|u| self.shards.reduced(u))
            .collect::<Result<_, _>>()?;
        Ok(())
    }

    fn clip(&mut self, max_norm: Option<f64>) -> Result<f64, DistError> {
        self.shards.clip(max_norm)
    }

    fn update(&mut self, lr: f64) -> Result<(), ModelError> {
        let grads = self.shards.begin_update();
        for (u, g) in grads.iter().enumerate() {
            let p = self.current(u)?;
            self.shards.adam(u, &p, g, lr)?;
            self.gather_into_params(u, &p)?;
        }
        Ok(())
    }

    fn first_non_finite(&self) -> Result<Option<String>, ModelError> {
        let named: Vec<_> = self.shards.units.iter().flat_map(|u| u.named()).collect();
        Ok(first_non_finite(named.into_iter())?.map(str::to_string))
    }

    fn discard_grads(&mut self) {
        self.shards.discard_grads();
    }

    fn held(&self) -> HeldState {
        let whole = self.shards.parameter_bytes();
        HeldState {
            fsdp: Fsdp::ShardGradOp.name(),
            parameters: whole,
            gradients: whole,
            optimizer: self.shards.state_bytes(&self.masters()),
        }
    }

    fn state_tensors(&self) -> Vec<(String, Tensor)> {
        let named = self.shards.tensors(&self.masters());
        named.into_iter().map(|(k, t)| (k, t.shallow_clone())).collect()
    }

    fn write_state(&self, dir: &Path) -> Result<(), ModelError> {
        self.shards.write_state(dir, &self.masters())
    }

    fn write_manifest(&self, dir: &Path) -> Result<(), ModelError> {
        self.shards.write_manifest(dir)
    }

    fn load(&mut self, dir: &Path) -> Result<(), ModelError> {
        let masters: Vec<Option<Tensor>> = self
            .master
            .iter()
            .map(|m| m.as_ref().map(Tensor::shallow_clone))
            .collect();
        let masters: Vec<Option<&Tensor>> = masters.iter().map(Option::as_ref).collect();
        let Some(named) = self.shards.read_state(dir, &masters)? else {
            return Ok(());
        };
        self.shards.load_moments(&named)?;
        for u in 0..self.shards.units.len() {
            let Some(master) = &self.master[u] else { continue };
            let unit = &self.shards.units[u];
            let pick = |name: &str, p: &Tensor| match named.get(&format!("master.{name}")) {
                Some(t) => t.f_to_kind(Kind::Float),
                None => p.f_to_kind(Kind::Float),
            };
            let loaded = self.shards.flat(u, &pick)?;
            tch::no_grad(|| -> Result<(), tch::TchError> {
                master.shallow_clone().f_copy_(&loaded)?;
                // The parameters are the master weights rounded, as the checkpoint's are.
                for (name, p) in unit.named() {
                    if let Some(m) = named.get(&format!("master.{name}")) {
                        p.shallow_clone().f_copy_(m)?;
                    }
                }
                Ok(())
            })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tch::{Kind, Tensor, nn};

    use super::super::replicated::{Reduction, Replicated};
    use super::*;
    use crate::train::AdamW;

    /// A little model's variables: an embedding, two layers of odd sizes (shards end
    /// mid-tensor, the last one padded) and a final norm.
    fn variables(vs: &nn::VarStore, rank: usize) {
        let p = vs.root();
        let init = |shape: &[i64], seed: f64| {
            let n: i64 = shape.iter().product();
            let t = Tensor::arange(n, (Kind::Float, tch::Device::Cpu))
                .f_mul_scalar(0.37)
                .unwrap();
            (t + seed).sin().view(shape)
        };
        let var = |name: &str, t: &Tensor| {
            let (path, last) = name.rsplit_once('.').unwrap();
            let at = path.split('.').fold(p.clone(), |at, part| at / part);
            let _ = at.var_copy(last, t);
        };
        var("model.embed_tokens.weight", &init(&[7, 3], 0.1));
        var("model.layers.0.mlp.up_proj.weight", &init(&[5, 3], 0.2));
        var("model.layers.0.input_layernorm.weight", &init(&[3], 0.3));
        var("model.layers.1.mlp.up_proj.weight", &init(&[4, 3], 0.4));
        var("model.norm.weight", &init(&[3], 0.5));
        // Each rank's own gradients.
        let sorted: BTreeMap<String, Tensor> = vs.variables().into_iter().collect();
        for (i, v) in sorted.values().enumerate() {
            let g = (v.detach() * (rank as f64 + 1.0) + i as f64).cos();
            (v * g).sum(Kind::Float).backward();
        }
    }

    /// Two ranks (threads on a file store) step the sharded state and write it rank by rank;
    /// one replicated optimizer steps on the sum of their gradients: the same norms, the same
    /// parameters; the state read back by a replicated optimizer (assembled from both files)
    /// equals the replicated one, and each rank of a new sharded run reads its own file back.
    /// Rank `rank` of 2: one sharded step, its state written to `ckpt` and read back
    /// unchanged; the clipped norm and the parameters after the step.
    fn sharded_rank_step(
        rank: usize,
        store: &std::path::Path,
        ckpt: &std::path::Path,
        config: AdamWConfig,
    ) -> (f64, BTreeMap<String, Tensor>) {
        let world = World::with_file_store(store, rank, 2, Duration::from_secs(30)).unwrap();
        let world = std::sync::Arc::new(world);
        let sharded = |vs: &nn::VarStore| {
            variables(vs, rank);
            let params = vs.variables().into_iter().collect();
            ShardGradOp::new(&params, world.clone(), config).unwrap()
        };
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let mut adamw = sharded(&vs);
        adamw.reduce_grads().unwrap();
        let norm = adamw.clip(Some(1.0)).unwrap();
        adamw.update(1e-2).unwrap();
        adamw.write_state(ckpt).unwrap();
        world.barrier().unwrap();
        if rank == 0 {
            adamw.write_manifest(ckpt).unwrap();
        }
        world.barrier().unwrap();
        let mut again = sharded(&nn::VarStore::new(tch::Device::Cpu));
        again.load(ckpt).unwrap();
        assert_eq!(again.updates(), 1);
        for ((k, a), (_, b)) in adamw.state_tensors().iter().zip(again.state_tensors()) {
            assert!(a.equal(&b), "rank {rank} read its {k} back changed");
        }
        (norm, vs.variables().into_iter().collect())
    }

    #[test]
    fn sharded_steps_equal_the_replicated_update() {
        let dir = std::env::temp_dir().join(format!("treetrain-shard-{}", std::process::id()));
        let ckpt = dir.join("checkpoint");
        std::fs::create_dir_all(&ckpt).unwrap();
        let store = dir.join("store");
        let _ = std::fs::remove_file(&store);
        let config = AdamWConfig {
            weight_decay: 0.1,
            ..AdamWConfig::default()
        };
        let run = |rank: usize| {
            let (store, ckpt) = (store.clone(), ckpt.clone());
            std::thread::spawn(move || sharded_rank_step(rank, &store, &ckpt, config))
        };
        let (a, b) = (run(0), run(1));
        let (a, b) = (a.join().unwrap(), b.join().unwrap());
        // The replicated reference: the summed gradients in one process.
        let vs = nn::VarStore::new(tch::Device::Cpu);
        variables(&vs, 0);
        let other = nn::VarStore::new(tch::Device::Cpu);
        variables(&other, 1);
        let theirs = other.variables();
        for (name, v) in vs.variables() {
            let mut g = v.grad();
            let _ = g.f_add_(&theirs[&name].grad()).unwrap();
        }
        let mut adamw = AdamW::new(&vs, config);
        let norm = adamw.clip_grad_norm(Some(1.0));
        adamw.step(1e-2).unwrap();
        for (got_norm, params) in [a, b] {
            assert!((got_norm - norm).abs() <= 1e-6 * norm, "{got_norm} vs {norm}");
            for (name, v) in vs.variables() {
                let diff = (&params[&name] - &v).abs().max().double_value(&[]);
                assert!(diff <= 1e-7, "{name}: {diff}");
            }
        }
        let fresh = nn::VarStore::new(tch::Device::Cpu);
        variables(&fresh, 0);
        let replicated = || {
            let single = Arc::new(World::single());
            Replicated::new(AdamW::new(&fresh, config), single, Reduction::AfterBackward)
        };
        let mut whole = replicated();
        whole.load(&ckpt).unwrap();
        assert_eq!(whole.updates(), 1);
        // A shard file cut short (a copy interrupted) is named, not read.
        let file = ckpt.join("optimizer.shard-1-of-2.safetensors");
        let bytes = std::fs::read(&file).unwrap();
        std::fs::write(&file, &bytes[..bytes.len() - 1]).unwrap();
        let err = replicated().load(&ckpt).unwrap_err().to_string();
        assert!(
            err.contains("shard-1-of-2") && err.contains("the manifest says"),
            "{err}"
        );
        let want = adamw.state_tensors();
        let got: BTreeMap<String, Tensor> = whole.state_tensors().into_iter().collect();
        assert_eq!(got.len(), want.len());
        for (key, t) in want {
            let diff = (&got[&key] - t).abs().max().double_value(&[]);
            assert!(diff <= 1e-7, "{key}: {diff}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
