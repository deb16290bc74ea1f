//! Linear maps of one input (q/k/v, gate/up), owned together with the buffer that lets them
//! run as one product: the seam between a layer's readable forward and its fast path.
//!
//! Once tied ([`Projections::tie`]), one buffer holds the maps' weights end to end, and each
//! map's `weight` (the variable under its `state_dict` name) is re-pointed at its rows of it
//! ([`host_memory::gather`]: in huge pages on the CPU). Loading, saving, optimizer steps,
//! broadcasts and adapter merges all write the variables in place, so they write the buffer:
//! the fused product never reads stale weights and nothing is stored twice. A forward that
//! needs gradients, or a map with an adapter, runs the maps one by one, so the values are
//! always those of the maps themselves.

use tch::Tensor;

use super::cpu_kernels::{self, CpuOps};
use super::error::ModelError;
use super::host_memory;
use super::layers::{Linear, linear_with};

/// `N` linear maps of the same input, each under its name within the layer.
#[derive(Debug)]
pub struct Projections<const N: usize> {
    names: [&'static str; N],
    maps: [Linear; N],
    /// The maps' shared buffer, once tied.
    fused: Option<Fused>,
}

/// The shared buffer of tied maps.
#[derive(Debug)]
struct Fused {
    /// `[sum of out_features, in_features]`: the maps' weights, in order.
    weight: Tensor,
    /// `[sum of out_features]` when every map has a bias.
    bias: Option<Tensor>,
    /// Each map's `out_features`.
    sizes: Vec<i64>,
}

/// What [`Projections::forward`] computed: the maps' outputs side by side as one product, or
/// one output per map.
#[derive(Debug)]
pub enum Projected<'a, const N: usize> {
    /// `[..., sum of out_features]`, the maps' outputs side by side, with each map's width.
    Fused(Tensor, &'a [i64]),
    /// One output per map.
    Separate([Tensor; N]),
}

impl<const N: usize> Projected<'_, N> {
    /// The one product, when the maps ran as one (a kernel may take it whole).
    pub fn fused(&self) -> Option<&Tensor> {
        match self {
            Projected::Fused(y, _) => Some(y),
            Projected::Separate(_) => None,
        }
    }

    /// Each map's output (views of the one product, when it is one).
    pub fn split(self) -> [Tensor; N] {
        match self {
            Projected::Separate(outputs) => outputs,
            Projected::Fused(y, sizes) => {
                let mut parts = y.split_with_sizes(sizes, -1).into_iter();
                std::array::from_fn(|_| parts.next().expect("one part per map"))
            }
        }
    }
}

impl<const N: usize> Projections<N> {
    /// `maps` under `names` (their `state_dict` names within the layer), not yet tied.
    pub fn new(names: [&'static str; N], maps: [Linear; N]) -> Self {
        Projections {
            names,
            maps,
            fused: None,
        }
    }

    /// The maps, in order.
    pub fn maps(&self) -> &[Linear; N] {
        &self.maps
    }

    /// The maps by name (an adapter is attached or merged through these).
    pub(crate) fn named_mut(&mut self) -> [(&'static str, &mut Linear); N] {
        let mut maps = self.maps.iter_mut();
        std::array::from_fn(|i| (self.names[i], maps.next().expect("one map per name")))
    }

    /// The same base tensors (shared, not copied) without adapters, the buffer shared too.
    pub fn base_view(&self) -> Self {
        Projections {
            names: self.names,
            maps: std::array::from_fn(|i| self.maps[i].base_view()),
            fused: self.fused.as_ref().map(|f| Fused {
                weight: f.weight.shallow_clone(),
                bias: f.bias.as_ref().map(Tensor::shallow_clone),
                sizes: f.sizes.clone(),
            }),
        }
    }

    /// The shared buffer's weight `[sum of out_features, in_features]` and bias, once tied.
    pub fn buffers(&self) -> Option<(&Tensor, Option<&Tensor>)> {
        self.fused.as_ref().map(|f| (&f.weight, f.bias.as_ref()))
    }

    /// Moves the maps' current weights (and biases) into one buffer and points each map's
    /// tensors at its rows, after the parameters have their final dtype and device. Maps that
    /// cannot share one (different inputs, dtypes or devices, some with a bias and some
    /// without) stay as they are.
    pub(crate) fn tie(&mut self) -> Result<(), ModelError> {
        let Some(first) = self.maps.first() else {
            return Ok(());
        };
        let (input, kind, device) = (first.weight.size()[1], first.weight.kind(), first.weight.device());
        let biased = first.bias.is_some();
        let compatible = self.maps.iter().all(|l| {
            let w = &l.weight;
            w.dim() == 2
                && w.size()[1] == input
                && w.kind() == kind
                && w.device() == device
                && l.bias.is_some() == biased
        });
        if !compatible {
            return Ok(());
        }
        let sizes: Vec<i64> = self.maps.iter().map(|l| l.weight.size()[0]).collect();
        let mut weights: Vec<&mut Tensor> = self.maps.iter_mut().map(|l| &mut l.weight).collect();
        let Some(weight) = host_memory::gather(&mut weights)? else {
            return Ok(());
        };
        let weight = weight.f_view([sizes.iter().sum::<i64>(), input])?;
        let mut biases: Vec<&mut Tensor> = self.maps.iter_mut().filter_map(|l| l.bias.as_mut()).collect();
        let bias = host_memory::gather(&mut biases)?;
        self.fused = Some(Fused { weight, bias, sizes });
        Ok(())
    }

    /// The maps' outputs for `x` `[..., in]`: one product (with `ops`, see
    /// `super::layers::linear_with`) where that gives the maps' own values, i.e. they are tied,
    /// none has an adapter and no graph is recorded; else one product per map.
    pub fn forward(&self, x: &Tensor, ops: CpuOps) -> Projected<'_, N> {
        match &self.fused {
            Some(f) if !self.maps.iter().any(|l| l.adapter.is_some()) && !self.builds_graph(x) => {
                Projected::Fused(linear_with(x, &f.weight, f.bias.as_ref(), ops), &f.sizes)
            }
            _ => Projected::Separate(std::array::from_fn(|i| self.maps[i].forward(x))),
        }
    }

    /// Whether a forward of the maps on `x` would be recorded for backward: `x` or a weight
    /// requires grad and gradient mode is on.
    fn builds_graph(&self, x: &Tensor) -> bool {
        let mut inputs = vec![x];
        inputs.extend(self.maps.iter().map(|l| &l.weight));
        cpu_kernels::records_graph(&inputs)
    }
}

#[cfg(test)]
mod tests {
    use tch::{Device, Kind, nn};

