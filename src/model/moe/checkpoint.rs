//! The hub's per-expert layout of a sparse layer's experts
//! (`mlp.experts.{e}.{gate,up,down}_proj.weight`) against the fused parameters treetrain holds
//! (`mlp.experts.gate_up_proj [E, 2I, H]`, `mlp.experts.down_proj [E, H, I]`, transformers 5's
//! own names). Both layouts load; a save writes the fused one, which transformers 5 loads as is.

use std::collections::HashMap;

use tch::Tensor;

/// Which fused parameter a per-expert tensor fills, and where.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ExpertSlice {
    /// The fused parameter's `state_dict` name.
    pub(crate) fused: String,
    /// The expert's index (the fused tensor's first dimension).
    pub(crate) expert: i64,
    /// Which of the expert's projections.
    pub(crate) part: Part,
}

/// An expert's projection in the hub's layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Part {
    /// `gate_proj`: the first half of `gate_up_proj[e]`'s rows.
    Gate,
    /// `up_proj`: the second half.
    Up,
    /// `down_proj`: all of `down_proj[e]`.
    Down,
}

impl ExpertSlice {
    /// The slice a per-expert tensor of checkpoint name `name` fills, when `name` is one and
    /// its fused parameter is among `vars`.
    pub(crate) fn of(name: &str, vars: &HashMap<String, Tensor>) -> Option<ExpertSlice> {
        let (prefix, rest) = name.split_once(".experts.")?;
        let (expert, leaf) = rest.split_once('.')?;
        let expert: i64 = expert.parse().ok()?;
        let (fused, part) = match leaf {
            "gate_proj.weight" => ("gate_up_proj", Part::Gate),
            "up_proj.weight" => ("gate_up_proj", Part::Up),
            "down_proj.weight" => ("down_proj", Part::Down),
            _ => return None,
        };
        let fused = format!("{prefix}.experts.{fused}");
        let var = vars.get(&fused)?;
        (expert >= 0 && expert < var.size()[0]).then_some(ExpertSlice { fused, expert, part })
    }

    /// The view of `fused` (the parameter named [`ExpertSlice::fused`]) this slice fills.
    pub(crate) fn view(&self, fused: &Tensor) -> Tensor {
        let expert = fused.get(self.expert);
        let half = expert.size()[0] / 2;
        match self.part {
            Part::Gate => expert.narrow(0, 0, half),
            Part::Up => expert.narrow(0, half, half),
            Part::Down => expert,
        }
    }

    /// Per-expert tensors that fill the fused parameter `var` (named `name`) completely, when it
    /// is one.
    pub(crate) fn pieces_of(name: &str, var: &Tensor) -> Option<usize> {
        let experts = usize::try_from(var.size().first().copied()?).ok()?;
        match name.rsplit_once(".experts.")?.1 {
            "gate_up_proj" => Some(2 * experts),
            "down_proj" => Some(experts),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    #[test]
    fn per_expert_names_find_their_rows_in_the_fused_parameters() {
        let mut vars = HashMap::new();
        let gu = Tensor::arange(3 * 4 * 2, (Kind::Float, Device::Cpu)).view([3, 4, 2]);
        vars.insert(
            "model.layers.1.mlp.experts.gate_up_proj".to_string(),
            gu.shallow_clone(),
        );
        let up = ExpertSlice::of("model.layers.1.mlp.experts.2.up_proj.weight", &vars).unwrap();
        assert_eq!((up.expert, up.part), (2, Part::Up));
        assert_eq!(
            Vec::<f32>::try_from(up.view(&gu).reshape([-1])).unwrap(),
            [20.0, 21.0, 22.0, 23.0]
        );
        let gate = ExpertSlice::of("model.layers.1.mlp.experts.0.gate_proj.weight", &vars).unwrap();
        assert_eq!(
            Vec::<f32>::try_from(gate.view(&gu).reshape([-1])).unwrap(),
            [0.0, 1.0, 2.0, 3.0]
        );
        for other in [
            "model.layers.1.mlp.experts.3.up_proj.weight",
            "model.layers.0.mlp.experts.0.up_proj.weight",
            "model.layers.1.mlp.experts.0.up_proj.bias",
        ] {
            assert_eq!(ExpertSlice::of(other, &vars), None, "{other}");
        }
        assert_eq!(
            ExpertSlice::pieces_of("model.layers.1.mlp.experts.gate_up_proj", &gu),
            Some(6)
        );
    }
}
