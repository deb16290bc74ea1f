//! What of the CUDA-graph decode path runs without a GPU: the graph-safe cache write it records
//! (the slot as a device value) equals the ordinary write, a graph asked for off CUDA is a typed
//! error, and the graph library resolves every symbol it needs against a real CUDA libtorch
//! (the torch 2.11.0 wheel of the torchrun venv), reporting the missing GPU as an error. The
//! capture and replay themselves run in scripts/gpu-check.sh on a GPU.

mod common;

use std::path::Path;

use tch::{Kind, Tensor};
use treetrain::device::Device;
use treetrain::generate::{GenerateError, GenerationConfig, Generator};
use treetrain::model::{KvCache, LoadOptions, Model, StaticCache};

fn tiny() -> Model {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/qwen3");
    let opts = LoadOptions {
        dtype: Some(Kind::Float),
        device: Device::Cpu,
    };
    Model::load(&dir, opts).unwrap()
}

#[test]
fn decode_steps_writing_at_a_device_slot_equal_the_ordinary_cache() {
    let m = tiny();
    let (b, slots) = (3, 12);
    let mask = Tensor::ones([b, 1, 1, slots], (Kind::Bool, tch::Device::Cpu));
    let run = |device_slot: bool| {
        let mut cache = StaticCache::new(&m.lm.config, b, slots, Kind::Float, Device::Cpu).unwrap();
        let slot = device_slot.then(|| cache.write_at_device_slot().unwrap());
        let mut outs = Vec::new();
        for step in 0..6i64 {
            if let Some(s) = &slot {
                let _ = s.shallow_clone().fill_(cache.len());
            }
            let ids = Tensor::from_slice(&[3 + step, 7 + step, 11 + step]).view([b, 1]);
            let pos = Tensor::full([b, 1], step, (Kind::Int64, tch::Device::Cpu));
            let h = tch::no_grad(|| m.lm.forward_cached(&ids, &pos, &mut cache, &mask)).unwrap();
            outs.push(h);
        }
        (outs, cache)
    };
    let ((plain, _), (slotted, mut cache)) = (run(false), run(true));
    for (a, b) in plain.iter().zip(&slotted) {
        assert!(a.equal(b), "the same hidden states, step for step");
    }
    // A chunk of several tokens is refused while the cache writes at a device slot.
    let ids = Tensor::zeros([b, 2], (Kind::Int64, tch::Device::Cpu));
    let mask2 = Tensor::ones([b, 1, 2, slots], (Kind::Bool, tch::Device::Cpu));
    let err = tch::no_grad(|| m.lm.forward_cached(&ids, &ids, &mut cache, &mask2)).unwrap_err();
    assert!(err.to_string().contains("one token at a time"), "{err}");
}

#[test]
fn a_graph_off_cuda_is_a_config_error() {
    let m = tiny();
    let cfg = GenerationConfig {
        max_new_tokens: 4,
        cuda_graph: true,
        ..Default::default()
    };
    let err = Generator::new().generate(&m.lm, &[vec![5, 6, 7]], &cfg).unwrap_err();
    assert!(
        matches!(&err, GenerateError::Config(m) if m.contains("cuda_graph needs a CUDA device")),
        "{err}"
    );
}

#[test]
fn the_graph_library_loads_into_a_cuda_libtorch_and_reports_the_missing_gpu() {
    let Some(lib) = common::cuda_torch_lib() else {
        eprintln!("skipped: TREETRAIN_TORCHRUN (scripts/setup-torchrun.sh) names no CUDA torch");
        return;
    };
    // Without libtorch_cuda in the process the library cannot load: its CUDA symbols are
    // unresolved, and the error says what it needs.
    let before = treetrain::generate::cuda_graph::CudaGraph::new(0)
        .err()
        .expect("no CUDA libtorch yet");
    assert!(
        before.to_string().contains("CUDA graphs need a CUDA libtorch"),
        "{before}"
    );
    treetrain::device::load_torch_cuda(&lib).expect("the venv's libtorch_cuda.so loads");
    // Now every symbol resolves (RTLD_NOW), and the library's first call reaches libtorch's
    // CUDA runtime, which finds no GPU here: an error with libtorch's words, not a crash.
    match treetrain::generate::cuda_graph::CudaGraph::new(0) {
        Err(GenerateError::CudaGraph(why)) => {
            assert!(!why.contains("undefined symbol"), "{why}");
            eprintln!("as expected without a GPU: {why}");
        }
        Err(other) => panic!("unexpected error kind: {other}"),
        Ok(_) => eprintln!("a GPU is present: the graph was created"),
    }
}
