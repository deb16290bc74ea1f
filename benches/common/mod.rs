//! Shared by the bench binaries.

use std::path::Path;
use std::process::Command;

/// A Python that can `import modules` (e.g. `"transformers, torch"`): `--python`, else
/// `$TREETRAIN_BENCH_PYTHON`, else the fixture venv made by scripts/fixtures/venv.sh.
#[allow(dead_code)] // not every bench binary compares against Python
pub fn python(arg: Option<String>, modules: &str) -> Option<String> {
    let home = std::env::var("HOME").unwrap_or_default();
    let venv = Path::new(&home).join(".cache/treetrain/fixture-venv/bin/python");
    let check = format!("import {modules}");
    [
        arg,
        std::env::var("TREETRAIN_BENCH_PYTHON").ok(),
        venv.exists().then(|| venv.display().to_string()),
    ]
    .into_iter()
    .flatten()
    .find(|p| {
        Command::new(p)
            .args(["-c", &check])
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

/// The JSON line `py script args...` prints last (`None`, the script's last error line said,
/// when there is none): how a bench reads its Python reference's result.
#[allow(dead_code)]
pub fn python_result(py: &str, script: &str, args: &[&std::ffi::OsStr]) -> Option<serde_json::Value> {
    let out = Command::new(py)
        .arg(root().join(script))
        .args(args)
        .output()
        .expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let parsed = stdout
        .lines()
        .last()
        .and_then(|l| serde_json::from_str::<serde_json::Value>(l).ok());
    if parsed.is_none() {
        let err = String::from_utf8_lossy(&out.stderr);
        println!("{script}: failed: {}", err.lines().last().unwrap_or(""));
    }
    parsed
}

/// The checkout the benches read data and scripts from and write `target/bench/` into:
/// `$TREETRAIN_BENCH_ROOT` when set (a bench binary carried to another machine, as
/// scripts/gpu-check.sh does), else the checkout it was built in.
pub fn root() -> std::path::PathBuf {
    std::env::var_os("TREETRAIN_BENCH_ROOT").map_or_else(|| env!("CARGO_MANIFEST_DIR").into(), Into::into)
}

/// The flags every bench binary takes (each adds its own beside them with
/// `#[command(flatten)]`). `cargo bench` passes `--bench`: a full run; without it (`cargo test
/// --all-targets`) a seconds-long smoke run. The test harness's own flags, which `cargo test --
/// ...` passes to every target, are accepted and ignored.
#[derive(clap::Args, Debug)]
pub struct Common {
    /// A full run (what `cargo bench` passes); without it, a seconds-long smoke run.
    #[arg(long = "bench")]
    pub full: bool,
    /// The checkpoint folder a full run benches.
    #[arg(long)]
    pub model: Option<std::path::PathBuf>,
    /// A published `config.json`: a full run benches a random model of it, made once under
    /// `target/bench/models/`.
    #[arg(long)]
    pub config: Option<std::path::PathBuf>,
    /// Where the model runs: cpu, cuda or cuda:N (resolved after parsing, so a device that
    /// is missing is an error, exit 1, not a usage error).
    #[arg(long)]
    device: Option<String>,
    /// The parameters' dtype.
    #[arg(long, value_enum)]
    dtype: Option<treetrain::device::Dtype>,
    /// Steps of a full run.
    #[arg(long)]
    steps: Option<u64>,
    /// Keep the first N decoder layers of `--config` (a model at the published width that fits
    /// the host); the derived config is written under `target/bench/configs/`.
    #[arg(long)]
    layers: Option<u64>,
    /// A Python with the packages the comparison needs (else `$TREETRAIN_BENCH_PYTHON`, else
    /// the fixture venv).
    #[arg(long)]
    pub python: Option<String>,
    #[command(flatten)]
    harness: Harness,
}

/// The test harness's flags and filters (`cargo test -- --include-ignored`), ignored.
#[derive(clap::Args, Debug)]
struct Harness {
    #[arg(long, hide = true)]
    include_ignored: bool,
    #[arg(long, hide = true)]
    ignored: bool,
    #[arg(long, hide = true)]
    nocapture: bool,
    #[arg(long, hide = true)]
    show_output: bool,
    #[arg(long, hide = true)]
    quiet: bool,
    #[arg(long, hide = true)]
    exact: bool,
    #[arg(long, hide = true)]
    test_threads: Option<String>,
    #[arg(long, hide = true)]
    color: Option<String>,
    #[arg(long, hide = true)]
    format: Option<String>,
    #[arg(hide = true)]
    filters: Vec<String>,
}

#[allow(dead_code)] // each bench binary compiles this module and uses part of it
impl Common {
    /// Writes `target/bench/<name>.json` (`<name>_smoke.json` for a smoke run) and says where.
    pub fn write_result(&self, name: &str, result: &serde_json::Value) {
        let file = if self.full {
            format!("{name}.json")
        } else {
            format!("{name}_smoke.json")
        };
        let path = root().join("target/bench").join(file);
        let _ = std::fs::create_dir_all(path.parent().expect("parent"));
        std::fs::write(&path, serde_json::to_string_pretty(result).expect("json")).expect("write");
        println!("wrote {}", path.display());
    }

    /// The checkpoint a full run uses: `--model DIR` as it is, `--config config.json` as a
    /// random model of that published config ([`random_model_dir`]); else `default` (and always
    /// `default` in a smoke run).
    pub fn model_dir(&self, default: std::path::PathBuf) -> std::path::PathBuf {
        match (self.full, &self.model, &self.config) {
            (true, Some(dir), _) => dir.clone(),
            (true, None, Some(_)) => random_model_dir(&self.config_file(default.join("config.json")), self.device()),
            _ => default,
        }
    }

    /// The `config.json` a full run builds its random model from: `--config FILE`, or the
    /// `config.json` of `--model DIR`; else `default` (always in a smoke run).
    pub fn config_file(&self, default: std::path::PathBuf) -> std::path::PathBuf {
        match (self.full, &self.config, &self.model) {
            (true, Some(config), _) => match self.layers {
                Some(n) => with_layers(config, n),
                None => config.clone(),
            },
            (true, None, Some(dir)) => dir.join("config.json"),
            _ => default,
        }
    }

    /// `--device` (default CPU).
    pub fn device(&self) -> treetrain::device::Device {
        match self.device.as_deref().map(treetrain::device::parse_device) {
            None => treetrain::device::Device::Cpu,
            Some(Ok(device)) => device,
            Some(Err(e)) => {
                eprintln!("--device: {e}");
                std::process::exit(1);
            }
        }
    }

    /// `--dtype` as a tch kind (default fp32).
    pub fn kind(&self) -> tch::Kind {
        self.dtype.unwrap_or_default().kind()
    }

    /// `--steps N` in a full run (default `full`), `smoke` otherwise.
    pub fn steps(&self, full: u64, smoke: u64) -> u64 {
        if self.full { self.steps.unwrap_or(full) } else { smoke }
    }
}

/// `config` with its first `n` decoder layers only, written as
/// `target/bench/configs/<stem>-<n>-layers.json`.
fn with_layers(config: &Path, n: u64) -> std::path::PathBuf {
    let text = std::fs::read_to_string(config).expect("read config.json");
    let mut v: serde_json::Value = serde_json::from_str(&text).expect("config.json");
    v["num_hidden_layers"] = n.into();
    if let Some(dense) = v.get_mut("mlp_only_layers").and_then(|d| d.as_array_mut()) {
        dense.retain(|l| l.as_u64().is_some_and(|l| l < n));
    }
    let stem = config.file_stem().and_then(|s| s.to_str()).unwrap_or("config");
    let path = root()
        .join("target/bench/configs")
        .join(format!("{stem}-{n}-layers.json"));
    let _ = std::fs::create_dir_all(path.parent().expect("parent"));
    std::fs::write(&path, serde_json::to_string_pretty(&v).expect("json")).expect("write config");
    path
}

/// How glibc's allocator treats large blocks while a bench runs.
#[allow(dead_code)]
pub enum AllocatorMode {
    /// Freed memory stays with the process (steady-state speed).
    Time,
    /// Every large tensor is its own mapping, returned on free (honest resident peaks).
    Measure,
}

/// Sets the allocator's mode: `Measure` maps every large tensor on its own and returns it on
/// free, so resident memory follows live tensors (honest peaks); `Time` keeps freed memory.
#[allow(dead_code)]
pub fn allocator(mode: AllocatorMode) {
    let (mmap, trim) = match mode {
        AllocatorMode::Time => (64 << 20, 1 << 30),
        AllocatorMode::Measure => (256 << 10, 1 << 20),
    };
    // SAFETY: mallopt and malloc_trim only tune and trim glibc's allocator.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, mmap);
        libc::mallopt(libc::M_TRIM_THRESHOLD, trim);
        libc::malloc_trim(0);
    }
}

/// Resets the process's resident-memory high-water mark (`VmHWM`).
#[allow(dead_code)]
pub fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// A `/proc/self/status` field in KiB (`VmRSS:`, `VmHWM:`).
#[allow(dead_code)]
pub fn status_kib(field: &str) -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0.0)
}

