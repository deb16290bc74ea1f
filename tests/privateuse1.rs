//! treetrain on a PrivateUse1 device (how TorchNeuron appears to PyTorch), against the CPU.
//!
//! The device is the stand-in backend of tests/standin (host memory, a CPU fallback, op and
//! byte counters), registered as `neuron` with 2 devices and loaded through the same code path
//! as TorchNeuron's library. Every check runs the same work on `cpu` and on `neuron:0` and
//! compares; the counters show the work reached the device.

mod common;

use std::ffi::{CString, c_char, c_void};
use std::path::PathBuf;

use tch::{Kind, Tensor};
use treetrain::device::{Device, DeviceError, DeviceSpec, PadTo, Platform, parse_device, privateuse1};
use treetrain::generate::{GenerationConfig, Generator};
use treetrain::grpo::GrpoTrainer;
use treetrain::model::{Dtype, DtypeSetting, LoadOptions, Model, StaticCache};
use treetrain::pack::Packing;
use treetrain::sft::SftTrainer;
use treetrain::train::Trainer;

/// Loads the stand-in (once per process; loading again is a no-op) and returns its library.
fn standin() -> PathBuf {
    let lib = common::standin_library(true);
    let backend = privateuse1::load(std::slice::from_ref(&lib)).expect("load the stand-in backend");
    assert_eq!((backend.name.as_str(), backend.device_count), ("neuron", 2));
    lib
}

fn neuron() -> Device {
    standin();
    parse_device("neuron").unwrap()
}