    use super::*;

    fn three_maps(vs: &nn::VarStore, bias: bool) -> Projections<3> {
        let root = vs.root();
        let maps = [("q", 6), ("k", 2), ("v", 2)].map(|(name, out)| Linear::new(&root / name, 4, out, bias));
        tch::no_grad(|| {
            for (i, l) in maps.iter().enumerate() {
                l.weight
                    .shallow_clone()
                    .copy_(&Tensor::randn(l.weight.size(), (Kind::Float, Device::Cpu)));
                if let Some(b) = &l.bias {
                    let _ = b.shallow_clone().fill_(i as f64 + 0.5);
                }
            }
        });
        Projections::new(["q", "k", "v"], maps)
    }

    fn check_against_the_maps(p: &Projections<3>, x: &Tensor) {
        let out = tch::no_grad(|| p.forward(x, CpuOps::Libtorch));
        assert!(out.fused().is_some(), "tied maps run as one product");
        for (g, l) in out.split().iter().zip(p.maps()) {
            let want = tch::no_grad(|| l.forward(x));
            assert!(g.allclose(&want, 1e-6, 1e-6, false));
        }
    }

    #[test]
    fn one_product_equals_the_maps_and_follows_in_place_writes() {
        tch::manual_seed(3);
        let vs = nn::VarStore::new(Device::Cpu);
        let mut p = three_maps(&vs, true);
        let before: Vec<Tensor> = p.maps().iter().map(|l| l.weight.copy()).collect();
        p.tie().unwrap();
        // The variables kept their values, names and shapes.
        for (l, b) in p.maps().iter().zip(&before) {
            assert!(l.weight.equal(b));
        }
        assert_eq!(vs.variables()["k.weight"].size(), vec![2, 4]);
        let x = Tensor::randn([2, 3, 4], (Kind::Float, Device::Cpu));
        check_against_the_maps(&p, &x);
        // An in-place write to one map's weight (a load, an optimizer step) is in the buffer.
        tch::no_grad(|| {
            let _ = p.maps()[1]
                .weight
                .shallow_clone()
                .f_add_(&Tensor::ones([2, 4], (Kind::Float, Device::Cpu)))
                .unwrap();
        });
        check_against_the_maps(&p, &x);
        let [_, k, _] = tch::no_grad(|| p.forward(&x, CpuOps::Libtorch).split());
        let want = tch::no_grad(|| x.linear(&(&before[1] + 1.0), p.maps()[1].bias.as_ref()));
        assert!(
            k.allclose(&want, 1e-5, 1e-5, false),
            "the buffer holds the written weight"
        );
    }

    #[test]
    fn a_forward_that_needs_gradients_runs_the_maps_one_by_one() {
        let vs = nn::VarStore::new(Device::Cpu);
        let mut p = three_maps(&vs, false);
        p.tie().unwrap();
        let x = Tensor::randn([5, 4], (Kind::Float, Device::Cpu));
        let out = p.forward(&x, CpuOps::Libtorch);
        assert!(out.fused().is_none(), "a recorded forward runs map by map");
        let [q, k, v] = out.split();
        (q.sum(Kind::Float) + k.sum(Kind::Float) + v.sum(Kind::Float)).backward();
        for l in p.maps() {
            let g = l.weight.grad();
            assert!(g.defined(), "every weight gets its gradient");
            // d(sum of x W^T)/dW = column sums of x, for every output row.
            let want = x.sum_dim_intlist([0].as_slice(), false, Kind::Float).expand_as(&g);
            assert!(g.allclose(&want, 1e-5, 1e-5, false));
        }
        // Maps that cannot share one buffer are left alone.
        let vs = nn::VarStore::new(Device::Cpu);
        let root = vs.root();
        let mut p = Projections::new(
            ["a", "b"],
            [
                Linear::new(&root / "a", 4, 2, false),
                Linear::new(&root / "b", 3, 2, false),
            ],
        );
        p.tie().unwrap();
        assert!(p.buffers().is_none());
    }
}