/// A checkpoint folder with random weights for a published `config.json` (the configs, not
/// the weights: no hub here), made once under `target/bench/models/<name>/` with the shipped
/// tiny tokenizer's files (its ids lie inside any real vocabulary), so Python loads the same
/// model. Drawn on `device` from a fixed seed (`Model::drawn`: seconds on a GPU for a config
/// of billions of parameters).
#[allow(dead_code)]
pub fn random_model_dir(config: &Path, device: treetrain::device::Device) -> std::path::PathBuf {
    let name = config
        .file_stem()
        .map_or("model".into(), |s| s.to_string_lossy().into_owned());
    let dir = root().join("target/bench/models").join(name);
    if dir.join("model.safetensors").exists() {
        return dir;
    }
    let hf = treetrain::model::HfConfig::from_file(config).expect("config.json");
    let opts = treetrain::model::LoadOptions {
        dtype: Some(tch::Kind::Float),
        device,
    };
    let model = treetrain::model::Model::drawn(hf, opts, 1, 0.02).expect("random model");
    let tokenizer = treetrain::shipped::tiny_model_dir().expect("tiny model");
    let _ = std::fs::remove_dir_all(&dir);
    model.save(&dir, Some(&tokenizer)).expect("save random model");
    dir
}

/// Stops the bench (exit 1, the reason on stderr) when `device` is a CUDA device this process
/// cannot use, before any model is made: a random checkpoint of a large config takes a minute
/// and gigabytes to write.
#[allow(dead_code)]
pub fn require(device: treetrain::device::Device) {
    if let treetrain::device::Device::Cuda(i) = device
        && let Err(e) = treetrain::device::DeviceSpec::Cuda(i).resolve()
    {
        eprintln!("{e}");
        std::process::exit(1);
    }
}

