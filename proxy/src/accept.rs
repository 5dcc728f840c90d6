//! The accept loop's two policies.
//!
//! **Back-off.** When `accept` fails (out of file descriptors, out of memory), retrying at
//! once spins and floods the log; [`AcceptBackoff`] waits longer after each consecutive
//! failure (10 ms doubling to 1 s) and logs one line per episode, then at most one summary
//! every 10 s, then one line when accepting works again. Pure; `server.rs` obeys.
//!
//! **Admission** ([`ConnectionTable`], shared through [`Connections`]). Slow clients that
//! dribble their request headers (slowloris) used to fill the connection cap, after which
//! mlxd stopped accepting and even `/health` waited in the kernel's backlog. Now:
//! - a connection still waiting for its request head (new, or idle between keep-alive
//!   requests) is the first to go: at a limit, a new connection replaces the oldest of them
//!   (one in a general slot before any in the reserve, since the new connection takes the
//!   replaced one's slot), so a client that sends its request at once is always served. A new connection becomes
//!   replaceable only once the server has read all it sent and found no whole head
//!   ([`ConnectionTable::waiting_for_client`]): under a slowloris that reconnects as fast as
//!   it is closed, the slots turn over in milliseconds, and a probe whose head sat unread in
//!   its socket for that long (a loaded machine) used to be replaced before it was read. Until
//!   then the accept loop waits, which ties its pace to the connections' tasks;
//! - one client (peer IP) holds at most `per_client` connections; past that its own oldest
//!   waiting connection is replaced, or the new one is closed;
//! - `reserve` connections beyond the cap serve only health, monitoring and admin routes, so
//!   probes get in while the cap is busy with real requests;
//! - with the cap and the reserve busy with requests and nothing waiting, accepting stops
//!   (new clients wait in the backlog), as before.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{oneshot, Notify};
use tokio::time::Instant;

const FIRST_DELAY: Duration = Duration::from_millis(10);
const MAX_DELAY: Duration = Duration::from_secs(1);
const LOG_EVERY: Duration = Duration::from_secs(10);

#[derive(Debug, Default)]
pub struct AcceptBackoff {
    /// Consecutive failures.
    failures: u32,
    /// Failures since the last log line.
    unlogged: u64,
    last_log: Option<Instant>,
}

/// What to do after a failed accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Failure {
    pub delay: Duration,
    /// `Some(n)`: log now, covering `n` failures (this one included).
    pub log: Option<u64>,
}

impl AcceptBackoff {
    pub fn failure(&mut self, now: Instant) -> Failure {
        let delay = FIRST_DELAY
            .saturating_mul(1u32.checked_shl(self.failures.min(16)).unwrap_or(u32::MAX))
            .min(MAX_DELAY);
        self.failures = self.failures.saturating_add(1);
        self.unlogged += 1;
        let due = self
            .last_log
            .is_none_or(|t| now.duration_since(t) >= LOG_EVERY);
        let log = due.then(|| {
            self.last_log = Some(now);
            std::mem::take(&mut self.unlogged)
        });
        Failure { delay, log }
    }

    /// An accept worked; returns the failures of the episode that just ended, if any.
    pub fn success(&mut self) -> Option<u32> {
        let n = std::mem::take(&mut self.failures);
        self.unlogged = 0;
        self.last_log = None;
        (n > 0).then_some(n)
    }
}

/// The default connection cap: 1024, or fewer when the open-file limit is low — each
/// proxied request holds a client socket and an engine socket, and 64 descriptors stay
/// free for engines, logs and the listener.
pub fn default_max_connections(open_files: u64) -> usize {
    let by_fds = open_files.saturating_sub(64) / 2;
    usize::try_from(by_fds)
        .unwrap_or(usize::MAX)
        .clamp(16, 1024)
}

/// The admission limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Connections for any route (`server.max_connections`).
    pub cap: usize,
    /// Further connections for health, monitoring and admin routes only.
    pub reserve: usize,
    /// Connections one peer IP may hold.
    pub per_client: usize,
}

