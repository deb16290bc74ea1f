//! AdamW, clipping and schedules against torch.optim.AdamW, clip_grad_norm_ and transformers'
//! schedules (tests/fixtures/adamw.json, scripts/fixtures/make_optim_fixtures.py).

use tch::{Device, Kind, Tensor, nn};
use treetrain::train::{AdamW, AdamWConfig, LrSchedule, ScheduleKind};

fn fixture() -> serde_json::Value {
    serde_json::from_str(include_str!("fixtures/adamw.json")).unwrap()
}

fn tensor(v: &serde_json::Value) -> Tensor {
    match v.as_array().unwrap().first() {
        Some(serde_json::Value::Array(_)) => {
            let rows: Vec<Vec<f32>> = serde_json::from_value(v.clone()).unwrap();
            Tensor::from_slice2(&rows)
        }
        _ => Tensor::from_slice(&serde_json::from_value::<Vec<f32>>(v.clone()).unwrap()),
    }
}

/// A var store with the fixture's three parameters under their names.
fn store(f: &serde_json::Value) -> (nn::VarStore, Vec<Tensor>) {
    let vs = nn::VarStore::new(Device::Cpu);
    let names: Vec<String> = serde_json::from_value(f["names"].clone()).unwrap();
    let mut params = Vec::new();
    for (name, init) in names.iter().zip(f["init"].as_array().unwrap()) {
        let t = tensor(init);
        let (path, leaf) = name.rsplit_once('.').unwrap();
        let mut p = vs.root();
        for part in path.split('.') {
            p = &p / part;
        }
        let var = p.var(leaf, &t.size(), nn::Init::Const(0.0));
        tch::no_grad(|| var.shallow_clone().copy_(&t));
        params.push(var);
    }
    (vs, params)
}

fn run_steps(
    opt: &mut AdamW,
    params: &[Tensor],
    f: &serde_json::Value,
    steps: std::ops::Range<usize>,
    sched: &LrSchedule,
) {
    for step in steps {
        for (p, g) in params.iter().zip(f["grads"][step].as_array().unwrap()) {
            let mut grad = p.grad();
            if !grad.defined() {
                // Materialise a gradient buffer the way backward would.
                (p * 0.0).sum(Kind::Float).backward();
                grad = p.grad();
            }
            tch::no_grad(|| grad.copy_(&tensor(g)));
        }
        let norm = opt.clip_grad_norm(Some(0.5));
        assert!(
            (norm - f["grad_norms"][step].as_f64().unwrap()).abs() < 1e-4,
            "step {step} norm {norm}"
        );
        let lr = sched.lr_at(step as u64);
        assert!((lr - f["lrs"][step].as_f64().unwrap()).abs() < 1e-12);
        opt.step(lr).unwrap();
    }
}

#[test]
fn adamw_with_clipping_and_decay_groups_matches_torch() {
    let f = fixture();
    let (vs, params) = store(&f);
    let mut opt = AdamW::new(
        &vs,
        AdamWConfig {
            weight_decay: 0.1,
            ..Default::default()
        },
    );
    let sched = LrSchedule {
        lr: 0.05,
        kind: ScheduleKind::Linear,
        warmup_steps: 2,
        total_steps: 6,
    };
    run_steps(&mut opt, &params, &f, 0..6, &sched);
    for (p, want) in params.iter().zip(f["params_after"][5].as_array().unwrap()) {
        let d = (p - tensor(want)).abs().max().double_value(&[]);
        assert!(d < 1e-6, "max |diff| {d}");
    }
}

#[test]
fn saved_state_resumes_exactly() {
    let f = fixture();
    let sched = LrSchedule {
        lr: 0.05,
        kind: ScheduleKind::Linear,
        warmup_steps: 2,
        total_steps: 6,
    };
    let cfg = AdamWConfig {
        weight_decay: 0.1,
        ..Default::default()
    };
    let (vs, params) = store(&f);
    let mut opt = AdamW::new(&vs, cfg);
    run_steps(&mut opt, &params, &f, 0..3, &sched);
    let dir = std::env::temp_dir().join(format!("treetrain-adamw-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    opt.save(&dir).unwrap();
    // A fresh store at step 3's weights and the saved moments continue identically.
    let (vs2, params2) = store(&f);
    for (a, b) in params2.iter().zip(&params) {
        tch::no_grad(|| a.shallow_clone().copy_(b));
    }
    let mut opt2 = AdamW::new(&vs2, cfg);
    opt2.load(&dir).unwrap();
    assert_eq!(opt2.step, 3);
    run_steps(&mut opt, &params, &f, 3..6, &sched);
    run_steps(&mut opt2, &params2, &f, 3..6, &sched);
    for (a, b) in params.iter().zip(&params2) {
        assert_eq!((a - b).abs().max().double_value(&[]), 0.0, "bit-exact resume");
    }
    std::fs::remove_file(dir.join("optimizer.safetensors")).unwrap();
    assert!(
        opt2.load(&dir)
            .unwrap_err()
            .to_string()
            .contains("optimizer.safetensors")
    );
}

#[test]
fn schedules_match_transformers() {
    let f = fixture();
    for (kind, name) in [
        (ScheduleKind::Constant, "constant"),
        (ScheduleKind::Linear, "linear"),
        (ScheduleKind::Cosine, "cosine"),
    ] {
        let s = LrSchedule {
            lr: 1.0,
            kind,
            warmup_steps: 3,
            total_steps: 10,
        };
        let want: Vec<f64> = serde_json::from_value(f["schedule_factors"][name].clone()).unwrap();
        for (step, w) in want.iter().enumerate() {
            assert!(
                (s.factor(step as u64) - w).abs() < 1e-12,
                "{name} step {step}: {} vs {w}",
                s.factor(step as u64)
            );
        }
    }
    assert_eq!(
        LrSchedule::with_warmup_ratio(1.0, ScheduleKind::Linear, 0.1, 25).warmup_steps,
        3
    );
}

/// `zero_grad` frees the gradients, as PyTorch's `zero_grad()` (`set_to_none=True`) does: the
/// next backward's gradient is exactly that backward's, and a step leaves a parameter that got
/// no gradient untouched (no weight decay, no moment update), as `torch.optim.AdamW` skips a
/// parameter whose `grad` is `None`.
#[test]
fn zero_grad_frees_gradients_and_the_step_skips_unused_parameters() {
    let vs = nn::VarStore::new(Device::Cpu);
    let used = vs.root().var("used", &[3, 2], nn::Init::Const(0.5));
    let unused = vs.root().var("unused", &[3, 2], nn::Init::Const(0.5));
    let config = AdamWConfig {
        weight_decay: 0.1,
        ..AdamWConfig::default()
    };
    let mut opt = AdamW::new(&vs, config);
    (&used * &unused).sum(Kind::Float).backward();
    opt.step(1e-2).unwrap();
    opt.zero_grad();
    assert!(!used.grad().defined() && !unused.grad().defined());
    let unused_before = unused.copy();
    let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]).view([3, 2]);
    (&used * &x).sum(Kind::Float).backward();
    assert_eq!(used.grad(), x, "the fresh gradient, not added into an old one");
    assert!(!unused.grad().defined());
    opt.step(1e-2).unwrap();
    assert_eq!(unused, unused_before, "a parameter without a gradient is skipped");
}
