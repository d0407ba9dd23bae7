//! TCP keepalive on every proxied socket, with ztunnel's settings and
//! defaults, so that an idle connection behind a NAT or a load balancer
//! that forgets quiet flows is noticed and ended instead of dying silently.
//!
//! ztunnel (istio/ztunnel at 62d82653) reads `KEEPALIVE_ENABLED` (true),
//! `KEEPALIVE_TIME` (180 s), `KEEPALIVE_INTERVAL` (180 s) and
//! `KEEPALIVE_RETRIES` (9) into `SocketConfig` (`src/config.rs`), and
//! applies them to the sockets its 15001 and 15006 listeners accept
//! (`socket::Listener::accept`, `src/socket.rs`) and to every socket it
//! dials (`DefaultSocketFactory::setup_socket`, `src/proxy.rs`). We apply
//! them to the same sockets and also to those the 15008 listener accepts,
//! which ztunnel leaves without: a tunnel's TCP connection outlives its
//! streams' idle periods just as long.
//!
//! Options set on a listening socket are copied by the kernel into each
//! socket it accepts (`tcp_create_openreq_child` re-arms the keepalive
//! timer of a clone whose `SO_KEEPALIVE` is set), so listeners carry them
//! once instead of four `setsockopt` calls per connection.

use std::{io, time::Duration};

use socket2::{SockRef, TcpKeepalive};

/// When and how often an idle connection is probed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Keepalive {
    /// Idle time before the first probe (`TCP_KEEPIDLE`).
    pub time: Duration,
    /// Time between unanswered probes (`TCP_KEEPINTVL`).
    pub interval: Duration,
    /// Unanswered probes after which the connection is reset
    /// (`TCP_KEEPCNT`).
    pub retries: u32,
}

impl Keepalive {
    /// ztunnel's defaults (`SocketConfig::default`).
    pub const ZTUNNEL: Self = Self {
        time: Duration::from_secs(180),
        interval: Duration::from_secs(180),
        retries: 9,
    };

    /// Turns keepalive on for `socket` with these settings.
    pub fn apply(&self, socket: SockRef<'_>) -> io::Result<()> {
        let params = TcpKeepalive::new()
            .with_time(self.time)
            .with_interval(self.interval)
            .with_retries(self.retries);
        socket.set_tcp_keepalive(&params)
    }
}

/// What the kernel holds for `socket`: its keepalive settings, or `None`
/// when keepalive is off.
pub fn read_back(socket: SockRef<'_>) -> io::Result<Option<Keepalive>> {
    if !socket.keepalive()? {
        return Ok(None);
    }
    Ok(Some(Keepalive {
        time: socket.tcp_keepalive_time()?,
        interval: socket.tcp_keepalive_interval()?,
        retries: socket.tcp_keepalive_retries()?,
    }))
}

/// Applies `keepalive` (when on) to `socket`.
pub fn apply(keepalive: Option<Keepalive>, socket: SockRef<'_>) -> io::Result<()> {
    keepalive.map_or(Ok(()), |k| k.apply(socket))
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "tests fail loudly on unexpected errors")]
mod tests {
    use super::*;

    fn read_back(socket: SockRef<'_>) -> Option<Keepalive> {
        super::read_back(socket).unwrap()
    }

    #[test]
    fn the_kernel_holds_what_was_set() {
        let socket = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        assert_eq!(read_back(SockRef::from(&socket)), None);
        let custom = Keepalive {
            time: Duration::from_secs(7),
            interval: Duration::from_secs(3),
            retries: 2,
        };
        apply(Some(custom), SockRef::from(&socket)).unwrap();
        assert_eq!(read_back(SockRef::from(&socket)), Some(custom));
        apply(None, SockRef::from(&socket)).unwrap();
        assert_eq!(
            read_back(SockRef::from(&socket)),
            Some(custom),
            "off touches nothing"
        );
    }
}
