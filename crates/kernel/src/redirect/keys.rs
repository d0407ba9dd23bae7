//! Conversions between user-space addresses and the map key forms of
//! `dataplane-common` (16-byte, IPv4-mapped addresses; LPM-trie keys).

use std::net::{IpAddr, Ipv6Addr};

use dataplane_common::{IpAddr16, NETNS_PREFIX_BITS, NetnsAddr};
use ipnet::IpNet;

/// The map form of an address: IPv4 in the IPv4-mapped form.
pub(crate) fn addr16(ip: IpAddr) -> IpAddr16 {
    let v6 = match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    };
    IpAddr16::from_octets(v6.octets())
}

/// The address a map key holds, IPv4-mapped addresses as IPv4.
pub(crate) fn ip_of(addr: &IpAddr16) -> IpAddr {
    IpAddr::V6(Ipv6Addr::from(addr.octets())).to_canonical()
}

/// Prefix length and data of the `OUT_EXCL_CIDRS` key for `net` in the
/// network namespace `netns_cookie`: the cookie's 64 bits, then the
/// network's bits (an IPv4 network as its IPv4-mapped form, so 96 more).
/// Host bits are cleared so equal networks always give equal keys.
pub(crate) fn cidr_key(netns_cookie: u64, net: &IpNet) -> (u32, NetnsAddr) {
    let net = net.trunc();
    let bits = match net {
        IpNet::V4(v4) => 96 + u32::from(v4.prefix_len()),
        IpNet::V6(v6) => u32::from(v6.prefix_len()),
    };
    (
        NETNS_PREFIX_BITS + bits,
        NetnsAddr::new(netns_cookie, addr16(net.network())),
    )
}

/// The cookie an `OUT_EXCL_CIDRS` key belongs to.
pub(crate) fn cidr_key_cookie(data: &NetnsAddr) -> u64 {
    u64::from_be_bytes(data.netns_cookie_be)
}

#[cfg(test)]
#[expect(
    clippy::unwrap_used,
    reason = "a bad fixture should fail the test loudly"
)]
mod tests {
    use super::*;

    #[test]
    fn v4_cidr_is_mapped_and_truncated() {
        let (bits, data) = cidr_key(7, &"10.1.2.3/16".parse().unwrap());
        assert_eq!(bits, 64 + 96 + 16);
        assert_eq!(cidr_key_cookie(&data), 7);
        assert_eq!(ip_of(&data.addr), "10.1.0.0".parse::<IpAddr>().unwrap());
    }

    #[test]
    fn v6_cidr_keeps_its_prefix() {
        let (bits, data) = cidr_key(1, &"fd00:1::/64".parse().unwrap());
        assert_eq!(bits, 64 + 64);
        assert_eq!(ip_of(&data.addr), "fd00:1::".parse::<IpAddr>().unwrap());
    }

    #[test]
    fn addresses_round_trip() {
        for ip in ["10.0.0.1", "fd00::1", "::1"] {
            let ip: IpAddr = ip.parse().unwrap();
            assert_eq!(ip_of(&addr16(ip)), ip);
        }
        assert!(addr16("127.0.0.1".parse().unwrap()).is_loopback());
        assert!(addr16("::1".parse().unwrap()).is_loopback());
        assert!(!addr16("10.0.0.1".parse().unwrap()).is_loopback());
    }
}
