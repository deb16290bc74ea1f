//! `treetrain env`: what this process runs on, in the spirit of `trl env`.

use crate::device::privateuse1::{self, Backend};
use crate::device::{Accelerators, HostProbe, PadTo, Platform};
use crate::display::{self, Rich, escape};
use crate::distributed::{GlooDevice, LaunchEnv, built_with_gloo};

/// Versions, machine, accelerators and the policies that follow, gathered once.
#[derive(Debug, Clone)]
pub struct EnvReport {
    /// This crate's version.
    pub treetrain_version: String,
    /// The tch crate version treetrain is built with.
    pub tch_version: String,
    /// libtorch version of the folder treetrain was linked against (its `build-version`).
    pub libtorch_version: String,
    /// libtorch folder at build time.
    pub libtorch_build_dir: String,
    /// The `libtorch_cpu.so` this process actually loaded.
    pub libtorch_loaded: Option<String>,
    /// OS name and architecture.
    pub os: String,
    /// Every accelerator.
    pub accelerators: Accelerators,
    /// The multi-process launch this process is part of (torchrun's variables), `None` for
    /// one process, or why the variables do not describe one.
    pub world: Result<Option<LaunchEnv>, String>,
    /// Whether this build can create Gloo process groups.
    pub gloo: bool,
    /// The PrivateUse1 backend registered in this process (TorchNeuron's `neuron`, loaded from
    /// `TREETRAIN_PRIVATEUSE1_LIB`), or why its library failed to load.
    pub privateuse1: Result<Option<Backend>, String>,
}

/// tch's version, pinned in Cargo.toml.
pub const TCH_VERSION: &str = "0.24.0";

impl EnvReport {
    /// Collects the report for this process.
    pub fn collect() -> Self {
        let loaded = privateuse1::load_from_env().map_err(|e| e.to_string());
        let mut report = Self::from_parts(&HostProbe::system(), Accelerators::detect());
        if !matches!(loaded, Ok(None)) {
            report.privateuse1 = loaded;
        }
        report
    }

