//! Accelerator detection against fake machine roots.

use std::fs;
use std::path::Path;

use treetrain::EnvReport;
use treetrain::device::{Accelerators, HostProbe, PadTo, Platform, TorchFacts, parse_visible_cores};
use treetrain::display::Rich;

fn cpu_only_torch() -> TorchFacts {
    TorchFacts {
        cuda_device_count: 0,
        cudnn: false,
        mps: false,
        threads: 2,
        interop_threads: 2,
        openmp: true,
        mkl: true,
        mkldnn: true,
    }
}

fn touch(root: &Path, rel: &str, content: &str) {
    let p = root.join(rel);
    fs::create_dir_all(p.parent().unwrap()).unwrap();
    fs::write(p, content).unwrap();
}

fn fake_root(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("treetrain-fake-{name}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(dir.join("dev")).unwrap();
    dir
}

#[test]
fn bare_machine_is_cpu_and_says_why_no_cuda() {
    let root = fake_root("bare");
    touch(&root, "proc/cpuinfo", "processor\t: 0\nmodel name\t: Test CPU 9000\n");
    let acc = Accelerators::detect_with(&HostProbe::fake(&root, &[("OMP_NUM_THREADS", "2")]), &cpu_only_torch());
    assert_eq!(acc.platform(), Platform::Cpu);
    assert_eq!(acc.tch_device(), tch::Device::Cpu);
    assert_eq!(acc.cpu.model.as_deref(), Some("Test CPU 9000"));
    assert_eq!(acc.cpu.omp_num_threads.as_deref(), Some("2"));
    assert!(acc.neuron.is_none());
    let why = acc.cuda.unavailable_reason.as_deref().unwrap();
    assert!(why.contains("no NVIDIA driver"), "{why}");
    assert!(acc.notes().is_empty());
}

#[test]
fn driver_without_cuda_libtorch_points_at_the_fix() {
    let root = fake_root("driver");
    touch(&root, "dev/nvidiactl", "");
    touch(
        &root,
        "proc/driver/nvidia/version",
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.82.07  Wed Aug 27 2025\nGCC version: gcc 12\n",
    );
    touch(
        &root,
        "proc/self/maps",
        "7f00 r-xp 0 0 0 /opt/libtorch/lib/libtorch_cpu.so\n",
    );
    let acc = Accelerators::detect_with(&HostProbe::fake(&root, &[]), &cpu_only_torch());
    assert_eq!(acc.cuda.driver.as_deref(), Some("580.82.07"));
    let why = acc.cuda.unavailable_reason.unwrap();
    assert!(
        why.contains("libtorch_cuda.so is not loaded") && why.contains("TREETRAIN_TORCH_CUDA"),
        "{why}"
    );

    touch(
        &root,
        "proc/self/maps",
        "7f00 r-xp 0 0 0 /opt/torch/lib/libtorch_cuda.so\n",
    );
    let acc = Accelerators::detect_with(&HostProbe::fake(&root, &[]), &cpu_only_torch());
    assert!(acc.cuda.unavailable_reason.unwrap().contains("reports no device"));
}

#[test]
fn cuda_devices_get_driver_names() {
    let root = fake_root("cuda");
    touch(&root, "dev/nvidiactl", "");
    touch(
        &root,
        "proc/driver/nvidia/gpus/0000:19:00.0/information",
        "Model: \t NVIDIA H200\nIRQ: 1\n",
    );
    let torch = TorchFacts {
        cuda_device_count: 1,
        cudnn: true,
        ..cpu_only_torch()
    };
    let acc = Accelerators::detect_with(&HostProbe::fake(&root, &[]), &torch);
    assert!(acc.cuda.available && acc.cuda.cudnn && acc.cuda.unavailable_reason.is_none());
    assert_eq!(acc.cuda.devices[0].name.as_deref(), Some("NVIDIA H200"));
    assert_eq!(acc.platform(), Platform::Cuda);
    assert_eq!(acc.tch_device(), tch::Device::Cuda(0));
    assert_eq!(PadTo::Auto.resolve(acc.platform()), None);
}

#[test]
fn trn2_groups_eight_physical_cores_into_four_logical() {
    let root = fake_root("trn2");
    touch(&root, "dev/neuron0", "");
    touch(&root, "sys/devices/virtual/dmi/id/product_name", "trn2.3xlarge\n");
    let acc = Accelerators::detect_with(&HostProbe::fake(&root, &[]), &cpu_only_torch());
    let n = acc.neuron.as_ref().unwrap();
    assert_eq!(n.devices, vec![0]);
    assert_eq!(n.instance_type.as_deref(), Some("trn2.3xlarge"));
    assert_eq!(
        (n.physical_cores(), n.logical_cores(), n.usable_logical_cores()),
        (8, 4, 4)
    );
    assert!(!n.logical_nc_from_env);
    assert_eq!(acc.platform(), Platform::Neuron);
    // Without TorchNeuron's library loaded tensors stay on CPU, and the report says how to load it.
    assert_eq!(acc.tch_device(), tch::Device::Cpu);
    assert!(acc.notes()[0].contains("TREETRAIN_PRIVATEUSE1_LIB"));
    assert_eq!(PadTo::Auto.resolve(acc.platform()), Some(128));
    assert_eq!(acc.platform().preferred_dtype(), treetrain::model::Dtype::Bf16);
}

#[test]
fn neuron_environment_variables_are_honoured_and_checked() {
    let root = fake_root("trn2-env");
    for i in 0..2 {
        touch(&root, &format!("dev/neuron{i}"), "");
    }
    touch(&root, "sys/devices/virtual/dmi/id/product_name", "trn2.48xlarge");
    let probe = HostProbe::fake(
        &root,
        &[("NEURON_LOGICAL_NC_CONFIG", "1"), ("NEURON_RT_VISIBLE_CORES", "0-3,9")],
    );
    let n = Accelerators::detect_with(&probe, &cpu_only_torch()).neuron.unwrap();
    assert_eq!((n.physical_cores(), n.logical_cores()), (16, 16));
    assert!(n.logical_nc_from_env);
    assert_eq!(n.visible_cores, Some(vec![0, 1, 2, 3, 9]));
    assert_eq!(n.usable_logical_cores(), 5);
    assert!(n.warnings.is_empty(), "{:?}", n.warnings);

    let probe = HostProbe::fake(
        &root,
        &[("NEURON_LOGICAL_NC_CONFIG", "3"), ("NEURON_RT_VISIBLE_CORES", "7-2")],
    );
    let n = Accelerators::detect_with(&probe, &cpu_only_torch()).neuron.unwrap();
    assert_eq!(n.logical_nc_config, 2, "invalid value falls back to the trn2 default");
    assert_eq!(n.visible_cores, None);
    assert_eq!(n.warnings.len(), 2, "{:?}", n.warnings);
    assert!(n.warnings.iter().any(|w| w.contains("NEURON_RT_VISIBLE_CORES")));

    let probe = HostProbe::fake(&root, &[("NEURON_RT_VISIBLE_CORES", "0-40")]);
    let n = Accelerators::detect_with(&probe, &cpu_only_torch()).neuron.unwrap();
    assert!(
        n.warnings.iter().any(|w| w.contains("only 8 logical cores")),
        "{:?}",
        n.warnings
    );
}

#[test]
fn sysfs_core_count_beats_instance_family() {
    let root = fake_root("trn1");
    touch(&root, "dev/neuron0", "");
    touch(&root, "sys/devices/virtual/dmi/id/product_name", "trn1.2xlarge");
    let n = Accelerators::detect_with(&HostProbe::fake(&root, &[]), &cpu_only_torch())
        .neuron
        .unwrap();
    assert_eq!((n.physical_cores(), n.logical_cores()), (2, 2));
    touch(&root, "sys/devices/virtual/neuron_device/neuron0/core_count", "4\n");
    let n = Accelerators::detect_with(&HostProbe::fake(&root, &[]), &cpu_only_torch())
        .neuron
        .unwrap();
    assert_eq!(n.physical_cores(), 4);
    assert!(n.cores_source.contains("sysfs"));
}

#[test]
fn visible_core_lists_parse() {
    assert_eq!(parse_visible_cores("2").unwrap(), vec![2]);
    assert_eq!(parse_visible_cores("0, 2,4-5").unwrap(), vec![0, 2, 4, 5]);
    assert_eq!(parse_visible_cores("1,1,0-1").unwrap(), vec![0, 1]);
    for bad in ["", "a", "3-1", "0-", "-1", "0-99999"] {
        let err = parse_visible_cores(bad).unwrap_err().to_string();
        assert!(err.contains("NEURON_RT_VISIBLE_CORES"), "{bad}: {err}");
    }
}

#[test]
fn env_report_renders_every_section() {
    let root = fake_root("report");
    touch(&root, "dev/neuron0", "");
    touch(&root, "etc/os-release", "NAME=Test\nPRETTY_NAME=\"Test OS <1>\"\n");
    let probe = HostProbe::fake(&root, &[]);
    let report = EnvReport::from_parts(&probe, Accelerators::detect_with(&probe, &cpu_only_torch()));
    let text = report.text();
    for needle in [
        "treetrain",
        "libtorch",
        "2.11.0",
        "Neuron",
        "1 device(s)",
        "pad_to_multiple_of=auto",
        "128",
    ] {
        assert!(text.contains(needle), "{needle} missing in\n{text}");
    }
    let html = report.html();
    assert!(html.contains("Test OS &lt;1&gt;"), "OS name must be escaped");
    assert!(html.contains("<h4>Accelerators</h4>") && html.contains("<h4>Notes</h4>"));
    let json = report.to_json();
    assert_eq!(json["policies"]["platform"], "neuron");
    assert_eq!(json["policies"]["pad_to_multiple_of=auto"], "128");
    assert!(json["processes"]["world"].as_str().unwrap().starts_with("one process"));
    assert!(
        json["processes"]["data parallelism"]
            .as_str()
            .unwrap()
            .contains("ProcessGroupGloo")
    );
    let sharding = json["processes"]["sharding"].as_str().unwrap();
    assert!(
        ["no_shard", "shard_grad_op", "full_shard"]
            .iter()
            .all(|m| sharding.contains(m))
    );
}

#[test]
fn env_report_shows_the_configured_world() {
    let root = fake_root("world");
    let vars = [
        ("WORLD_SIZE", "4"),
        ("RANK", "3"),
        ("LOCAL_RANK", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29511"),
        ("TORCHELASTIC_USE_AGENT_STORE", "True"),
    ];
    let probe = HostProbe::fake(&root, &vars);
    let report = EnvReport::from_parts(&probe, Accelerators::detect_with(&probe, &cpu_only_torch()));
    let world = report.to_json()["processes"]["world"].as_str().unwrap().to_string();
    assert_eq!(
        world,
        "rank 3 of 4 (local rank 1); store 127.0.0.1:29511 hosted by the launcher; Gloo binds 127.0.0.1"
    );
    assert!(report.text().contains("Processes") && report.html().contains("<h4>Processes</h4>"));
    let bad = HostProbe::fake(&root, &[("WORLD_SIZE", "2"), ("RANK", "0")]);
    let report = EnvReport::from_parts(&bad, Accelerators::detect_with(&bad, &cpu_only_torch()));
    let world = report.to_json()["processes"]["world"].as_str().unwrap().to_string();
    assert!(
        world.starts_with("misconfigured") && world.contains("MASTER_PORT"),
        "{world}"
    );
}

#[test]
fn loading_a_missing_cuda_library_is_a_typed_error() {
    let err = treetrain::device::load_torch_cuda(Path::new("/nonexistent/torch/lib")).unwrap_err();
    assert!(err.to_string().contains("libtorch_cuda.so"), "{err}");
}
