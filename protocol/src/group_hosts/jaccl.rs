//! The jaccl backend (RDMA over Thunderbolt 5, macOS): what `mlx.launch --backend jaccl`
//! requires of a hostfile and what it gives each rank, written once for `mlxd` (checked at
//! config load) and for the engine (rank 0 starting the group).
//!
//! Each host's `rdma` lists, in rank order, the RDMA device it reaches that rank through
//! (`rdma_en3`, as `ibv_devices` names them; a list of devices when several cables join the
//! pair) and `null` for itself. Every rank is given three variables, as `mlx.launch` gives
//! them: `MLX_RANK`; `MLX_IBV_DEVICES`, a file holding the matrix of every host's list (MLX
//! takes the group's size from it, so no `MLX_WORLD_SIZE`); and `MLX_JACCL_COORDINATOR`,
//! rank 0's address and a port, where the ranks exchange their RDMA connection details.
//!
//! TOML has no null: in `mlxd.toml` a host's own entry is written `""` (or `[]`), read as
//! `null`, so the matrix MLX reads is the one `mlx.launch` would write for the same hosts.
use std::net::{IpAddr, Ipv4Addr, ToSocketAddrs};

use serde::{Deserialize, Serialize};

use super::GroupHost;

/// The variable naming the rank.
pub const RANK_ENV: &str = "MLX_RANK";
/// The variable naming the file of the devices matrix.
pub const DEVICES_ENV: &str = "MLX_IBV_DEVICES";
/// The variable holding the coordinator's `ip:port`.
pub const COORDINATOR_ENV: &str = "MLX_JACCL_COORDINATOR";

/// Other names jaccl reads for its settings (its own `JACCL_*` spellings, and the switch to
/// its ring topology). A rank must not inherit them from the environment `mlxd` runs in: they
/// would contradict, or change, what the group was given.
pub const NOT_INHERITED: &[&str] = &[
    "JACCL_RANK",
    "JACCL_IBV_DEVICES",
    "JACCL_COORDINATOR",
    "JACCL_RING",
    "MLX_JACCL_RING",
];

/// A host's RDMA device(s) towards one other rank, as `mlx.launch`'s hostfile writes them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum RdmaDevices {
    One(String),
    Several(Vec<String>),
}

impl RdmaDevices {
    fn names(&self) -> &[String] {
        match self {
            RdmaDevices::One(name) => std::slice::from_ref(name),
            RdmaDevices::Several(names) => names,
        }
    }
}

impl std::fmt::Display for RdmaDevices {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let json = serde_json::to_string(self).map_err(|_| std::fmt::Error)?;
        f.write_str(&json)
    }
}

/// `""` and `[]`, the ways `mlxd.toml` writes a host's own entry, as `None` (JSON `null`).
pub fn no_device_as_none(entry: Option<RdmaDevices>) -> Option<RdmaDevices> {
    entry.filter(|d| match d {
        RdmaDevices::One(name) => !name.is_empty(),
        RdmaDevices::Several(names) => !names.is_empty(),
    })
}

/// Whether `hosts` form a jaccl group: every host's `rdma` has one entry per rank, `null` for
/// itself and a device for every other rank (a full mesh, as `mlx.launch --backend jaccl`
/// requires), and rank 0 has an address the others reach ([`coordinator_ip`]).
pub fn check(hosts: &[GroupHost]) -> Result<(), String> {
    check_devices(hosts)?;
    coordinator_ip(hosts).map(drop)
}

/// The `rdma` lists' part of [`check`].
pub fn check_devices(hosts: &[GroupHost]) -> Result<(), String> {
    let n = hosts.len();
    let own = "its own entry is null (\"\" in mlxd.toml)";
    for (rank, host) in hosts.iter().enumerate() {
        if host.rdma.is_empty() {
            return Err(format!(
                "host {:?} (rank {rank}) has no rdma list: the jaccl backend needs each host's \
                 RDMA device towards every rank, {n} entries in rank order where {own}, as in \
                 mlx.launch's hostfile",
                host.ssh
            ));
        }
        if host.rdma.len() != n {
            return Err(format!(
                "host {:?} (rank {rank}): rdma has {} entries, but a group of {n} ranks needs \
                 {n}, one per rank in rank order where {own}",
                host.ssh,
                host.rdma.len()
            ));
        }
        if let Some(devices) = &host.rdma[rank] {
            return Err(format!(
                "host {:?} (rank {rank}): rdma[{rank}] = {devices} is the host's own entry; \
                 {own}",
                host.ssh
            ));
        }
        let bad = host
            .rdma
            .iter()
            .flatten()
            .flat_map(RdmaDevices::names)
            .find(|name| name.is_empty() || name.contains(char::is_whitespace));
        if let Some(name) = bad {
            return Err(format!(
                "host {:?} (rank {rank}): {name:?} is not an RDMA device name (empty, or with \
                 spaces)",
                host.ssh
            ));
        }
    }
    let missing: Vec<(usize, usize)> = (0..n)
        .flat_map(|i| (0..n).map(move |j| (i, j)))
        .filter(|&(i, j)| i != j && hosts[i].rdma[j].is_none())
        .collect();
    if !missing.is_empty() {
        let mut pairs: Vec<String> = missing
            .iter()
            .take(3)
            .map(|&(i, j)| format!("{} to {}", hosts[i].ssh, hosts[j].ssh))
            .collect();
        if missing.len() > 3 {
            pairs.push(format!("and {} more", missing.len() - 3));
        }
        return Err(format!(
            "no RDMA device is listed for {}: the jaccl backend joins every pair of ranks",
            pairs.join(", ")
        ));
    }
    Ok(())
}

