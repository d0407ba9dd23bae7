//! Names the proxy resolves for itself: the DNS name of a service endpoint
//! without IPs (a ServiceEntry endpoint with `resolution: DNS`, which
//! istiod sends as a workload with a `hostname`), looked up when a
//! connection picks it, as ztunnel does (`src/state.rs`
//! `resolve_on_demand_dns`).
//!
//! The lookup goes through the pods' upstream [`Forwarder`]: the same
//! servers (the node's resolv.conf, or `--dns-upstream`), the same cache
//! (answers kept for their TTL, at most [`super::upstream::MAX_CACHE_TTL`];
//! failures for [`super::upstream::NEGATIVE_TTL`]) and the same bounds on
//! time and queries in flight. ztunnel's resolver (hickory, from the
//! system configuration) caches by TTL too. The name is asked as given,
//! fully qualified: istiod sends a ServiceEntry's hosts, which are.

use std::net::IpAddr;

use hickory_proto::{
    op::{Message, MessageType, OpCode, Query, ResponseCode},
    rr::{Name, RData, RecordType},
};

use super::{DnsError, Forwarder};

/// The addresses `hostname` resolves to (its A and AAAA records, asked at
/// once), in the order the servers gave them.
pub async fn lookup_ip(forwarder: &Forwarder, hostname: &str) -> Result<Vec<IpAddr>, DnsError> {
    let mut name = Name::from_ascii(hostname).map_err(|err| DnsError::BadName {
        name: hostname.to_owned(),
        reason: err.to_string(),
    })?;
    // Asked as absolute (no search list), as the reply will name it.
    name.set_fqdn(true);
    let (v4, v6) = tokio::join!(
        ask(forwarder, &name, RecordType::A),
        ask(forwarder, &name, RecordType::AAAA)
    );
    let (v4, v6) = match (v4, v6) {
        // One family failing is not the name failing (a server that
        // refuses AAAA, say).
        (Err(err), Err(_)) => return Err(err),
        (v4, v6) => (v4.unwrap_or_default(), v6.unwrap_or_default()),
    };
    let addrs: Vec<IpAddr> = v4.into_iter().chain(v6).collect();
    if addrs.is_empty() {
        return Err(DnsError::NoAddresses {
            name: hostname.to_owned(),
        });
    }
    Ok(addrs)
}

/// One question's addresses: the records of type `qtype` in the answer
/// (whatever their owner: a CNAME chain ends at the addresses).
async fn ask(
    forwarder: &Forwarder,
    name: &Name,
    qtype: RecordType,
) -> Result<Vec<IpAddr>, DnsError> {
    let mut request = Message::new(query_id(), MessageType::Query, OpCode::Query);
    request.metadata.recursion_desired = true;
    request.queries.push(Query::query(name.clone(), qtype));
    let raw = request.to_vec().map_err(|err| DnsError::BadName {
        name: name.to_ascii(),
        reason: err.to_string(),
    })?;
    let forwarded = forwarder.forward(&request, &raw).await?;
    let reply = Message::from_vec(&forwarded.reply).map_err(|_| DnsError::BadAnswer {
        name: name.to_ascii(),
        code: "unparseable".to_owned(),
    })?;
    let code = reply.metadata.response_code;
    if code != ResponseCode::NoError {
        return Err(DnsError::BadAnswer {
            name: name.to_ascii(),
            code: code.to_string(),
        });
    }
    Ok(reply
        .answers
        .iter()
        .filter_map(|record| match &record.data {
            RData::A(a) if qtype == RecordType::A => Some(IpAddr::V4(a.0)),
            RData::AAAA(aaaa) if qtype == RecordType::AAAA => Some(IpAddr::V6(aaaa.0)),
            _ => None,
        })
        .collect())
}

/// A query id no off-path sender can guess (the forwarder checks the
/// reply's id and question).
fn query_id() -> u16 {
    u16::try_from(crate::state::random_index(1 << 16)).unwrap_or_default()
}

/// Which of `addrs` a connection to `original` goes to: one at random of
/// the same IP family as the address the client dialled, else of the
/// other (ztunnel `resolve_on_demand_dns`: pure IPv4 or IPv6 clusters
/// need the first rule). `pick` chooses an index below its argument.
pub fn choose(
    addrs: &[IpAddr],
    original: IpAddr,
    pick: impl FnOnce(usize) -> usize,
) -> Option<IpAddr> {
    let same: Vec<IpAddr> = addrs
        .iter()
        .copied()
        .filter(|ip| ip.is_ipv6() == original.is_ipv6())
        .collect();
    let from = if same.is_empty() { addrs } else { &same[..] };
    match from.len() {
        0 => None,
        n => from.get(pick(n).min(n - 1)).copied(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_client_family_is_preferred_then_the_other() {
        let v4: IpAddr = [192, 0, 2, 1].into();
        let v4b: IpAddr = [192, 0, 2, 2].into();
        let v6: IpAddr = "2001:db8::1".parse().unwrap_or(v4);
        let both = [v6, v4, v4b];
        assert_eq!(choose(&both, v4b, |_| 0), Some(v4));
        assert_eq!(choose(&both, v4b, |n| n - 1), Some(v4b));
        assert_eq!(choose(&both, v6, |_| 0), Some(v6));
        // Only the other family: it.
        assert_eq!(choose(&[v6], v4, |_| 0), Some(v6));
        // A bad pick stays in range.
        assert_eq!(choose(&both, v4, |_| 9), Some(v4b));
        assert_eq!(choose(&[], v4, |_| 0), None);
    }
}
