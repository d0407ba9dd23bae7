//! The source ports of one pod's transparent sockets (see
//! [`super::original_source`]).
//!
//! A transparent connection to an app has the client's address and a port
//! of the engine's choosing. The pod's namespace may already hold that
//! tuple: a connection from the client to the same app that `sk_lookup`
//! captured has the app's address as its local end, so its tuple is the
//! one the app's end of ours would have. The kernel does not see the clash
//! (it checks only the connecting socket's own tuple): our SYN meets the
//! captured connection instead of the app, which answers it with a
//! challenge ACK, and the connect hangs until it times out. The client's
//! kernel chose its port without knowing ours, so nothing but the engine
//! can avoid it: the pod's captured connections register their tuples
//! while open ([`SourcePorts::hold`]) and [`SourcePorts::next_for`] skips
//! those.
//!
//! What remains: a client that picks, for a new connection, the port one of
//! ours holds; the client's kernel cannot know of it (Istio's node proxy,
//! which lets the kernel pick, shares this), and a captured connection an
//! agent handing over still serves, which only that agent knows of.

use std::{
    collections::HashSet,
    net::{IpAddr, SocketAddr},
    sync::{
        Arc, Mutex,
        atomic::{AtomicU32, Ordering},
    },
};

/// One pod's transparent source ports: the kernel's default ephemeral range
/// (32768-60999), taken in turn from a random start, so that a port comes
/// back only after every other one was used (a client address reaching one
/// app port that fast would run out of tuples with or without the mesh:
/// each closed connection holds its tuple in `TIME_WAIT` for 60 s), except
/// those of the pod's open captured connections.
#[derive(Debug)]
pub struct SourcePorts {
    next: AtomicU32,
    /// (client, app) of the pod's captured connections still open.
    captured: Mutex<HashSet<(SocketAddr, SocketAddr)>>,
}

/// How many ports held by captured connections one choice skips at most:
/// past that, the port is tried anyway (the client holding that many
/// consecutive ones is not worth a longer search; the connect then fails
/// as it would have).
const MAX_SKIPPED: u32 = 64;

impl SourcePorts {
    const FIRST: u32 = 32_768;
    const COUNT: u32 = 60_999 - Self::FIRST + 1;

    /// Starts at a random port of the range.
    pub fn new() -> Self {
        let start = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        Self {
            next: AtomicU32::new(start % Self::COUNT),
            captured: Mutex::default(),
        }
    }

    /// The next port in turn for a connection from `client` to `app`,
    /// skipping those of the pod's open captured connections between the
    /// same two.
    pub fn next_for(&self, client: IpAddr, app: SocketAddr) -> u16 {
        let captured = self.captured.lock().ok();
        let mut port = self.next();
        for _ in 0..MAX_SKIPPED {
            let held = captured
                .as_ref()
                .is_some_and(|set| set.contains(&(SocketAddr::new(client, port), app)));
            if !held {
                break;
            }
            port = self.next();
        }
        port
    }

    /// Registers a captured connection from `client` to `app` (the
    /// connection's local address) until the returned guard drops.
    pub fn hold(self: &Arc<Self>, client: SocketAddr, app: SocketAddr) -> HeldTuple {
        let tuple = (client, app);
        if let Ok(mut set) = self.captured.lock() {
            set.insert(tuple);
        }
        HeldTuple {
            ports: Arc::clone(self),
            tuple,
        }
    }

    fn next(&self) -> u16 {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        // Below 65,536 by construction of the range.
        (Self::FIRST + n % Self::COUNT) as u16
    }
}

impl Default for SourcePorts {
    fn default() -> Self {
        Self::new()
    }
}

/// A captured connection's tuple, registered with its pod's
/// [`SourcePorts`] while the guard lives.
#[derive(Debug)]
pub struct HeldTuple {
    ports: Arc<SourcePorts>,
    tuple: (SocketAddr, SocketAddr),
}

impl Drop for HeldTuple {
    fn drop(&mut self) {
        if let Ok(mut set) = self.ports.captured.lock() {
            set.remove(&self.tuple);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{
        net::{IpAddr, Ipv4Addr, SocketAddr},
        sync::Arc,
    };

    use super::SourcePorts;

    const CLIENT: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1));
    const APP: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2)), 9000);

    #[test]
    fn source_ports_stay_in_the_ephemeral_range_and_come_back_only_after_all_others() {
        let ports = SourcePorts::new();
        let first = ports.next_for(CLIENT, APP);
        let mut seen = std::collections::HashSet::from([first]);
        for _ in 1..SourcePorts::COUNT {
            let port = ports.next_for(CLIENT, APP);
            assert!((32_768..=60_999).contains(&port), "{port}");
            assert!(seen.insert(port), "{port} came back early");
        }
        assert_eq!(ports.next_for(CLIENT, APP), first);
    }

    #[test]
    fn the_ports_of_open_captured_connections_are_skipped_while_they_are_open() {
        let ports = Arc::new(SourcePorts::new());
        let first = ports.next_for(CLIENT, APP);
        let after = |n: u32| {
            let offset = (u32::from(first) - SourcePorts::FIRST + n) % SourcePorts::COUNT;
            u16::try_from(SourcePorts::FIRST + offset).expect("in the range")
        };
        let [a, b, c, d] = [1, 2, 3, 4].map(after);
        let held_a = ports.hold(SocketAddr::new(CLIENT, a), APP);
        let _held_b = ports.hold(SocketAddr::new(CLIENT, b), APP);
        // The same port from another client, or to another app, is no clash.
        let other_client = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 3));
        let _other = ports.hold(SocketAddr::new(other_client, c), APP);
        assert_eq!(ports.next_for(CLIENT, APP), c);
        drop(held_a);
        let other_app = SocketAddr::new(APP.ip(), 9001);
        let _to_other_app = ports.hold(SocketAddr::new(CLIENT, d), other_app);
        assert_eq!(ports.next_for(CLIENT, APP), d);
        // Back to `a` only after the whole range, and free by then.
        for _ in 0..SourcePorts::COUNT - 4 {
            ports.next_for(CLIENT, APP);
        }
        assert_eq!(ports.next_for(CLIENT, APP), a);
    }
}
