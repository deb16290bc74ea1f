//! Bakes libtorch's library folder into every binary this package links (lib tests,
//! integration tests, benches, the CLI), so none of them needs `LD_LIBRARY_PATH`.
//! tch's own rpath only covers tch's targets.
//!
//! Also compiles the C++ shim that reaches c10d (process groups) against the same libtorch
//! headers, with Gloo's headers when setup-libtorch.sh unpacked them, and the one that reaches
//! PyTorch's PrivateUse1 device slot (TorchNeuron's `neuron`).

use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-changed=build.rs");
    let Some(libtorch) = std::env::var_os("LIBTORCH").map(PathBuf::from) else {
        println!(
            "cargo:warning=LIBTORCH is not set: run scripts/setup-libtorch.sh (it lays out libtorch 2.11.0 in .deps/libtorch)"
        );
        println!("cargo:rustc-env=TREETRAIN_LIBTORCH_VERSION=unknown");
        println!("cargo:rustc-env=TREETRAIN_LIBTORCH_DIR=unknown");
        return;
    };
    let lib = libtorch.join("lib");
    if !lib.join("libtorch_cpu.so").exists() {
        panic!(
            "libtorch not found in {}: run scripts/setup-libtorch.sh from the treetrain checkout \
             (it provisions libtorch 2.11.0 from the PyPI torch wheel)",
            libtorch.display()
        );
    }
    let version = std::fs::read_to_string(libtorch.join("build-version")).unwrap_or_default();
    println!("cargo:rerun-if-changed={}", libtorch.join("build-version").display());
    println!("cargo:rustc-env=TREETRAIN_LIBTORCH_VERSION={}", version.trim());
    println!("cargo:rustc-env=TREETRAIN_LIBTORCH_DIR={}", libtorch.display());
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    // Keep libtorch.so NEEDED (the linker's --as-needed would drop it): on a GPU machine a real
    // libtorch.so found first on LD_LIBRARY_PATH then pulls in libtorch_cuda.so and CUDA works.
    println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
    println!("cargo:rustc-link-arg=-L{}", lib.display());
    println!("cargo:rustc-link-arg=-ltorch");
    println!("cargo:rustc-link-arg=-Wl,--as-needed");
    compile_c10d_shim(&libtorch);
    compile_privateuse1_shim(&libtorch);
    compile_cpu_kernels(&libtorch);
    let graph = ("src/generate/cuda_graph.cpp", "libtreetrain_cuda_graph.so");
    build_cuda_library(
        &libtorch,
        graph,
        "cuda_runtime_api.h",
        None,
        "TREETRAIN_CUDA_GRAPH_LIB_BUILT",
    );
    let memory = ("src/device/cuda_memory.cpp", "libtreetrain_cuda_memory.so");
    build_cuda_library(
        &libtorch,
        memory,
        "cuda_runtime_api.h",
        None,
        "TREETRAIN_CUDA_MEMORY_LIB_BUILT",
    );
    let nccl = ("src/distributed/nccl.cpp", "libtreetrain_nccl.so");
    let stubs = Some("src/distributed/cuda_stubs");
    build_cuda_library(&libtorch, nccl, "nccl.h", stubs, "TREETRAIN_NCCL_LIB_BUILT");
}

/// A C++ build against libtorch's headers, as torch-sys builds its own wrapper.
fn torch_build(libtorch: &std::path::Path, source: &str) -> cc::Build {
    println!("cargo:rerun-if-changed={source}");
    println!("cargo:rerun-if-changed=src/shim/guarded.hpp");
    let include = libtorch.join("include");
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .file(source)
        .flag("-std=c++17")
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .warnings(false);
    build
}

/// The PrivateUse1 shim: loading backend libraries and placing tensors on their devices.
fn compile_privateuse1_shim(libtorch: &std::path::Path) {
    torch_build(libtorch, "src/device/privateuse1_shim.cpp").compile("treetrain_privateuse1");
    println!("cargo:rustc-link-lib=dylib=dl");
}