impl Limits {
    /// The reserve and the per-client limit that go with `cap`: a reserve of 1/32 of it
    /// (4 to 64), and half the cap per client (at least 1; raise `cap` behind a reverse
    /// proxy, where every client has the proxy's address).
    pub fn for_cap(cap: usize) -> Self {
        Self {
            cap,
            reserve: (cap / 32).clamp(4, 64),
            per_client: (cap / 2).max(1),
        }
    }
}

/// What to do with a new connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Serve it as connection `id` (a reserve one serves health and admin routes only),
    /// after closing connection `evict` if set.
    Go {
        id: u64,
        reserve: bool,
        evict: Option<u64>,
    },
    /// Its client holds `per_client` connections, all busy: close it.
    Refuse,
    /// No room: wait for some before admitting it.
    Wait,
}

#[derive(Debug)]
struct Conn {
    ip: IpAddr,
    reserve: bool,
    state: ConnState,
}

/// Where a connection stands with its requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ConnState {
    /// Admitted at `since`; the server has not yet read all the client sent.
    Unread { since: Instant },
    /// Waiting for the client to send (the rest of) a request head, since `since`: its
    /// admission, or its last response. Replaceable.
    Waiting { since: Instant },
    /// A request is in flight.
    Busy,
}

impl Conn {
    fn waiting_since(&self) -> Option<Instant> {
        match self.state {
            ConnState::Waiting { since } => Some(since),
            ConnState::Unread { .. } | ConnState::Busy => None,
        }
    }
}

/// Who holds a connection slot, and which of them only wait for a request head. Pure.
#[derive(Debug)]
pub struct ConnectionTable {
    limits: Limits,
    conns: HashMap<u64, Conn>,
    per_ip: HashMap<IpAddr, usize>,
    general: usize,
    reserved: usize,
    next: u64,
}

impl ConnectionTable {
    pub fn new(limits: Limits) -> Self {
        Self {
            limits,
            conns: HashMap::new(),
            per_ip: HashMap::new(),
            general: 0,
            reserved: 0,
            next: 0,
        }
    }

    /// The longest-waiting connection that has not sent a request head, of `ip` if given, in
    /// the reserve or a general slot as `reserve` says.
    fn oldest_waiting(&self, ip: Option<IpAddr>, reserve: bool) -> Option<u64> {
        self.conns
            .iter()
            .filter(|(_, c)| ip.is_none_or(|ip| c.ip == ip) && c.reserve == reserve)
            .filter_map(|(id, c)| c.waiting_since().map(|t| (t, *id)))
            .min()
            .map(|(_, id)| id)
    }

    /// Whether [`Self::admit`] would find room for a client under its own limit.
    pub fn has_room(&self) -> bool {
        self.general < self.limits.cap
            || self.reserved < self.limits.reserve
            || self.conns.values().any(|c| c.waiting_since().is_some())
    }

    /// Admits a connection from `ip` arriving at `now`. A replaced connection's slot passes to
    /// the new one, so a waiting connection in a general slot goes before one in the reserve:
    /// the new connection then serves every route, where taking a reserve connection's place
    /// would leave it only health and admin routes while general slots merely wait.
    pub fn admit(&mut self, ip: IpAddr, now: Instant) -> Admit {
        let (evict, reserve) =
            if self.per_ip.get(&ip).copied().unwrap_or(0) >= self.limits.per_client {
                if let Some(victim) = self.oldest_waiting(Some(ip), false) {
                    (Some(victim), false)
                } else if let Some(victim) = self.oldest_waiting(Some(ip), true) {
                    (Some(victim), true)
                } else {
                    return Admit::Refuse;
                }
            } else if self.general < self.limits.cap {
                (None, false)
            } else if let Some(victim) = self.oldest_waiting(None, false) {
                (Some(victim), false)
            } else if self.reserved < self.limits.reserve {
                (None, true)
            } else if let Some(victim) = self.oldest_waiting(None, true) {
                (Some(victim), true)
            } else {
                return Admit::Wait;
            };
        if let Some(victim) = evict {
            self.closed(victim);
        }
        let id = self.next;
        self.next += 1;
        self.conns.insert(
            id,
            Conn {
                ip,
                reserve,
                state: ConnState::Unread { since: now },
            },
        );
        *self.per_ip.entry(ip).or_default() += 1;
        if reserve {
            self.reserved += 1;
        } else {
            self.general += 1;
        }
        Admit::Go { id, reserve, evict }
    }

