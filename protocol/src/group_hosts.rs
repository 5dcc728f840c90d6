//! The hosts of an engine group, one per rank, rank 0 first, written as `mlx.launch`'s
//! hostfile entries: a host name, or `{ ssh = "studio-2", ips = ["10.0.0.2"] }` (the name
//! `ssh` connects to, the addresses the ring backend uses), with `rdma` for the jaccl backend
//! (the host's RDMA device towards each rank, [`jaccl`]). mlxd adds keys `mlx.launch` does
//! not read (it ignores them): `port`, `engine`, `model` and `ssh_options`.
//!
//! Rank 0 is the engine `mlxd` starts, on this machine: its entry gives only its ring address.
//! A rank whose `ssh` names this machine (`127.0.0.1`, `localhost`, `::1`) is started as rank
//! 0's child; any other through `ssh`, as `mlx.launch` does.
//!
//! The engine option `distributed_hosts` carries them: comma-separated names when every entry
//! is a plain name, else the entries as a JSON list.
use std::net::IpAddr;

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::{Deserialize, Serialize};

pub mod jaccl;

pub use jaccl::RdmaDevices;

/// Names of this machine: a rank on one of them is started without `ssh`.
pub const LOCAL_HOSTS: &[&str] = &["127.0.0.1", "localhost", "::1"];

/// The first ring port of ranks on other machines, rank `r` listening on this plus `r`:
/// `mlx.launch`'s default `--starting-port` and its numbering with one address per host.
pub const RING_STARTING_PORT: u16 = 32323;

/// One rank's host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupHost {
    /// What `ssh` connects to: a host name or address, `user@host`, or a `Host` of the ssh
    /// configuration.
    pub ssh: String,
    /// The addresses the ring backend reaches this rank at (the first is used); default: `ssh`
    /// itself when it is an IP address, 127.0.0.1 for this machine's names.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ips: Vec<String>,
    /// For the jaccl backend: the RDMA device(s) this host reaches each rank through, one
    /// entry per rank in rank order, `None` (JSON `null`) for itself, as in `mlx.launch`'s
    /// hostfile ([`jaccl`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rdma: Vec<Option<RdmaDevices>>,
    /// This rank's ring port; default: a free one on this machine, [`RING_STARTING_PORT`] plus
    /// the rank on another. For jaccl, rank 0's is the coordinator's port (default: a free
    /// one); the other ranks' are not used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// `mlxd-engine` on that host; default: the path of rank 0's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<String>,
    /// The model on that host (a directory); default: rank 0's model, as rank 0 names it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Arguments for `ssh` before the host (`["-p", "2222", "-i", "~/.ssh/mlxd"]`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ssh_options: Vec<String>,
}

impl GroupHost {
    /// A host given by name only.
    pub fn named(name: &str) -> Self {
        Self {
            ssh: name.to_owned(),
            ips: Vec::new(),
            rdma: Vec::new(),
            port: None,
            engine: None,
            model: None,
            ssh_options: Vec::new(),
        }
    }

    /// Whether the rank runs on this machine (started without `ssh`).
    pub fn is_local(&self) -> bool {
        LOCAL_HOSTS.contains(&self.ssh.as_str())
    }

    fn is_plain_name(&self) -> bool {
        *self == Self::named(&self.ssh)
    }

    /// The address the ring backend reaches this rank at. A host name is refused, as
    /// `mlx.launch` refuses it: the ring backend takes IP addresses.
    pub fn ring_ip(&self) -> Result<String, String> {
        if let Some(ip) = self.ips.first() {
            return ip
                .parse::<IpAddr>()
                .map(|ip| ip.to_string())
                .map_err(|_| format!("host {:?}: ips[0] = {ip:?} is not an IP address", self.ssh));
        }
        if self.is_local() {
            return Ok("127.0.0.1".into());
        }
        // `user@10.0.0.2` reaches 10.0.0.2.
        let address = self.ssh.rsplit('@').next().unwrap_or(&self.ssh);
        address
            .parse::<IpAddr>()
            .map(|ip| ip.to_string())
            .map_err(|_| {
                format!(
                    "host {:?}: the ring backend needs its IP address; add ips = [\"...\"] to its \
                 entry (as in mlx.launch's hostfile)",
                    self.ssh
                )
            })
    }
}

/// The fields of a host written as a table (`GroupHost` itself, whose `Deserialize` also
/// takes a plain name).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    ssh: String,
    #[serde(default)]
    ips: Vec<String>,
    #[serde(default)]
    rdma: Vec<Option<RdmaDevices>>,
    port: Option<u16>,
    engine: Option<String>,
    model: Option<String>,
    #[serde(default)]
    ssh_options: Vec<String>,
}

/// A host as configuration writes it: a name, or a table of the fields above.
pub fn deserialize_host<'de, D: Deserializer<'de>>(d: D) -> Result<GroupHost, D::Error> {
    struct HostVisitor;
    impl<'de> Visitor<'de> for HostVisitor {
        type Value = GroupHost;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str(
                "a host name or a table { ssh, ips, rdma, port, engine, model, ssh_options }",
            )
        }
        fn visit_str<E: de::Error>(self, name: &str) -> Result<GroupHost, E> {
            Ok(GroupHost::named(name))
        }
        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<GroupHost, A::Error> {
            let e = Entry::deserialize(de::value::MapAccessDeserializer::new(map))?;
            Ok(GroupHost {
                ssh: e.ssh,
                ips: e.ips,
                rdma: e.rdma.into_iter().map(jaccl::no_device_as_none).collect(),
                port: e.port,
                engine: e.engine,
                model: e.model,
                ssh_options: e.ssh_options,
            })
        }
    }
    d.deserialize_any(HostVisitor)
}

