//! The CUDA caching allocator's statistics library: it loads only into a CUDA libtorch, every
//! symbol resolves there, and without a GPU its calls return libtorch's reason, not a crash.

mod common;

use treetrain::device::{cuda_memory_stats, load_torch_cuda, reset_cuda_peak};

#[test]
fn the_memory_library_loads_into_a_cuda_libtorch_and_reports_the_missing_gpu() {
    let Some(lib) = common::cuda_torch_lib() else {
        eprintln!("skipped: TREETRAIN_TORCHRUN (scripts/setup-torchrun.sh) names no CUDA torch");
        return;
    };
    // Without libtorch_cuda in the process its CUDA symbols are unresolved: an error naming
    // what it needs and the device.
    let before = cuda_memory_stats(0).expect_err("no CUDA libtorch yet").to_string();
    assert!(
        before.contains("need a CUDA libtorch") && before.contains("cuda:0"),
        "{before}"
    );
    load_torch_cuda(&lib).expect("the venv's libtorch_cuda.so loads");
    for result in [cuda_memory_stats(0).map(|_| ()), reset_cuda_peak(0)] {
        match result {
            Err(e) => {
                let why = e.to_string();
                assert!(!why.contains("undefined symbol") && !why.contains("lacks"), "{why}");
                eprintln!("as expected without a GPU: {why}");
            }
            Ok(()) => eprintln!("a GPU is present: the allocator answered"),
        }
    }
}
