//! A service's virtual IP on its network, as istiod sends one
//! (`NetworkAddress` in `Service.addresses`) and ztunnel keys services
//! by it (`src/state/service.rs`: `ServiceStore::by_vip`, a map from
//! `NetworkAddress`): two networks may give their services the same VIP
//! (overlapping service ranges), and a client resolves the one on its
//! own network.

use std::{fmt, net::IpAddr, str::FromStr};

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
}