    /// The server read all that new connection `id` sent without a whole request head: it
    /// now waits for its client, and may be replaced (in its place by admission time).
    /// Returns whether that made it replaceable.
    pub fn waiting_for_client(&mut self, id: u64) -> bool {
        match self.conns.get_mut(&id) {
            Some(c) => match c.state {
                ConnState::Unread { since } => {
                    c.state = ConnState::Waiting { since };
                    true
                }
                ConnState::Waiting { .. } | ConnState::Busy => false,
            },
            None => false,
        }
    }

    /// Connection `id` delivered a request head.
    pub fn request_started(&mut self, id: u64) {
        if let Some(c) = self.conns.get_mut(&id) {
            c.state = ConnState::Busy;
        }
    }

    /// Connection `id` finished a response and waits for the next request head.
    pub fn request_finished(&mut self, id: u64, now: Instant) {
        if let Some(c) = self.conns.get_mut(&id) {
            c.state = ConnState::Waiting { since: now };
        }
    }

    /// Connection `id` is gone (closed, or evicted); unknown ids are ignored.
    pub fn closed(&mut self, id: u64) {
        let Some(c) = self.conns.remove(&id) else {
            return;
        };
        if let Some(n) = self.per_ip.get_mut(&c.ip) {
            *n -= 1;
            if *n == 0 {
                self.per_ip.remove(&c.ip);
            }
        }
        if c.reserve {
            self.reserved -= 1;
        } else {
            self.general -= 1;
        }
    }
}

/// The [`ConnectionTable`] shared by the accept loop and the connections, with the means
/// to close an evicted connection and to wake the accept loop when room appears.
#[derive(Debug)]
pub struct Connections {
    state: Mutex<Shared>,
    room: Notify,
}

#[derive(Debug)]
struct Shared {
    table: ConnectionTable,
    /// Dropping a connection's sender closes it (its task selects on the receiver).
    evictors: HashMap<u64, oneshot::Sender<()>>,
}

/// A connection's slot: released on drop.
#[derive(Debug)]
pub struct Slot {
    conns: Arc<Connections>,
    pub id: u64,
    /// Serves health, monitoring and admin routes only.
    pub reserve: bool,
}

impl Connections {
    pub fn new(limits: Limits) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(Shared {
                table: ConnectionTable::new(limits),
                evictors: HashMap::new(),
            }),
            room: Notify::new(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        // Nothing panics while holding it; a poisoned table is still consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits until a connection could be admitted (a free slot, or one to replace).
    pub async fn room(&self) {
        loop {
            let notified = self.room.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.lock().table.has_room() {
                return;
            }
            notified.await;
        }
    }

    /// Admits a connection from `ip`: its slot and the receiver that fires (closes) when it
    /// is evicted, or `None` when it must be closed at once. Waits while there is no room.
    pub async fn admit(self: &Arc<Self>, ip: IpAddr) -> Option<(Slot, oneshot::Receiver<()>)> {
        loop {
            {
                let mut s = self.lock();
                match s.table.admit(ip, Instant::now()) {
                    Admit::Refuse => return None,
                    Admit::Go { id, reserve, evict } => {
                        if let Some(victim) = evict {
                            // Dropping the sender ends the victim's task, which closes it.
                            s.evictors.remove(&victim);
                        }
                        let (tx, rx) = oneshot::channel();
                        s.evictors.insert(id, tx);
                        let slot = Slot {
                            conns: self.clone(),
                            id,
                            reserve,
                        };
                        return Some((slot, rx));
                    }
                    Admit::Wait => {}
                }
            }
            self.room().await;
        }
    }
}

impl Slot {
    /// The server read all the new connection sent, without a whole request head: it is
    /// replaceable from now on ([`ConnectionTable::waiting_for_client`]).
    pub fn waiting_for_client(&self) {
        let replaceable = self.conns.lock().table.waiting_for_client(self.id);
        if replaceable {
            self.conns.room.notify_one();
        }
    }