/// What the stand-in counted: ops run natively, ops through its CPU fallback, bytes allocated.
fn counters(lib: &std::path::Path) -> (i64, i64, i64) {
    let path = CString::new(lib.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: the library is loaded already (RTLD_NOLOAD); the symbols are plain C functions.
    unsafe {
        let handle = dlopen(path.as_ptr(), RTLD_NOW | RTLD_NOLOAD);
        assert!(!handle.is_null(), "stand-in not loaded");
        let get = |name: &str| {
            let sym = CString::new(name).unwrap();
            let f = dlsym(handle, sym.as_ptr());
            assert!(!f.is_null(), "{name} missing");
            std::mem::transmute::<*mut c_void, extern "C" fn() -> i64>(f)()
        };
        (
            get("standin_native_ops"),
            get("standin_fallback_ops"),
            get("standin_allocated_bytes"),
        )
    }
}

const RTLD_NOW: i32 = 2;
const RTLD_NOLOAD: i32 = 4;
unsafe extern "C" {
    fn dlopen(path: *const c_char, flags: i32) -> *mut c_void;
    fn dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void;
}

fn tiny(device: Device) -> Model {
    let dir = treetrain::shipped::tiny_model_dir().unwrap();
    Model::load(
        &dir,
        LoadOptions {
            dtype: Some(Kind::Float),
            device,
        },
    )
    .unwrap()
}

fn assert_on(device: Device, what: &str, t: &Tensor) {
    assert_eq!(Device::of(t), device, "{what} is on {} instead", Device::of(t));
}

#[test]
fn device_names_resolve_against_the_loaded_backend() {
    let lib = standin();
    let d = parse_device("neuron:1").unwrap();
    assert_eq!(d.to_string(), "neuron:1");
    assert_eq!(d.platform(), Platform::Neuron);
    assert_eq!("NEURON:0".parse::<DeviceSpec>().unwrap(), DeviceSpec::PrivateUse1(0));
    let err = parse_device("neuron:2").unwrap_err().to_string();
    assert!(
        err.contains("has 2 device(s)") && err.contains(&lib.display().to_string()),
        "{err}"
    );
    let backend = privateuse1::registered().unwrap().unwrap();
    assert_eq!(backend.name, "neuron");
    assert!(treetrain::display::Rich::text(&backend).contains("2 device(s)"));
}

#[test]
fn missing_and_broken_libraries_are_named() {
    let missing = PathBuf::from("/nonexistent/libtorchneuron.so");
    let err = privateuse1::load(std::slice::from_ref(&missing)).unwrap_err();
    assert!(
        matches!(&err, DeviceError::Load { path, .. } if *path == missing),
        "{err}"
    );
    let dir = tempfile_dir("broken");
    let broken = dir.join("libbroken.so");
    std::fs::write(&broken, b"not an ELF file").unwrap();
    let err = privateuse1::load(std::slice::from_ref(&broken))
        .unwrap_err()
        .to_string();
    assert!(err.contains("could not load") && err.contains("libbroken.so"), "{err}");
}

fn tempfile_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("treetrain-pu1-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn every_parameter_and_buffer_lives_on_the_device_and_scores_equal_the_cpu() {
    let lib = standin();
    let device = neuron();
    let before = counters(&lib);
    let (cpu, dev) = (tiny(Device::Cpu), tiny(device));
    for (name, var) in dev.vs.variables() {
        assert_on(device, &name, &var);
    }
    let buffers = dev.lm.buffers();
    assert!(
        buffers.len() > 2 * dev.lm.layers.len(),
        "inv_freq and the fused buffers of every layer"
    );
    for (name, t) in buffers {
        assert_on(device, &name, t);
    }
    assert_eq!(dev.device(), device);
    let cache = StaticCache::new(&dev.lm.config, 2, 16, Kind::Float, device).unwrap();
    assert_eq!(cache.device(), device);
    let ids: Vec<i64> = (0..40).map(|i| (i * 37 + 5) % 500).collect();
    let (a, b) = (cpu.score(&ids).unwrap(), dev.score(&ids).unwrap());
    let worst = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    assert!(worst <= 1e-5, "score differs by {worst}");
    let after = counters(&lib);
    assert!(after.0 > before.0 && after.1 > before.1, "{before:?} -> {after:?}");
    // The weights alone are ~2 MB at fp32; they were allocated on the device.
    let weights: i64 = dev.vs.variables().values().map(|t| t.numel() as i64 * 4).sum();
    assert!(
        after.2 - before.2 >= weights,
        "{} bytes for {weights} of weights",
        after.2 - before.2
    );
}

#[test]
fn greedy_generation_gives_the_same_tokens_with_its_cache_on_the_device() {
    let device = neuron();
    let (cpu, dev) = (tiny(Device::Cpu), tiny(device));
    let prompts: Vec<Vec<i64>> = vec![vec![5, 17, 99, 3, 250, 42, 7], vec![1, 9, 4], vec![77]];
    let cfg = GenerationConfig {
        max_new_tokens: 12,
        prefill_chunk_size: 4,
        ..Default::default()
    };
    let (mut g_cpu, mut g_dev) = (Generator::new(), Generator::new());
    let a = g_cpu.generate(&cpu.lm, &prompts, &cfg).unwrap();
    let b = g_dev.generate(&dev.lm, &prompts, &cfg).unwrap();
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.output_ids, y.output_ids);
        let worst = x
            .logprobs
            .iter()
            .zip(&y.logprobs)
            .map(|(p, q)| (p - q).abs())
            .fold(0f32, f32::max);
        assert!(worst <= 1e-5, "log-probs differ by {worst}");
    }
    let groups = g_dev.generate_groups(&dev.lm, &prompts, 3, &cfg).unwrap();
    let reference = g_cpu.generate_groups(&cpu.lm, &prompts, 3, &cfg).unwrap();
    let ids = |c: &[treetrain::generate::Completion]| c.iter().map(|c| c.output_ids.clone()).collect::<Vec<_>>();
    assert_eq!(ids(&groups), ids(&reference));
    assert_eq!(g_dev.ledger, g_cpu.ledger, "the device saw the same shapes");
}

#[test]
fn twenty_sft_steps_equal_the_cpu_and_the_optimizer_state_lives_on_the_device() {
    let device = neuron();
    let run = |spec: DeviceSpec| {
        let mut cfg = common::shipped_sft(None, 20);
        cfg.train.device = spec;
        // `auto` would pick bf16 on neuron; the comparison is exact fp32 on both.
        cfg.train.precision.dtype = DtypeSetting::Fixed(Dtype::Fp32);
        let mut t = SftTrainer::new(cfg).unwrap();
        let losses: Vec<f64> = (0..20).map(|_| t.step().unwrap().loss).collect();
        (losses, t)
    };
    let (cpu, _) = run(DeviceSpec::Cpu);
    let (dev, trainer) = run(DeviceSpec::PrivateUse1(0));
    for (i, (a, b)) in cpu.iter().zip(&dev).enumerate() {
        assert!((a - b).abs() <= 1e-5 * a.abs(), "step {}: cpu {a} neuron {b}", i + 1);
    }
    for (name, var) in trainer.model().vs.variables() {
        assert_on(device, &name, &var);
    }
    let state = trainer.core().optim.state_tensors();
    assert!(!state.is_empty());
    for (name, t) in state {
        assert_on(device, &name, &t);
    }
}