/// The coordinator's address: rank 0's `ips[0]` (as `mlx.launch` takes it), else the address
/// its `ssh` name resolves to (127.0.0.1 for this machine's names). A loopback address is
/// refused when a rank runs on another machine, which could not reach it.
pub fn coordinator_ip(hosts: &[GroupHost]) -> Result<IpAddr, String> {
    let first = hosts
        .first()
        .ok_or_else(|| "a jaccl group needs its hosts".to_owned())?;
    let ip = match first.ips.first() {
        Some(ip) => resolve(ip, "ips[0]")?,
        None if first.is_local() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        // `user@studio-1` is reached at studio-1.
        None => resolve(first.ssh.rsplit('@').next().unwrap_or(&first.ssh), "ssh")?,
    };
    if ip.is_loopback() {
        if let Some(far) = hosts.iter().skip(1).find(|h| !h.is_local()) {
            return Err(format!(
                "the jaccl coordinator, rank 0 (host {:?}), is reached at {ip}, which host {:?} \
                 cannot reach; give rank 0's entry ips = [\"...\"] with an address the other \
                 hosts reach",
                first.ssh, far.ssh
            ));
        }
    }
    Ok(ip)
}

/// `name` as an IP address: itself when it is one, else the first address it resolves to
/// (IPv4 first).
fn resolve(name: &str, key: &str) -> Result<IpAddr, String> {
    if let Ok(ip) = name.parse::<IpAddr>() {
        return Ok(ip);
    }
    let unresolved = |why: String| {
        format!(
            "the jaccl coordinator is rank 0, at {name:?} (its {key}), which does not resolve \
             ({why}); give rank 0's entry ips = [\"...\"] with its IP address"
        )
    };
    let addresses: Vec<IpAddr> = (name, 0)
        .to_socket_addrs()
        .map_err(|e| unresolved(e.to_string()))?
        .map(|a| a.ip())
        .collect();
    addresses
        .iter()
        .find(|ip| ip.is_ipv4())
        .or(addresses.first())
        .copied()
        .ok_or_else(|| unresolved("no address".into()))
}

/// The file `MLX_IBV_DEVICES` names: every host's `rdma` list, in rank order, as JSON.
pub fn devices_matrix(hosts: &[GroupHost]) -> String {
    let rows: Vec<&Vec<Option<RdmaDevices>>> = hosts.iter().map(|h| &h.rdma).collect();
    serde_json::to_string(&rows).expect("device names always serialize")
}

/// What every rank of one jaccl group is given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JacclGroup {
    /// `MLX_JACCL_COORDINATOR`: rank 0's `ip:port`.
    pub coordinator: String,
    /// The content of the file `MLX_IBV_DEVICES` names ([`devices_matrix`]).
    pub devices: String,
}

impl JacclGroup {
    /// The group of `hosts` ([`check`]), its coordinator listening on `port` of rank 0.
    pub fn new(hosts: &[GroupHost], port: u16) -> Result<Self, String> {
        check_devices(hosts)?;
        let ip = coordinator_ip(hosts)?;
        Ok(Self {
            // As mlx.launch writes it: `ip:port`, an IPv6 address unbracketed.
            coordinator: format!("{ip}:{port}"),
            devices: devices_matrix(hosts),
        })
    }