    /// The connection delivered a request head: it is no longer replaceable.
    pub fn request_started(&self) {
        self.conns.lock().table.request_started(self.id);
    }

    /// The connection finished a response: replaceable again until its next request.
    pub fn request_finished(&self) {
        self.conns
            .lock()
            .table
            .request_finished(self.id, Instant::now());
        self.conns.room.notify_one();
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        {
            let mut s = self.conns.lock();
            s.table.closed(self.id);
            s.evictors.remove(&self.id);
        }
        self.conns.room.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([127, 0, 0, last])
    }

    fn go(a: Admit) -> (u64, bool, Option<u64>) {
        match a {
            Admit::Go { id, reserve, evict } => (id, reserve, evict),
            other => panic!("not admitted: {other:?}"),
        }
    }

    fn table(cap: usize, reserve: usize, per_client: usize) -> ConnectionTable {
        ConnectionTable::new(Limits {
            cap,
            reserve,
            per_client,
        })
    }

    /// Admits one connection from each of `ips`, a millisecond apart from `t0`.
    fn admitted(t: &mut ConnectionTable, ips: &[u8], t0: Instant) -> Vec<u64> {
        ips.iter()
            .zip(0u64..)
            .map(|(&last, ms)| go(t.admit(ip(last), t0 + Duration::from_millis(ms))).0)
            .collect()
    }

    #[tokio::test(start_paused = true)]
    async fn waiting_connections_make_room_oldest_first() {
        let mut t = table(3, 1, 10);
        let t0 = Instant::now();
        let [a, b, c] = admitted(&mut t, &[2, 3, 4], t0)[..] else {
            unreachable!()
        };
        for id in [a, b, c] {
            assert!(t.waiting_for_client(id));
        }
        t.request_started(a);
        // At the cap: the oldest connection still waiting for its head (b) is replaced.
        let (d, reserve, evict) = go(t.admit(ip(1), t0 + Duration::from_millis(3)));
        assert_eq!((reserve, evict), (false, Some(b)));
        t.request_started(c);
        t.request_started(d);
        // Every general slot busy with a request: the reserve.
        let (e, reserve, evict) = go(t.admit(ip(1), t0));
        assert_eq!((reserve, evict), (true, None));
        t.request_started(e);
        assert!(!t.has_room());
        assert_eq!(t.admit(ip(5), t0), Admit::Wait);
        // A finished response makes its connection replaceable.
        t.request_finished(a, t0 + Duration::from_millis(9));
        assert!(t.has_room());
        let (f, _, evict) = go(t.admit(ip(5), t0));
        assert_eq!(evict, Some(a));
        t.request_started(f);
        t.closed(e);
        assert!(go(t.admit(ip(6), t0)).1);
    }

