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

/// The c10d shim, with `-DUSE_C10D_GLOO` when Gloo's headers are at `TREETRAIN_GLOO_INCLUDE`.
fn compile_c10d_shim(libtorch: &std::path::Path) {
    println!("cargo:rerun-if-env-changed=TREETRAIN_GLOO_INCLUDE");
    let mut build = torch_build(libtorch, "src/train/distributed/c10d_shim.cpp");
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