    /// The report for given accelerators, reading OS facts through `probe`.
    pub fn from_parts(probe: &HostProbe, accelerators: Accelerators) -> Self {
        let pretty = probe
            .read("/etc/os-release")
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("PRETTY_NAME=").map(|v| v.trim_matches('"').to_string()))
            })
            .unwrap_or_else(|| std::env::consts::OS.to_string());
        let libtorch_loaded = probe.read("/proc/self/maps").and_then(|maps| {
            maps.lines()
                .filter_map(|l| l.split_whitespace().nth(5))
                .find(|p| p.ends_with("/libtorch_cpu.so"))
                .map(str::to_string)
        });
        EnvReport {
            treetrain_version: env!("CARGO_PKG_VERSION").to_string(),
            tch_version: TCH_VERSION.to_string(),
            libtorch_version: env!("TREETRAIN_LIBTORCH_VERSION").to_string(),
            libtorch_build_dir: env!("TREETRAIN_LIBTORCH_DIR").to_string(),
            libtorch_loaded,
            os: format!("{pretty} ({})", std::env::consts::ARCH),
            accelerators,
            world: LaunchEnv::from_lookup(|k| probe.var(k).map(str::to_string)).map_err(|e| e.to_string()),
            gloo: built_with_gloo(),
            privateuse1: privateuse1::registered().map_err(|e| e.to_string()),
        }
    }

    /// The platform runs here plan for: Neuron's when a PrivateUse1 backend is loaded.
    pub fn platform(&self) -> Platform {
        match self.privateuse1 {
            Ok(Some(_)) => Platform::Neuron,
            _ => self.accelerators.platform(),
        }
    }

    /// Where `device = "auto"` places a run (CUDA first, then a loaded PrivateUse1 backend).
    fn auto_device(&self) -> String {
        match (&self.privateuse1, self.accelerators.cuda.available) {
            (Ok(Some(b)), false) if b.device_count > 0 => format!("{}:0", b.name),
            _ => crate::device::Device::from(self.accelerators.tch_device()).to_string(),
        }
    }

    fn version_rows(&self) -> Vec<(&'static str, String)> {
        let cpu = &self.accelerators.cpu;
        vec![
            ("treetrain", self.treetrain_version.clone()),
            ("tch", self.tch_version.clone()),
            ("libtorch", self.libtorch_version.clone()),
            (
                "libtorch loaded from",
                self.libtorch_loaded.clone().unwrap_or_else(|| "unknown".into()),
            ),
            ("OS", self.os.clone()),
            ("CPU", cpu.model.clone().unwrap_or_else(|| "unknown".into())),
            (
                "threads",
                format!(
                    "{} logical CPUs; libtorch {} intra-op, {} inter-op{}",
                    cpu.logical_cpus,
                    cpu.torch_threads,
                    cpu.torch_interop_threads,
                    cpu.omp_num_threads
                        .as_ref()
                        .map_or(String::new(), |v| format!(" (OMP_NUM_THREADS={v})"))
                ),
            ),
            (
                "OpenMP / MKL / oneDNN",
                format!("{} / {} / {}", yes(cpu.openmp), yes(cpu.mkl), yes(cpu.mkldnn)),
            ),
        ]
    }

    fn accelerator_rows(&self) -> Vec<(&'static str, String)> {
        let a = &self.accelerators;
        let cuda = if a.cuda.available {
            let names: Vec<String> = a
                .cuda
                .devices
                .iter()
                .map(|d| format!("cuda:{} {}", d.index, d.name.as_deref().unwrap_or("")))
                .collect();
            format!(
                "{} device(s): {}; cuDNN {}",
                a.cuda.devices.len(),
                names.join(", "),
                yes(a.cuda.cudnn)
            )
        } else {
            format!(
                "unavailable: {}",
                a.cuda.unavailable_reason.as_deref().unwrap_or("unknown")
            )
        };
        let mut rows = vec![("CUDA", cuda)];
        if let Some(driver) = &a.cuda.driver {
            rows.push(("NVIDIA driver", driver.clone()));
        }
        rows.push(("MPS", yes(a.mps).to_string()));
        let neuron = match &a.neuron {
            None => "none (no /dev/neuron* device)".to_string(),
            Some(n) => format!(
                "{} device(s){}: {} physical cores ({}), {} logical (NEURON_LOGICAL_NC_CONFIG={}{}), {} usable{}",
                n.devices.len(),
                n.instance_type.as_ref().map_or(String::new(), |t| format!(" on {t}")),
                n.physical_cores(),
                n.cores_source,
                n.logical_cores(),
                n.logical_nc_config,
                if n.logical_nc_from_env { "" } else { ", default" },
                n.usable_logical_cores(),
                n.visible_cores
                    .as_ref()
                    .map_or(String::new(), |_| " (NEURON_RT_VISIBLE_CORES)".to_string()),
            ),
        };
        rows.push(("Neuron", neuron));
        let backend = match &self.privateuse1 {
            Err(e) => format!("failed to load: {e}"),
            Ok(None) => format!("none loaded ({} names a backend library)", privateuse1::LIBRARY_ENV),
            Ok(Some(b)) => format!("{:?}, {} device(s), from {}", b.name, b.device_count, b.library_list()),
        };
        rows.push(("PrivateUse1", backend));
        rows
    }

    fn process_rows(&self) -> Vec<(&'static str, String)> {
        let backend = match self.gloo {
            true => "c10d ProcessGroupGloo (host tensors; others staged through host memory)",
            false => "unavailable: built without Gloo's headers (scripts/setup-libtorch.sh)",
        };
        let world = match &self.world {
            Err(e) => format!("misconfigured: {e}"),
            Ok(None) => {
                "one process (no WORLD_SIZE; `treetrain launch --nproc-per-node N -- ...` or torchrun scales out)"
                    .into()
            }
            Ok(Some(w)) => format!(
                "rank {} of {} (local rank {}); store {}:{} hosted by {}; Gloo binds {}",
                w.rank,
                w.size,
                w.local_rank,
                w.master_addr,
                w.master_port,
                if w.agent_store { "the launcher" } else { "rank 0" },
                match w.gloo_device() {
                    GlooDevice::Default => "this host's address".to_string(),
                    GlooDevice::Hostname(h) => h,
                    GlooDevice::Interface(i) => format!("interface {i}"),
                }
            ),
        };
        let sharding = match self.gloo {
            true => {
                "fsdp per run: no_shard (default), shard_grad_op (ZeRO-2) or full_shard (ZeRO-3); a run's World display shows its mode and per-rank bytes"
            }
            false => "unavailable without a process group",
        };
        vec![
            ("data parallelism", backend.to_string()),
            ("sharding", sharding.to_string()),
            ("world", world),
        ]
    }

    fn policy_rows(&self) -> Vec<(&'static str, String)> {
        let p = self.platform();
        vec![
            ("platform", p.to_string()),
            ("device auto", self.auto_device()),
            ("preferred dtype", p.preferred_dtype().to_string()),
            (
                "pad_to_multiple_of=auto",
                PadTo::Auto
                    .resolve(p)
                    .map_or("no padding".to_string(), |m| m.to_string()),
            ),
            (
                "new shape costs",
                if p.compiles_per_shape() {
                    "a graph compile (~60 s)"
                } else {
                    "nothing (eager)"
                }
                .to_string(),
            ),
        ]
    }

    /// The report as JSON (for `treetrain env --json` and bug reports).
    pub fn to_json(&self) -> serde_json::Value {
        let obj = |rows: Vec<(&str, String)>| {
            serde_json::Value::Object(rows.into_iter().map(|(k, v)| (k.to_string(), v.into())).collect())
        };
        serde_json::json!({
            "versions": obj(self.version_rows()),
            "accelerators": obj(self.accelerator_rows()),
            "policies": obj(self.policy_rows()),
            "processes": obj(self.process_rows()),
            "notes": self.accelerators.notes(),
        })
    }
}

