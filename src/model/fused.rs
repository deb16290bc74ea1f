//! Linear maps of one input computed as one matmul (q/k/v, gate/up) where no graph is built
//! (generation, scoring): fewer, larger products per layer.
//!
//! One buffer holds the maps' weights end to end, and each map's `weight` (the variable under
//! its `state_dict` name) is re-pointed at its rows of it ([`host_memory::gather`]: in huge
//! pages on the CPU). Loading, saving, optimizer steps, broadcasts and adapter merges all write
//! the variables in place, so they write the buffer: the fused product never reads stale
//! weights and nothing is stored twice. A forward that needs gradients, or a map with an
//! adapter, runs the maps one by one.

use tch::Tensor;

use super::ModelError;
use super::cpu_kernels::{self, CpuOps};
use super::host_memory;
use super::layers::Linear;

/// The shared buffer of several linear maps of the same input.
#[derive(Debug)]
pub struct FusedLinear {
    /// `[sum of out_features, in_features]`: the maps' weights, in order.
    weight: Tensor,
    /// `[sum of out_features]` when every map has a bias.
    bias: Option<Tensor>,
    /// Each map's `out_features`.
    sizes: Vec<i64>,
}

impl FusedLinear {
    /// Moves the current values of `linears`' weights (and biases) into one buffer and points
    /// each map's tensors at its rows. `None` when the maps cannot share one (different inputs,
    /// dtypes or devices, some with a bias and some without).
    pub fn tie(linears: &mut [&mut Linear]) -> Result<Option<Self>, ModelError> {
        let Some(first) = linears.first().map(|l| &l.weight) else {
            return Ok(None);
        };
        let (input, kind, device) = (first.size()[1], first.kind(), first.device());
        let biased = linears.first().is_some_and(|l| l.bias.is_some());
        let compatible = linears.iter().all(|l| {
            let w = &l.weight;
            w.dim() == 2
                && w.size()[1] == input
                && w.kind() == kind
                && w.device() == device
                && l.bias.is_some() == biased
        });
        if !compatible {
            return Ok(None);
        }
        let sizes: Vec<i64> = linears.iter().map(|l| l.weight.size()[0]).collect();
        let mut weights: Vec<&mut Tensor> = linears.iter_mut().map(|l| &mut l.weight).collect();
        let Some(weight) = host_memory::gather(&mut weights)? else {
            return Ok(None);
        };
        let weight = weight.f_view([sizes.iter().sum::<i64>(), input])?;
        let mut biases: Vec<&mut Tensor> = linears.iter_mut().filter_map(|l| l.bias.as_mut()).collect();
        let bias = host_memory::gather(&mut biases)?;
        Ok(Some(FusedLinear { weight, bias, sizes }))
    }

    /// The outputs of `linears` (the maps this buffer was tied from, in order) for `x`
    /// `[..., in]`: one product when that gives the same values, else one per map.
    pub fn forward(&self, x: &Tensor, linears: &[&Linear]) -> Vec<Tensor> {
        match self.product(x, linears, CpuOps::Libtorch) {
            Some(y) => self.split(&y),
            None => linears.iter().map(|l| l.forward(x)).collect(),
        }
    }

    /// The maps' outputs as views of their side-by-side product `y` ([`FusedLinear::product`]).
    fn split(&self, y: &Tensor) -> Vec<Tensor> {
        y.split_with_sizes(self.sizes.as_slice(), -1)
    }

    /// The maps' outputs side by side, `[..., sum of out_features]` (one product), when that
    /// gives the same values as the maps one by one: none has an adapter and no graph is
    /// recorded. `None` otherwise. `ops` as in [`super::layers::linear_with`].
    pub fn product(&self, x: &Tensor, linears: &[&Linear], ops: CpuOps) -> Option<Tensor> {
        if linears.iter().any(|l| l.adapter.is_some()) || builds_graph(x, linears) {
            return None;
        }
        Some(super::layers::linear_with(x, &self.weight, self.bias.as_ref(), ops))
    }

    /// The outputs of `linears` for `x`: views of `product` when the caller already asked
    /// `fused` for it (to run a kernel over it whole), so it is not computed again; else through
    /// `fused` when the maps were tied ([`FusedLinear::forward`]); else one product per map.
    pub fn outputs_of_product<const N: usize>(
        fused: Option<&FusedLinear>,
        product: Option<Tensor>,
        x: &Tensor,
        linears: [&Linear; N],
    ) -> [Tensor; N] {
        let parts = match fused.zip(product) {
            Some((f, y)) => f.split(&y),
            None => fused.map(|f| f.forward(x, &linears)).unwrap_or_default(),
        };
        let mut parts = parts.into_iter();
        std::array::from_fn(|i| parts.next().unwrap_or_else(|| linears[i].forward(x)))
    }

