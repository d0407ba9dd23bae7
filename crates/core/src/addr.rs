//! Addresses as the mesh compares them.
//!
//! A dual-stack listener reports an IPv4 peer as an IPv4-mapped IPv6
//! address (`::ffff:10.1.0.11`); workloads, services and policies name it
//! as IPv4, so every address is made canonical before it is looked up or
//! matched. The engine's own ports are never a forwarding destination.

use std::net::SocketAddr;

use dataplane_common::{HBONE_PORT, INBOUND_PLAINTEXT_PORT, OUTBOUND_PORT};

/// The address as the application used it: IPv4-mapped IPv6 becomes IPv4.
pub fn canonical(addr: SocketAddr) -> SocketAddr {
    SocketAddr::new(addr.ip().to_canonical(), addr.port())
}

/// Whether `port` is one of the engine's own ports (outbound capture,
/// inbound plaintext capture, HBONE), which must never be a forwarding
/// destination: that would loop.
pub fn is_engine_port(port: u16) -> bool {
    matches!(port, OUTBOUND_PORT | INBOUND_PLAINTEXT_PORT | HBONE_PORT)
}

/// Whether `port` is one of the capture listeners' ports, which the kernel
/// programs refuse as an outbound destination (redirecting there would make
/// the engine dial its own listener).
pub fn is_capture_port(port: u16) -> bool {
    matches!(port, OUTBOUND_PORT | INBOUND_PLAINTEXT_PORT)
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "fixed test addresses")]
mod tests {
    use super::*;

    #[test]
    fn mapped_v4_becomes_v4_and_v6_stays() {
        let mapped: SocketAddr = "[::ffff:10.1.0.11]:80".parse().unwrap();
        assert_eq!(canonical(mapped), "10.1.0.11:80".parse().unwrap());
        let v6: SocketAddr = "[fd00::1]:80".parse().unwrap();
        assert_eq!(canonical(v6), v6);
    }
}