#[test]
fn the_shape_ledger_of_an_sft_run_on_the_device_measures_auto_padding() {
    neuron();
    let shapes = |pad: PadTo| {
        let mut cfg = common::shipped_sft(None, 6);
        cfg.train.device = DeviceSpec::PrivateUse1(0);
        cfg.packing = None;
        cfg.pad_to_multiple_of = pad;
        cfg.tokenize.max_length = 256;
        let mut t = SftTrainer::new(cfg).unwrap();
        for _ in 0..6 {
            t.step().unwrap();
        }
        let forward = t.ledger.graph("sft/forward").unwrap().clone();
        let backward = t.ledger.graph("sft/backward").unwrap().clone();
        assert_eq!(forward.shapes, backward.shapes);
        forward
    };
    let unpadded = shapes(PadTo::None);
    let auto = shapes(PadTo::Auto);
    assert!(
        auto.shapes.keys().all(|s| s[1] % 128 == 0),
        "auto pads to 128 on neuron: {:?}",
        auto.shapes.keys()
    );
    assert!(
        auto.shapes.len() < unpadded.shapes.len(),
        "padding cuts distinct shapes: {} vs {}",
        auto.shapes.len(),
        unpadded.shapes.len()
    );
}

#[test]
fn a_tree_packed_grpo_update_on_the_device_equals_the_cpu() {
    let device = neuron();
    let mut cfg = {
        let mut c = common::shipped_grpo();
        c.rollouts.prompts_per_step = 4;
        c
    };
    cfg.max_steps = 1;
    cfg.train.precision.dtype = DtypeSetting::Fixed(Dtype::Fp32);
    // AdamW's first step moves an entry by lr * g / (|g| + eps): with the default 1e-8, entries
    // whose gradient is summation noise (most vocabulary rows, for a model as sure of its replies
    // as the shipped SFT model) move by O(lr) either way. At 1e-6 they move in proportion to
    // the gradient, so comparing updates compares gradients.
    cfg.train.optimizer.adamw.eps = 1e-6;
    assert_eq!(cfg.update.packing, Packing::Tree);
    let mut cpu_trainer = GrpoTrainer::new(cfg.clone()).unwrap();
    let cpu_step = cpu_trainer.step().unwrap();
    cfg.train.device = DeviceSpec::PrivateUse1(0);
    let mut dev_trainer = GrpoTrainer::new(cfg).unwrap();
    let dev_step = dev_trainer.step().unwrap();
    assert_eq!(
        cpu_step.rollouts.reward_mean, dev_step.rollouts.reward_mean,
        "same rollouts"
    );
    // GRPO's loss at ratio 1 is a sum of advantages that cancel (~1e-7 here): compared in
    // absolute terms; the update itself is compared weight by weight below.
    assert!(
        (cpu_step.update.loss - dev_step.update.loss).abs() <= 1e-6,
        "loss cpu {} neuron {}",
        cpu_step.update.loss,
        dev_step.update.loss
    );
    // The update, tensor by tensor: AdamW's first step is lr * g / (|g| + eps), so entries
    // with near-zero gradients turn summation-order noise into O(lr) moves; compared in norm,
    // as tests/grpo.rs compares tree and flat packing.
    let start = Model::load(&common::root().join("datasets/tiny-qwen3-sft"), LoadOptions::default()).unwrap();
    let start = start.vs.variables();
    let (cpu_vars, dev_vars) = (cpu_trainer.model().vs.variables(), dev_trainer.model().vs.variables());
    for (name, d) in &dev_vars {
        assert_on(device, name, d);
        let cpu_delta = &cpu_vars[name] - &start[name];
        let dev_delta = Device::to_host(d).unwrap() - &start[name];
        let rel = (&cpu_delta - &dev_delta).norm().double_value(&[]) / cpu_delta.norm().double_value(&[]).max(1e-30);
        assert!(rel <= 1e-3, "{name}: the update differs by {rel:.2e} in norm");
    }
}