    /// The shared weight buffer `[sum of out_features, in_features]`.
    pub(crate) fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The shared bias buffer `[sum of out_features]`, when the maps have biases.
    pub(crate) fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// The same buffer (shared, not copied).
    pub fn shallow_clone(&self) -> FusedLinear {
        FusedLinear {
            weight: self.weight.shallow_clone(),
            bias: self.bias.as_ref().map(Tensor::shallow_clone),
            sizes: self.sizes.clone(),
        }
    }
}

/// Whether a forward of `linears` on `x` would be recorded for backward: `x` or a weight
/// requires grad and gradient mode is on.
fn builds_graph(x: &Tensor, linears: &[&Linear]) -> bool {
    let mut inputs = vec![x];
    inputs.extend(linears.iter().map(|l| &l.weight));
    cpu_kernels::records_graph(&inputs)
}

#[cfg(test)]
mod tests {
    use tch::{Device, Kind, nn};

    use super::*;

    fn three_maps(vs: &nn::VarStore, bias: bool) -> Vec<Linear> {
        let root = vs.root();
        let maps: Vec<Linear> = [("q", 6), ("k", 2), ("v", 2)]
            .into_iter()
            .map(|(name, out)| Linear::new(&root / name, 4, out, bias))
            .collect();
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
        maps
    }

    #[test]
    fn one_product_equals_the_maps_and_follows_in_place_writes() {
        tch::manual_seed(3);
        let vs = nn::VarStore::new(Device::Cpu);
        let mut maps = three_maps(&vs, true);
        let before: Vec<Tensor> = maps.iter().map(|l| l.weight.copy()).collect();
        let mut refs: Vec<&mut Linear> = maps.iter_mut().collect();
        let fused = FusedLinear::tie(&mut refs).unwrap().expect("compatible maps");
        let maps_ref: Vec<&Linear> = maps.iter().collect();
        // The variables kept their values, names and shapes.
        for (l, b) in maps.iter().zip(&before) {
            assert!(l.weight.equal(b));
        }
        assert_eq!(vs.variables()["k.weight"].size(), vec![2, 4]);
        let x = Tensor::randn([2, 3, 4], (Kind::Float, Device::Cpu));
        let check = |fused: &FusedLinear| {
            let got = tch::no_grad(|| fused.forward(&x, &maps_ref));
            for (g, l) in got.iter().zip(&maps_ref) {
                let want = tch::no_grad(|| l.forward(&x));
                assert!(g.allclose(&want, 1e-6, 1e-6, false));
            }
        };
        check(&fused);
        // An in-place write to one map's weight (a load, an optimizer step) is in the buffer.
        tch::no_grad(|| {
            let _ = maps_ref[1]
                .weight
                .shallow_clone()
                .f_add_(&Tensor::ones([2, 4], (Kind::Float, Device::Cpu)))
                .unwrap();
        });
        check(&fused);
        let k = tch::no_grad(|| fused.forward(&x, &maps_ref).remove(1));
        let want = tch::no_grad(|| x.linear(&(&before[1] + 1.0), maps_ref[1].bias.as_ref()));
        assert!(
            k.allclose(&want, 1e-5, 1e-5, false),
            "the buffer holds the written weight"
        );
    }

    #[test]
    fn a_forward_that_needs_gradients_runs_the_maps_one_by_one() {
        let vs = nn::VarStore::new(Device::Cpu);
        let mut maps = three_maps(&vs, false);
        let mut refs: Vec<&mut Linear> = maps.iter_mut().collect();
        let fused = FusedLinear::tie(&mut refs).unwrap().unwrap();
        let maps_ref: Vec<&Linear> = maps.iter().collect();
        let x = Tensor::randn([5, 4], (Kind::Float, Device::Cpu));
        let outs = fused.forward(&x, &maps_ref);
        Tensor::stack(
            &[
                outs[0].sum(Kind::Float),
                outs[1].sum(Kind::Float),
                outs[2].sum(Kind::Float),
            ],
            0,
        )
        .sum(Kind::Float)
        .backward();
        for l in &maps_ref {
            let g = l.weight.grad();
            assert!(g.defined(), "every weight gets its gradient");
            // d(sum of x W^T)/dW = column sums of x, for every output row.
            let want = x.sum_dim_intlist([0].as_slice(), false, Kind::Float).expand_as(&g);
            assert!(g.allclose(&want, 1e-5, 1e-5, false));
        }
        // Maps that cannot share one buffer are left alone.
        let vs = nn::VarStore::new(Device::Cpu);
        let root = vs.root();
        let mut a = Linear::new(&root / "a", 4, 2, false);
        let mut b = Linear::new(&root / "b", 3, 2, false);
        assert!(FusedLinear::tie(&mut [&mut a, &mut b]).unwrap().is_none());
    }
}
