//! Which process holds a TCP port, for the "address already in use" message of `mlxd serve`:
//! the listening socket's inode from `/proc/net/tcp{,6}`, then the process whose file
//! descriptors include it. Only this user's processes can be looked into; `None` otherwise.

use std::path::Path;

/// The inodes of sockets listening on `port` in a `/proc/net/tcp`-format table.
pub fn listening_inodes(table: &str, port: u16) -> Vec<u64> {
    const LISTEN: &str = "0A";
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let local = f.get(1)?;
            let (_, p) = local.rsplit_once(':')?;
            let p = u16::from_str_radix(p, 16).ok()?;
            (p == port && *f.get(3)? == LISTEN).then(|| f.get(9)?.parse().ok())?
        })
        .collect()
}

/// `pid 1234 (mlxd)` for the process listening on `port`, when it can be seen.
pub fn holder(port: u16) -> Option<String> {
    let inodes: Vec<u64> = ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|t| std::fs::read_to_string(t).ok())
        .flat_map(|t| listening_inodes(&t, port))
        .collect();
    if inodes.is_empty() {
        return None;
    }
    let wanted: Vec<String> = inodes.iter().map(|i| format!("socket:[{i}]")).collect();
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        let holds = fds.flatten().any(|fd| {
            std::fs::read_link(fd.path()).is_ok_and(|l| wanted.iter().any(|w| Path::new(w) == l))
        });
        if holds {
            let name = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
            return Some(format!("pid {pid} ({})", name.trim()));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_listening_socket_of_a_port() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4242 1 0000000000000000 100 0 0 10 0\n\
   1: 0100007F:1F90 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 4343 1 0000000000000000 20 4 30 10 -1\n\
   2: 00000000:1FA0 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4444 1 0000000000000000 100 0 0 10 0\n";
        assert_eq!(listening_inodes(table, 8080), vec![4242]);
        assert_eq!(listening_inodes(table, 8096), vec![4444]);
        assert!(listening_inodes(table, 1).is_empty());
    }

    #[test]
    fn names_this_process_for_a_port_it_holds() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let h = holder(port).expect("this process holds the port");
        assert!(
            h.starts_with(&format!("pid {} (", std::process::id())),
            "{h}"
        );
    }
}
