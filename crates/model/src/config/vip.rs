//! A service's virtual IP on its network, as istiod sends one
//! (`NetworkAddress` in `Service.addresses`) and ztunnel keys services
//! by it (`src/state/service.rs`: `ServiceStore::by_vip`, a map from
//! `NetworkAddress`): two networks may give their services the same VIP
//! (overlapping service ranges), and a client resolves the one on its
//! own network. A VIP range ([`VipRange`], a ServiceEntry's CIDR
//! `addresses`) carries its network the same way (ztunnel `NetworkCidr`,
//! matched only for a destination on that network:
//! `ServiceStore::get_best_by_cidr_vip`).

use std::{fmt, net::IpAddr, str::FromStr};

use ipnet::IpNet;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::SharedStr;

/// A VIP and the network it belongs to (empty: the default one).
///
/// Written `network/ip` (`/10.96.0.10` on the default network), as
/// ztunnel writes a `NetworkAddress` in its config dump; read that way, or
/// as a bare IP (the default network).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Vip {
    /// The network (empty: the default one).
    pub network: SharedStr,
    /// The address, canonical (an IPv4-mapped IPv6 address is its IPv4),
    /// as it is looked up.
    pub ip: IpAddr,
}

impl Vip {
    /// `ip` on `network`, the IP made canonical.
    pub fn new(network: impl Into<SharedStr>, ip: IpAddr) -> Self {
        Self {
            network: network.into(),
            ip: ip.to_canonical(),
        }
    }
}

impl From<IpAddr> for Vip {
    /// `ip` on the default network.
    fn from(ip: IpAddr) -> Self {
        Self::new(SharedStr::default(), ip)
    }
}

/// A VIP that is neither `network/ip` nor an IP.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("VIP `{0}` is not `network/ip` with a valid IP (e.g. `/10.96.0.10`)")]
pub struct VipError(String);

impl FromStr for Vip {
    type Err = VipError;

    /// `network/ip`, `/ip` or `ip`. The network is what comes before the
    /// last `/` (a network name holds no `/` in istiod's, but the IP never
    /// does, so the last one splits).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (network, ip) = s.rsplit_once('/').unwrap_or(("", s));
        let ip: IpAddr = ip.parse().map_err(|_| VipError(s.to_owned()))?;
        Ok(Self::new(network, ip))
    }
}

impl fmt::Display for Vip {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.ip)
    }
}

impl Serialize for Vip {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Vip {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(d)?;
        raw.parse().map_err(serde::de::Error::custom)
    }
}

/// A VIP range and the network it belongs to (empty: the default one).
///
/// Written `network/cidr` (`/192.0.2.0/24` on the default network), as
/// ztunnel's `NetworkCidr` displays; read that way, or as a bare CIDR (the
/// default network).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct VipRange {
    /// The network (empty: the default one).
    pub network: SharedStr,
    /// The range, its address canonical (an IPv4-mapped range is the IPv4
    /// one) and its host bits kept as given, as ztunnel keeps them
    /// (`src/state/service.rs`: `IpNet::new` of the address sent), so
    /// both dumps write `10.97.0.5/16` alike; membership ignores them.
    pub net: IpNet,
}

impl VipRange {
    /// `net` on `network`, made canonical as [`VipRange::net`] says.
    pub fn new(network: impl Into<SharedStr>, net: IpNet) -> Self {
        let net = match (net.addr(), net.addr().to_canonical()) {
            // `::ffff:a.b.c.d/n` with n >= 96 is the IPv4 range /n-96.
            (IpAddr::V6(_), IpAddr::V4(v4)) if net.prefix_len() >= 96 => {
                IpNet::new(IpAddr::V4(v4), net.prefix_len() - 96).unwrap_or(net)
            }
            _ => net,
        };
        Self {
            network: network.into(),
            net,
        }
    }

