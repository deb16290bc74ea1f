//! The one description of a run's trained parameters every strategy works over: grouped into
//! units (the embeddings, each decoder layer, the rest), each flattened in name order. A unit
//! is what `full_shard` gathers and frees as one, what the sharded modes cut into one flat
//! shard per rank, and what the overlapped all-reduce hands to its buckets as a layer's
//! backward ends.

use std::collections::BTreeMap;

use tch::Tensor;

use crate::model::ParamUnit;

/// Which unit a parameter belongs to, in the order a forward meets them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum UnitKey {
    /// `model.embed_tokens`.
    Embeddings,
    /// Decoder layer `i`.
    Layer(usize),
    /// The final norm and an untied head.
    Rest,
}

impl UnitKey {
    /// The unit of a parameter of this `state_dict` name.
    fn of(name: &str) -> Self {
        match ParamUnit::of(name) {
            ParamUnit::Layer(i) => UnitKey::Layer(i),
            ParamUnit::Root if name.contains("embed_tokens") => UnitKey::Embeddings,
            ParamUnit::Root => UnitKey::Rest,
        }
    }

    /// Whether the model asks for this unit as `unit` (the root is two of ours).
    pub(crate) fn serves(self, unit: ParamUnit) -> bool {
        match (self, unit) {
            (UnitKey::Layer(i), ParamUnit::Layer(j)) => i == j,
            (UnitKey::Layer(_), ParamUnit::Root) | (_, ParamUnit::Layer(_)) => false,
            (_, ParamUnit::Root) => true,
        }
    }
}

/// One unit: its parameters in name order.
#[derive(Debug)]
pub(crate) struct Unit {
    pub(crate) key: UnitKey,
    pub(crate) names: Vec<String>,
    pub(crate) params: Vec<Tensor>,
    /// Elements of all its parameters.
    pub(crate) total: i64,
}

impl Unit {
    /// `whole`, the unit's parameters flattened (and maybe padded), split into one view per
    /// parameter in its shape.
    pub(crate) fn split(&self, whole: &Tensor) -> Result<Vec<Tensor>, tch::TchError> {
        let mut at = 0;
        let mut pieces = Vec::with_capacity(self.params.len());
        for p in &self.params {
            let n = p.numel() as i64;
            pieces.push(whole.f_narrow(0, at, n)?.f_view(p.size().as_slice())?);
            at += n;
        }
        Ok(pieces)
    }

    /// `(name, parameter)` pairs.
    pub(crate) fn named(&self) -> impl Iterator<Item = (&String, &Tensor)> {
        self.names.iter().zip(&self.params)
    }
}

/// The units of `params` (trained parameters by name, the same on every rank), in
/// [`UnitKey`] order.
pub(crate) fn units_of(params: &BTreeMap<String, Tensor>) -> Vec<Unit> {
    let mut grouped: BTreeMap<UnitKey, Vec<&String>> = BTreeMap::new();
    for name in params.keys() {
        grouped.entry(UnitKey::of(name)).or_default().push(name);
    }
    grouped
        .into_iter()
        .map(|(key, names)| {
            let params: Vec<Tensor> = names.iter().map(|n| params[*n].shallow_clone()).collect();
            Unit {
                key,
                total: params.iter().map(|t| t.numel() as i64).sum(),
                names: names.into_iter().cloned().collect(),
                params,
            }
        })
        .collect()
}
