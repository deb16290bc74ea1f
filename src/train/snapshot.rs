//! Copies of a var store's values by name: how a generation thread's copy of the policy gets
//! the trained weights (all of them, or a LoRA adapter's alone).

use tch::{Tensor, nn::VarStore};

use super::error::TrainError;

/// Deep copies of every parameter, by `state_dict` name.
pub(crate) fn snapshot(vs: &VarStore) -> Vec<(String, Tensor)> {
    tch::no_grad(|| {
        vs.variables()
            .into_iter()
            .map(|(name, t)| (name, t.detach().copy()))
            .collect()
    })
}

/// Copies a snapshot into `vs` in place.
pub(crate) fn load_snapshot(vs: &VarStore, weights: &[(String, Tensor)]) -> Result<(), TrainError> {
    let vars = vs.variables();
    tch::no_grad(|| {
        for (name, t) in weights {
            let mut dst = vars
                .get(name)
                .ok_or_else(|| TrainError::Worker(format!("weight sync: the generator has no `{name}`")))?
                .shallow_clone();
            dst.f_copy_(t)
                .map_err(|e| TrainError::Worker(format!("weight sync of `{name}`: {e}")))?;
        }
        Ok(())
    })
}