#[test]
fn the_cli_loads_the_backend_from_the_environment_and_names_a_missing_op() {
    let full = common::standin_library(true);
    let bare = common::standin_library(false);
    let tiny = treetrain::shipped::tiny_model_dir().unwrap();
    let run = |lib: &std::path::Path, args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_treetrain"))
            .args(args)
            .env(privateuse1::LIBRARY_ENV, lib)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, stdout, stderr) = run(&full, &["env"]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        stdout.contains("neuron") && stdout.contains(&full.display().to_string()),
        "{stdout}"
    );
    let model = tiny.display().to_string();
    let input = tempfile_dir("cli").join("rows.jsonl");
    std::fs::write(&input, "{\"input_ids\": [1, 2, 3, 4]}\n").unwrap();
    let input = input.display().to_string();
    let (code, _, stderr) = run(
        &bare,
        &["score", "--model", &model, "--device", "neuron", "--input", &input],
    );
    assert_eq!(code, Some(1), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    for needle in ["neuron:0 has no kernel for aten::", &bare.display().to_string()] {
        assert!(stderr.contains(needle), "`{needle}` missing from: {stderr}");
    }
}

/// The device self-check: a backend without a `view` kernel (its `view` falls back to the CPU
/// and no longer aliases) is refused before any work, with the op named, on the command line
/// and in the library; the full stand-in passes it. CUDA devices run the same code.
#[test]
fn the_device_self_check_refuses_a_backend_that_lacks_a_view_kernel() {
    let report = treetrain::model::check_device(neuron()).unwrap();
    assert_eq!(report.ops.len(), 9, "{report:?}");
    assert!(report.ops.iter().all(|(_, d)| *d <= 1e-4), "{report:?}");
    let noview = common::standin_without_view();
    let tiny = treetrain::shipped::tiny_model_dir().unwrap().display().to_string();
    let input = tempfile_dir("self-check").join("rows.jsonl");
    std::fs::write(&input, "{\"input_ids\": [1, 2, 3, 4]}\n").unwrap();
    let input = input.display().to_string();
    let run = |args: &[&str], check: Option<&str>| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_treetrain"));
        cmd.args(args)
            .env(privateuse1::LIBRARY_ENV, &noview)
            .env("RUST_BACKTRACE", "0");
        if let Some(v) = check {
            cmd.env(treetrain::model::DEVICE_CHECK_ENV, v);
        }
        let out = cmd.output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let score = ["score", "--model", &tiny, "--device", "neuron", "--input", &input];
    for args in [&["env", "--check-device", "neuron"][..], &score[..]] {
        let (code, stdout, stderr) = run(args, None);
        assert_eq!(code, Some(1), "{args:?}: {stdout}{stderr}");
        assert!(stdout.is_empty(), "{args:?} wrote {stdout}");
        assert!(
            stderr.contains("neuron:0 fails treetrain's self-check: view (an in-place write through a view"),
            "{args:?}: {stderr}"
        );
    }
    // Turned off, the same backend runs (and this op happens not to matter to scoring).
    let (code, stdout, stderr) = run(&score, Some("0"));
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.contains("logprobs"), "{stdout}");
}

/// The tiny Muse Spark on the device: a packed pair of rows past its 32-position window (the
/// device's dense packed mask, cut to the window) and greedy generation with its cache there
/// give what the CPU gives.
#[test]
fn muse_spark_scores_and_generates_on_the_device_as_on_the_cpu() {
    let device = neuron();
    let dir = treetrain::shipped::tiny_muse_spark_dir().unwrap();
    let load = |device| {
        let opts = LoadOptions {
            dtype: Some(Kind::Float),
            device,
        };
        Model::load(&dir, opts).unwrap()
    };
    let (cpu, dev) = (load(Device::Cpu), load(device));
    let long: Vec<i64> = (0..80).map(|i| (i * 37 + 5) % 2000).collect();
    let rows: [&[i64]; 2] = [&long, &long[..45]];
    let (a, b) = (cpu.score_packed(&rows).unwrap(), dev.score_packed(&rows).unwrap());
    let worst = a
        .iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(worst <= 1e-5, "score differs by {worst}");
    let cfg = GenerationConfig {
        max_new_tokens: 12,
        prefill_chunk_size: 16,
        ..Default::default()
    };
    let prompts = vec![long[..40].to_vec(), vec![1, 9, 4]];
    let x = Generator::new().generate(&cpu.lm, &prompts, &cfg).unwrap();
    let y = Generator::new().generate(&dev.lm, &prompts, &cfg).unwrap();
    for (x, y) in x.iter().zip(&y) {
        assert_eq!(x.output_ids, y.output_ids);
    }
}