fn yes(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}

impl Rich for EnvReport {
    fn html(&self) -> String {
        let esc = |rows: Vec<(&'static str, String)>| -> Vec<(&'static str, String)> {
            rows.into_iter().map(|(k, v)| (k, escape(&v))).collect()
        };
        let mut body = display::section("treetrain environment", &display::kv_table(&esc(self.version_rows())));
        body.push_str(&display::section(
            "Accelerators",
            &display::kv_table(&esc(self.accelerator_rows())),
        ));
        body.push_str(&display::section(
            "Policies",
            &display::kv_table(&esc(self.policy_rows())),
        ));
        body.push_str(&display::section(
            "Processes",
            &display::kv_table(&esc(self.process_rows())),
        ));
        let notes = self.accelerators.notes();
        if !notes.is_empty() {
            let items: String = notes
                .iter()
                .map(|n| format!("<li class=\"warn\">{}</li>", escape(n)))
                .collect();
            body.push_str(&display::section("Notes", &format!("<ul>{items}</ul>")));
        }
        display::style::container(&body)
    }

    fn text(&self) -> String {
        let mut s = String::new();
        for (title, rows) in [
            ("treetrain environment", self.version_rows()),
            ("Accelerators", self.accelerator_rows()),
            ("Policies", self.policy_rows()),
            ("Processes", self.process_rows()),
        ] {
            s.push_str(&format!("{title}\n"));
            for (k, v) in rows {
                s.push_str(&format!("  {k:<24} {v}\n"));
            }
        }
        for n in self.accelerators.notes() {
            s.push_str(&format!("note: {n}\n"));
        }
        s
    }
}

crate::display::rich_display!(EnvReport);
