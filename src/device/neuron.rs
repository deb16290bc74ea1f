use super::error::DeviceError;
use super::probe::HostProbe;

/// AWS Neuron devices found on the machine (Trainium / Inferentia2).
///
/// Found through the driver's device nodes `/dev/neuron<N>`; cores per device come from
/// `/sys/devices/virtual/neuron_device/neuron<N>/core_count` when the driver exposes it, else
/// from the instance family in `/sys/devices/virtual/dmi/id/product_name`. Trainium2 has 8
/// physical cores per chip, grouped two per logical core by default (`NEURON_LOGICAL_NC_CONFIG`
/// = 2), so a trn2.3xlarge shows 4 logical cores. `NEURON_RT_VISIBLE_CORES` restricts which
/// logical cores this process may use.
#[derive(Debug, Clone, PartialEq)]
pub struct NeuronInfo {
    /// Indices of `/dev/neuron<N>` nodes, sorted.
    pub devices: Vec<u32>,
    /// EC2 instance type, when the DMI product name tells it (e.g. `trn2.3xlarge`).
    pub instance_type: Option<String>,
    /// Physical NeuronCores per device.
    pub physical_cores_per_device: u32,
    /// Where `physical_cores_per_device` came from.
    pub cores_source: String,
    /// Physical cores per logical core.
    pub logical_nc_config: u32,
    /// Whether `logical_nc_config` was set by `NEURON_LOGICAL_NC_CONFIG`.
    pub logical_nc_from_env: bool,
    /// Logical cores named by `NEURON_RT_VISIBLE_CORES`, if set.
    pub visible_cores: Option<Vec<u32>>,
    /// Problems found while reading the configuration (invalid variables are reported here and
    /// ignored, so detection itself never fails).
    pub warnings: Vec<String>,
}

/// Cores per device and default logical grouping per instance family.
fn family_defaults(instance_type: &str) -> Option<(u32, u32, &'static str)> {
    let family = instance_type.split('.').next().unwrap_or("");
    match family {
        "trn1" | "trn1n" => Some((2, 1, "Trainium1: 2 cores per chip")),
        "inf2" => Some((2, 1, "Inferentia2: 2 cores per chip")),
        "trn2" | "trn2u" => Some((8, 2, "Trainium2: 8 cores per chip")),
        "trn3" => Some((8, 2, "Trainium3: assumed 8 cores per chip like Trainium2")),
        _ => None,
    }
}

impl NeuronInfo {
    /// Detects Neuron devices; `None` when the machine has no `/dev/neuron*` node.
    pub(crate) fn detect(probe: &HostProbe) -> Option<Self> {
        let mut devices: Vec<u32> = probe
            .list("/dev")
            .iter()
            .filter_map(|n| n.strip_prefix("neuron")?.parse().ok())
            .collect();
        if devices.is_empty() {
            return None;
        }
        devices.sort_unstable();
        let mut warnings = Vec::new();
        let instance_type = probe
            .read("/sys/devices/virtual/dmi/id/product_name")
            .filter(|s| family_defaults(s).is_some());
        let sysfs_cores = probe
            .read(&format!(
                "/sys/devices/virtual/neuron_device/neuron{}/core_count",
                devices[0]
            ))
            .and_then(|s| s.parse::<u32>().ok())
            .filter(|&c| c > 0);
        let family = instance_type.as_deref().and_then(family_defaults);
        let (physical_cores_per_device, cores_source) = match (sysfs_cores, family) {
            (Some(c), _) => (c, "driver sysfs core_count".to_string()),
            (None, Some((c, _, why))) => (c, why.to_string()),
            (None, None) => (
                8,
                "unknown instance type: assumed Trainium2 (8 cores per chip)".to_string(),
            ),
        };
        let default_lnc = family
            .map(|f| f.1)
            .unwrap_or(if physical_cores_per_device >= 8 { 2 } else { 1 });
        let (logical_nc_config, logical_nc_from_env) = match probe.var("NEURON_LOGICAL_NC_CONFIG") {
            Some(v) => match v.trim().parse::<u32>() {
                Ok(n @ (1 | 2)) => (n, true),
                _ => {
                    warnings.push(format!(
                        "NEURON_LOGICAL_NC_CONFIG={v:?} is not 1 or 2; using the default {default_lnc}"
                    ));
                    (default_lnc, false)
                }
            },
            None => (default_lnc, false),
        };
        let visible_cores = match probe.var("NEURON_RT_VISIBLE_CORES").map(parse_visible_cores) {
            Some(Ok(v)) => Some(v),
            Some(Err(e)) => {
                warnings.push(format!("{e}; ignoring it"));
                None
            }
            None => None,
        };
        let mut info = NeuronInfo {
            devices,
            instance_type,
            physical_cores_per_device,
            cores_source,
            logical_nc_config,
            logical_nc_from_env,
            visible_cores,
            warnings,
        };
        if let Some(v) = &info.visible_cores {
            let logical = info.logical_cores();
            if let Some(bad) = v.iter().find(|&&c| c >= logical) {
                info.warnings.push(format!(
                    "NEURON_RT_VISIBLE_CORES names core {bad}, but only {logical} logical cores exist"
                ));
            }
        }
        Some(info)
    }

    /// Physical NeuronCores on the machine.
    pub fn physical_cores(&self) -> u32 {
        self.devices.len() as u32 * self.physical_cores_per_device
    }

    /// Logical NeuronCores on the machine (what the runtime schedules on).
    pub fn logical_cores(&self) -> u32 {
        (self.physical_cores() / self.logical_nc_config.max(1)).max(1)
    }

    /// Logical cores this process may use: the visible set when given, else all.
    pub fn usable_logical_cores(&self) -> u32 {
        let all = self.logical_cores();
        match &self.visible_cores {
            Some(v) => v.iter().filter(|&&c| c < all).count() as u32,
            None => all,
        }
    }
}

/// Parses `NEURON_RT_VISIBLE_CORES`: a list of core indices and inclusive ranges, `0-3` or `0,2,5-6`.
pub fn parse_visible_cores(value: &str) -> Result<Vec<u32>, DeviceError> {
    let invalid = |reason: &str| DeviceError::InvalidEnv {
        var: "NEURON_RT_VISIBLE_CORES".into(),
        value: value.into(),
        reason: reason.into(),
    };
    let mut cores = Vec::new();
    for part in value.split(',').map(str::trim) {
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (a.trim(), b.trim()),
            None => (part, part),
        };
        let lo: u32 = lo
            .parse()
            .map_err(|_| invalid("expected core indices like 0-3 or 0,2"))?;
        let hi: u32 = hi
            .parse()
            .map_err(|_| invalid("expected core indices like 0-3 or 0,2"))?;
        if hi < lo {
            return Err(invalid("a range ends before it starts"));
        }
        if hi - lo > 4096 {
            return Err(invalid("range too large"));
        }
        cores.extend(lo..=hi);
    }
    cores.sort_unstable();
    cores.dedup();
    Ok(cores)
}