    /// The variables rank `rank` is given besides the devices file's ([`DEVICES_ENV`], whose
    /// path depends on where the file is written).
    pub fn env(&self, rank: usize) -> Vec<(&'static str, String)> {
        vec![
            (RANK_ENV, rank.to_string()),
            (COORDINATOR_ENV, self.coordinator.clone()),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::super::parse_hosts;
    use super::*;

    /// Three Macs joined pairwise, as mlx.launch's documentation writes the hostfile.
    const MESH: &str = r#"[
        {"ssh": "m1", "ips": ["10.0.0.1"], "rdma": [null, "rdma_en2", "rdma_en3"]},
        {"ssh": "m2", "ips": ["10.0.0.2"], "rdma": ["rdma_en2", null, ["rdma_en3", "rdma_en4"]]},
        {"ssh": "m3", "ips": ["10.0.0.3"], "rdma": ["rdma_en2", "rdma_en3", null]}
    ]"#;

    #[test]
    fn a_mesh_gives_each_rank_the_matrix_and_rank_0s_address() {
        let hosts = parse_hosts(MESH).unwrap();
        let group = JacclGroup::new(&hosts, 5000).unwrap();
        assert_eq!(group.coordinator, "10.0.0.1:5000");
        let matrix: serde_json::Value = serde_json::from_str(&group.devices).unwrap();
        assert_eq!(
            matrix,
            serde_json::json!([
                [null, "rdma_en2", "rdma_en3"],
                ["rdma_en2", null, ["rdma_en3", "rdma_en4"]],
                ["rdma_en2", "rdma_en3", null]
            ])
        );
        assert_eq!(
            group.env(2),
            vec![
                ("MLX_RANK", "2".to_owned()),
                ("MLX_JACCL_COORDINATOR", "10.0.0.1:5000".to_owned())
            ]
        );
        // The entries survive the engine option's round trip.
        assert_eq!(
            parse_hosts(&super::super::to_option(&hosts)).unwrap(),
            hosts
        );
    }

    #[test]
    fn own_entries_written_empty_read_as_null() {
        let hosts = parse_hosts(
            r#"[{"ssh": "127.0.0.1", "rdma": ["", "rdma_en5"]},
                {"ssh": "127.0.0.1", "rdma": ["rdma_en5", []]}]"#,
        )
        .unwrap();
        assert_eq!(hosts[0].rdma[0], None);
        assert_eq!(hosts[1].rdma[1], None);
        assert_eq!(
            devices_matrix(&hosts),
            r#"[[null,"rdma_en5"],["rdma_en5",null]]"#
        );
        assert!(check(&hosts).is_ok());
    }

    #[test]
    fn malformed_matrices_say_what_is_wrong() {
        let with = |edit: &dyn Fn(&mut Vec<GroupHost>)| {
            let mut hosts = parse_hosts(MESH).unwrap();
            edit(&mut hosts);
            check(&hosts).unwrap_err()
        };
        let e = with(&|h| h[1].rdma.clear());
        assert!(e.contains("host \"m2\" (rank 1) has no rdma list"), "{e}");
        let e = with(&|h| {
            h[2].rdma.pop();
        });
        assert!(
            e.contains("host \"m3\" (rank 2): rdma has 2 entries, but a group of 3 ranks needs 3"),
            "{e}"
        );
        let e = with(&|h| h[0].rdma[0] = Some(RdmaDevices::One("rdma_en1".into())));
        assert!(
            e.contains("rdma[0] = \"rdma_en1\" is the host's own entry; its own entry is null"),
            "{e}"
        );
        let e = with(&|h| {
            h[0].rdma[2] = None;
            h[2].rdma[1] = None;
        });
        assert!(
            e.contains("no RDMA device is listed for m1 to m3, m3 to m2: "),
            "{e}"
        );
        let e = with(&|h| h[1].rdma[0] = Some(RdmaDevices::Several(vec!["a b".into()])));
        assert!(e.contains("\"a b\" is not an RDMA device name"), "{e}");
        let e = with(&|h| {
            for host in h.iter_mut() {
                host.rdma = vec![None, None, None];
            }
        });
        assert!(e.contains("and 3 more"), "{e}");
    }

    #[test]
    fn the_coordinator_is_an_address_the_others_reach() {
        let mut hosts = parse_hosts(MESH).unwrap();
        hosts[0].ips.clear();
        hosts[0].ssh = "me@no-such-host.invalid".into();
        let e = check(&hosts).unwrap_err();
        assert!(
            e.contains("at \"no-such-host.invalid\" (its ssh), which does not resolve")
                && e.contains("ips = [\"...\"]"),
            "{e}"
        );
        hosts[0].ssh = "localhost".into();
        let e = check(&hosts).unwrap_err();
        assert!(
            e.contains("is reached at 127.0.0.1, which host \"m2\" cannot reach"),
            "{e}"
        );
        // A name is resolved; this machine's names reach this machine's ranks.
        hosts[0].ssh = "m1".into();
        hosts[0].ips = vec!["localhost".into()];
        for h in &mut hosts[1..] {
            h.ssh = "127.0.0.1".into();
        }
        assert!(coordinator_ip(&hosts).unwrap().is_loopback());
    }
}