    /// Whether `ip` (canonical) on `network` is in this range: only a
    /// destination on the range's own network is (ztunnel
    /// `get_best_by_cidr_vip`: `nc.network != vip.network` is skipped).
    pub fn contains(&self, network: &str, ip: &IpAddr) -> bool {
        *self.network == *network && self.net.contains(ip)
    }
}

impl From<IpNet> for VipRange {
    /// `net` on the default network.
    fn from(net: IpNet) -> Self {
        Self::new(SharedStr::default(), net)
    }
}

/// A VIP range that is neither `network/cidr` nor a CIDR.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("VIP range `{0}` is not `network/cidr` with a valid CIDR (e.g. `/192.0.2.0/24`)")]
pub struct VipRangeError(String);

impl FromStr for VipRange {
    type Err = VipRangeError;

    /// `network/ip/len`, `/ip/len` or `ip/len`: the prefix length is after
    /// the last `/`, the network (if any) before the one ahead of it.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || VipRangeError(s.to_owned());
        let (head, len) = s.rsplit_once('/').ok_or_else(bad)?;
        let (network, ip) = head.rsplit_once('/').unwrap_or(("", head));
        let net: IpNet = format!("{ip}/{len}").parse().map_err(|_| bad())?;
        Ok(Self::new(network, net))
    }
}

impl fmt::Display for VipRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.net)
    }
}

impl Serialize for VipRange {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for VipRange {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(d)?;
        raw.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test inputs are literals")]
mod tests {
    use super::*;

    #[test]
    fn reads_and_writes_network_slash_ip() {
        let vip: Vip = "net1/10.96.0.10".parse().unwrap();
        assert_eq!(&*vip.network, "net1");
        assert_eq!(vip.to_string(), "net1/10.96.0.10");
        let bare: Vip = "fd00::10".parse().unwrap();
        assert_eq!(bare, Vip::from("fd00::10".parse::<IpAddr>().unwrap()));
        assert_eq!(bare.to_string(), "/fd00::10");
        let mapped: Vip = "n/::ffff:10.0.0.1".parse().unwrap();
        assert_eq!(mapped.ip, "10.0.0.1".parse::<IpAddr>().unwrap());
        assert!("net1/300.1.1.1".parse::<Vip>().is_err());
        assert!("net1/".parse::<Vip>().is_err());
    }

    #[test]
    fn a_range_reads_and_writes_network_slash_cidr() {
        let range: VipRange = "net1/192.0.2.9/24".parse().unwrap();
        assert_eq!(&*range.network, "net1");
        assert_eq!(range.to_string(), "net1/192.0.2.9/24");
        assert!(range.contains("net1", &"192.0.2.200".parse().unwrap()));
        assert!(!range.contains("net1", &"192.0.3.9".parse().unwrap()));
        let bare: VipRange = "fd00::/112".parse().unwrap();
        assert_eq!(bare, VipRange::from("fd00::/112".parse::<IpNet>().unwrap()));
        assert_eq!(bare.to_string(), "/fd00::/112");
        assert_eq!(bare, bare.to_string().parse().unwrap());
        let mapped: VipRange = "n/::ffff:10.0.0.0/104".parse().unwrap();
        assert_eq!(mapped.net, "10.0.0.0/8".parse::<IpNet>().unwrap());
        for bad in [
            "net1/10.0.0.0",
            "10.0.0.0",
            "net1/10.0.0.0/33",
            "n/x/8",
            "/",
        ] {
            assert!(bad.parse::<VipRange>().is_err(), "{bad}");
        }
    }

    #[test]
    fn a_range_holds_only_its_own_networks_addresses() {
        let range: VipRange = "east/10.1.0.0/16".parse().unwrap();
        let ip = "10.1.2.3".parse().unwrap();
        assert!(range.contains("east", &ip));
        assert!(!range.contains("west", &ip));
        assert!(!range.contains("", &ip));
        assert!(!range.contains("east", &"10.2.0.1".parse().unwrap()));
    }
}