/// A list of hosts as configuration writes them (names or tables).
pub fn deserialize_hosts<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<GroupHost>, D::Error> {
    #[derive(Deserialize)]
    struct One(#[serde(deserialize_with = "deserialize_host")] GroupHost);
    Ok(Vec::<One>::deserialize(d)?
        .into_iter()
        .map(|o| o.0)
        .collect())
}

/// The hosts of `distributed_hosts`: comma-separated names or a JSON list of entries (names
/// or objects), two or more, each checked ([`check_hosts`]).
pub fn parse_hosts(s: &str) -> Result<Vec<GroupHost>, String> {
    let s = s.trim();
    let hosts = if s.starts_with('[') {
        let mut de = serde_json::Deserializer::from_str(s);
        deserialize_hosts(&mut de).map_err(|e| format!("not a JSON list of hosts: {e}"))?
    } else {
        s.split(',').map(|h| GroupHost::named(h.trim())).collect()
    };
    check_hosts(&hosts)?;
    Ok(hosts)
}

/// Two or more hosts, each with a name `ssh` can take.
pub fn check_hosts(hosts: &[GroupHost]) -> Result<(), String> {
    if hosts.len() < 2 {
        return Err(format!(
            "a group needs two or more hosts (one per rank), got {}",
            hosts.len()
        ));
    }
    if let Some(h) = hosts
        .iter()
        .find(|h| h.ssh.is_empty() || h.ssh.starts_with('-') || h.ssh.contains(char::is_whitespace))
    {
        return Err(format!(
            "{:?} is not a host name (empty, or starting with '-', or with spaces)",
            h.ssh
        ));
    }
    Ok(())
}

/// The ring backend's addresses: every host has one, and a group does not mix this machine's
/// loopback addresses with others (a rank on another machine cannot reach 127.0.0.1: rank 0's
/// entry then needs `ips` with an address of this machine).
pub fn check_ring(hosts: &[GroupHost]) -> Result<(), String> {
    let mut ips = Vec::new();
    for host in hosts {
        let ip: IpAddr = host.ring_ip()?.parse().map_err(|e| format!("{e}"))?;
        ips.push((host, ip));
    }
    let loopback = ips.iter().find(|(_, ip)| ip.is_loopback());
    let other = ips.iter().find(|(_, ip)| !ip.is_loopback());
    if let (Some((near, near_ip)), Some((far, far_ip))) = (loopback, other) {
        return Err(format!(
            "host {:?} is reached at {near_ip}, which host {:?} ({far_ip}) cannot reach; give \
             every host an address the others reach (ips = [\"...\"])",
            near.ssh, far.ssh
        ));
    }
    Ok(())
}

/// `hosts` as the value of `distributed_hosts` ([`parse_hosts`] reads it back).
pub fn to_option(hosts: &[GroupHost]) -> String {
    if hosts.iter().all(GroupHost::is_plain_name) {
        let names: Vec<&str> = hosts.iter().map(|h| h.ssh.as_str()).collect();
        return names.join(",");
    }
    serde_json::to_string(hosts).expect("host entries always serialize")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_entries_read_back_as_written() {
        let hosts = parse_hosts("127.0.0.1, localhost").unwrap();
        assert_eq!(
            hosts,
            vec![GroupHost::named("127.0.0.1"), GroupHost::named("localhost")]
        );
        assert_eq!(to_option(&hosts), "127.0.0.1,localhost");
        let json = r#"["127.0.0.1", {"ssh": "me@studio-2", "ips": ["10.0.0.2"], "port": 5000,
            "engine": "/opt/mlxd-engine", "model": "/m", "ssh_options": ["-p", "2222"]}]"#;
        let hosts = parse_hosts(json).unwrap();
        assert_eq!(hosts[1].ring_ip().unwrap(), "10.0.0.2");
        assert_eq!(hosts[1].port, Some(5000));
        assert!(!hosts[1].is_local() && hosts[0].is_local());
        assert_eq!(parse_hosts(&to_option(&hosts)).unwrap(), hosts);
    }

    #[test]
    fn the_ring_needs_addresses_and_bad_entries_say_why() {
        assert_eq!(
            GroupHost::named("localhost").ring_ip().unwrap(),
            "127.0.0.1"
        );
        assert_eq!(
            GroupHost::named("u@10.1.2.3").ring_ip().unwrap(),
            "10.1.2.3"
        );
        let e = GroupHost::named("studio-2.local").ring_ip().unwrap_err();
        assert!(e.contains("\"studio-2.local\"") && e.contains("ips"), "{e}");
        let e = parse_hosts("127.0.0.1").unwrap_err();
        assert!(e.contains("two or more hosts (one per rank), got 1"), "{e}");
        let e = parse_hosts("127.0.0.1,-oProxyCommand=x").unwrap_err();
        assert!(e.contains("not a host name"), "{e}");
        let mixed = parse_hosts("127.0.0.1,10.0.0.2").unwrap();
        let e = check_ring(&mixed).unwrap_err();
        assert!(e.contains("\"127.0.0.1\" is reached at 127.0.0.1"), "{e}");
        assert!(check_ring(&parse_hosts("127.0.0.1,127.0.0.2").unwrap()).is_ok());
        let e = parse_hosts(r#"["127.0.0.1", {"ssh": "h", "adress": "x"}]"#).unwrap_err();
        assert!(e.contains("unknown field `adress`"), "{e}");
    }
}