/// The decode-step CPU kernels (`src/model/cpu_kernels/`): always optimised (a debug build's
/// tests would otherwise run them unvectorised), with OpenMP for `at::parallel_for`, linked
/// against the libgomp libtorch itself loads (one OpenMP runtime in the process). The weight
/// product may contract multiply-adds (its sums are reordered anyway); the small ops may not,
/// so they round as libtorch's separate kernels do.
fn compile_cpu_kernels(libtorch: &std::path::Path) {
    println!("cargo:rerun-if-changed=src/model/cpu_kernels/product.inc");
    torch_build(libtorch, "src/model/cpu_kernels/product.cpp")
        .opt_level(3)
        .flag("-fopenmp")
        .flag("-ffp-contract=fast")
        .compile("treetrain_cpu_product");
    torch_build(libtorch, "src/model/cpu_kernels/decode_ops.cpp")
        .opt_level(3)
        .flag("-fopenmp")
        .flag("-ffp-contract=off")
        .compile("treetrain_cpu_decode_ops");
    torch_build(libtorch, "src/model/host_memory.cpp").compile("treetrain_host_memory");
    torch_build(libtorch, "src/generate/cpu_sampler.cpp")
        .opt_level(3)
        .flag("-fopenmp")
        .flag("-ffp-contract=off")
        .compile("treetrain_cpu_sampler");
    let gomp = libtorch.join("lib/libgomp.so.1");
    println!("cargo:rustc-link-arg={}", gomp.display());
}

/// A shared library of treetrain's own that runs on CUDA: `lib` (e.g. the CUDA-graph one,
/// src/generate/cuda_graph.cpp, or the NCCL one, src/distributed/nccl.cpp) into OUT_DIR,
/// when the headers it needs (`header`: the CUDA runtime's, NCCL's) are at
/// `TREETRAIN_CUDA_INCLUDE` (scripts/setup-cuda-headers.sh). Its CUDA symbols resolve only when
/// it is loaded into a process running CUDA libtorch, so nothing here links CUDA. `stubs`: a
/// folder searched last (declarations the CUDA headers at hand lack). Its path reaches the
/// crate as `env` (empty when it was not built).
fn build_cuda_library(
    libtorch: &std::path::Path,
    (source, lib): (&str, &str),
    header: &str,
    stubs: Option<&str>,
    env: &str,
) {
    println!("cargo:rerun-if-changed={source}");
    println!("cargo:rerun-if-env-changed=TREETRAIN_CUDA_INCLUDE");
    let cuda = std::env::var_os("TREETRAIN_CUDA_INCLUDE").map(PathBuf::from);
    // The folder setup-cuda-headers.sh replaces whole: a new one (new headers) rebuilds.
    if let Some(dir) = cuda.as_ref().filter(|c| c.exists()) {
        println!("cargo:rerun-if-changed={}", dir.display());
    }
    let Some(cuda) = cuda.filter(|c| c.join(header).exists()) else {
        println!("cargo:warning={header} not found (TREETRAIN_CUDA_INCLUDE): no {lib}; run scripts/setup-libtorch.sh");
        println!("cargo:rustc-env={env}=");
        return;
    };
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR")).join(lib);
    let mut build = torch_build(libtorch, source);
    build.include(&cuda).opt_level(2).pic(true);
    if let Some(stubs) = stubs {
        println!("cargo:rerun-if-changed={stubs}");
        build.include(stubs);
    }
    let mut command = build.get_compiler().to_command();
    command.args(["-shared", "-o"]).arg(&out).arg(source);
    let status = command.status().expect("run the C++ compiler");
    assert!(status.success(), "compiling {source} failed");
    println!("cargo:rustc-env={env}={}", out.display());
}

/// The c10d shim, with `-DUSE_C10D_GLOO` when Gloo's headers are at `TREETRAIN_GLOO_INCLUDE`.
fn compile_c10d_shim(libtorch: &std::path::Path) {
    println!("cargo:rerun-if-env-changed=TREETRAIN_GLOO_INCLUDE");
    let mut build = torch_build(libtorch, "src/distributed/c10d_shim.cpp");
    let gloo = std::env::var_os("TREETRAIN_GLOO_INCLUDE").map(PathBuf::from);
    match gloo.filter(|g| g.join("gloo/algorithm.h").exists()) {
        Some(g) => {
            build.define("USE_C10D_GLOO", None).include(g);
        }
        None => println!(
            "cargo:warning=Gloo headers not found (TREETRAIN_GLOO_INCLUDE): process groups will be unavailable; run scripts/setup-libtorch.sh"
        ),
    }
    build.compile("treetrain_c10d");
    println!("cargo:rustc-link-lib=dylib=torch_cpu");
    println!("cargo:rustc-link-lib=dylib=c10");
}
