//! Recovering a captured connection's original destination from the
//! `ORIG_DST` map, keyed by the pod's network namespace and the connection
//! tuple, given the accepted socket's addresses.
//!
//! The namespace is part of the key because the tuple repeats across pods:
//! every pod's apps connect from loopback to the same `127.0.0.1:15001`
//! inside their own namespace, and the kernel draws two namespaces' source
//! ports for the same tuple from one sequence, so two pods dialling at the
//! same moment often get the same port (seen: one pod's connection refused
//! for want of a record, the other's record overwritten).

use std::{
    net::{IpAddr, Ipv6Addr, SocketAddr},
    os::fd::{AsFd, OwnedFd},
};

use aya::{
    maps::{HashMap, MapData},
    sys::SyscallError,
};
use dataplane_common::{AF_INET, OrigDst, OrigDstKey, SockTuple, maps::ORIG_DST};

use super::{PinLayout, RedirectError, keys::addr16};

/// A handle on an instance's pinned `ORIG_DST` map, for the connections of
/// one network namespace. Opened by path, so the engine holds its own
/// descriptor independent of the loader.
pub struct OrigDstTable {
    map: HashMap<MapData, OrigDstKey, OrigDst>,
    /// The namespace whose records [`OrigDstTable::take`] reads.
    netns_cookie: u64,
    /// The same map, for the one command aya does not issue on it.
    fd: OwnedFd,
    /// Whether the kernel takes a record in one call (5.14); cleared on
    /// the first refusal, after which a lookup and a delete take two.
    take_in_one: bool,
}

impl std::fmt::Debug for OrigDstTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OrigDstTable")
    }
}

impl OrigDstTable {
    /// Opens the pinned map of the instance laid out by `pins`, for the
    /// connections from the network namespace with cookie `netns_cookie`.
    pub fn open(pins: &PinLayout, netns_cookie: u64) -> Result<Self, RedirectError> {
        let path = pins.map(ORIG_DST);
        let fd = crate::bpf_syscall::obj_get(&path)
            .map_err(|io_error| syscall_error("bpf_obj_get", io_error))?;
        Ok(Self {
            map: super::stats::open_pinned(pins, ORIG_DST)?,
            fd,
            netns_cookie,
            take_in_one: true,
        })
    }

    /// The original destination of the connection whose accepted socket has
    /// peer address `peer` and local address `local`, removing the record
    /// (each connection is looked up once). `None` when the connection was
    /// not captured by our programs.
    pub fn take(
        &mut self,
        peer: SocketAddr,
        local: SocketAddr,
    ) -> Result<Option<SocketAddr>, RedirectError> {
        let key = OrigDstKey {
            netns_cookie: self.netns_cookie,
            tuple: tuple_of(peer, local),
            _pad: [0; 4],
        };
        if self.take_in_one {
            match crate::bpf_syscall::map_lookup_and_delete::<_, OrigDst>(self.fd.as_fd(), &key) {
                Ok(orig) => return Ok(Some(socket_addr_of(&orig))),
                Err(err) if err.raw_os_error() == Some(libc::ENOENT) => return Ok(None),
                Err(err) if crate::bpf_syscall::unsupported(&err) => {
                    tracing::info!(error = %err, "this kernel cannot read and delete a hash map entry in one call (5.14); original destinations are taken with a lookup and a delete");
                    self.take_in_one = false;
                }
                Err(io_error) => {
                    return Err(syscall_error("bpf_map_lookup_and_delete_elem", io_error));
                }
            }
        }
        match self.map.get(&key, 0) {
            Ok(orig) => {
                // A failed delete only leaves the record to LRU eviction.
                let _ = self.map.remove(&key);
                Ok(Some(socket_addr_of(&orig)))
            }
            Err(err) if super::error::is_not_found(&err) => Ok(None),
            Err(source) => Err(RedirectError::Map {
                name: ORIG_DST,
                source,
            }),
        }
    }
}

/// A `bpf()` call of ours on `ORIG_DST` that failed, as aya reports its own.
fn syscall_error(call: &'static str, io_error: std::io::Error) -> RedirectError {
    super::error::map_err(ORIG_DST)(SyscallError { call, io_error }.into())
}

/// The key the kernel wrote for a connection from `client` to `connected_to`
/// (the client's view: its own address, and the rewritten destination).
pub fn tuple_of(client: SocketAddr, connected_to: SocketAddr) -> SockTuple {
    SockTuple {
        src_addr: addr16(client.ip()),
        dst_addr: addr16(connected_to.ip()),
        src_port: client.port(),
        dst_port: connected_to.port(),
    }
}

fn socket_addr_of(orig: &OrigDst) -> SocketAddr {
    let v6 = Ipv6Addr::from(orig.addr.octets());
    let ip = match v6.to_ipv4_mapped() {
        Some(v4) if orig.family == AF_INET || orig.addr.is_ipv4_mapped() => IpAddr::V4(v4),
        _ => IpAddr::V6(v6),
    };
    SocketAddr::new(ip, orig.port)
}

#[cfg(test)]
#[expect(
    clippy::unwrap_used,
    reason = "a bad fixture should fail the test loudly"
)]
mod tests {
    use std::net::Ipv4Addr;

    use dataplane_common::IpAddr16;

    use super::*;

    #[test]
    fn v4_tuple_uses_mapped_form_and_host_order_ports() {
        let t = tuple_of(
            "10.0.0.1:40000".parse().unwrap(),
            "127.0.0.1:15001".parse().unwrap(),
        );
        assert_eq!(t.src_port, 40000);
        assert_eq!(t.dst_port, 15001);
        assert!(t.src_addr.is_ipv4_mapped());
        assert_eq!(
            t.dst_addr,
            IpAddr16::from_ipv4_be(u32::from(Ipv4Addr::LOCALHOST).to_be())
        );
    }

    #[test]
    fn v4_and_mapped_v6_sockets_give_the_same_key() {
        let v4 = tuple_of("10.0.0.1:1".parse().unwrap(), "10.0.0.2:2".parse().unwrap());
        let mapped = tuple_of(
            "[::ffff:10.0.0.1]:1".parse().unwrap(),
            "[::ffff:10.0.0.2]:2".parse().unwrap(),
        );
        assert_eq!(v4, mapped);
    }

    #[test]
    fn orig_dst_round_trips_both_families() {
        let v4 = OrigDst {
            addr: IpAddr16::from_ipv4_be(u32::from(Ipv4Addr::new(10, 1, 2, 3)).to_be()),
            port: 8080,
            family: AF_INET,
        };
        assert_eq!(socket_addr_of(&v4), "10.1.2.3:8080".parse().unwrap());
        let v6 = OrigDst {
            addr: IpAddr16::from_octets("fd00::7".parse::<Ipv6Addr>().unwrap().octets()),
            port: 443,
            family: dataplane_common::AF_INET6,
        };
        assert_eq!(socket_addr_of(&v6), "[fd00::7]:443".parse().unwrap());
    }
}