    /// At the cap, a waiting connection in a general slot is replaced before an older one in
    /// the reserve, so the new connection serves every route (a slowloris fills the reserve
    /// too: `tests/limits.rs` saw a chat request take a reserve connection's place and get 503).
    #[tokio::test(start_paused = true)]
    async fn a_general_slot_is_replaced_before_the_reserve() {
        let mut t = table(2, 1, 10);
        let t0 = Instant::now();
        let [a, b] = admitted(&mut t, &[2, 3], t0)[..] else {
            unreachable!()
        };
        t.request_started(a);
        t.request_started(b);
        let (r, reserve, _) = go(t.admit(ip(4), t0 + Duration::from_millis(2)));
        assert!(reserve);
        assert!(t.waiting_for_client(r));
        // b finishes and waits; r, in the reserve, has waited longer, yet b is replaced.
        t.request_finished(b, t0 + Duration::from_millis(5));
        let (_, reserve, evict) = go(t.admit(ip(5), t0 + Duration::from_millis(6)));
        assert_eq!((reserve, evict), (false, Some(b)));
        // With no general slot waiting and the reserve full, the reserve's waiting one goes.
        let (_, reserve, evict) = go(t.admit(ip(6), t0 + Duration::from_millis(7)));
        assert_eq!((reserve, evict), (true, Some(r)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_new_connection_is_replaceable_only_once_the_server_found_it_waiting() {
        let mut t = table(2, 0, 10);
        let t0 = Instant::now();
        let [a, b] = admitted(&mut t, &[2, 3], t0)[..] else {
            unreachable!()
        };
        // Both unread (a probe's head may sit in its socket): nothing to replace, so wait.
        assert!(!t.has_room());
        assert_eq!(t.admit(ip(4), t0), Admit::Wait);
        // b was read and waits for more: replaceable although a is older.
        assert!(t.waiting_for_client(b));
        assert!(t.has_room());
        let (c, _, evict) = go(t.admit(ip(4), t0 + Duration::from_millis(2)));
        assert_eq!(evict, Some(b));
        // Found waiting later than a newer one, a still goes first: admission order counts.
        assert!(t.waiting_for_client(c));
        assert!(t.waiting_for_client(a));
        assert_eq!(go(t.admit(ip(5), t0)).2, Some(a));
        // Only an unread connection becomes waiting this way; a busy one does not.
        t.request_started(c);
        assert!(!t.waiting_for_client(c));
        assert!(!t.waiting_for_client(12345));
    }

    #[tokio::test(start_paused = true)]
    async fn one_client_holds_at_most_its_share() {
        let mut t = table(10, 2, 2);
        let now = Instant::now();
        // Its own oldest waiting connection makes room; others are untouched.
        let [a, b, other] = admitted(&mut t, &[2, 2, 3], now)[..] else {
            unreachable!()
        };
        for id in [a, b, other] {
            t.waiting_for_client(id);
        }
        assert_eq!(go(t.admit(ip(2), now)).2, Some(a));
        t.request_started(b);
        let c = t.conns.keys().copied().max().unwrap();
        t.request_started(c);
        assert_eq!(t.admit(ip(2), now), Admit::Refuse);
        assert!(t.conns.contains_key(&other));
        t.closed(b);
        assert_eq!(go(t.admit(ip(2), now)).2, None);
        t.closed(12345);
    }

    #[tokio::test(start_paused = true)]
    async fn backs_off_and_logs_once_per_ten_seconds() {
        let mut b = AcceptBackoff::default();
        let mut delays = Vec::new();
        let mut logs = Vec::new();
        for _ in 0..400 {
            let f = b.failure(Instant::now());
            delays.push(f.delay.as_millis() as u64);
            if let Some(n) = f.log {
                logs.push(n);
            }
            tokio::time::advance(f.delay).await;
        }
        assert_eq!(&delays[..8], &[10, 20, 40, 80, 160, 320, 640, 1000]);
        assert!(delays.iter().all(|d| *d <= 1000));
        // About 390 s of failures: a first line, then one summary every 10 s.
        assert!(logs.len() <= 41, "{}", logs.len());
        assert_eq!(logs[0], 1);
        assert_eq!(logs.iter().sum::<u64>() as usize, 400 - b.unlogged as usize);
        assert_eq!(b.success(), Some(400));
        assert_eq!(b.success(), None);
        assert_eq!(b.failure(Instant::now()).delay, Duration::from_millis(10));
    }

    #[test]
    fn the_connection_cap_follows_the_open_file_limit() {
        assert_eq!(default_max_connections(20_000), 1024);
        assert_eq!(default_max_connections(256), 96);
        assert_eq!(default_max_connections(10), 16);
    }
}