/// Median of `v` (NaN when empty).
#[allow(dead_code)]
pub fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    match n {
        0 => f64::NAN,
        // An even count: the mean of the middle two (two pairs are not "the larger one").
        _ if n.is_multiple_of(2) => (s[n / 2 - 1] + s[n / 2]) / 2.0,
        _ => s[n / 2],
    }
}

/// Read bandwidth of this machine in GB/s: the best of 5 sums over a 1 GiB f32 tensor (one
/// read of every byte, nothing written but the scalar) in huge pages where the system has them,
/// as the models' parameters and KV caches are (`treetrain::bench_support::huge_page_empty`).
#[allow(dead_code)]
pub fn read_bandwidth_gbs() -> f64 {
    let like = tch::Tensor::zeros([1], (tch::Kind::Float, tch::Device::Cpu));
    let (mut t, _) = treetrain::bench_support::huge_page_empty(1 << 28, &like).expect("1 GiB in huge pages");
    let _ = t.fill_(1.0);
    best_sum_gbs(&t)
}

/// [`read_bandwidth_gbs`] over libtorch's own allocation (4 KiB pages where the system's THP
/// mode is `madvise`): what the parameters would be read from outside huge pages.
#[allow(dead_code)]
pub fn allocator_read_bandwidth_gbs() -> f64 {
    best_sum_gbs(&tch::Tensor::ones([1 << 28], (tch::Kind::Float, tch::Device::Cpu)))
}

/// The best of 5 sums over `t`, in GB/s read.
fn best_sum_gbs(t: &tch::Tensor) -> f64 {
    let bytes = (t.numel() * 4) as f64;
    (0..5)
        .map(|_| {
            let s = std::time::Instant::now();
            let _ = t.sum(tch::Kind::Float).double_value(&[]);
            bytes / s.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}

/// Read bandwidth of `device` in GB/s: [`read_bandwidth_gbs`] on the CPU; on a GPU the best of
/// 5 sums over a 4 GiB tensor there (synchronized).
#[allow(dead_code)]
pub fn device_read_bandwidth_gbs(device: treetrain::device::Device) -> f64 {
    if device == treetrain::device::Device::Cpu {
        return read_bandwidth_gbs();
    }
    let t = device.ones(&[1 << 30], tch::Kind::Float).expect("4 GiB on the device");
    let bytes = (t.numel() * 4) as f64;
    (0..5)
        .map(|_| {
            sync(device);
            let s = std::time::Instant::now();
            let _ = t.sum(tch::Kind::Float).double_value(&[]);
            bytes / s.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}

/// Waits for `device`'s queued work (nothing to wait for on the CPU).
#[allow(dead_code)]
pub fn sync(device: treetrain::device::Device) {
    if let treetrain::device::Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

/// This machine's f32 matmul rate in GFLOP/s: the best of 5 products of 2048 x 2048 matrices.
#[allow(dead_code)]
pub fn matmul_gflops() -> f64 {
    let n = 2048;
    let a = tch::Tensor::ones([n, n], (tch::Kind::Float, tch::Device::Cpu)) * 0.5;
    let _ = a.matmul(&a);
    (0..5)
        .map(|_| {
            let s = std::time::Instant::now();
            let c = a.matmul(&a);
            let _ = c.double_value(&[0, 0]);
            2.0 * (n * n * n) as f64 / s.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}
