//! What of the NCCL backend runs without a GPU: `libtreetrain_nccl.so` cannot load into the
//! CPU-only libtorch (its `ProcessGroupNCCL` symbols are unresolved, and the error says what it
//! needs), and `distributed_backend = "auto"` then keeps Gloo while `"nccl"` stops with the
//! reason. Once the torchrun venv's CUDA libtorch (torch 2.11.0 from PyPI) is in the process,
//! every symbol resolves, the header's NCCL version is the one torch pins and equals the
//! version of the venv's `libnccl.so.2`, and making a group on `cuda:0` reports the missing GPU
//! as an error, not a crash. A collective on a GPU runs in scripts/gpu-check.sh.

mod common;

use std::time::Duration;

use treetrain::device::DeviceSpec;
use treetrain::distributed::nccl::{NcclLibrary, version_string};
use treetrain::distributed::{BackendChoice, CommBackend, ProcessGroup, Store};

#[test]
fn the_nccl_library_resolves_against_a_cuda_libtorch_and_reports_the_missing_gpu() {
    // 1. CPU-only libtorch: the library cannot load, and says what it needs.
    let before = NcclLibrary::load().expect_err("no CUDA libtorch yet");
    assert!(before.contains("NCCL needs a CUDA libtorch"), "{before}");
    // ... so a CUDA run asked to use NCCL stops with that reason, and `auto` keeps Gloo.
    let forced = CommBackend::Nccl
        .choose(DeviceSpec::Cuda(0), 0, 0)
        .unwrap_err()
        .to_string();
    assert!(
        forced.contains("NCCL needs a CUDA libtorch") && forced.contains("rank 0"),
        "{forced}"
    );
    match CommBackend::Auto.choose(DeviceSpec::Cuda(0), 0, 0).unwrap() {
        BackendChoice::Gloo(Some(why)) => assert!(why.contains("NCCL needs a CUDA libtorch"), "{why}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        CommBackend::Gloo.choose(DeviceSpec::Cuda(0), 0, 0).unwrap(),
        BackendChoice::Gloo(None)
    );
    let Some(lib) = common::cuda_torch_lib() else {
        eprintln!("skipped the CUDA half: TREETRAIN_TORCHRUN (scripts/setup-torchrun.sh) names no CUDA torch");
        return;
    };
    // 2. The venv's CUDA libtorch (which loads its libnccl.so.2): every symbol resolves now
    //    (RTLD_NOW), and the versions agree with torch 2.11.0's pin.
    treetrain::device::load_torch_cuda(&lib).expect("the venv's libtorch_cuda.so loads");
    let nccl = NcclLibrary::load().expect("every symbol resolves");
    let v = nccl.checked_versions().expect("header and runtime agree");
    assert_eq!(version_string(v.header), "2.28.9");
    // 3. A group on cuda:0 of a one-rank world: no GPU here, so libtorch's error, not a crash.
    let dir = std::env::temp_dir().join(format!("treetrain-nccl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let timeout = Duration::from_secs(20);
    let store = Store::file(&dir.join("store"), 1, timeout, 0).unwrap();
    match ProcessGroup::nccl(store, "t", (0, 1), 0, timeout) {
        Err(e) => {
            let e = e.to_string();
            assert!(!e.contains("undefined symbol") && e.contains("rank 0"), "{e}");
            eprintln!("as expected without a GPU: {e}");
        }
        Ok(g) => eprintln!("a GPU is present: a group of {} rank(s) was made", g.size()),
    }
    let _ = std::fs::remove_dir_all(&dir);
    // 4. A CPU run never takes NCCL: `auto` is Gloo without a word, `nccl` an error.
    let cpu = CommBackend::Nccl.choose(DeviceSpec::Cpu, 0, 0).unwrap_err().to_string();
    assert!(cpu.contains("not a CUDA GPU"), "{cpu}");
    assert_eq!(
        CommBackend::Auto.choose(DeviceSpec::Cpu, 0, 0).unwrap(),
        BackendChoice::Gloo(None)
    );
}
