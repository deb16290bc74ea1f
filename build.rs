//! Bakes libtorch's library folder into every binary this package links (lib tests,
//! integration tests, benches, the CLI), so none of them needs `LD_LIBRARY_PATH`.
//! tch's own rpath only covers tch's targets.

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
}
