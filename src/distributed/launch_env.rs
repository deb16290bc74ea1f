//! torchrun's description of this process: its rank, the world's size, where the rendezvous
//! store is, and which interface Gloo binds.

use std::net::IpAddr;

use super::error::DistError;
use super::group::GlooDevice;

/// torchrun's description of this process (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
/// `MASTER_PORT`, and whether its agent already hosts the store).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// `RANK`.
    pub rank: usize,
    /// `WORLD_SIZE`.
    pub size: usize,
    /// `LOCAL_RANK` (picks the accelerator on this host).
    pub local_rank: usize,
    /// `MASTER_ADDR`: the store's host.
    pub master_addr: String,
    /// `MASTER_PORT`: the store's port.
    pub master_port: u16,
    /// `TORCHELASTIC_USE_AGENT_STORE`: the launcher hosts the store, every rank is a client.
    pub agent_store: bool,
    /// `TORCHELASTIC_RESTART_COUNT`: keys of a restarted attempt do not meet the old ones.
    pub attempt: u64,
    /// `GLOO_SOCKET_IFNAME`: the interface Gloo binds.
    pub interface: Option<String>,
}

impl LaunchEnv {
    /// The launch described by this process's environment; `None` outside a multi-process
    /// launch (no `WORLD_SIZE`, or 1).
    pub fn from_env() -> Result<Option<Self>, DistError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// [`LaunchEnv::from_env`] over any variable lookup (testable).
    pub(crate) fn from_lookup(var: impl Fn(&str) -> Option<String>) -> Result<Option<Self>, DistError> {
        let size: usize = match var("WORLD_SIZE") {
            None => return Ok(None),
            Some(v) => parse(&v, "WORLD_SIZE", 0)?,
        };
        let rank: usize = parse(&need(&var, "RANK")?, "RANK", 0)?;
        if size <= 1 {
            return Ok(None);
        }
        if rank >= size {
            return Err(DistError::new(
                rank,
                "launch",
                format!("RANK={rank} is not below WORLD_SIZE={size}"),
            ));
        }
        let local_rank = var("LOCAL_RANK").map_or(Ok(rank), |v| parse(&v, "LOCAL_RANK", rank))?;
        Ok(Some(LaunchEnv {
            rank,
            size,
            local_rank,
            master_addr: var("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into()),
            master_port: port(&need(&var, "MASTER_PORT")?, rank)?,
            agent_store: var("TORCHELASTIC_USE_AGENT_STORE")
                .is_some_and(|v| v.eq_ignore_ascii_case("true") || v == "1"),
            attempt: var("TORCHELASTIC_RESTART_COUNT")
                .map_or(Ok(0), |v| parse(&v, "TORCHELASTIC_RESTART_COUNT", rank))?,
            interface: var("GLOO_SOCKET_IFNAME").filter(|s| !s.is_empty()),
        }))
    }

    /// Where Gloo binds: the named interface, loopback when the store is on loopback (a
    /// one-host run stays off the network), else this host's own address.
    pub(crate) fn gloo_device(&self) -> GlooDevice {
        if let Some(i) = &self.interface {
            return GlooDevice::Interface(i.clone());
        }
        let loopback =
            self.master_addr == "localhost" || self.master_addr.parse::<IpAddr>().is_ok_and(|a| a.is_loopback());
        match loopback {
            true => GlooDevice::Hostname("127.0.0.1".into()),
            false => GlooDevice::Default,
        }
    }
}

fn need(var: &impl Fn(&str) -> Option<String>, key: &'static str) -> Result<String, DistError> {
    var(key).ok_or_else(|| DistError::new(0, "launch", format!("WORLD_SIZE is set but {key} is not")))
}

fn parse<T: std::str::FromStr>(value: &str, key: &'static str, rank: usize) -> Result<T, DistError> {
    value
        .trim()
        .parse()
        .map_err(|_| DistError::new(rank, "launch", format!("{key}={value:?} is not a non-negative integer")))
}

/// `MASTER_PORT`: a TCP port every rank can name, so 1 to 65535 (0 would have rank 0 bind a
/// port of the system's choosing that no other rank can know).
fn port(value: &str, rank: usize) -> Result<u16, DistError> {
    let refuse = |why: &str| {
        let m = format!(
            "MASTER_PORT={value:?} {why}; set a port from 1 to 65535 that is free on MASTER_ADDR's host (torchrun: --master-port)"
        );
        DistError::new(rank, "launch", m)
    };
    match value.trim().parse::<u64>() {
        Ok(0) => Err(refuse("asks for any free port, which the other ranks cannot know")),
        Ok(p) => u16::try_from(p).map_err(|_| refuse("is past the last TCP port, 65535")),
        Err(_) => Err(refuse("is not a port number")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn torchrun_environment_maps_to_a_launch() {
        let e = LaunchEnv::from_lookup(env(&[
            ("WORLD_SIZE", "2"),
            ("RANK", "1"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("TORCHELASTIC_RESTART_COUNT", "2"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (e.rank, e.size, e.local_rank, e.master_port, e.attempt),
            (1, 2, 1, 29500, 2)
        );
        assert!(e.agent_store);
        assert_eq!(e.gloo_device(), GlooDevice::Hostname("127.0.0.1".into()));
        assert_eq!(LaunchEnv::from_lookup(env(&[])).unwrap(), None);
        assert_eq!(
            LaunchEnv::from_lookup(env(&[("WORLD_SIZE", "1"), ("RANK", "0")])).unwrap(),
            None
        );
    }

    #[test]
    fn bad_launch_variables_are_named() {
        let e = LaunchEnv::from_lookup(env(&[("WORLD_SIZE", "2"), ("RANK", "0")])).unwrap_err();
        assert!(e.message.contains("MASTER_PORT"), "{e}");
        let e = LaunchEnv::from_lookup(env(&[("WORLD_SIZE", "2"), ("RANK", "2"), ("MASTER_PORT", "1")])).unwrap_err();
        assert!(e.message.contains("RANK=2"), "{e}");
        for (port, why) in [
            ("0", "any free port"),
            ("70000", "past the last TCP port"),
            ("x", "not a port"),
        ] {
            let e = LaunchEnv::from_lookup(env(&[("WORLD_SIZE", "2"), ("RANK", "1"), ("MASTER_PORT", port)]))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(&format!("MASTER_PORT=\"{port}\" ")) && e.contains(why) && e.contains("1 to 65535"),
                "{e}"
            );
        }
        let e = LaunchEnv::from_lookup(env(&[("WORLD_SIZE", "two"), ("RANK", "0")])).unwrap_err();
        assert!(e.message.contains("WORLD_SIZE"), "{e}");
    }
}
